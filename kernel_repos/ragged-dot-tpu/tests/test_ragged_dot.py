"""ragged_dot through the torch op of the built torch-cpu variant, in TPU interpret mode.

Race detection and NaN-filled uninitialised memory are on (tpu_kernels pytest
plugin), so a kernel that reads garbage or races fails here.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tpu_kernels.runtime.hardware import resolve_target

CASES = [
    # m, k, n, group_sizes, transpose_rhs
    (1, 96, 200, [1], False),
    (1, 128, 128, [0, 0, 1, 0], True),
    (7, 96, 200, [3, 0, 2, 1], False),
    (7, 200, 96, [0, 7, 0, 0], True),
    (64, 128, 256, [64], False),
    (64, 200, 96, [10, 0, 0, 30, 4, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 1], True),
    (129, 96, 200, [50, 0, 0, 60], False),
    (129, 256, 200, [129, 0, 0, 0], True),
    (512, 200, 96, [40, 0, 100, 0, 64, 8, 0, 200, 0, 30, 0, 0, 20, 0, 40, 10], False),
    (512, 256, 384, [500, 12, 0, 0], True),
]


def _tolerance(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-2


def _random_inputs(m, k, n, group_sizes, transpose_rhs, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lhs = torch.randn(m, k, generator=generator).to(dtype)
    shape = (len(group_sizes), n, k) if transpose_rhs else (len(group_sizes), k, n)
    rhs = torch.randn(shape, generator=generator).to(dtype)
    return lhs, rhs, torch.tensor(group_sizes, dtype=torch.int32)


def _relative_error(out, expected):
    return ((out.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n,group_sizes,transpose_rhs", CASES)
def test_matches_reference(kernel, m, k, n, group_sizes, transpose_rhs, dtype):
    lhs, rhs, sizes = _random_inputs(m, k, n, group_sizes, transpose_rhs, dtype)
    out = kernel.ragged_dot(lhs, rhs, sizes, transpose_rhs=transpose_rhs)
    # The reference sees the same (rounded) inputs and computes in float64.
    expected = kernel.reference.ragged_dot_reference(lhs.double(), rhs.double(), sizes, transpose_rhs=transpose_rhs)
    assert out.shape == (m, n) and out.dtype == dtype
    assert not torch.isnan(out).any()
    assert _relative_error(out, expected) <= _tolerance(dtype)
    rows = sum(group_sizes)
    assert torch.equal(out[rows:], torch.zeros_like(out[rows:])), "rows past the groups must be zero"


# Multi-tile schedules through the JAX function with explicit small tiles, so
# that every part of the schedule runs at affordable sizes. Each case names
# what it forces.
SCHEDULE_CASES = {
    # 4 row tiles (last 4 rows), 3 K tiles (last 44 columns), 2 N tiles (last 72);
    # groups straddle row tiles; rows 80..99 are past the groups, row tile 3 is
    # a zero-writing tail item.
    "tail-tiles-m-k-n": (100, 300, 200, [20, 0, 45, 15], (32, 128, 128, None, 1)),
    # Row chunks: 96-row tiles in chunks of 48 rows, chunks past a group's rows
    # skipped; a tail tile past the groups.
    "row-chunks": (150, 256, 128, [7, 30, 0, 50, 3], (96, 256, 128, 48, 1)),
    # Three group slots per step over one resident row tile: 4 active groups
    # leave 2 idle slots in the second step; K and N tiles with tails.
    "groups-per-step-3": (40, 200, 160, [5, 0, 12, 7, 0, 9], (40, 128, 128, None, 3)),
    # Two group slots with row chunks (16 + 16 + 8 rows); rows past the groups.
    "groups-per-step-2-chunks": (40, 128, 256, [9, 14, 0, 6], (40, 128, 128, 16, 2)),
    # No rows in any group: only the zero-writing tail item, in a step whose second slot is idle.
    "all-groups-empty": (24, 128, 128, [0, 0, 0], (24, 128, 128, None, 2)),
    # Every row tile past the groups but the first: three zero-writing tail items.
    "tail-items": (64, 128, 256, [3, 0, 5], (16, 128, 256, None, 1)),
    # Chunks start at groups' first rows, off the 16-row grid (5, 42, 112, 162 rows in); chunks
    # that run past a 96-row tile's end carry their last rows into the next tile.
    "chunks-at-group-starts": (200, 128, 128, [5, 37, 0, 70, 50, 20], (96, 128, 128, 32, 1)),
    # The same with K and N in tiles with tails: chunks carried across row tiles accumulate over K steps.
    "chunks-k-tiles": (100, 300, 200, [20, 0, 45, 15], (32, 128, 128, 16, 1)),
}


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(SCHEDULE_CASES))
def test_multi_tile_schedules_match_reference(kernel, interpret, to_jax, case, dtype, transpose_rhs):
    m, k, n, group_sizes, tiles = SCHEDULE_CASES[case]
    config = kernel.gmm.tiles.TileConfig(*tiles)
    lhs, rhs, sizes = _random_inputs(m, k, n, group_sizes, transpose_rhs, dtype, seed=len(case))
    out = interpret(
        lambda: kernel.gmm.kernel.grouped_matmul(to_jax(lhs), to_jax(rhs), jnp.asarray(sizes.numpy()),
                                      transpose_rhs=transpose_rhs, config=config)
    )
    expected = kernel.reference.ragged_dot_reference(lhs.double(), rhs.double(), sizes, transpose_rhs=transpose_rhs)
    assert not torch.isnan(out).any()
    rows = sum(group_sizes)
    assert torch.equal(out[rows:], torch.zeros_like(out[rows:])), "rows past the groups must be zero"
    if rows:
        assert _relative_error(out, expected) <= _tolerance(dtype)


@pytest.mark.slow
def test_schedule_cases_cover_what_they_name(kernel):
    """The schedule cases above really run several tiles, tails, slots and chunks."""
    make_work_items = kernel.gmm.schedule.make_work_items
    seen = set()
    for m, k, n, group_sizes, tiles in SCHEDULE_CASES.values():
        config = kernel.gmm.tiles.TileConfig(*tiles)
        kernel.gmm.tiles.check_config(config, kernel.MatmulProblem(m, k, n, len(group_sizes), "bfloat16", "bfloat16",
                                                                    False), resolve_target())
        items = make_work_items(jnp.asarray(group_sizes, jnp.int32), m, config.tile_m)
        count = int(items.count[0])
        tail_items = int(jnp.sum(items.row_end[:count] == 0))
        seen.update(
            name
            for name, present in {
                "m tail": m % config.tile_m and m > config.tile_m,
                "k tail": k % config.tile_k and k > config.tile_k,
                "n tail": n % config.tile_n and n > config.tile_n,
                "idle slots": count % config.groups_per_step,
                "several slots": config.groups_per_step > 1,
                "chunks": config.chunk_m is not None and config.chunk_m < config.tile_m,
                "zero-writing tail item": tail_items > 0,
                "rows past the groups": sum(group_sizes) < m,
                "group start off the sublane grid": any(start % 16 for start in np.cumsum(group_sizes)[:-1]),
                "chunk across a tile": config.chunk_m is not None and _chunk_crosses_a_tile(group_sizes, config),
            }.items()
            if present
        )
    assert seen == {
        "m tail", "k tail", "n tail", "idle slots", "several slots", "chunks", "zero-writing tail item",
        "rows past the groups", "group start off the sublane grid", "chunk across a tile",
    }


def _chunk_crosses_a_tile(group_sizes, config):
    """Whether some group's chunks, laid from its first row on the 16-row grid, cross a row tile's end."""
    start = 0
    for size in group_sizes:
        end = start + size
        chunk = start // 16 * 16
        while size and chunk < end:
            if chunk // config.tile_m != (chunk + config.chunk_m - 1) // config.tile_m:
                return True
            chunk += config.chunk_m
        start = end
    return False


@pytest.mark.parametrize("case", ["chunks-at-group-starts", "tail-items"])
def test_rows_past_the_groups_can_be_left_unwritten(kernel, interpret, to_jax, case):
    """zero_rows_past_groups=False: the live rows are the same; row tiles past the groups are never written."""
    m, k, n, group_sizes, tiles = SCHEDULE_CASES[case]
    config = kernel.gmm.tiles.TileConfig(*tiles)
    lhs, rhs, sizes = _random_inputs(m, k, n, group_sizes, False, torch.float32, seed=3)
    out = interpret(
        lambda: kernel.gmm.kernel.grouped_matmul(to_jax(lhs), to_jax(rhs), jnp.asarray(sizes.numpy()), config=config,
                                      zero_rows_past_groups=False)
    )
    expected = kernel.reference.ragged_dot_reference(lhs.double(), rhs.double(), sizes)
    rows = sum(group_sizes)
    assert _relative_error(out[:rows], expected[:rows]) <= 1e-5
    first_untouched_tile = -(-rows // config.tile_m) * config.tile_m
    # The interpreter fills memory nobody wrote with NaN.
    assert torch.isnan(out[first_untouched_tile:]).all()


def test_traces_under_torch_compile(kernel):
    lhs, rhs, sizes = _random_inputs(16, 96, 128, [5, 11], False, torch.float32, seed=1)
    compiled = torch.compile(lambda a, b, c: kernel.ragged_dot(a, b, c) * 2, fullgraph=True)
    expected = kernel.reference.ragged_dot_reference(lhs.double(), rhs.double(), sizes) * 2
    assert _relative_error(compiled(lhs, rhs, sizes), expected) <= 1e-5


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(lhs=torch.randn(4, 8, 16)), ValueError, "lhs must be 2-D"),
        (dict(rhs=torch.randn(16, 32)), ValueError, "rhs must be 3-D"),
        (dict(group_sizes=torch.tensor([[4, 4]], dtype=torch.int32)), ValueError, "group_sizes must be 1-D"),
        (dict(lhs=torch.randn(8, 16).to(torch.float64)), TypeError, "lhs must be float32 or bfloat16"),
        (dict(lhs=torch.randn(8, 16).to(torch.int32)), TypeError, "lhs must be float32 or bfloat16"),
        (dict(rhs=torch.randn(2, 16, 32).to(torch.bfloat16)), TypeError, "rhs dtype"),
        (dict(rhs=torch.randn(2, 24, 32)), ValueError, "K mismatch"),
        (dict(group_sizes=torch.tensor([4.0, 4.0])), TypeError, "group_sizes must have an integer dtype"),
        (dict(group_sizes=torch.tensor([True, False])), TypeError, "group_sizes must have an integer dtype"),
        (dict(group_sizes=torch.tensor([4, 4, 0], dtype=torch.int32)), ValueError, "3 groups but rhs has 2"),
        (dict(group_sizes=torch.tensor([-1, 4], dtype=torch.int32)), ValueError, "non-negative"),
        (dict(group_sizes=torch.tensor([5, 4], dtype=torch.int32)), ValueError, "sum to 9, past the 8 rows"),
        (dict(group_sizes=torch.tensor([-1, 4], dtype=torch.int64)), ValueError, "non-negative"),
        (dict(group_sizes=torch.tensor([5, 4], dtype=torch.uint8)), ValueError, "sum to 9, past the 8 rows"),
        (dict(group_sizes=torch.tensor([5, 4], dtype=torch.uint16)), ValueError, "sum to 9, past the 8 rows"),
        (dict(lhs=torch.randn(0, 16)), ValueError, "sum to 8, past the 0 rows"),
        (dict(lhs=[[1.0]]), TypeError, "lhs must be a torch.Tensor"),
    ],
)
def test_bad_input_is_refused(kernel, change, error, match):
    args = dict(lhs=torch.randn(8, 16), rhs=torch.randn(2, 16, 32), group_sizes=torch.tensor([4, 4], dtype=torch.int32))
    args.update(change)
    with pytest.raises(error, match=match):
        kernel.ragged_dot(args["lhs"], args["rhs"], args["group_sizes"])
