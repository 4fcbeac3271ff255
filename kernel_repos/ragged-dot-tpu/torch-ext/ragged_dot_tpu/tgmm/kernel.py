"""Transposed grouped matmul (`tgmm`) as a Pallas TPU kernel: the weights' gradient of a grouped matmul.

`transposed_grouped_matmul(lhs[M, K], rhs[M, N], group_sizes[G]) -> [G, K, N]`:
per group g, `lhs_g^T @ rhs_g` over the group's rows `[offsets[g],
offsets[g+1])`; an empty group gets zeros, rows past `sum(group_sizes)`
contribute nothing (whatever they hold, NaN included). For `out = grouped_matmul(x, w, ...)`,
`d_w = tgmm(x, d_out)` in the `[G, K, N]` layout and `tgmm(d_out, x)` in the
transposed `[G, N, K]` one: the same kernel with its operands swapped.

Schedule: the output block `(group, K tile, N tile)` stays resident while
the grid walks the group's row tiles, so each group's gradient is written
once. A *work item* is one (group, row tile) pair that intersects, laid out
group by group; an empty group gets one item that keeps the previous item's
row tile (no fetch) and only writes its zeros. The grid is
`(n_tiles, k_tiles, items)`: lhs row tiles are read once per N tile, rhs row
tiles once per K tile (with `tile_k = K` and `tile_n = N`, everything once);
a row tile shared by two groups is fetched once for both (consecutive items).

MXU work: an item multiplies its rows in chunks of `chunk_m` rows, by a
loop over the chunks that touch its group's rows. Two layouts
(`TgmmConfig.group_chunks`):
- chunks at fixed offsets of the row tile: a group boundary inside a chunk
  costs that chunk twice (once per group), about one chunk per group;
- chunks laid from each group's first row (rounded down to the native
  sublane tile), as the forward does: a group costs ceil((rows + offset) /
  chunk_m) chunks, about half a chunk less. A chunk belongs to the item of
  the tile where it starts and is multiplied whole there, so the lhs and rhs
  blocks are windows of `tile_m + chunk_m` rows: chunk_m / tile_m more row
  reads. Worth it where the MXU, not HBM, bounds the kernel
  (`tgmm.tiles.heuristic_tgmm_config` decides).

`transposed_grouped_matmul` plans a call (`plan.make`); `call` runs a plan.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._hardware import TpuGeneration, resolve_target, sublane_multiple
from ..common.routing import int32_group_sizes
from ..gmm.kernel import scheduled_matmul_call
from ..problem import TgmmProblem
from .plan import TgmmPlan, make
from .tiles import TgmmConfig


class TgmmItems(NamedTuple):
    """Scalar-prefetch arrays describing the work items of one tgmm call."""

    row_tile: jax.Array  # [max_items] int32: row tile of each item (an empty group's item keeps the previous one)
    group: jax.Array  # [max_items] int32: output group of each item
    row_start: jax.Array  # [max_items] int32: first row of the item's group
    row_end: jax.Array  # [max_items] int32: one past the group's last row (row_start for an empty group)
    chunk_start: jax.Array  # [max_items] int32: tile-relative first row of the group's first chunk starting in the tile
    count: jax.Array  # [1] int32: number of items, the size of the grid's item axis


def max_tgmm_items(m: int, num_groups: int, tile_m: int) -> int:
    # Non-empty groups touch at most m_tiles + (their number - 1) tiles; each empty one adds an item.
    return pl.cdiv(m, tile_m) + num_groups - 1


def make_tgmm_items(group_sizes: jax.Array, m: int, tile_m: int, chunk_m: int | None = None, align: int = 8) -> TgmmItems:
    """Work items of a call; with `chunk_m`, each item's first chunk of its group's chunks (laid from the
    group's first row rounded down to `align`) that starts in its tile, else 0 (chunks at fixed offsets)."""
    num_groups = group_sizes.shape[0]
    capacity = max_tgmm_items(m, num_groups, tile_m)
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    nonempty = group_sizes > 0
    first_tile = starts // tile_m
    tiles = jnp.where(nonempty, (ends - 1) // tile_m - first_tile + 1, 1)
    item_end = jnp.cumsum(tiles)
    count = item_end[-1]

    item = jnp.arange(capacity, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(item_end, item, side="right"), num_groups - 1)
    own_tile = first_tile[group] + (item - (item_end[group] - tiles[group]))
    # Row tiles never decrease along the items, so an empty group's item (and the unused capacity)
    # takes the row tile of the item before it by a running maximum: it fetches nothing.
    tile = lax.cummax(jnp.where(nonempty[group] & (item < count), own_tile, 0))
    chunk_start = jnp.zeros_like(item)
    if chunk_m:
        behind = tile * tile_m - starts[group] // align * align
        chunk_start = jnp.where(behind <= 0, -behind, (chunk_m - behind % chunk_m) % chunk_m)
    return TgmmItems(
        row_tile=tile.astype(jnp.int32),
        group=group.astype(jnp.int32),
        row_start=starts[group].astype(jnp.int32),
        row_end=ends[group].astype(jnp.int32),
        chunk_start=chunk_start.astype(jnp.int32),
        count=count.astype(jnp.int32).reshape(1),
    )


def _item_chunks(tile_start, chunk_start, row_start, row_end, plan: TgmmPlan):
    """The item's chunks `[first, end)` (tile-relative chunk numbers) that touch its group's rows: with
    `group_chunks`, those of the group's chunks that start in this tile (the window holds their rows past its
    end), none for an empty group; else those of the tile's fixed chunks that overlap the group's rows.
    lax.div truncates: its operands are clamped to >= 0 (`//` lowers `sign`, whose Mosaic rule needs a TPU
    device)."""
    tile_m, chunk_m = plan.tile_m, plan.chunk_m
    if plan.group_chunks:
        rows = jnp.maximum(jnp.minimum(tile_m, row_end - tile_start) - chunk_start, 0)
        return 0, jnp.where(row_start < row_end, lax.div(rows + chunk_m - 1, chunk_m), 0)
    first = lax.div(jnp.clip(row_start - tile_start, 0, tile_m), chunk_m)
    return first, lax.div(jnp.clip(row_end - tile_start, 0, tile_m) + chunk_m - 1, chunk_m)


def _body(row_tile_ref, group_ref, row_start_ref, row_end_ref, chunk_start_ref, count_ref, lhs_ref, rhs_ref, out_ref,
          acc_ref, *, plan: TgmmPlan, align: int, precision):
    del count_ref  # the grid's item axis has that length
    tile_m, chunk_m, group_chunks = plan.tile_m, plan.chunk_m, plan.group_chunks
    item = pl.program_id(2)
    items = pl.num_programs(2)
    group = group_ref[item]
    starts_group = jnp.logical_or(item == 0, group != group_ref[jnp.maximum(item - 1, 0)])
    ends_group = jnp.logical_or(item == items - 1, group != group_ref[jnp.minimum(item + 1, items - 1)])
    tile_start = row_tile_ref[item] * tile_m
    row_start = row_start_ref[item]
    row_end = row_end_ref[item]

    @pl.when(starts_group)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    chunk_start = chunk_start_ref[item] if group_chunks else 0
    first_chunk, end_chunk = _item_chunks(tile_start, chunk_start, row_start, row_end, plan)

    # A loop over them, not one `pl.when` per chunk unrolled: Mosaic compiles the chunk's matmul once, and the
    # traffic model counts the loop's trips at each step from its bounds.
    def multiply_chunk(chunk, loop_state):
        start = pl.multiple_of(chunk_start + chunk * chunk_m, align)  # tile-relative
        row = tile_start + start + lax.broadcasted_iota(jnp.int32, (chunk_m, 1), 0)
        keep = jnp.logical_and(row >= row_start, row < row_end)
        # Select, not multiply: rows outside the group may hold anything (NaN), and 0 * NaN is NaN.
        lhs = lhs_ref[pl.ds(start, chunk_m), :]
        rhs = rhs_ref[pl.ds(start, chunk_m), :]
        lhs = jnp.where(keep, lhs, jnp.zeros_like(lhs))
        rhs = jnp.where(keep, rhs, jnp.zeros_like(rhs))
        acc_ref[...] += lax.dot_general(
            lhs, rhs, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
        )
        return loop_state

    lax.fori_loop(first_chunk, end_chunk, multiply_chunk, ())

    @pl.when(ends_group)
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def transposed_grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype=None,
    config: TgmmConfig | None = None,
    generation: str | TpuGeneration | None = None,
) -> jax.Array:
    """Per group, `lhs_g^T @ rhs_g`: `lhs[M, K], rhs[M, N] -> [G, K, N]` (f32 accumulation).

    `G = group_sizes.shape[0]`; `out_dtype` defaults to lhs's; `generation` (a name or a target, resolved here;
    default this device's) picks the tiles (`tgmm.plan.make`). Inputs are
    assumed valid (integer sizes summing to at most M; `ops.py` checks the
    torch entries). With an empty dimension the result is zeros and no kernel
    runs.
    """
    m, k = lhs.shape
    n = rhs.shape[1]
    num_groups = group_sizes.shape[0]
    out_dtype = lhs.dtype if out_dtype is None else out_dtype
    group_sizes = int32_group_sizes(group_sizes)
    if 0 in (m, k, n, num_groups):
        return jnp.zeros((num_groups, k, n), out_dtype)
    problem = TgmmProblem(m, k, n, num_groups, jnp.dtype(lhs.dtype).name, jnp.dtype(out_dtype).name)
    return call(lhs, rhs, group_sizes, make(problem, resolve_target(generation), config))


def call(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                                   plan: TgmmPlan) -> jax.Array:
    """`transposed_grouped_matmul` as `plan` says (inputs of the plan's non-empty problem, assumed valid)."""
    problem = plan.problem
    m, k, n, num_groups = problem.m, problem.k, problem.n, problem.groups
    tile_m, tile_k, tile_n, chunk_m, group_chunks = plan.tile_m, plan.tile_k, plan.tile_n, plan.chunk_m, plan.group_chunks
    out_dtype = jnp.dtype(problem.out_dtype)
    align = sublane_multiple(lhs.dtype)
    items = make_tgmm_items(int32_group_sizes(group_sizes), m, tile_m, chunk_m if group_chunks else None, align)
    k_tiles, n_tiles = pl.cdiv(k, tile_k), pl.cdiv(n, tile_n)
    grid = (n_tiles, k_tiles, items.count[0])

    def row_block(row_tile, column_step, columns, column_tiles):
        if group_chunks:  # element offsets of the window; with one column tile a literal 0, which Mosaic sees is aligned
            return row_tile * tile_m, 0 if column_tiles == 1 else column_step * columns
        return row_tile, column_step

    def lhs_index(n_step, k_step, item, row_tile, group, row_start, row_end, chunk_start, count):
        return row_block(row_tile[item], k_step, tile_k, k_tiles)

    def rhs_index(n_step, k_step, item, row_tile, group, row_start, row_end, chunk_start, count):
        return row_block(row_tile[item], n_step, tile_n, n_tiles)

    def out_index(n_step, k_step, item, row_tile, group, row_start, row_end, chunk_start, count):
        return group[item], k_step, n_step

    def row_spec(columns: int, index):
        if group_chunks:
            # A window of the tile and the next chunk_m rows; past the array's end it is padding, never used.
            block = (pl.Element(tile_m + chunk_m, (0, tile_m + chunk_m)), pl.Element(columns, (0, columns)))
            return pl.BlockSpec(block, index)
        return pl.BlockSpec((tile_m, columns), index)

    precision = lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else lax.Precision.DEFAULT
    itemsize = jnp.dtype(lhs.dtype).itemsize
    grid_spec = pltpu.PrefetchScalarGridSpec(
        len(items), grid, [row_spec(tile_k, lhs_index), row_spec(tile_n, rhs_index)],
        pl.BlockSpec((None, tile_k, tile_n), out_index), [pltpu.VMEM((tile_k, tile_n), jnp.float32)])
    # lhs once per N tile, rhs once per K tile (windows: chunk_m / tile_m more), every group's gradient written once.
    window_reads = 1 + (chunk_m / tile_m if group_chunks else 0)
    bytes_accessed = int((m * k * n_tiles + m * n * k_tiles) * window_reads * itemsize
                         + num_groups * k * n * out_dtype.itemsize)
    body = functools.partial(_body, plan=plan, align=align, precision=precision)
    run = scheduled_matmul_call(body, jax.ShapeDtypeStruct((num_groups, k, n), out_dtype), grid_spec,
                                ("parallel", "parallel", "arbitrary"), plan.vmem_limit_bytes, (m, k, n),
                                bytes_accessed=bytes_accessed, name="tgmm")
    return run(*items, lhs, rhs)
