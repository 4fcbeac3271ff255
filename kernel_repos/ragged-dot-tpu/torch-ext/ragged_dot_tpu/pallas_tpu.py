"""Grouped matmul (ragged dot) as a Pallas TPU kernel.

`lhs[M, K]` rows are sorted by group: rows `[offsets[g], offsets[g+1])` belong
to group `g` and are multiplied by `rhs[g]`. Rows past the last group come out
as zeros, or, with `zero_rows_past_groups=False` (an experts layer, whose rows
past the groups are other ranks' sentinel picks), are not written at all.

Schedule: the M axis is cut into row tiles of `tile_m`. A *work item* is one
(group, row tile) pair that intersects; a row tile straddling a group boundary
appears once per group it touches, and consecutive work items on the same row
tile accumulate into the same resident output block. Row tiles no group
reaches (past `sum(group_sizes)`) get one work item that only writes zeros,
or none without `zero_rows_past_groups`: then those rows cost no grid step,
no MXU work and no HBM traffic (a call without any live row runs one empty
item, as Pallas fetches the blocks of a grid's first step).
The grid is `(n_tiles, steps, k_tiles)`; a step runs `groups_per_step`
consecutive work items (each with its own copy of the `rhs` operand, so each
fetches its own group's weights block), and the number of steps is computed
from the group sizes (a dynamic grid axis): empty groups add no grid step.

What each operand moves (the point of the schedule, for decode):
- consecutive work items of one group keep the same `rhs` block index, so
  with `tile_k = K` each active group's weights are fetched once per N tile,
  however many row tiles the group spans, and empty groups fetch nothing;
- consecutive work items on one row tile keep the `lhs` and `out` block
  indices, so every row is read and written once per N tile (with
  `tile_m >= M` and `tile_k = K`, lhs is one single-buffered block read once);
- zero-writing tail items and idle group slots keep the blocks they had (no
  fetch) and skip the matmul: rows past the groups cost only their write.

MXU work: with `chunk_m` below the row tile, each group is multiplied in
chunks of `chunk_m` rows laid from its first row (rounded down to the native
sublane tile, the finest offset Mosaic slices VMEM at), each under a
`pl.when` that skips chunks past the group's rows. So a group costs
ceil((rows + its start's offset from the sublane grid) / chunk_m) chunks,
wherever its rows fall: no chunk is spent on two groups at a group boundary,
and none is split at a row tile boundary. The item of the tile where a chunk
starts multiplies it whole: its lhs block is a window of `tile_m + chunk_m`
rows (element offsets), and the results of rows past the tile's end go to a
carry buffer that the next row tile's accumulator starts from. (The window's
extra rows cost chunk_m / tile_m more lhs reads.) Without chunks, an item
multiplies its whole row tile, masked to its group's rows.
Tile sizes come from `config.select_config`.

Quantized weights (`quant.py`) are read as one byte each: an int8 block is
cast to lhs's dtype at the matmul and its per-output-column scales multiply
the result; an fp8 block is dequantized once per step into VMEM scratch
(under the slot's `pl.when`: only for a slot with rows in the tile).

The CostEstimate counts what the kernel reads: the rows, the weights of the
groups expected active for M uniformly routed rows
(`config.expected_active_groups`: the group sizes are data, unknown when
the call is traced) and the output.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._hardware import sublane_multiple
from .config import (
    TileConfig, check_config, expected_active_groups, row_chunks, row_tile_rows, select_config, vmem_limit,
)
from .quant import FP8, INT8, dequantize_fp8_block, scheme_of
from .routing import int32_group_sizes


class WorkItems(NamedTuple):
    """Scalar-prefetch arrays describing the work items of one call."""

    row_tile: jax.Array  # [max_items] int32: output row tile of each item
    lhs_tile: jax.Array  # [max_items] int32: lhs row tile fetched for it (a tail item keeps the previous one)
    group: jax.Array  # [max_items] int32: rhs group of each item
    row_start: jax.Array  # [max_items] int32: first row of the item's group (0 for a tail item)
    row_end: jax.Array  # [max_items] int32: one past the item's group's last row (0 for a tail item)
    chunk_start: jax.Array  # [max_items] int32: first row of the group's first chunk that starts in the item's tile
    count: jax.Array  # [1] int32: number of real items, the size of the grid's work-item axis


def max_work_items(m: int, num_groups: int, tile_m: int) -> int:
    return pl.cdiv(m, tile_m) + num_groups - 1


def make_work_items(
    group_sizes: jax.Array, m: int, tile_m: int, zero_rows_past_groups: bool = True, chunk_m: int | None = None,
    align: int = 8,
) -> WorkItems:
    """Work items of a call; `chunk_m` and `align` lay each group's chunks (module docstring)."""
    num_groups = group_sizes.shape[0]
    m_tiles = pl.cdiv(m, tile_m)
    capacity = max_work_items(m, num_groups, tile_m)

    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    nonempty = group_sizes > 0
    first_tile = starts // tile_m
    last_tile = jnp.where(nonempty, (ends - 1) // tile_m, first_tile - 1)
    tiles_per_group = jnp.where(nonempty, last_tile - first_tile + 1, 0)

    total_rows = ends[-1]
    first_untouched_tile = pl.cdiv(total_rows, tile_m)
    untouched_tiles = m_tiles - first_untouched_tile

    # Items are laid out group by group, then the untouched tail tiles.
    group_item_end = jnp.cumsum(tiles_per_group)
    group_items = group_item_end[-1]
    # Without any item (no live row, tail not zeroed) the grid still runs one empty item.
    count = jnp.maximum(group_items + untouched_tiles, 1) if zero_rows_past_groups else jnp.maximum(group_items, 1)

    item = jnp.arange(capacity, dtype=jnp.int32)
    in_groups = item < group_items
    item_group = jnp.minimum(jnp.searchsorted(group_item_end, item, side="right"), num_groups - 1)
    item_group_begin = group_item_end[item_group] - tiles_per_group[item_group]
    group_tile = first_tile[item_group] + (item - item_group_begin)
    tail_tile = first_untouched_tile + (item - group_items)

    # A group's chunks start every chunk_m rows from its first row on the sublane grid; the item's
    # first is the first of them at or past its tile's first row (tile-relative).
    chunk = chunk_m or tile_m
    chunk_base = starts[item_group] // align * align
    tile_start = group_tile * tile_m
    behind = tile_start - chunk_base
    chunk_start = jnp.where(behind <= 0, -behind, (chunk - behind % chunk) % chunk)

    # Tail items keep the lhs and rhs blocks of the last group item, so they fetch nothing new.
    last_nonempty_group = jnp.max(jnp.where(nonempty, jnp.arange(num_groups), 0))
    last_group_tile = jnp.where(group_items > 0, first_untouched_tile - 1, 0)
    return WorkItems(
        row_tile=jnp.where(in_groups, group_tile, tail_tile).astype(jnp.int32),
        lhs_tile=jnp.where(in_groups, group_tile, last_group_tile).astype(jnp.int32),
        group=jnp.where(in_groups, item_group, last_nonempty_group).astype(jnp.int32),
        row_start=jnp.where(in_groups, starts[item_group], 0).astype(jnp.int32),
        row_end=jnp.where(in_groups, ends[item_group], 0).astype(jnp.int32),
        chunk_start=jnp.where(in_groups, chunk_start, 0).astype(jnp.int32),
        count=count.astype(jnp.int32).reshape(1),
    )


def _step_item(step, slot: int, groups_per_step: int, count):
    """The work item in `slot` of grid step `step`.

    A slot past the last item repeats its item of the step before (so its
    blocks do not move); in the first step, where there is none, it repeats
    item 0.
    """
    item = step * groups_per_step + slot
    if groups_per_step == 1:
        return item
    return jnp.where(item < count, item, jnp.maximum(item - groups_per_step, 0))


def _body(
    row_tile_ref,
    lhs_tile_ref,
    group_ref,
    row_start_ref,
    row_end_ref,
    chunk_start_ref,
    count_ref,
    lhs_ref,
    *refs,
    k: int,
    tile_k: int,
    tile_n: int,
    chunk_m: int | None,
    groups_per_step: int,
    transpose_rhs: bool,
    quantization: str | None,
    precision,
):
    del lhs_tile_ref, group_ref  # used by the index maps only
    rhs_refs, refs = refs[:groups_per_step], refs[groups_per_step:]
    scale_refs, refs = (refs[:groups_per_step], refs[groups_per_step:]) if quantization else ((), refs)
    out_ref, acc_ref, *scratch = refs
    carry_ref = scratch.pop(0) if chunk_m else None  # [2 chunk_m, tile_n]: rows [tile_m - chunk_m, tile_m + chunk_m)
    dequantized_refs = scratch  # fp8: each slot's weights block, dequantized once per step
    step = pl.program_id(1)
    steps = pl.num_programs(1)
    k_step = pl.program_id(2)
    count = count_ref[0]
    tile_m = acc_ref.shape[0]
    align = sublane_multiple(lhs_ref.dtype)
    # Every slot of a step works on the same row tile (the kernel wrapper checks it).
    first_item = step * groups_per_step
    row_tile = row_tile_ref[first_item]
    tile_start = row_tile * tile_m
    starts_row_tile = jnp.logical_or(step == 0, row_tile != row_tile_ref[jnp.maximum(first_item - groups_per_step, 0)])
    next_item = jnp.minimum(first_item + groups_per_step, count - 1)
    ends_row_tile = jnp.logical_or(step == steps - 1, row_tile_ref[next_item] != row_tile)

    if chunk_m:

        @pl.when(jnp.logical_and(k_step == 0, step == 0))
        def _():
            carry_ref[...] = jnp.zeros_like(carry_ref)

    @pl.when(jnp.logical_and(k_step == 0, starts_row_tile))
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        if chunk_m:
            # Rows of the previous tile's last chunks that ran into this tile.
            acc_ref[:chunk_m, :] = carry_ref[chunk_m:, :]
            carry_ref[...] = jnp.zeros_like(carry_ref)

    k_columns_ragged = k % tile_k != 0

    def weights(slot):
        """The slot's weights block in the activation dtype (int8 as its integers: the scales come after the dot)."""
        if quantization == FP8:
            return dequantized_refs[slot][...]
        rhs = rhs_refs[slot][...]
        return rhs.astype(lhs_ref.dtype) if quantization == INT8 else rhs

    def multiply(slot, start, rows: int, keep):
        """lhs rows [start, start + rows) x the slot's weights, with rows not `keep` taken as zero; `start` on the
        sublane grid."""
        lhs = lhs_ref[pl.ds(start, rows), :]
        rhs = weights(slot)
        # Select, not multiply: rows and K columns outside the data may hold
        # garbage (NaN), and 0 * NaN is NaN.
        if k_columns_ragged:
            col = k_step * tile_k + lax.broadcasted_iota(jnp.int32, (1, tile_k), 1)
            keep = jnp.logical_and(keep, col < k)
            rhs_k_axis = 1 if transpose_rhs else 0
            rhs_k = k_step * tile_k + lax.broadcasted_iota(jnp.int32, rhs.shape, rhs_k_axis)
            rhs = jnp.where(rhs_k < k, rhs, jnp.zeros_like(rhs))
        lhs = jnp.where(keep, lhs, jnp.zeros_like(lhs))
        contract_rhs = 1 if transpose_rhs else 0
        product = lax.dot_general(
            lhs,
            rhs,
            (((1,), (contract_rhs,)), ((), ())),
            preferred_element_type=jnp.float32,
            precision=precision,
        )
        # int8: one scale per output column, common to the whole dot product.
        return product * scale_refs[slot][...] if quantization == INT8 else product

    for slot in range(groups_per_step):
        item = first_item + slot
        # An idle slot (past the last item) and a tail item (rows past every
        # group) have an empty row range, so no chunk of theirs computes.
        # lax.select rather than jnp.where: jnp.where is a nested jit, which
        # hides these predicates from the traffic model's per-step evaluation.
        real = item < count
        zero = jnp.int32(0)
        last_real = jnp.minimum(item, count - 1)
        row_start = lax.select(real, row_start_ref[last_real], zero)
        row_end = lax.select(real, row_end_ref[last_real], zero)
        rows_in_tile = jnp.logical_and(row_start < tile_start + tile_m, row_end > tile_start)
        if quantization == FP8:

            @pl.when(rows_in_tile)
            def _(slot=slot):
                n_offset, k_offset = pl.program_id(0) * tile_n, k_step * tile_k
                offsets = (n_offset, k_offset) if transpose_rhs else (k_offset, n_offset)
                dequantize_fp8_block(rhs_refs[slot], scale_refs[slot][...], *offsets, dequantized_refs[slot])

        if not chunk_m:

            @pl.when(rows_in_tile)
            def _(slot=slot, row_start=row_start, row_end=row_end):
                row = tile_start + lax.broadcasted_iota(jnp.int32, (tile_m, 1), 0)
                keep = jnp.logical_and(row >= row_start, row < row_end)
                acc_ref[...] += multiply(slot, 0, tile_m, keep)

            continue
        chunk_start = chunk_start_ref[last_real]
        # The item's chunks start in its tile: at most tile_m / chunk_m of them.
        for chunk in range(tile_m // chunk_m):
            start = chunk_start + chunk * chunk_m  # tile-relative, on the sublane grid

            # Chunks past the group's rows (or starting in the next tile) skip the MXU.
            @pl.when(jnp.logical_and(start < tile_m, tile_start + start < row_end))
            def _(slot=slot, start=start, row_start=row_start, row_end=row_end):
                start = pl.multiple_of(start, align)
                row = tile_start + start + lax.broadcasted_iota(jnp.int32, (chunk_m, 1), 0)
                product = multiply(slot, start, chunk_m, jnp.logical_and(row >= row_start, row < row_end))

                @pl.when(start + chunk_m <= tile_m)
                def _():
                    acc_ref[pl.ds(start, chunk_m), :] += product

                @pl.when(start + chunk_m > tile_m)
                def _():
                    carry_start = pl.multiple_of(start - (tile_m - chunk_m), align)
                    carry_ref[pl.ds(carry_start, chunk_m), :] += product

    # The output block is copied out only when the row tile changes, so it is
    # filled once, at the last step on its row tile.
    @pl.when(jnp.logical_and(k_step == pl.num_programs(2) - 1, ends_row_tile))
    def _():
        if chunk_m:
            acc_ref[tile_m - chunk_m :, :] += carry_ref[:chunk_m, :]
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    rhs_scales: jax.Array | None = None,
    *,
    transpose_rhs: bool = False,
    zero_rows_past_groups: bool = True,
    config: TileConfig | None = None,
    generation: str | None = None,
) -> jax.Array:
    """`lhs[M,K] x rhs[G,K,N] (or [G,N,K] with transpose_rhs) -> [M,N]` per row group.

    Rows past `sum(group_sizes)` come out as zeros, or are left unwritten
    (whatever the output buffer held) with `zero_rows_past_groups=False`.
    Quantized `rhs` (int8 or float8_e4m3fn) comes with `rhs_scales`
    (`quant.py`: `[G, N]` per output channel for int8; `[G, ceil(D1/128),
    ceil(D2/128)]` blocks over rhs's own dims for fp8); the output is in
    lhs's dtype. Inputs are assumed valid: the torch ops check them (`ops.py`);
    `group_sizes` has an integer dtype and sums to at most M. With an empty
    dimension (M, K, N or G zero) there is nothing to multiply: the result is
    zeros and no kernel runs.
    """
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    group_sizes = int32_group_sizes(group_sizes)
    if 0 in (m, k, n, num_groups):
        return jnp.zeros((m, n), lhs.dtype)
    quantization = scheme_of(rhs.dtype)
    if config is None:
        config = select_config(m, k, n, lhs.dtype, generation=generation, num_groups=num_groups, rhs_dtype=rhs.dtype)
    check_config(config, m, k, n, lhs.dtype, rhs.dtype)
    tile_m, tile_k, tile_n = row_tile_rows(config, m, lhs.dtype), min(config.tile_k, k), min(config.tile_n, n)
    chunk_m = config.chunk_m if row_chunks(config, m, lhs.dtype) > 1 else None
    groups_per_step = config.groups_per_step
    items = make_work_items(group_sizes, m, tile_m, zero_rows_past_groups, chunk_m, sublane_multiple(lhs.dtype))
    count = items.count[0]
    k_tiles = pl.cdiv(k, tile_k)
    grid = (pl.cdiv(n, tile_n), pl.cdiv(count, groups_per_step), k_tiles)

    # An item without rows (a tail item, or an idle slot) pins the K block to
    # the last one, where the item it repeats ended, so its blocks stay put.
    def k_block(item, k_step, row_start, row_end):
        return jnp.where(row_end[item] > row_start[item], k_step, k_tiles - 1)

    def lhs_index(n_step, step, k_step, row_tile, lhs_tile, group, row_start, row_end, chunk_start, count):
        item = step * groups_per_step
        if chunk_m:  # element offsets of the window; with one K tile a literal 0, which Mosaic sees is aligned
            k_offset = 0 if k_tiles == 1 else k_block(item, k_step, row_start, row_end) * tile_k
            return lhs_tile[item] * tile_m, k_offset
        return lhs_tile[item], k_block(item, k_step, row_start, row_end)

    def rhs_index(slot, n_step, step, k_step, row_tile, lhs_tile, group, row_start, row_end, chunk_start, count):
        item = _step_item(step, slot, groups_per_step, count[0])
        k_index = k_block(item, k_step, row_start, row_end)
        if groups_per_step > 1:
            k_index = jnp.where(step * groups_per_step + slot < count[0], k_index, k_tiles - 1)
        if transpose_rhs:
            return group[item], n_step, k_index
        return group[item], k_index, n_step

    def out_index(n_step, step, k_step, row_tile, lhs_tile, group, row_start, row_end, chunk_start, count):
        return row_tile[step * groups_per_step], n_step

    if chunk_m:
        # A window of the tile and the next chunk_m rows; past the array's end it is padding, never used.
        lhs_block = (pl.Element(tile_m + chunk_m, (0, tile_m + chunk_m)), pl.Element(tile_k, (0, tile_k)))
    else:
        lhs_block = (tile_m, tile_k)
    if tile_m >= m and tile_k == k:
        # The whole lhs is one block that never moves: one buffer, not two.
        lhs_spec = pl.BlockSpec(lhs_block, lhs_index, pipeline_mode=pl.Buffered(1))
    else:
        lhs_spec = pl.BlockSpec(lhs_block, lhs_index)
    rhs_block = (None, tile_n, tile_k) if transpose_rhs else (None, tile_k, tile_n)
    rhs_specs = [pl.BlockSpec(rhs_block, functools.partial(rhs_index, slot)) for slot in range(groups_per_step)]
    scale_specs, scale_operands, dequantized = [], [], []
    if quantization == INT8:
        # The N tile's scales, as a [1, tile_n] row: the scales get a unit dim so the block is (1, tile_n).
        def scale_index(slot, n_step, *grid_and_prefetch):
            return rhs_index(slot, n_step, *grid_and_prefetch)[0], 0, n_step

        scale_specs = [pl.BlockSpec((None, 1, tile_n), functools.partial(scale_index, slot))
                       for slot in range(groups_per_step)]
        scale_operands = [rhs_scales.reshape(num_groups, 1, n)] * groups_per_step
    elif quantization == FP8:
        # The group's whole (small) grid of block scales; the kernel picks the tile's blocks.
        def scale_index(slot, n_step, *grid_and_prefetch):
            return rhs_index(slot, n_step, *grid_and_prefetch)[0], 0, 0

        scale_specs = [pl.BlockSpec((None, *rhs_scales.shape[1:]), functools.partial(scale_index, slot))
                       for slot in range(groups_per_step)]
        scale_operands = [rhs_scales] * groups_per_step
        dequantized = [pltpu.VMEM(rhs_block[1:], lhs.dtype) for _ in range(groups_per_step)]
    precision = lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else lax.Precision.DEFAULT
    body = functools.partial(
        _body,
        k=k,
        tile_k=tile_k,
        tile_n=tile_n,
        chunk_m=chunk_m,
        groups_per_step=groups_per_step,
        transpose_rhs=transpose_rhs,
        quantization=quantization,
        precision=precision,
    )
    itemsize = jnp.dtype(lhs.dtype).itemsize
    # A resident lhs is read once; tiled, once per N tile (and chunk_m more rows per row tile).
    lhs_reads = 1 if tile_m >= m and tile_k == k else grid[0] * (1 + (chunk_m or 0) / tile_m)
    # Per active group: its weights once, and its scales once per N tile.
    group_bytes = k * n * jnp.dtype(rhs.dtype).itemsize + (0 if rhs_scales is None else grid[0] * rhs_scales[0].size * 4)
    call = pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((m, n), lhs.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(items),
            grid=grid,
            in_specs=[lhs_spec, *rhs_specs, *scale_specs],
            out_specs=pl.BlockSpec((tile_m, tile_n), out_index),
            scratch_shapes=[pltpu.VMEM((tile_m, tile_n), jnp.float32)]
            + ([pltpu.VMEM((2 * chunk_m, tile_n), jnp.float32)] if chunk_m else [])
            + dequantized,
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=vmem_limit(config, m, k, n, lhs.dtype, rhs.dtype),
        ),
        cost_estimate=pl.CostEstimate(
            flops=2 * m * k * n,
            transcendentals=0,
            bytes_accessed=int((m * k * lhs_reads + m * n) * itemsize
                               + expected_active_groups(m, num_groups) * group_bytes),
        ),
        name="ragged_dot",
    )
    return call(*items, lhs, *([rhs] * groups_per_step), *scale_operands)
