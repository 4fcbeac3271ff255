"""Gathered rows (`MatmulProblem.gathered`): the grouped matmul's lhs rows copied from their tokens by the kernel.

lhs is the `[tokens, K]` token rows, left in HBM, and a scalar-prefetched
`row_token[M]` names each sorted row's token. Each step that starts a row
tile waits for its window's rows, copied one row per DMA into one of two
VMEM buffers, and starts the copies of the next step's window into the
other (`kernel.py`'s docstring has the whole schedule).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common.packed_rows import unpack_rows
from .plan import MatmulPlan


def token_rows(words_ref, dtype: str, k: int, split: int, start, rows: int):
    """Copied token rows `[start, start + rows)` of one buffer, as `kernel._lhs_rows` gives them: f32 rows as they are;
    bf16 rows, copied as words (`common.packed_rows.pack_rows`), as their K columns before `split` and from it."""
    words = words_ref[pl.ds(start, rows), :]
    if dtype == "float32":
        return ((words, None),)
    # A bf16 value's bits are the top half of its f32 bits: both parts widen exactly, then narrow exactly.
    first, second = (part.astype(jnp.bfloat16) for part in unpack_rows(words))
    return ((first, slice(0, split)), (second[:, : k - split], slice(split, k)))


class Gather(NamedTuple):
    """The refs gathered rows take: the tokens in HBM, their scalar-prefetched schedule, and two buffers."""

    tokens: object  # HBM [T, K] (f32) or [T, K / 2] (packed bf16)
    row_token: object  # SMEM [M]: each sorted row's token
    live_rows: object  # SMEM [1]: rows in groups (sum of the group sizes); rows past them are never copied
    buffers: object  # VMEM [2, window, ...]
    semaphores: object  # DMA [2]
    current: object  # SMEM [1]: which buffer holds this step's rows


def _copies(gather: Gather, buffer, start, stop, tile_start):
    """Rows [start, stop) of a window starting at sorted row `tile_start`, each from its token into `buffer`."""
    def copy(row):
        return pltpu.make_async_copy(gather.tokens.at[pl.ds(gather.row_token[row], 1)],
                                     gather.buffers.at[buffer, pl.ds(row - tile_start, 1)],
                                     gather.semaphores.at[buffer])

    def start_all():
        lax.fori_loop(start, stop, lambda row, carry: (copy(row).start(), carry)[1], 0)

    def wait_all():
        lax.fori_loop(start, stop, lambda row, carry: (copy(row).wait(), carry)[1], 0)

    return start_all, wait_all


def gather_rows(gather: Gather, lhs_tile_ref, step, steps, plan: MatmulPlan):
    """Copies this step's window of rows from their tokens (module docstring) and returns the buffer holding it.

    The rows each copy loop runs over are computed here, outside the `pl.when`s: the traffic model evaluates
    them per grid step from the program ids and the scalar prefetch.
    """
    slots, tile_m = plan.groups_per_step, plan.tile_m
    window, last_item = gather.buffers.shape[1], lhs_tile_ref.shape[0] - 1
    item = step * slots
    tile = lhs_tile_ref[item]
    first = step == 0
    new_tile = jnp.logical_or(first, tile != lhs_tile_ref[jnp.maximum(item - slots, 0)])
    next_tile = lhs_tile_ref[jnp.minimum(item + slots, last_item)]
    prefetch = jnp.logical_and(step + 1 < steps, next_tile != tile)
    live = gather.live_rows[0]
    start, next_start = tile * tile_m, next_tile * tile_m
    stop, next_stop = jnp.clip(live, start, start + window), jnp.clip(live, next_start, next_start + window)

    @pl.when(first)
    def _():
        gather.current[0] = 0
        _copies(gather, 0, start, stop, start)[0]()

    @pl.when(jnp.logical_and(new_tile, jnp.logical_not(first)))
    def _():
        gather.current[0] = 1 - gather.current[0]

    buffer = gather.current[0]

    @pl.when(prefetch)
    def _():
        _copies(gather, 1 - buffer, next_start, next_stop, next_start)[0]()

    @pl.when(new_tile)
    def _():
        _copies(gather, buffer, start, stop, start)[1]()

    return buffer
