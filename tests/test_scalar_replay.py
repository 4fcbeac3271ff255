"""The scalar replay of a kernel's own copies (`perf.scalar_replay`): loops whose bounds come from the loop around
them, one wait covering several copies, SMEM kept across grid steps, phases priced with their overlap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from benchmarks import perf

ROW = 128 * 4  # one float32 row of the table


def _segments_kernel(one_wait: bool):
    """Per grid step: for each of the step's segments (bounds from scalar prefetch), copy its rows one by one into
    VMEM and sum them; the inner loop's bounds are the outer loop's values. With `one_wait` the step waits once per
    segment on a descriptor of its own covering all the segment's row copies."""

    def kernel(starts_ref, ends_ref, first_ref, last_ref, table_ref, o_ref, buffer, semaphore):
        step = pl.program_id(0)

        def segment(s, total):
            start, end = starts_ref[s], ends_ref[s]

            def copy(r):
                return pltpu.make_async_copy(table_ref.at[pl.ds(r, 1)], buffer.at[pl.ds(r - start, 1)],
                                             semaphore.at[0])

            jax.lax.fori_loop(start, end, lambda r, c: (copy(r).start(), c)[1], 0)
            if one_wait:
                rows = end - start
                whole = pltpu.make_async_copy(buffer.at[pl.ds(0, rows)], buffer.at[pl.ds(0, rows)], semaphore.at[0])
                pl.when(rows > 0)(whole.wait)
            else:
                jax.lax.fori_loop(start, end, lambda r, c: (copy(r).wait(), c)[1], 0)
            return total + jnp.sum(buffer[...], axis=0, keepdims=True)

        o_ref[...] = jax.lax.fori_loop(first_ref[step], last_ref[step] + 1, segment,
                                       jnp.zeros((1, 128), jnp.float32)).repeat(8, axis=0)

    def call(starts, ends, first, last, table):
        steps = first.shape[0]
        return pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                4, (steps,), [pl.BlockSpec(memory_space=pl.ANY)], pl.BlockSpec((8, 128), lambda i, *_: (i, 0)),
                [pltpu.VMEM((16, 128), jnp.float32), pltpu.SemaphoreType.DMA((1,))]),
            out_shape=jax.ShapeDtypeStruct((8 * steps, 128), jnp.float32),
        )(starts, ends, first, last, table)

    return call


# Segments of 3, 0, 7, 16 and 5 rows; step 0 owns segments 0-1, step 1 segments 2-4, step 2 none.
STARTS = np.array([0, 3, 3, 10, 26], np.int32)
ENDS = np.array([3, 3, 10, 26, 31], np.int32)
FIRST, LAST = np.array([0, 2, 5], np.int32), np.array([1, 4, 4], np.int32)
TABLE = jax.ShapeDtypeStruct((64, 128), jnp.float32)


@pytest.mark.parametrize("one_wait", [False, True])
def test_copies_in_loops_bounded_by_the_loop_around_them_are_counted_per_step(one_wait):
    [call] = perf.model_pallas_traffic(_segments_kernel(one_wait), STARTS, ENDS, FIRST, LAST, TABLE)
    table = call.operands[4]
    assert not call.unmodelled_dmas and call.dots_exact
    assert list(table.fetched_per_step) == [3 * ROW, (7 + 16 + 5) * ROW, 0]
    assert table.hbm_bytes == 31 * ROW
    assert any("scalar program" in note for note in call.notes)
    perf.roofline(call, "v6e")


def test_vector_work_counts_each_trip_the_scalars_take():
    [call] = perf.model_pallas_traffic(_segments_kernel(False), STARTS, ENDS, FIRST, LAST, TABLE)
    # One (16, 128) reduction and one add per segment that runs: 2 segments at step 0, 3 at step 1, none at step 2.
    per_segment = call.vector_per_step[0] / 2
    assert per_segment > 0
    assert list(call.vector_per_step[:2]) == [2 * per_segment, 3 * per_segment]


def test_phases_are_priced_between_full_overlap_and_none():
    """A step cut into phases (a wait's copies, then the work after it) is priced as the kernel's own double
    buffering runs it: no faster than its copies or its work alone, no slower than both one after the other."""
    [call] = perf.model_pallas_traffic(_segments_kernel(False), STARTS, ENDS, FIRST, LAST, TABLE)
    # A phase per segment with rows (segment 1 has none: its work joins segment 0's phase); a step with no copy
    # is one phase of work.
    assert list(np.bincount(call.phases.step, minlength=3)) == [1, 3, 1]
    modelled = perf.roofline(call, "v6e")
    work = call.vector_seconds_per_step("v6e").sum()
    assert max(modelled.hbm_bound_s, work) + modelled.overhead_s <= modelled.pipelined_time_s + 1e-15
    assert modelled.pipelined_time_s <= modelled.hbm_bound_s + work + modelled.overhead_s + 1e-15


def test_a_loop_bound_read_from_vmem_is_refused_with_the_reason():
    def kernel(n_ref, table_ref, o_ref, buffer, semaphore):
        count = o_ref.shape[0] + jnp.sum(buffer[...]).astype(jnp.int32)  # a value computed in VMEM

        def copy(r):
            return pltpu.make_async_copy(table_ref.at[pl.ds(r, 1)], buffer.at[pl.ds(0, 1)], semaphore.at[0])

        jax.lax.fori_loop(0, count, lambda r, c: (copy(r).start(), copy(r).wait(), c)[2], 0)
        o_ref[...] = buffer[...]

    def call(n, table):
        return pl.pallas_call(
            kernel, grid_spec=pltpu.PrefetchScalarGridSpec(
                1, (1,), [pl.BlockSpec(memory_space=pl.ANY)], pl.BlockSpec((8, 128), lambda i, *_: (0, 0)),
                [pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA((1,))]),
            out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))(n, table)

    [call_traffic] = perf.model_pallas_traffic(call, np.array([3], np.int32), TABLE)
    assert call_traffic.unmodelled_dmas
    assert any("could not be replayed" in note and "VMEM" in note for note in call_traffic.notes)
    with pytest.raises(ValueError, match="cannot time this kernel"):
        perf.roofline(call_traffic, "v6e")
