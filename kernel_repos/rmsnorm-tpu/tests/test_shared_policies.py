"""The norm kernels size VMEM by the project's one policy and take their tuned row blocks from a table of the one
form, as every kernel repo's kernels do: the policy is `_hardware`'s (the build's copy of
tpu_kernels/runtime/hardware.py), at this kernel's margin and bound (`norm.tiles`); the table is `_tuning`'s, one
JSON file beside the code that reads it."""

from pathlib import Path

import pytest
from tpu_kernels import testing
from tpu_kernels.runtime.hardware import SUPPORTED_GENERATIONS, resolve_target


@pytest.mark.parametrize("generation", SUPPORTED_GENERATIONS)
def test_rmsnorm_sizes_vmem_by_the_one_policy(kernel, generation):
    testing.assert_vmem_policy(kernel.norm.tiles, generation)


def test_rmsnorm_takes_the_tuned_row_blocks_of_its_table(kernel):
    tiles = kernel.norm.tiles
    table = Path(kernel.__file__).parent / "norm" / "tuned_tiles.json"
    testing.assert_tuned_table(table, tiles.TUNED_TILES, tiles.TunedKey, tiles.RowBlockTiles, lambda key: (
        tiles.RowBlockTiles(tiles.select(kernel.NormProblem(key.op, key.rows, key.hidden, key.dtype),
                                         resolve_target(key.generation)).block_rows)))
