"""The flash kernels size VMEM by the project's one policy and take their tuned tiles from a table of the one form,
as every kernel repo's kernels do: the policy is `_hardware`'s (the build's copy of tpu_kernels/runtime/hardware.py),
at this kernel's margin and bound (`common.vmem`); the table is `_tuning`'s, one JSON file beside the code that
reads it."""

from pathlib import Path

import pytest
from tpu_kernels import testing
from tpu_kernels.runtime.hardware import SUPPORTED_GENERATIONS, resolve_target


@pytest.mark.parametrize("generation", SUPPORTED_GENERATIONS)
def test_attention_sizes_vmem_by_the_one_policy(kernel, generation):
    testing.assert_vmem_policy(kernel.common.vmem, generation)


def test_the_forward_takes_the_tuned_tiles_of_its_table(kernel):
    tiles = kernel.flash.tiles

    def selects(key):
        shape = key._asdict()
        generation = shape.pop("generation")
        chosen = tiles.select(kernel.Problem.of_shape(**shape), resolve_target(generation))
        return tiles.ForwardTiles(chosen.block_q, chosen.block_kv, chosen.kv_heads_per_step)

    testing.assert_tuned_table(Path(kernel.__file__).parent / "flash" / "tuned_tiles.json", tiles.TUNED_TILES,
                               tiles.TunedKey, tiles.ForwardTiles, selects)
