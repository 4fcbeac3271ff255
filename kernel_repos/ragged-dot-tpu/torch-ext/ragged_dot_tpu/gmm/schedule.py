"""The grouped matmul's schedule: its work items, and the blocks each operand moves from one to the next.

Both as `kernel.py`'s module docstring describes them (schedule; what each
operand moves); the kernel body runs over them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common.quant import FP8, dequantized_in_vmem, per_channel_scales, scheme_of, stored_rows
from .plan import MatmulPlan


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


def weights_parts(plan: MatmulPlan) -> int:
    """Weights blocks per step: 2 (the N tile's gate and up columns apart) with a concatenated gate over several
    N tiles, else 1 (interleaved: the N tile's pairs are one block)."""
    gate = plan.problem.gate
    return 2 if gate is not None and not gate.interleaved and plan.tile_n < plan.problem.n else 1


def _block_columns(plan: MatmulPlan) -> int:
    """Columns of a weights block and its accumulator: twice the N tile (gate and up) with a gate in one block,
    else the N tile."""
    return 2 * plan.tile_n if plan.problem.gate is not None and weights_parts(plan) == 1 else plan.tile_n


class BlockSpecs(NamedTuple):
    """What `pallas_call` takes of a call's blocks."""

    in_specs: list
    out_spec: pl.BlockSpec
    scratch: list
    operands: list  # after lhs: rhs once per group slot, then the scales and the bias once per slot


def block_specs(plan: MatmulPlan, rhs, rhs_scales, bias) -> BlockSpecs:
    """Blocks, index maps and scratch of a call (`kernel.py`'s module docstring: what each operand moves)."""
    problem, tile_m, tile_k, tile_n, chunk_m = plan.problem, plan.tile_m, plan.tile_k, plan.tile_n, plan.chunk_m
    slots, k_tiles, parts = plan.groups_per_step, pl.cdiv(problem.k, plan.tile_k), weights_parts(plan)
    columns = _block_columns(plan)
    quantization = scheme_of(problem.rhs_dtype)
    # With a gate, the up projection's blocks start this many N blocks into rhs (`gmm.plan.gated_plan`: N is a
    # multiple of tile_n then).
    up_blocks = problem.n // tile_n

    # An item without rows (a tail item, or an idle slot) pins the K block to
    # the last one, where the item it repeats ended, so its blocks stay put.
    def k_block(item, k_step, row_start, row_end):
        return jnp.where(row_end[item] > row_start[item], k_step, k_tiles - 1)

    def lhs_index(n_step, step, k_step, row_tile, lhs_tile, group, row_start, row_end, chunk_start, count, *_):
        item = step * slots
        if chunk_m:  # element offsets of the window; with one K tile a literal 0, which Mosaic sees is aligned
            k_offset = 0 if k_tiles == 1 else k_block(item, k_step, row_start, row_end) * tile_k
            return lhs_tile[item] * tile_m, k_offset
        return lhs_tile[item], k_block(item, k_step, row_start, row_end)

    def rhs_index(slot, part, n_step, step, k_step, row_tile, lhs_tile, group, row_start, row_end, chunk_start,
                  count, *_):
        item = _step_item(step, slot, slots, count[0])
        k_index = k_block(item, k_step, row_start, row_end)
        if slots > 1:
            k_index = jnp.where(step * slots + slot < count[0], k_index, k_tiles - 1)
        n_index = n_step + part * up_blocks
        if problem.transpose_rhs:
            return group[item], n_index, k_index
        return group[item], k_index, n_index

    def out_index(n_step, step, k_step, row_tile, lhs_tile, group, row_start, row_end, chunk_start, count, *_):
        return row_tile[step * slots], n_step

    if chunk_m:
        # A window of the tile and the next chunk_m rows; past the array's end it is padding, never used.
        lhs_block = (pl.Element(tile_m + chunk_m, (0, tile_m + chunk_m)), pl.Element(tile_k, (0, tile_k)))
    else:
        lhs_block = (tile_m, tile_k)
    # The whole lhs as one block never moves: one buffer, not two.
    resident = tile_m >= problem.m and tile_k == problem.k
    if problem.gathered:  # copied by the kernel from the tokens (`kernel.py`'s module docstring)
        lhs_spec = pl.BlockSpec(memory_space=pl.ANY)
    else:
        lhs_spec = pl.BlockSpec(lhs_block, lhs_index, **(dict(pipeline_mode=pl.Buffered(1)) if resident else {}))
    rhs_block = (None, columns, tile_k) if problem.transpose_rhs else (None, tile_k, columns)
    stored_block = (None, stored_rows(rhs_block[1], quantization), rhs_block[2])
    in_specs = [lhs_spec, *(pl.BlockSpec(stored_block, functools.partial(rhs_index, slot, part))
                            for slot in range(slots) for part in range(parts))]
    operands = [rhs] * (slots * parts)
    scratch = ([pltpu.VMEM((tile_m, columns), jnp.float32) for _ in range(parts)]
               + ([pltpu.VMEM((2 * chunk_m, columns), jnp.float32) for _ in range(parts)] if chunk_m else []))
    scales_and_bias = _scales_and_bias_specs(plan, rhs_index, rhs_scales, bias)
    in_specs += scales_and_bias.in_specs
    operands += scales_and_bias.operands
    if dequantized_in_vmem(quantization) and not plan.fp8_matmul:
        scratch += [pltpu.VMEM(rhs_block[1:], jnp.dtype(problem.dtype)) for _ in range(slots)]
    if problem.gathered:
        words = (problem.k, jnp.float32) if problem.dtype == "float32" else (plan.gather_split, jnp.int32)
        # One row tile never prefetches a next one: one buffer.
        copies = 1 if tile_m >= problem.m else 2
        scratch += [pltpu.VMEM((copies, tile_m + (chunk_m or 0), words[0]), words[1]),
                    pltpu.SemaphoreType.DMA((2,)), pltpu.SMEM((1,), jnp.int32)]
    out_columns = plan.out_split if problem.packed_out else tile_n
    return BlockSpecs(in_specs, pl.BlockSpec((tile_m, out_columns), out_index), scratch, operands)


class _OperandSpecs(NamedTuple):
    in_specs: list
    operands: list


def _scales_and_bias_specs(plan: MatmulPlan, rhs_index, rhs_scales, bias) -> _OperandSpecs:
    """The blocks of the weights' scales and of the bias, once per group slot, each following the slot's weights
    block (`rhs_index`)."""
    problem, slots, parts = plan.problem, plan.groups_per_step, weights_parts(plan)
    columns = _block_columns(plan)
    quantization = scheme_of(problem.rhs_dtype)
    up_blocks = problem.n // plan.tile_n  # where the up projection's columns start, as in `block_specs`
    in_specs, operands = [], []

    def scale_index(slot, n_step, *grid_and_prefetch):
        group = rhs_index(slot, 0, n_step, *grid_and_prefetch)[0]
        # int8 and int4: the weights block's column scales, as a [1, columns] row; fp8: the group's whole (small)
        # grid of block scales.
        return (group, 0, n_step) if per_channel_scales(quantization) else (group, 0, 0)

    def bias_index(slot, part, n_step, *grid_and_prefetch):
        return rhs_index(slot, part, n_step, *grid_and_prefetch)[0], 0, n_step + part * up_blocks

    if per_channel_scales(quantization):
        in_specs += [pl.BlockSpec((None, 1, columns), functools.partial(scale_index, slot)) for slot in range(slots)]
        operands += [rhs_scales.reshape(problem.groups, 1, rhs_scales.shape[-1])] * slots
    elif quantization == FP8:
        in_specs += [pl.BlockSpec((None, *rhs_scales.shape[1:]), functools.partial(scale_index, slot))
                     for slot in range(slots)]
        operands += [rhs_scales] * slots
    if problem.bias:
        in_specs += [pl.BlockSpec((None, 1, columns), functools.partial(bias_index, slot, part))
                     for slot in range(slots) for part in range(parts)]
        # In f32, as the accumulator adds it: a bias in a wider dtype than the rows keeps its precision. With a
        # gate, its 2N columns (gate, then up).
        operands += [bias.reshape(problem.groups, 1, bias.shape[-1]).astype(jnp.float32)] * (slots * parts)
    return _OperandSpecs(in_specs, operands)
