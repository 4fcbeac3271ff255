"""The grouped matmul sizes VMEM by the project's one policy and takes its tuned tiles from a table of the one form,
as every kernel repo's kernels do: the policy is `_hardware`'s (the build's copy of tpu_kernels/runtime/hardware.py),
at its defaults here; the table is `_tuning`'s, one JSON file beside the code that reads it."""

from pathlib import Path

import pytest
from tpu_kernels import testing
from tpu_kernels.runtime import hardware


@pytest.mark.parametrize("generation", hardware.SUPPORTED_GENERATIONS)
def test_the_grouped_matmul_sizes_vmem_by_the_policys_defaults(kernel, generation):
    problem = kernel.MatmulProblem(16384, 2048, 1536, 128, "bfloat16", "bfloat16", False)
    tiles = kernel.gmm.tiles.TileConfig(512, 2048, 1536, 256)
    target = hardware.resolve_target(generation)
    assert kernel.gmm.tiles.vmem_limit(tiles, problem, target) == hardware.vmem_limit_bytes(
        kernel.gmm.tiles.vmem_bytes(tiles, problem), generation)
    budget = hardware.vmem_budget_bytes(generation)
    with pytest.raises(ValueError, match=f"past the {budget >> 20} MiB budget on {generation}"):
        # Double-buffered weights blocks of 64 MiB.
        kernel.gmm.tiles.check_config(kernel.gmm.tiles.TileConfig(16, 8192, 4096),
                                      problem._replace(m=64, k=8192, n=4096), hardware.resolve_target(generation))


def test_the_grouped_matmul_takes_the_tuned_tiles_of_its_table(kernel):
    tiles = kernel.gmm.tiles

    def selects(key):
        problem = kernel.MatmulProblem(key.m, key.k, key.n, key.groups, key.dtype, key.rhs_dtype, key.transpose_rhs)
        return tiles.select(problem, hardware.resolve_target(key.generation))

    testing.assert_tuned_table(Path(kernel.__file__).parent / "gmm" / "tuned_tiles.json", tiles.TUNED_TILES,
                               tiles.TunedKey, tiles.TileConfig, selects)
