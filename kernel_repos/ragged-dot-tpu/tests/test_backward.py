"""Backward of ragged_dot and of the experts layer, in TPU interpret mode with race detection.

Gradients are checked against torch autograd through the float64 references
(`reference.py`) on random inputs with odd sizes, empty groups and rows past
the groups: relative error at most 1e-5 in float32 and 2e-2 in bfloat16.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch


def _tolerance(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-2


def _relative_error(out, expected):
    return ((out.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30)).item()


TGMM_CASES = {
    # m, k, n, group_sizes, config (tile_m, tile_k, tile_n, chunk_m) or None for the heuristic
    "one-row": (1, 96, 200, [0, 1, 0], None),
    "odd-sizes-empty-groups": (37, 72, 130, [5, 0, 11, 0, 9, 0], None),
    "rows-past-groups": (64, 128, 96, [10, 0, 30], None),
    # 3 row tiles of 32 in chunks of 16; groups straddle tiles and chunks; K and N in tiles with tails;
    # rows 90..99 past the groups; an empty group between two that share a row tile.
    "tiles-and-chunks": (100, 300, 200, [20, 0, 45, 0, 25, 0], (32, 128, 128, 16)),
    "all-groups-empty": (24, 128, 128, [0, 0, 0], (16, 128, 128, 16)),
    "leading-empty-groups": (48, 128, 128, [0, 0, 17, 31], (16, 128, 128, 16)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", TGMM_CASES)
def test_tgmm_matches_reference(kernel, interpret, to_jax, case, dtype):
    m, k, n, group_sizes, config = TGMM_CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    lhs = torch.randn(m, k, generator=generator).to(dtype)
    rhs = torch.randn(m, n, generator=generator).to(dtype)
    rows = sum(group_sizes)
    # Rows past the groups must contribute nothing, whatever they hold.
    lhs[rows:], rhs[rows:] = float("nan"), float("nan")
    sizes = torch.tensor(group_sizes, dtype=torch.int32)
    config = None if config is None else kernel.config.TgmmConfig(*config)
    out = interpret(lambda: kernel.pallas_tgmm.tgmm(to_jax(lhs), to_jax(rhs), to_jax(sizes), config=config))
    expected = kernel.reference.tgmm_reference(lhs, rhs, sizes)
    assert out.shape == (len(group_sizes), k, n)
    assert not torch.isnan(out).any()
    assert _relative_error(out, expected) <= _tolerance(dtype)
    for group, size in enumerate(group_sizes):
        if size == 0:
            assert torch.equal(out[group], torch.zeros_like(out[group])), "an empty group's gradient must be zero"


def test_tgmm_items_skip_rows_past_groups_and_fetch_nothing_for_empty_groups(kernel):
    items = kernel.pallas_tgmm.make_tgmm_items(jnp.asarray([0, 20, 0, 45, 0], jnp.int32), 100, 32)
    count = int(items.count[0])
    # Group 1 spans row tile 0; group 3 rows 20..64, tiles 0..2; empty groups one item each.
    assert count == 1 + 1 + 1 + 3 + 1
    assert list(np.asarray(items.group[:count])) == [0, 1, 2, 3, 3, 3, 4]
    # Empty groups keep the row tile of the item before them; nothing reaches tile 3 (rows 96..99).
    assert list(np.asarray(items.row_tile[:count])) == [0, 0, 0, 0, 1, 2, 2]
