"""The grid replay against hand counts: which blocks move at which step (a block index unchanged, scalar-prefetch
index maps, outputs written back and revisited, whole-array and ANY-space operands, partial edge blocks), calls
inside jit and scan, pl.when and dynamic grids evaluated from concrete values, and a kernel's own copies counted,
or the kernel refused where they cannot be. The pricing of what it counts: test_perf.py."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from benchmarks import perf

from .perf_kernels import BF16, BLOCK_FLOPS, MASK_X, MASK_Y, MATMUL, K, M, N, X, Y, masked_matmul


def _row_copy(x, *, block_rows, revisit_every):
    """Copies x's rows block by block; the grid revisits each block `revisit_every` times in a row."""
    rows, cols = x.shape
    blocks = rows // block_rows
    spec = pl.BlockSpec((block_rows, cols), lambda i, r: (i, 0))
    return pl.pallas_call(
        lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
        grid=(blocks, revisit_every),
        in_specs=[spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    )(x)


def test_a_block_index_unchanged_across_steps_is_not_fetched_again():
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    [call] = perf.model_pallas_traffic(functools.partial(_row_copy, block_rows=16, revisit_every=5), x)
    source, destination = call.operands
    assert call.steps == 4 * 5
    assert (source.transfers, source.hbm_bytes) == (4, 64 * 256 * 4)
    assert (destination.transfers, destination.hbm_bytes) == (4, 64 * 256 * 4)


def _gather_rows(block_ids, x, *, block_rows):
    """out block s = x block block_ids[s] (scalar prefetch drives the input's index map)."""
    steps = block_ids.shape[0]
    cols = x.shape[1]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(steps,),
        in_specs=[pl.BlockSpec((block_rows, cols), lambda s, ids: (ids[s], 0))],
        out_specs=pl.BlockSpec((block_rows, cols), lambda s, ids: (s, 0)),
    )
    return pl.pallas_call(
        lambda ids_ref, x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((steps * block_rows, cols), x.dtype),
    )(block_ids, x)


def test_scalar_prefetch_values_drive_the_index_maps():
    rng = np.random.default_rng(7)
    block_ids = np.repeat(rng.permutation(6), rng.integers(1, 4, size=6)).astype(np.int32)
    block_ids = np.concatenate([block_ids, block_ids[:2]])  # come back to blocks seen before
    x = jax.ShapeDtypeStruct((6 * 8, 512), jnp.bfloat16)
    [call] = perf.model_pallas_traffic(functools.partial(_gather_rows, block_rows=8), block_ids, x)
    prefetch, source, destination = call.operands
    changes = 1 + int(np.count_nonzero(block_ids[1:] != block_ids[:-1]))
    assert (prefetch.role, prefetch.hbm_bytes) == ("scalar_prefetch", block_ids.size * 4)
    assert source.transfers == changes
    assert source.distinct_blocks == 6
    assert source.hbm_bytes == changes * 8 * 512 * BF16
    assert destination.hbm_bytes == block_ids.size * 8 * 512 * BF16


def test_scalar_prefetch_given_abstractly_is_refused_with_a_clear_error():
    ids = jax.ShapeDtypeStruct((5,), jnp.int32)
    x = jax.ShapeDtypeStruct((40, 128), jnp.float32)
    with pytest.raises(ValueError, match="scalar-prefetch operand 0.*pass that argument concretely"):
        perf.model_pallas_traffic(functools.partial(_gather_rows, block_rows=8), ids, x)


def _scatter_rows(block_ids, x, *, block_rows, revisit_mode=None):
    """out block block_ids[s] = x block s (scalar prefetch drives the output's index map)."""
    steps = block_ids.shape[0]
    cols = x.shape[1]
    pipeline_mode = None if revisit_mode is None else pl.Buffered(1, revisit=revisit_mode)

    def kernel(ids_ref, x_ref, o_ref):
        o_ref[...] = x_ref[...]

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(steps,),
        in_specs=[pl.BlockSpec((block_rows, cols), lambda s, ids: (s, 0))],
        out_specs=pl.BlockSpec((block_rows, cols), lambda s, ids: (ids[s], 0), pipeline_mode=pipeline_mode),
    )
    return pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((8 * block_rows, cols), x.dtype)
    )(block_ids, x)


def test_output_is_written_back_when_its_index_changes_and_at_the_end():
    block_ids = np.array([3, 3, 1, 1, 1, 6, 2], np.int32)
    x = jax.ShapeDtypeStruct((7 * 8, 256), jnp.float32)
    [call] = perf.model_pallas_traffic(functools.partial(_scatter_rows, block_rows=8), block_ids, x)
    destination = call.outputs[0]
    assert destination.transfers == 4  # 3, 1, 6 on leaving them; 2 at the last step
    assert destination.hbm_bytes == 4 * 8 * 256 * 4
    assert destination.revisits == 0


def test_output_revisits_are_reported_and_read_back_under_revisit_mode_any():
    block_ids = np.array([0, 5, 0, 5, 5, 1], np.int32)
    x = jax.ShapeDtypeStruct((6 * 8, 128), jnp.float32)
    block_bytes = 8 * 128 * 4
    [plain] = perf.model_pallas_traffic(functools.partial(_scatter_rows, block_rows=8), block_ids, x)
    assert (plain.outputs[0].transfers, plain.outputs[0].revisits) == (5, 2)
    assert plain.outputs[0].hbm_bytes == 5 * block_bytes
    revisit_any = functools.partial(_scatter_rows, block_rows=8, revisit_mode=pl.RevisitMode.ANY)
    [reread] = perf.model_pallas_traffic(revisit_any, block_ids, x)
    assert reread.outputs[0].buffer_count == 1
    assert reread.outputs[0].hbm_bytes == (5 + 2) * block_bytes


def test_whole_array_blocks_are_fetched_once_and_any_space_operands_are_flagged():
    def kernel(w_ref, table_ref, x_ref, o_ref):
        o_ref[...] = x_ref[...] * w_ref[...]

    def scale(w, table, x):
        rows, cols = x.shape
        return pl.pallas_call(
            kernel,
            grid=(rows // 8,),
            in_specs=[
                pl.BlockSpec(memory_space=pltpu.VMEM),  # whole array, fetched once
                pl.BlockSpec(memory_space=pl.ANY),  # left in HBM for manual DMAs
                pl.BlockSpec((8, cols), lambda i: (i, 0)),
            ],
            out_specs=pl.BlockSpec((8, cols), lambda i: (i, 0)),
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        )(w, table, x)

    w = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    table = jax.ShapeDtypeStruct((1024, 128), jnp.float32)
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    [call] = perf.model_pallas_traffic(scale, w, table, x)
    weights, hbm_table, rows, _ = call.operands
    assert (weights.transfers, weights.hbm_bytes, weights.buffer_count) == (1, 8 * 128 * 4, 1)
    assert (hbm_table.memory_space, hbm_table.hbm_bytes) == ("any", 0)  # no copy touches it
    assert any("memory space any" in note for note in call.notes)
    assert rows.hbm_bytes == 64 * 128 * 4


def test_block_bytes_are_clipped_to_the_array_at_a_partial_edge_block():
    x = jax.ShapeDtypeStruct((40, 128), jnp.float32)
    spec = pl.BlockSpec((16, 128), lambda i: (i, 0))
    copy = pl.pallas_call(
        lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
        grid=(math.ceil(40 / 16),),
        in_specs=[spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    )
    [call] = perf.model_pallas_traffic(copy, x)
    assert call.inputs[0].hbm_bytes == 40 * 128 * 4
    assert call.outputs[0].hbm_bytes == 40 * 128 * 4


def test_calls_inside_jit_and_scan_are_each_replayed():
    def layers(x, ws):
        def layer(h, w):
            return MATMUL(h, w), None

        return jax.lax.scan(layer, x, ws)[0]

    x = jax.ShapeDtypeStruct((M, K), jnp.bfloat16)
    ws = jax.ShapeDtypeStruct((3, K, K), jnp.bfloat16)
    calls = perf.model_pallas_traffic(jax.jit(layers), x, ws)
    assert len(calls) == 3
    assert all(call.flops == 2 * M * K * K for call in calls)
    assert perf.roofline(calls, "v6e").time_s == pytest.approx(3 * perf.roofline(calls[0], "v6e").time_s)


def test_pl_when_on_scalar_prefetch_is_evaluated_at_every_step():
    block_on = np.array([1, 0, 0, 1], np.int32)
    [call] = perf.model_pallas_traffic(masked_matmul, block_on, MASK_X, MASK_Y)
    assert call.dots_exact
    assert call.flops == 2 * BLOCK_FLOPS
    # The pipeline still fetches every block: pl.when only skips the compute.
    assert call.inputs[0].transfers == call.inputs[1].transfers == 4


def test_active_steps_callback_removes_compute_the_model_cannot_see_skipped():
    block_on = np.array([1, 0, 0, 1], np.int32)
    gated_on_data = functools.partial(masked_matmul, gate_on_data=True)
    [every_step] = perf.model_pallas_traffic(gated_on_data, block_on, MASK_X, MASK_Y)
    assert not every_step.dots_exact  # x's data decides: the model counts the dot at every step
    assert every_step.flops == 4 * BLOCK_FLOPS

    def when_on(name, grid_indices, prefetch):
        (on,) = prefetch
        return on[grid_indices[:, 0]] == 1

    [masked] = perf.model_pallas_traffic(gated_on_data, block_on, MASK_X, MASK_Y, active_steps=when_on)
    assert masked.active_steps == 2
    assert masked.flops == 2 * BLOCK_FLOPS
    assert masked.hbm_bytes == every_step.hbm_bytes


def test_megablox_gmm_dynamic_grid_is_resolved_from_the_group_sizes():
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    rows, k, n, groups = 64, 256, 256, 4
    group_sizes = np.array([20, 0, 30, 14], np.int32)
    lhs = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((groups, k, n), jnp.bfloat16)
    [call] = perf.model_pallas_traffic(
        functools.partial(gmm, preferred_element_type=jnp.bfloat16, tiling=(64, 128, 128)), lhs, rhs, group_sizes
    )
    # One m-tile holds all rows; megablox visits it once per non-empty group.
    assert call.grid == (n // 128, 3, k // 128)
    weights = call.inputs[1]
    assert weights.distinct_blocks == 3 * (k // 128) * (n // 128)
    assert weights.hbm_bytes == 3 * k * n * BF16


def test_group_sizes_given_abstractly_are_refused_and_so_is_a_call_under_cond():
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    lhs = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((4, 256, 256), jnp.bfloat16)
    group_sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
    with pytest.raises(ValueError, match="dynamic size.*pass that argument concretely"):
        perf.model_pallas_traffic(
            functools.partial(gmm, preferred_element_type=jnp.bfloat16, tiling=(64, 128, 128)), lhs, rhs, group_sizes
        )

    def maybe_matmul(flag, x, y):
        return jax.lax.cond(flag, MATMUL, lambda a, b: jnp.zeros((M, N), jnp.bfloat16), x, y)

    with pytest.raises(NotImplementedError, match="inside `cond`"):
        perf.model_pallas_traffic(maybe_matmul, True, X, Y)


def _table_then_rows(read_table: bool):
    """x's rows copied through; with `read_table` the kernel also loads from the table left in HBM (not a copy)."""
    def gather_rows(table, x):
        def kernel(table_ref, x_ref, o_ref):
            o_ref[...] = x_ref[...] + (table_ref[pl.ds(0, 8), :] if read_table else 0.0)

        return pl.pallas_call(
            kernel, grid=(x.shape[0] // 8,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec((8, 128), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        )(table, x)

    return gather_rows


def test_an_operand_left_in_hbm_that_no_copy_touches_moves_no_bytes():
    table = jax.ShapeDtypeStruct((1024, 128), jnp.float32)
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    [call] = perf.model_pallas_traffic(_table_then_rows(False), table, x)
    assert not call.unmodelled_dmas and call.operands[0].hbm_bytes == 0
    perf.roofline(call, "v6e")


def test_roofline_refuses_a_kernel_that_uses_an_operand_in_hbm_other_than_by_copies():
    table = jax.ShapeDtypeStruct((1024, 128), jnp.float32)
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    [call] = perf.model_pallas_traffic(_table_then_rows(True), table, x)
    assert call.unmodelled_dmas == (call.operands[0].origin,)
    assert any("not through a copy" in note for note in call.notes)
    with pytest.raises(ValueError, match="memory space ANY.*cannot time this kernel"):
        perf.roofline(call, "v6e")


def _copied_rows(rows_from_vmem: bool):
    """A kernel that copies rows of an HBM table by index (scalar prefetch), a step ahead, as gathering kernels do:
    step i needs rows [8 i, min(8 i + 8, live)); with `rows_from_vmem` the live count comes from a VMEM block,
    which the replay cannot evaluate per step."""
    def kernel(index_ref, live_ref, table_ref, count_ref, o_ref, buffers, semaphores):
        step, steps = pl.program_id(0), pl.num_programs(0)
        live = count_ref[0, 0] if rows_from_vmem else live_ref[0]
        start, stop = step * 8, jnp.clip(live, step * 8, step * 8 + 8)
        next_start, next_stop = start + 8, jnp.clip(live, start + 8, start + 16)

        def copies(slot, first, last, base):
            def copy(row):
                return pltpu.make_async_copy(table_ref.at[pl.ds(index_ref[row], 1)],
                                             buffers.at[slot, pl.ds(row - base, 1)], semaphores.at[slot])
            def start_all():
                jax.lax.fori_loop(first, last, lambda r, c: (copy(r).start(), c)[1], 0)

            def wait_all():
                jax.lax.fori_loop(first, last, lambda r, c: (copy(r).wait(), c)[1], 0)

            return start_all, wait_all

        slot = step % 2
        pl.when(step == 0)(copies(0, start, stop, start)[0])
        pl.when(step + 1 < steps)(copies(1 - slot, next_start, next_stop, next_start)[0])
        copies(slot, start, stop, start)[1]()
        o_ref[...] = buffers[slot]

    def gather(index, live, table, count):
        return pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                2, (index.shape[0] // 8,),
                [pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec((1, 128), lambda i, *_: (0, 0))],
                pl.BlockSpec((8, 128), lambda i, *_: (i, 0)),
                [pltpu.VMEM((2, 8, 128), jnp.float32), pltpu.SemaphoreType.DMA((2,))]),
            out_shape=jax.ShapeDtypeStruct((index.shape[0], 128), jnp.float32),
        )(index, live, table, count)

    return gather


def test_a_kernels_own_copies_are_counted_at_the_steps_that_wait_for_them():
    index = np.arange(40, dtype=np.int32) * 7 % 1024
    table = jax.ShapeDtypeStruct((1024, 128), jnp.float32)
    count = jax.ShapeDtypeStruct((1, 128), jnp.int32)
    [call] = perf.model_pallas_traffic(_copied_rows(False), index, np.array([21], np.int32), table, count)
    copied = call.operands[2]
    assert copied.pipelined and not call.unmodelled_dmas
    row = 128 * 4
    # 21 live rows over steps of 8: 8, 8, 5, then none.
    assert list(copied.fetched_per_step) == [8 * row, 8 * row, 5 * row, 0, 0]
    assert copied.hbm_bytes == 21 * row
    assert any("counted from the kernel's own copies" in note for note in call.notes)
    perf.roofline(call, "v6e")


def test_a_copy_count_the_replay_cannot_evaluate_leaves_the_kernel_untimed():
    index = np.arange(40, dtype=np.int32)
    table = jax.ShapeDtypeStruct((1024, 128), jnp.float32)
    count = jax.ShapeDtypeStruct((1, 128), jnp.int32)
    [call] = perf.model_pallas_traffic(_copied_rows(True), index, np.array([21], np.int32), table, count)
    assert call.unmodelled_dmas == (call.operands[2].origin,)
    with pytest.raises(ValueError, match="cannot time this kernel"):
        perf.roofline(call, "v6e")
