"""What ragged-dot-tpu's kernels move and compute, by benchmarks.perf's grid replay (no TPU needed).

The claims checked: the fused experts kernel reads each active expert's
weights once and nothing of the others, in one grid step per active expert
(or per `experts_per_step` of them);
other ranks' sentinel picks cost no step, no weight read and no MXU pass;
the grouped matmul leaves rows past its groups alone when asked to; its row
chunks follow group starts, so no chunk is spent on two groups.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import perf
from tpu_kernels.runtime.hardware import resolve_target

V6E = resolve_target("v6e")

BF16 = 2
S = jax.ShapeDtypeStruct


@pytest.fixture
def kernel(ragged_dot_kernel):
    return ragged_dot_kernel


def _picks(tokens, top_k, experts, live_experts, seed=0):
    """Router-masking picks of one rank: `experts` local ones of which `live_experts` are picked."""
    rng = np.random.default_rng(seed)
    index = np.stack([rng.choice(experts * 4, top_k, replace=False) for _ in range(tokens)])
    # Picks of global experts this rank does not hold become sentinels (id == experts).
    index = np.where(index < live_experts, index, experts).astype(np.int32)
    weights = np.where(index < experts, rng.random((tokens, top_k)), 0.0).astype(np.float32)
    return index, weights


def _fused_traffic(kernel, tokens, hidden, intermediate, experts, index, weights, *, config=None, transposed=False):
    gate_up = (experts, hidden, 2 * intermediate) if transposed else (experts, 2 * intermediate, hidden)
    down = (experts, intermediate, hidden) if transposed else (experts, hidden, intermediate)
    fn = functools.partial(kernel.fused.kernel.fused_experts, activation="silu", weights_transposed=transposed,
                           config=config)
    [call] = perf.model_pallas_traffic(fn, S((tokens, hidden), jnp.bfloat16), index, weights,
                                       S(gate_up, jnp.bfloat16), S(down, jnp.bfloat16))
    return call


def _weights_read(call, experts, hidden, intermediate, transposed=False):
    if transposed:
        shapes = {(experts, hidden, 2 * intermediate), (experts, intermediate, hidden)}
    else:
        shapes = {(experts, 2 * intermediate, hidden), (experts, hidden, intermediate)}
    return sum(op.hbm_bytes for op in call.inputs if op.array_shape in shapes)


def _operand(call, shape):
    [operand] = [op for op in call.operands if op.role == "input" and op.array_shape == shape]
    return operand


def test_fused_reads_each_active_experts_weights_once_in_one_step_each(kernel):
    tokens, hidden, intermediate, experts = 16, 256, 128, 16
    index, weights = _picks(tokens, 4, experts, live_experts=6)
    active = len(np.unique(index[index < experts]))
    call = _fused_traffic(kernel, tokens, hidden, intermediate, experts, index, weights)
    assert call.grid == (active, 1) and call.steps == active
    gate_up = _operand(call, (experts, 2 * intermediate, hidden))
    down = _operand(call, (experts, hidden, intermediate))
    assert (gate_up.transfers, down.transfers) == (active, active)
    assert gate_up.hbm_bytes + down.hbm_bytes == active * 3 * intermediate * hidden * BF16
    # The hidden states are read once and the output written once.
    assert _operand(call, (tokens, hidden)).hbm_bytes == tokens * hidden * BF16
    assert call.hbm_write_bytes == tokens * hidden * BF16


def test_fused_gives_sentinel_picks_no_step_no_weights_and_no_mxu_pass(kernel):
    """Router masking (most picks other ranks') costs what the same live picks cost dispatched alone."""
    tokens, hidden, intermediate, experts = 16, 256, 128, 16
    index, weights = _picks(tokens, 4, experts, live_experts=6, seed=1)
    live = index < experts
    assert live.mean() < 0.5
    masked = _fused_traffic(kernel, tokens, hidden, intermediate, experts, index, weights)
    # Expert-parallel token dispatch: one row per live pick, top-1.
    dispatched = _fused_traffic(kernel, int(live.sum()), hidden, intermediate, experts, index[live][:, None],
                                weights[live][:, None])

    def expert_work(call):
        weights_read = _weights_read(call, experts, hidden, intermediate)
        expert_passes = sum(dot.count for dot in call.dots if (dot.k, dot.n) in ((hidden, 2 * intermediate),
                                                                                (intermediate, hidden)))
        return call.steps, weights_read, expert_passes

    active = len(np.unique(index[live]))
    assert expert_work(masked) == expert_work(dispatched) == (active, active * 3 * intermediate * hidden * BF16,
                                                              2 * active)


def test_fused_with_i_tiles_still_reads_each_weight_once(kernel):
    tokens, hidden, intermediate, experts = 8, 256, 256, 8
    index, weights = _picks(tokens, 2, experts, live_experts=5, seed=2)
    active = len(np.unique(index[index < experts]))
    config = kernel.fused.tiles.FusedConfig(16, 128)
    call = _fused_traffic(kernel, tokens, hidden, intermediate, experts, index, weights, config=config)
    assert call.steps == 2 * active
    assert _weights_read(call, experts, hidden, intermediate) == active * 3 * intermediate * hidden * BF16


@pytest.mark.parametrize("slots", [2, 3, 4])
def test_fused_with_several_experts_per_step_reads_each_weight_once_in_fewer_steps(kernel, slots):
    """Slots past the last active expert keep their blocks: no expert is read twice, no step is added."""
    tokens, hidden, intermediate, experts = 16, 256, 128, 16
    index, weights = _picks(tokens, 4, experts, live_experts=7, seed=3)
    active = len(np.unique(index[index < experts]))
    assert active % slots
    call = _fused_traffic(kernel, tokens, hidden, intermediate, experts, index, weights,
                          config=kernel.fused.tiles.FusedConfig(16, intermediate, slots))
    assert call.steps == -(-active // slots)
    assert _weights_read(call, experts, hidden, intermediate) == active * 3 * intermediate * hidden * BF16


def test_fused_slots_without_an_active_expert_read_one_expert_each_at_the_first_step(kernel):
    """What MULTI_EXPERT_MIN_TOKENS guards against: one active expert in four slots reads four experts' weights."""
    tokens, hidden, intermediate, experts = 4, 256, 128, 16
    index = np.full((tokens, 2), experts, np.int32)
    index[:, 0] = 5
    weights = np.where(index < experts, 0.5, 0.0).astype(np.float32)
    call = _fused_traffic(kernel, tokens, hidden, intermediate, experts, index, weights,
                          config=kernel.fused.tiles.FusedConfig(16, intermediate, 4))
    assert call.steps == 1
    assert _weights_read(call, experts, hidden, intermediate) == 4 * 3 * intermediate * hidden * BF16


@pytest.mark.parametrize("tile_i", [256, 128])
def test_fused_without_live_picks_runs_one_empty_step(kernel, tile_i):
    """One item over one I tile: the weights of one tile of one expert, nothing else."""
    tokens, hidden, intermediate, experts = 4, 256, 256, 8
    index = np.full((tokens, 2), experts, np.int32)
    call = _fused_traffic(kernel, tokens, hidden, intermediate, experts, index, np.zeros((tokens, 2), np.float32),
                          config=kernel.fused.tiles.FusedConfig(16, tile_i), transposed=True)
    assert call.steps == 1
    assert _weights_read(call, experts, hidden, intermediate, transposed=True) == 3 * tile_i * hidden * BF16
    # Only the per-step [T, T] x [T, 1] matmuls that turn the weights row into columns; no pass over weights.
    assert {(dot.m, dot.k, dot.n) for dot in call.dots} == {(tokens, tokens, 1)}


def _grouped_traffic(kernel, m, k, n, group_sizes, config, zero_rows_past_groups=True):
    fn = functools.partial(kernel.gmm.kernel.grouped_matmul, config=config, zero_rows_past_groups=zero_rows_past_groups)
    [call] = perf.model_pallas_traffic(fn, S((m, k), jnp.bfloat16), S((len(group_sizes), k, n), jnp.bfloat16),
                                       np.asarray(group_sizes, np.int32))
    return call


def test_grouped_rows_past_the_groups_cost_nothing_when_left_unwritten(kernel):
    # 512 rows, of which 100 live (the rest other ranks' sentinels), in 64-row tiles.
    m, k, n = 512, 256, 256
    config = kernel.gmm.tiles.TileConfig(64, 256, 256, 32)
    sizes = [30, 0, 50, 20]
    zeroed = _grouped_traffic(kernel, m, k, n, sizes, config)
    skipped = _grouped_traffic(kernel, m, k, n, sizes, config, zero_rows_past_groups=False)
    live_tiles = 2  # rows 0..99
    assert zeroed.hbm_write_bytes == m * n * BF16
    assert skipped.hbm_write_bytes == live_tiles * 64 * n * BF16
    assert skipped.steps == 4  # items: group 0 (tile 0), group 2 (tiles 0, 1), group 3 (tile 1)
    assert skipped.flops == zeroed.flops
    # Each live tile's lhs window: its 64 rows and the next chunk's 32.
    lhs = _operand(skipped, (m, k))
    assert lhs.hbm_bytes == live_tiles * (64 + 32) * k * BF16


@pytest.mark.parametrize("tile_m", [256, 128])
def test_grouped_chunks_follow_group_starts(kernel, tile_m):
    """Groups of 48, 80, 32 and 64 rows in 64-row chunks: 1 + 2 + 1 + 1 chunks, none shared at a boundary.

    Chunks at fixed offsets of the tile (0, 64, 128, 192) would take 6: the chunks at rows 0 and 128 each
    straddle two groups and would be multiplied once per group. In 128-row tiles the second chunk of the group
    at rows 48..127 crosses a tile end and is still multiplied once.
    """
    m, k, n = 224, 256, 256
    call = _grouped_traffic(kernel, m, k, n, [48, 80, 32, 64], kernel.gmm.tiles.TileConfig(tile_m, 256, 256, 64))
    assert call.dots_exact
    assert {(dot.m, dot.k, dot.n) for dot in call.dots} == {(64, k, n)}
    assert sum(dot.count for dot in call.dots) == 5


def test_the_layer_copies_only_live_picks_rows_in_and_out_of_its_grouped_matmuls(kernel):
    """Router masking at prefill size: the first grouped matmul copies one token row per live pick (sentinels none),
    the combine kernel one packed row per live pick; the model counts both from the kernels' own copies."""
    tokens, hidden, intermediate, experts, top_k = 1024, 256, 256, 4, 8
    index, weights = _picks(tokens, top_k, experts, live_experts=experts)
    live = int((index < experts).sum())
    fn = functools.partial(kernel.experts_layer, activation="silu", weights_transposed=False, fused=False,
                           generation="v6e")
    calls = perf.model_pallas_traffic(fn, S((tokens, hidden), jnp.bfloat16), index, weights,
                                      S((experts, 2 * intermediate, hidden), jnp.bfloat16),
                                      S((experts, hidden, intermediate), jnp.bfloat16))
    gate_up, down, combine = calls
    row_bytes = hidden * BF16
    # The gate_up kernel's copies: the live rows of each row tile's window (the tile and one chunk more, as its
    # pipelined lhs block would read), once per N tile (one here); the combine's: each live pick's row once.
    plan = kernel.plan.plan_experts(kernel.problem.ExpertsProblem(
        tokens, top_k, hidden, intermediate, experts, "bfloat16", "bfloat16", "float32", False, False,
        kernel.problem.Gate("silu")), V6E, fused=False).forward_gate_up
    window = plan.tile_m + (plan.chunk_m or 0)
    copied = sum(min(live, start + window) - start for start in range(0, live, plan.tile_m))
    [token_rows] = [op for op in gate_up.operands if op.array_shape == (tokens, hidden // 2)]
    assert gate_up.grid[0] == 1 and token_rows.hbm_bytes == copied * row_bytes
    [picked_rows] = [op for op in combine.operands if op.array_shape == (tokens * top_k, hidden // 2)]
    assert picked_rows.hbm_bytes == live * row_bytes
    assert not any(call.unmodelled_dmas for call in calls)
    perf.roofline(calls, "v6e")
