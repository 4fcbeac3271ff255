"""Grouped matmul (ragged dot) as a Pallas TPU kernel.

`lhs[M, K]` rows are sorted by group: rows `[offsets[g], offsets[g+1])` belong
to group `g` and are multiplied by `rhs[g]`. Rows past the last group come out
as zeros.

Schedule: the M axis is cut into row tiles of `tile_m`. A *work item* is one
(group, row tile) pair that intersects; a row tile straddling a group boundary
appears once per group it touches, and consecutive work items on the same row
tile accumulate into the same resident output block. Row tiles no group
reaches (past `sum(group_sizes)`) get one work item that only writes zeros.
The grid is `(n_tiles, max_work_items, k_tiles)`; the number of work items
depends on the group sizes, so the grid has a static upper bound
`m_tiles + num_groups - 1` and steps past the real count keep the previous
block indices (no DMA) and skip their body.

Because consecutive work items of one group keep the same `rhs` block index,
each active group's weights are fetched once per N tile when K fits in one
block, and empty groups cost nothing.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .config import TileConfig, select_config


class WorkItems(NamedTuple):
    """Scalar-prefetch arrays describing the work items of one call."""

    row_tile: jax.Array  # [max_items] int32: output row tile of each item
    group: jax.Array  # [max_items] int32: rhs group of each item
    row_start: jax.Array  # [max_items] int32: first row of the item's group
    row_end: jax.Array  # [max_items] int32: one past the item's group's last row
    count: jax.Array  # [1] int32: number of real items


def max_work_items(m: int, num_groups: int, tile_m: int) -> int:
    return pl.cdiv(m, tile_m) + num_groups - 1


def make_work_items(group_sizes: jax.Array, m: int, tile_m: int) -> WorkItems:
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
    count = group_items + untouched_tiles

    item = jnp.arange(capacity, dtype=jnp.int32)
    # Steps past `count` repeat the last real item so their block indices do not change.
    item = jnp.minimum(item, jnp.maximum(count - 1, 0))
    in_groups = item < group_items
    item_group = jnp.minimum(jnp.searchsorted(group_item_end, item, side="right"), num_groups - 1)
    item_group_begin = group_item_end[item_group] - tiles_per_group[item_group]
    group_tile = first_tile[item_group] + (item - item_group_begin)
    tail_tile = first_untouched_tile + (item - group_items)

    # A tail item keeps the rhs block of the last group with rows, so it fetches nothing new.
    last_nonempty_group = jnp.max(jnp.where(nonempty, jnp.arange(num_groups), 0))
    return WorkItems(
        row_tile=jnp.where(in_groups, group_tile, tail_tile).astype(jnp.int32),
        group=jnp.where(in_groups, item_group, last_nonempty_group).astype(jnp.int32),
        row_start=jnp.where(in_groups, starts[item_group], 0).astype(jnp.int32),
        row_end=jnp.where(in_groups, ends[item_group], 0).astype(jnp.int32),
        count=count.astype(jnp.int32).reshape(1),
    )


def _kernel(
    row_tile_ref,
    group_ref,
    row_start_ref,
    row_end_ref,
    count_ref,
    lhs_ref,
    rhs_ref,
    out_ref,
    acc_ref,
    *,
    k: int,
    tile_k: int,
    transpose_rhs: bool,
    precision,
):
    del group_ref  # used by the index maps only
    item = pl.program_id(1)
    k_step = pl.program_id(2)
    tile_m = lhs_ref.shape[0]

    @pl.when(item < count_ref[0])
    def _():
        starts_row_tile = jnp.logical_or(item == 0, row_tile_ref[item] != row_tile_ref[jnp.maximum(item - 1, 0)])

        @pl.when(jnp.logical_and(k_step == 0, starts_row_tile))
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        row = row_tile_ref[item] * tile_m + lax.broadcasted_iota(jnp.int32, (tile_m, 1), 0)
        in_group = jnp.logical_and(row >= row_start_ref[item], row < row_end_ref[item])
        lhs = lhs_ref[...]
        rhs = rhs_ref[...]
        # Select, not multiply: rows and K columns outside the data may hold
        # garbage (NaN), and 0 * NaN is NaN.
        keep = in_group
        if k % tile_k:
            col = k_step * tile_k + lax.broadcasted_iota(jnp.int32, (1, tile_k), 1)
            keep = jnp.logical_and(keep, col < k)
            rhs_k_axis = 1 if transpose_rhs else 0
            rhs_k = k_step * tile_k + lax.broadcasted_iota(jnp.int32, rhs.shape, rhs_k_axis)
            rhs = jnp.where(rhs_k < k, rhs, jnp.zeros_like(rhs))
        lhs = jnp.where(keep, lhs, jnp.zeros_like(lhs))
        contract_rhs = 1 if transpose_rhs else 0
        acc_ref[...] += lax.dot_general(
            lhs,
            rhs,
            (((1,), (contract_rhs,)), ((), ())),
            preferred_element_type=jnp.float32,
            precision=precision,
        )

        @pl.when(k_step == pl.num_programs(2) - 1)
        def _():
            out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def vmem_bytes(config: TileConfig, dtype) -> int:
    """VMEM the pipeline holds: double-buffered lhs, rhs and out blocks plus the f32 accumulator."""
    itemsize = jnp.dtype(dtype).itemsize
    blocks = config.tile_m * config.tile_k + config.tile_k * config.tile_n + config.tile_m * config.tile_n
    return 2 * blocks * itemsize + config.tile_m * config.tile_n * 4


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    config: TileConfig | None = None,
    generation: str | None = None,
) -> jax.Array:
    """`lhs[M,K] x rhs[G,K,N] (or [G,N,K] with transpose_rhs) -> [M,N]` per row group.

    Inputs are assumed valid (the torch API checks them); `group_sizes` is int32
    and sums to at most M.
    """
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if config is None:
        config = select_config(m, k, n, lhs.dtype, generation=generation)
    tile_m, tile_k, tile_n = config.tile_m, config.tile_k, config.tile_n
    items = make_work_items(group_sizes, m, tile_m)
    grid = (pl.cdiv(n, tile_n), max_work_items(m, num_groups, tile_m), pl.cdiv(k, tile_k))

    def lhs_index(n_step, item, k_step, row_tile, group, row_start, row_end, count):
        return row_tile[item], k_step

    def rhs_index(n_step, item, k_step, row_tile, group, row_start, row_end, count):
        if transpose_rhs:
            return group[item], n_step, k_step
        return group[item], k_step, n_step

    def out_index(n_step, item, k_step, row_tile, group, row_start, row_end, count):
        return row_tile[item], n_step

    rhs_block = (None, tile_n, tile_k) if transpose_rhs else (None, tile_k, tile_n)
    precision = lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else lax.Precision.DEFAULT
    kernel = functools.partial(_kernel, k=k, tile_k=tile_k, transpose_rhs=transpose_rhs, precision=precision)
    itemsize = jnp.dtype(lhs.dtype).itemsize
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), lhs.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(items),
            grid=grid,
            in_specs=[
                pl.BlockSpec((tile_m, tile_k), lhs_index),
                pl.BlockSpec(rhs_block, rhs_index),
            ],
            out_specs=pl.BlockSpec((tile_m, tile_n), out_index),
            scratch_shapes=[pltpu.VMEM((tile_m, tile_n), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=max(vmem_bytes(config, lhs.dtype) + (4 << 20), 16 << 20),
        ),
        cost_estimate=pl.CostEstimate(
            flops=2 * m * k * n,
            transcendentals=0,
            bytes_accessed=(m * k + num_groups * k * n + m * n) * itemsize,
        ),
        name="ragged_dot",
    )
    return call(*items, lhs, rhs)
