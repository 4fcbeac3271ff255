"""Each token's picks, weighted and summed, as a Pallas TPU kernel that copies only the live picks' rows.

The experts layer's second grouped matmul leaves one row per pick, sorted by
expert (`[M, H]`, as packed words per N tile: `gmm.plan.packed_plan`). Summing each
token's picks in XLA reads all T x K rows of that array, the sentinel
picks' too (another rank's experts, most picks under expert-parallel router
masking), and XLA writes and rereads a `[T, H]` gather per pick slot.

Here the grid runs over tiles of `tile_t` tokens (`tiles.select`), split in runs of
consecutive tiles over the device's TensorCores (v5p's two: the grid's
first dimension, parallel). Each step waits for its tile's live pick rows,
copied one row per DMA from the sorted rows into one of two VMEM buffers
(slab k holds the tile's tokens' k-th picks), and starts the copies of its
core's next tile into the other buffer; a core's first step copies its own
tile first. Then it weights each slab by its routing weights and sums them
in f32. With an odd number of tiles on two cores, the second core's last
step repeats its tile before (copies, sums and writes the same values): no
step lacks a tile, and no two cores write one block. Sentinel picks are never copied:
their slots in the buffer keep whatever they held, and a select (not a
multiply: they may hold NaN) drops them.

What each step copies is scheduled in XLA over the `[T, K]` picks (not their
rows): per tile, its live picks' sorted positions and buffer slots first,
and their count (`combine_schedule`), scalar-prefetched, so the kernel's
copy loops have no branch and the traffic model counts them per step
(`benchmarks.perf.kernel_dmas`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common.packed_rows import unpack_rows
from .plan import CombinePlan


class CombineSchedule(NamedTuple):
    """Scalar-prefetch operands: per token tile, its live picks' copies first."""

    source: jax.Array  # [tiles * K * tile_t] int32: the sorted row of each copy
    slot: jax.Array  # [tiles * K * tile_t] int32: its row in the tile's buffer (k * tile_t + token in tile)
    copies: jax.Array  # [tiles] int32: live picks of each tile


def combine_schedule(position: jax.Array, live: jax.Array, plan: CombinePlan) -> CombineSchedule:
    """The copies of each token tile from `position[T, K]` (each pick's sorted row) and `live[T, K]`."""
    tile_t, top_k, tiles = plan.tile_t, plan.problem.top_k, plan.tiles
    pad = tiles * tile_t - plan.problem.tokens
    position = jnp.pad(position, ((0, pad), (0, 0)))
    live = jnp.pad(live, ((0, pad), (0, 0)))

    def by_slab(picks):
        """[tiles, K x tile_t]: entry k * tile_t + t of a tile is its token t's k-th pick (and buffer row)."""
        return picks.reshape(tiles, tile_t, top_k).transpose(0, 2, 1).reshape(tiles, top_k * tile_t)

    position, live = by_slab(position), by_slab(live)
    first_live = jnp.argsort(jnp.logical_not(live), axis=1, stable=True).astype(jnp.int32)
    return CombineSchedule(source=jnp.take_along_axis(position, first_live, axis=1).reshape(-1).astype(jnp.int32),
                           slot=first_live.reshape(-1), copies=jnp.sum(live, axis=1, dtype=jnp.int32))


def call(rows: jax.Array, position: jax.Array, top_k_weights: jax.Array, live: jax.Array,
                  plan: CombinePlan) -> jax.Array:
    """`sum_k top_k_weights[t, k] * rows[position[t, k]]` over each token's live picks, in f32, as the problem's
    dtype.

    `rows` are the sorted rows as packed words (`[M, words]` int32, `common.packed_rows.pack_rows` per N tile
    of the problem's `tile_n` in `split` words: `problem.CombineProblem`); rows of picks not `live` are never read.
    """
    problem, tile_t, tiles = plan.problem, plan.tile_t, plan.tiles
    tokens, top_k, hidden = problem.tokens, problem.top_k, problem.hidden
    schedule = combine_schedule(position, live, plan)
    pad = ((0, tiles * tile_t - tokens), (0, 0))
    weights = jnp.pad(jnp.where(live, top_k_weights.astype(jnp.float32), 0.0), pad)
    live_flags = jnp.pad(live.astype(jnp.int32), pad)

    def by_tile(core, step, *_):
        return _tile(core, step, plan), 0

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(schedule),
        grid=(plan.cores, plan.tiles_per_core),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec((tile_t, top_k), by_tile),
                  pl.BlockSpec((tile_t, top_k), by_tile)],
        out_specs=pl.BlockSpec((tile_t, hidden), by_tile),
        scratch_shapes=[pltpu.VMEM((2, top_k * tile_t, problem.words), jnp.int32), pltpu.SemaphoreType.DMA((2,))],
    )
    return pl.pallas_call(
        functools.partial(_body, plan=plan),
        # The last tile's block is partial: its rows past the tokens are never written back.
        out_shape=jax.ShapeDtypeStruct((tokens, hidden), jnp.dtype(problem.dtype)),
        grid_spec=grid_spec,
        # Each core walks its tiles in order: each step's copies were started by the step before.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=plan.vmem_limit_bytes),
        cost_estimate=pl.CostEstimate(flops=2 * tokens * top_k * hidden, transcendentals=0,
                                      bytes_accessed=tokens * top_k * hidden * 2 + tokens * hidden * 2),
        name="combine_picks",
    )(*schedule, rows, weights, live_flags)


def _tile(core, step, plan: CombinePlan):
    """The token tile a core's step sums: its run's, the second core's last step past the tiles repeating the one
    before."""
    return jnp.minimum(core * plan.tiles_per_core + step, plan.tiles - 1)


def _body(source_ref, slot_ref, copies_ref, rows_ref, weights_ref, live_ref, out_ref, buffers, semaphores, *,
          plan: CombinePlan):
    core, step, steps = pl.program_id(0), pl.program_id(1), pl.num_programs(1)
    problem = plan.problem
    per_tile = problem.top_k * plan.tile_t
    buffer = step % 2
    tile, next_tile = _tile(core, step, plan), _tile(core, step + 1, plan)

    def copy(tile, target, entry):
        index = tile * per_tile + entry
        return pltpu.make_async_copy(rows_ref.at[pl.ds(source_ref[index], 1)],
                                     buffers.at[target, pl.ds(slot_ref[index], 1)], semaphores.at[target])

    def start_tile(tile, target, count):
        lax.fori_loop(0, count, lambda entry, carry: (copy(tile, target, entry).start(), carry)[1], 0)

    # The copy counts are read here, outside the branches: the traffic model evaluates them per step.
    count, next_count = copies_ref[tile], copies_ref[next_tile]
    pl.when(step == 0)(functools.partial(start_tile, tile, buffer, count))
    pl.when(step + 1 < steps)(functools.partial(start_tile, next_tile, 1 - buffer, next_count))
    lax.fori_loop(0, count, lambda entry, carry: (copy(tile, buffer, entry).wait(), carry)[1], 0)

    tile_t, split = plan.tile_t, problem.split
    weights, live = weights_ref[...], live_ref[...] > 0
    for n_tile in range(pl.cdiv(problem.hidden, problem.tile_n)):
        sums = [jnp.zeros((tile_t, split), jnp.float32) for _ in range(2)]
        for k in range(problem.top_k):
            words = buffers[buffer, pl.ds(k * tile_t, tile_t), pl.ds(n_tile * split, split)]
            # Rows of picks not live were never copied: selected away, whatever they hold.
            for part, values in enumerate(unpack_rows(words)):
                sums[part] = sums[part] + jnp.where(live[:, k : k + 1], weights[:, k : k + 1] * values, 0.0)
        tile_start = n_tile * problem.tile_n
        tile_end = min(tile_start + problem.tile_n, problem.hidden)
        for part, (start, end) in enumerate(((tile_start, min(tile_start + split, tile_end)),
                                             (tile_start + split, tile_end))):
            if end > start:  # a partial last tile's second part may hold no column
                out_ref[:, start:end] = sums[part][:, : end - start].astype(out_ref.dtype)
