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
sublane tile, the finest offset Mosaic slices VMEM at), by a loop over the
chunks that start before the group's rows end (no chunk past them reaches
the MXU). So a group costs
ceil((rows + its start's offset from the sublane grid) / chunk_m) chunks,
wherever its rows fall: no chunk is spent on two groups at a group boundary,
and none is split at a row tile boundary. The item of the tile where a chunk
starts multiplies it whole: its lhs block is a window of `tile_m + chunk_m`
rows (element offsets), and the results of rows past the tile's end go to a
carry buffer that the next row tile's accumulator starts from. (The window's
extra rows cost chunk_m / tile_m more lhs reads.) Without chunks, an item
multiplies its whole row tile, masked to its group's rows.
`grouped_matmul` plans a call (`plan.make`); `call` runs a plan.

With a gate (`MatmulProblem.gate`, the experts layer's first projection),
rhs holds 2N columns, the gate's then the up projection's, and the kernel
writes the gated intermediate `activation(lhs @ gate) * (lhs @ up)` [M, N],
gating the accumulators when the output block is written, so the [M, 2N]
projection never goes to HBM and no XLA pass reads it back. With one N tile
each step fetches all 2N columns as one block and splits the result (no MXU
padding for an N off the MXU width); with several, the gate's and the up's
blocks of its N tile (two views of rhs), each accumulated apart. GPT-OSS's
interleaved columns (gate and up alternate) are one block of the N tile's
pairs, de-interleaved when the output block is written by a matmul with a
0/1 matrix per 256 columns (`common.gates.deinterleaved_gated`).

Quantized weights (`common/quant.py`) are read as one byte each (int4: half a
byte): an int8 block is cast to lhs's dtype at the matmul; fp8 and int4
blocks are dequantized (int4: unpacked) once per step into VMEM scratch
(under the slot's `pl.when`: only for a slot with rows in the tile); int8's
and int4's per-output-column scales multiply the result. On a chip with an
fp8 MXU (`plan.fp8_matmul`: TPU7x) fp8 blocks are not dequantized: the rows
are quantized to fp8 per row and 128-wide K block and multiplied with them
as they are (`common.quant.fp8_matmul`).

With a bias (`MatmulProblem.bias`: an experts layer's per-expert biases), each
work item adds its group's bias row to its rows of the accumulator at its
first K step (with a gate, of each part: the gate's and the up's bias
columns), so the output leaves the kernel biased, and gated after the bias:
no XLA pass gathers a bias row per row and adds it (a `[M, N]` write and
reread).

With gathered rows (`MatmulProblem.gathered`: an experts layer's first
projection), lhs is the `[tokens, K]` token rows, left in HBM, and a
scalar-prefetched `row_token[M]` names each sorted row's token. Each step
that starts a row tile waits for its window's rows, copied one row per DMA
into one of two VMEM buffers, and starts the copies of the next step's
window into the other, as the pipeline would fetch a block; rows past the
groups (sentinel picks) are never copied. A row tile's first step in each N
tile copies its window and waits at once (the N tiles may run on two
cores). A row is copied whole (one K tile). Mosaic copies a bf16 row only in
pairs of rows (its VMEM tiling packs two rows per 32-bit word), so bf16
token rows travel as 32-bit words, each the bits of one element of the
row's columns before `plan.gather_split` (half of K, or the MXU-aligned
column past it) and one of the columns from it (`common.packed_rows.pack_rows`:
one XLA pass over the tokens); the kernel takes the parts apart with a
shift and a mask and multiplies each by its rows of the weights block.

With a packed output (`MatmulProblem.packed_out`: an experts layer's second
projection, whose rows the combine kernel (`combine/kernel.py`) copies one at a
time), each bf16 output block leaves as `plan.out_split` int32 words, word j
of an N tile holding its column j (low half) and its column out_split + j
(high half; nothing past the tile's columns) (`common.packed_rows.pack_rows`).

The CostEstimate counts what the kernel reads: the rows, the weights of the
groups expected active for M uniformly routed rows
(`common.routing.expected_active_groups`: the group sizes are data, unknown when
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

from .._hardware import TpuGeneration, resolve_target, sublane_multiple
from ..common.packed_rows import pack_rows
from ..common.quant import (
    FP8, INT4, INT8, dequantize_fp8_block, dequantized_in_vmem, fp8_matmul, fp8_window_scales, int4_packed_axis,
    per_channel_scales, scheme_of, unpack_int4_block,
)
from ..common.routing import int32_group_sizes
from ..problem import MatmulProblem, weight_shape
from .epilogue import epilogue
from .gathered_rows import Gather, gather_rows, token_rows
from .plan import MatmulPlan, make
from .schedule import WorkItems, block_specs, make_work_items, weights_parts
from .tiles import TileConfig


class _StepRefs(NamedTuple):
    """The refs of one grid step of the kernel body, past the scalar prefetch."""

    lhs: object  # (start, rows) -> ((rows of lhs, the K range of rhs they meet, or None for all of it), ...)
    rhs: tuple  # per group slot, per part (`schedule.weights_parts`): the weights blocks
    scales: tuple  # one per group slot (quantized weights), else empty
    bias: tuple  # per group slot, per part: a [1, block columns] f32 row (`MatmulProblem.bias`), else empty
    out: object
    acc: tuple  # per part: [tile_m, block columns] f32 (twice the N tile with a gate in one block)
    carry: tuple | None  # per part: [2 chunk_m, block columns] f32, rows [tile_m - chunk_m, tile_m + chunk_m)
    dequantized: tuple  # fp8 (unless plan.fp8_matmul) and int4: each slot's weights block, dequantized once per step


def _step_refs(lhs_ref, refs, plan: MatmulPlan) -> _StepRefs:
    """The step's refs, with lhs read from `lhs_ref` (gathered rows: the caller swaps in the copies' buffer)."""
    slots, parts = plan.groups_per_step, weights_parts(plan)
    quantized = scheme_of(plan.problem.rhs_dtype) is not None
    rhs, refs = refs[: slots * parts], refs[slots * parts :]
    rhs = tuple(tuple(rhs[slot * parts : (slot + 1) * parts]) for slot in range(slots))
    scales, refs = (refs[:slots], refs[slots:]) if quantized else ((), refs)
    bias, refs = (refs[: slots * parts], refs[slots * parts :]) if plan.problem.bias else ((), refs)
    bias = tuple(tuple(bias[slot * parts : (slot + 1) * parts]) for slot in range(slots)) if bias else ()
    out, *scratch = refs
    acc, scratch = tuple(scratch[:parts]), scratch[parts:]
    carry, scratch = (tuple(scratch[:parts]), scratch[parts:]) if plan.chunk_m else (None, scratch)
    return _StepRefs(functools.partial(_lhs_rows, lhs_ref), rhs, tuple(scales), tuple(bias), out, acc, carry,
                     tuple(scratch))


def _lhs_rows(lhs_ref, start, rows: int):
    return ((lhs_ref[pl.ds(start, rows), :], None),)


def _multiply(refs: _StepRefs, slot: int, part: int, start, rows: int, keep, k_step, plan: MatmulPlan,
              window_scales):
    """lhs rows [start, start + rows) x the slot's weights (its `part`), with rows not `keep` taken as zero; `start`
    on the sublane grid. int8 and int4 weights reach the MXU as their integers; their per-column scales multiply
    the result. With plan.fp8_matmul, fp8 weights meet the rows quantized to fp8 (`common.quant.fp8_matmul`), and
    `window_scales` are the slot's block scales over the step's window."""
    problem, tile_k = plan.problem, plan.tile_k
    quantization = scheme_of(problem.rhs_dtype)
    pieces = refs.lhs(start, rows)
    if len(pieces) > 1:  # gathered bf16 rows, as two parts of K (tile_k == k: no K tail, no quantized weights)
        rhs = refs.rhs[slot][part][...]
        product = None
        for lhs, k_range in pieces:
            rhs_part = rhs[:, k_range] if problem.transpose_rhs else rhs[k_range, :]
            part_product = lax.dot_general(jnp.where(keep, lhs, jnp.zeros_like(lhs)), rhs_part,
                                           (((1,), (1 if problem.transpose_rhs else 0,)), ((), ())),
                                           preferred_element_type=jnp.float32)
            product = part_product if product is None else product + part_product
        return product
    ((lhs, _),) = pieces
    if dequantized_in_vmem(quantization) and not plan.fp8_matmul:
        rhs = refs.dequantized[slot][...]
    else:
        rhs = refs.rhs[slot][part][...]
        rhs = rhs.astype(lhs.dtype) if quantization == INT8 else rhs
    # Select, not multiply: rows and K columns outside the data may hold
    # garbage (NaN), and 0 * NaN is NaN.
    if problem.k % tile_k:
        col = k_step * tile_k + lax.broadcasted_iota(jnp.int32, (1, tile_k), 1)
        keep = jnp.logical_and(keep, col < problem.k)
        rhs_k = k_step * tile_k + lax.broadcasted_iota(jnp.int32, rhs.shape, 1 if problem.transpose_rhs else 0)
        rhs = jnp.where(rhs_k < problem.k, rhs, jnp.zeros_like(rhs))
    lhs = jnp.where(keep, lhs, jnp.zeros_like(lhs))
    if plan.fp8_matmul:
        return fp8_matmul(lhs, rhs, window_scales, rhs_contract=1 if problem.transpose_rhs else 0)
    precision = lax.Precision.HIGHEST if problem.dtype == "float32" else lax.Precision.DEFAULT
    product = lax.dot_general(lhs, rhs, (((1,), (1 if problem.transpose_rhs else 0,)), ((), ())),
                              preferred_element_type=jnp.float32, precision=precision)
    return product * refs.scales[slot][...] if per_channel_scales(quantization) else product


def _accumulate_chunks(refs: _StepRefs, slot: int, tile_start, chunk_start, row_start, row_end, k_step,
                       plan: MatmulPlan, window_scales) -> None:
    """The slot's group's chunks that start in this row tile, each multiplied whole: the rows past the tile's
    end go to the carry, which the next row tile's accumulator starts from."""
    tile_m, chunk_m = plan.tile_m, plan.chunk_m
    align = sublane_multiple(plan.problem.dtype)
    # The group's chunks that start in this tile before its rows' end (at most tile_m / chunk_m). A loop over
    # them, not one `pl.when` per chunk unrolled: Mosaic compiles the chunk's matmuls once, and the traffic model
    # counts the loop's trips at each step from its bound. lax.div truncates: its operand is clamped to >= 0
    # (`//` lowers `sign`, whose Mosaic rule needs a TPU device).
    rows = jnp.maximum(jnp.minimum(tile_m, row_end - tile_start) - chunk_start, 0)
    chunks = lax.div(rows + chunk_m - 1, chunk_m)

    def multiply_chunk(chunk, loop_state):
        start = pl.multiple_of(chunk_start + chunk * chunk_m, align)  # tile-relative, on the sublane grid
        row = tile_start + start + lax.broadcasted_iota(jnp.int32, (chunk_m, 1), 0)
        keep = jnp.logical_and(row >= row_start, row < row_end)
        products = [_multiply(refs, slot, part, start, chunk_m, keep, k_step, plan, window_scales)
                    for part in range(len(refs.acc))]

        @pl.when(start + chunk_m <= tile_m)
        def _():
            for acc, product in zip(refs.acc, products):
                acc[pl.ds(start, chunk_m), :] += product

        @pl.when(start + chunk_m > tile_m)
        def _():
            carry_start = pl.multiple_of(start - (tile_m - chunk_m), align)
            for carry, product in zip(refs.carry, products):
                carry[pl.ds(carry_start, chunk_m), :] += product

        return loop_state

    lax.fori_loop(0, chunks, multiply_chunk, ())


class _RowTile(NamedTuple):
    """The row tile a grid step works on (every slot of a step works on the same one: `make_work_items` lays them
    so), and whether the step is its first or last on it."""

    count: object  # work items in the schedule
    first_item: object
    start: object  # its first row
    starts: object
    ends: object


def _row_tile(items: WorkItems, step, steps, plan: MatmulPlan) -> _RowTile:
    slots = plan.groups_per_step
    count = items.count[0]
    first_item = step * slots
    row_tile = items.row_tile[first_item]
    start = row_tile * plan.tile_m
    starts = jnp.logical_or(step == 0, row_tile != items.row_tile[jnp.maximum(first_item - slots, 0)])
    next_item = jnp.minimum(first_item + slots, count - 1)
    ends = jnp.logical_or(step == steps - 1, items.row_tile[next_item] != row_tile)
    return _RowTile(count, first_item, start, starts, ends)


def _open_row_tile(refs: _StepRefs, tile: _RowTile, step, k_step, plan: MatmulPlan) -> None:
    """The accumulators start from zeros at a row tile's first step, plus (chunked) the rows of the previous
    tile's last chunks that ran into this one."""
    chunk_m = plan.chunk_m
    if chunk_m:

        @pl.when(jnp.logical_and(k_step == 0, step == 0))
        def _():
            for carry in refs.carry:
                carry[...] = jnp.zeros_like(carry)

    @pl.when(jnp.logical_and(k_step == 0, tile.starts))
    def _():
        for part, acc in enumerate(refs.acc):
            acc[...] = jnp.zeros_like(acc)
            if chunk_m:
                carry = refs.carry[part]
                acc[:chunk_m, :] = carry[chunk_m:, :]
                carry[...] = jnp.zeros_like(carry)


def _add_bias(refs: _StepRefs, slot: int, tile: _RowTile, row_start, row_end, rows_in_tile, k_step,
              plan: MatmulPlan) -> None:
    """The slot's group's bias row, added to its rows of the accumulators at the first K step."""

    @pl.when(jnp.logical_and(k_step == 0, rows_in_tile))
    def _():
        row = tile.start + lax.broadcasted_iota(jnp.int32, (plan.tile_m, 1), 0)
        group_rows = jnp.logical_and(row >= row_start, row < row_end)
        for acc, bias in zip(refs.acc, refs.bias[slot]):
            acc[...] += jnp.where(group_rows, bias[...], 0.0)


def _decode_weights(refs: _StepRefs, slot: int, rows_in_tile, k_step, plan: MatmulPlan):
    """The slot's weights made ready for `_multiply`, once per step: fp8 dequantized (int4 unpacked) into VMEM for
    a slot with rows in the tile; on the fp8 MXU, the block scales over the step's window, returned (a few
    selects, outside the chunks' branches). int8 and float weights need nothing."""
    scheme = scheme_of(plan.problem.rhs_dtype)
    if plan.fp8_matmul:
        return fp8_window_scales(refs.scales[slot][...], refs.rhs[slot][0].shape,
                                 rhs_contract=1 if plan.problem.transpose_rhs else 0, k_offset=k_step * plan.tile_k,
                                 out_offset=pl.program_id(0) * plan.tile_n)
    if scheme == FP8:

        @pl.when(rows_in_tile)
        def _():
            n_offset, k_offset = pl.program_id(0) * plan.tile_n, k_step * plan.tile_k
            offsets = (n_offset, k_offset) if plan.problem.transpose_rhs else (k_offset, n_offset)
            dequantize_fp8_block(refs.rhs[slot][0], refs.scales[slot][...], *offsets, refs.dequantized[slot])
    elif scheme == INT4:
        pl.when(rows_in_tile)(functools.partial(unpack_int4_block, refs.rhs[slot][0], refs.dequantized[slot]))
    return None


def _accumulate_tile(refs: _StepRefs, slot: int, tile: _RowTile, row_start, row_end, rows_in_tile, k_step,
                     plan: MatmulPlan, window_scales) -> None:
    """Without chunks: the slot's group's rows of the whole row tile, the others masked."""

    @pl.when(rows_in_tile)
    def _():
        row = tile.start + lax.broadcasted_iota(jnp.int32, (plan.tile_m, 1), 0)
        keep = jnp.logical_and(row >= row_start, row < row_end)
        for part, acc in enumerate(refs.acc):
            acc[...] += _multiply(refs, slot, part, 0, plan.tile_m, keep, k_step, plan, window_scales)


def _run_slot(refs: _StepRefs, items: WorkItems, tile: _RowTile, slot: int, k_step, plan: MatmulPlan) -> None:
    """The slot's work item on the step's row tile: its bias, its weights decoded, its rows multiplied."""
    item, count = tile.first_item + slot, tile.count
    # An idle slot (past the last item) and a tail item (rows past every
    # group) have an empty row range, so no chunk of theirs computes.
    # lax.select rather than jnp.where: jnp.where is a nested jit, which
    # hides these predicates from the traffic model's per-step evaluation.
    real = item < count
    zero = jnp.int32(0)
    last_real = jnp.minimum(item, count - 1)
    row_start = lax.select(real, items.row_start[last_real], zero)
    row_end = lax.select(real, items.row_end[last_real], zero)
    rows_in_tile = jnp.logical_and(row_start < tile.start + plan.tile_m, row_end > tile.start)
    if refs.bias:
        _add_bias(refs, slot, tile, row_start, row_end, rows_in_tile, k_step, plan)
    window_scales = _decode_weights(refs, slot, rows_in_tile, k_step, plan)
    if plan.chunk_m:
        _accumulate_chunks(refs, slot, tile.start, items.chunk_start[last_real], row_start, row_end, k_step, plan,
                           window_scales)
    else:
        _accumulate_tile(refs, slot, tile, row_start, row_end, rows_in_tile, k_step, plan, window_scales)


def _close_row_tile(refs: _StepRefs, plan: MatmulPlan) -> None:
    """The output block, written once, at the last step on its row tile (it is copied out only when the row tile
    changes): the carry's rows that belong to this tile added in, then the epilogue."""
    chunk_m = plan.chunk_m
    if chunk_m:
        for acc, carry in zip(refs.acc, refs.carry):
            acc[plan.tile_m - chunk_m :, :] += carry[:chunk_m, :]
    epilogue(plan)(refs.out, refs.acc, plan)


def _kernel_refs(lhs_ref, refs, prefetch, step, steps, plan: MatmulPlan) -> _StepRefs:
    """The step's refs; with gathered rows, lhs reads the buffer this step's rows were copied into."""
    if not plan.problem.gathered:
        return _step_refs(lhs_ref, refs, plan)
    *refs, buffers, semaphores, current = refs
    gather = Gather(lhs_ref, *prefetch[len(WorkItems._fields) :], buffers, semaphores, current)
    buffer = gather_rows(gather, WorkItems(*prefetch[: len(WorkItems._fields)]).lhs_tile, step, steps, plan)
    return _step_refs(None, refs, plan)._replace(
        lhs=functools.partial(token_rows, buffers.at[buffer], plan.problem.dtype, plan.problem.k, plan.gather_split))


def _body(*refs, plan: MatmulPlan):
    """Walks the step's work items (module docstring); what each does is the plan's choice of bias, weights
    decoder, chunks and epilogue."""
    prefetch, (lhs_ref, *refs) = refs[: _prefetch_count(plan)], refs[_prefetch_count(plan) :]
    items = WorkItems(*prefetch[: len(WorkItems._fields)])
    step, steps, k_step = pl.program_id(1), pl.num_programs(1), pl.program_id(2)
    refs = _kernel_refs(lhs_ref, refs, prefetch, step, steps, plan)
    tile = _row_tile(items, step, steps, plan)
    _open_row_tile(refs, tile, step, k_step, plan)
    for slot in range(plan.groups_per_step):
        _run_slot(refs, items, tile, slot, k_step, plan)
    pl.when(jnp.logical_and(k_step == pl.num_programs(2) - 1, tile.ends))(lambda: _close_row_tile(refs, plan))


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    rhs_scales: jax.Array | None = None,
    *,
    transpose_rhs: bool = False,
    zero_rows_past_groups: bool = True,
    config: TileConfig | None = None,
    generation: str | TpuGeneration | None = None,
) -> jax.Array:
    """`lhs[M,K] x rhs[G,K,N] (or [G,N,K] with transpose_rhs) -> [M,N]` per row group.

    Rows past `sum(group_sizes)` come out as zeros, or are left unwritten
    (whatever the output buffer held) with `zero_rows_past_groups=False`.
    Quantized `rhs` (int8, float8_e4m3fn, or int4 packed in uint8) comes
    with `rhs_scales` (`common/quant.py`: `[G, N]` per output channel for int8 and
    int4; `[G, ceil(D1/128), ceil(D2/128)]` blocks over rhs's own dims for
    fp8); the output is in
    lhs's dtype. Tiles: `config`, else the plan's (`gmm.plan.make`
    for `generation`, a name or a target, resolved here; default this device's). Inputs are assumed valid: the
    torch ops check them (`ops.py`); `group_sizes` has an integer dtype and
    sums to at most M. With an empty dimension (M, K, N or G zero) there is
    nothing to multiply: the result is zeros and no kernel runs.
    """
    m, k = lhs.shape
    rhs_shape = weight_shape(rhs, k, 2 if transpose_rhs else 1)
    num_groups = rhs_shape[0]
    n = rhs_shape[1] if transpose_rhs else rhs_shape[2]
    if 0 in (m, k, n, num_groups):
        return jnp.zeros((m, n), lhs.dtype)
    if scheme_of(rhs.dtype) == INT4 and int4_packed_axis(rhs_shape) == 2:
        # Packed along its last dim, where XLA stores its last two dims swapped: the kernel reads that view (a
        # bitcast), whose rows are the packed ones.
        rhs, transpose_rhs = jnp.swapaxes(rhs, 1, 2), not transpose_rhs
    problem = MatmulProblem(m, k, n, num_groups, jnp.dtype(lhs.dtype).name, jnp.dtype(rhs.dtype).name,
                            transpose_rhs=bool(transpose_rhs), zero_rows_past_groups=bool(zero_rows_past_groups))
    return call(lhs, rhs, group_sizes, make(problem, resolve_target(generation), config), rhs_scales)


def _prefetch_count(plan: MatmulPlan) -> int:
    """Scalar-prefetch operands: the work items, and with gathered rows each row's token and the live rows."""
    return len(WorkItems._fields) + (2 if plan.problem.gathered else 0)


def call(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, plan: MatmulPlan,
         rhs_scales: jax.Array | None = None, bias: jax.Array | None = None,
         row_token: jax.Array | None = None) -> jax.Array:
    """`grouped_matmul` as `plan` says (inputs of the plan's non-empty problem, assumed valid): quantized weights
    with their `rhs_scales`, and the plan's problem's `bias` (`[groups, n]`; with a gate `[groups, 2n]`, gate then
    up) when it has one. With gathered rows (`MatmulProblem.gathered`) lhs is the `[tokens, k]` token rows and
    `row_token[m]` each sorted row's token (its entries past the groups are never read)."""
    problem, tile_m = plan.problem, plan.tile_m
    if (bias is not None) != problem.bias:
        raise ValueError(f"the plan {'takes a' if problem.bias else 'has no'} bias, got "
                         f"{'none' if bias is None else 'one'}")
    if (row_token is not None) != problem.gathered:
        raise ValueError(f"the plan {'gathers its rows and takes' if problem.gathered else 'takes sorted rows, not'} "
                         f"row_token, got {'none' if row_token is None else 'one'}")
    m, k, n = problem.m, problem.k, problem.n
    group_sizes = int32_group_sizes(group_sizes)
    items = make_work_items(group_sizes, m, tile_m, problem.zero_rows_past_groups, plan.chunk_m,
                            sublane_multiple(lhs.dtype))
    prefetch = tuple(items)
    if problem.gathered:
        prefetch += (row_token.astype(jnp.int32), jnp.sum(group_sizes).reshape(1))
        lhs = lhs if lhs.dtype == jnp.float32 else pack_rows(lhs, plan.gather_split)
    grid = (pl.cdiv(n, plan.tile_n), pl.cdiv(items.count[0], plan.groups_per_step), pl.cdiv(k, plan.tile_k))
    specs = block_specs(plan, rhs, rhs_scales, bias)
    itemsize = jnp.dtype(problem.dtype).itemsize
    # A resident lhs is read once; tiled, once per N tile (and chunk_m more rows per row tile).
    lhs_reads = 1 if tile_m >= m and plan.tile_k == k else grid[0] * (1 + (plan.chunk_m or 0) / tile_m)
    # Per active group: its weights once (with a gate, both halves), and its scales once per N tile.
    read_n = n if problem.gate is None else 2 * n
    group_bytes = (k * read_n * (0.5 if scheme_of(rhs.dtype) == INT4 else jnp.dtype(rhs.dtype).itemsize)
                   + (0 if rhs_scales is None else grid[0] * rhs_scales[0].size * 4)
                   + (read_n * 4 if problem.bias else 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(len(prefetch), grid, specs.in_specs, specs.out_spec, specs.scratch)
    run = scheduled_matmul_call(
        functools.partial(_body, plan=plan), _out_shape(plan), grid_spec,
        ("parallel", "arbitrary", "arbitrary"), plan.vmem_limit_bytes, (m, k, read_n),
        bytes_accessed=int((m * k * lhs_reads + m * n) * itemsize + plan.active_groups * group_bytes),
        name="ragged_dot")
    return run(*prefetch, lhs, *specs.operands)


def _out_shape(plan: MatmulPlan) -> jax.ShapeDtypeStruct:
    problem = plan.problem
    if problem.packed_out:
        return jax.ShapeDtypeStruct((problem.m, pl.cdiv(problem.n, plan.tile_n) * plan.out_split), jnp.int32)
    return jax.ShapeDtypeStruct((problem.m, problem.n), jnp.dtype(problem.dtype))


def scheduled_matmul_call(body, out_shape, grid_spec, semantics, vmem_limit_bytes: int, mkn, *, bytes_accessed: int,
                          name: str):
    """The pallas_call of a matmul over a scalar-prefetched work schedule: grouped_matmul's and tgmm's
    (`tgmm/kernel.py`) differ only in these arguments. Its cost: 2 m k n flops, no transcendentals."""
    m, k, n = mkn
    return pl.pallas_call(
        body,
        out_shape=out_shape,
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=vmem_limit_bytes),
        cost_estimate=pl.CostEstimate(flops=2 * m * k * n, transcendentals=0, bytes_accessed=bytes_accessed),
        name=name,
    )
