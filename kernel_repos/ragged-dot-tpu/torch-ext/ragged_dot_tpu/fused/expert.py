"""One expert's work in the fused experts kernel (`fused.kernel`): the refs a slot of experts reads, how a
scheme's weights blocks reach the matmuls (the plan's `weights_decoder`), and one chunk of rows through the
expert's I tile by the gate's layout (`expert_rows_of`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..common.gates import DEINTERLEAVED_COLUMNS, deinterleaved_gated, gated
from ..common.quant import (
    FP8, INT4, INT8, dequantize_fp8_block, fp8_matmul, fp8_matmul_of_blocks, fp8_window_scales, per_channel_scales,
    scheme_of, unpack_int4_block,
)
from .plan import FusedPlan
from .schedule import block_shift
from .tiles import BIAS_BLOCK_EXPERTS, SCALE_BLOCK_EXPERTS


def dot(lhs, rhs, lhs_contract: int, rhs_contract: int, precision):
    return lax.dot_general(
        lhs, rhs, (((lhs_contract,), (rhs_contract,)), ((), ())), preferred_element_type=jnp.float32,
        precision=precision,
    )


def expert_bias(bias_ref, expert, block_experts: int = BIAS_BLOCK_EXPERTS):
    """This expert's row of a `[block_experts, n]` block (biases; scales: SCALE_BLOCK_EXPERTS), as a `[1, n]` f32
    row.

    Rows past the last expert (a partial last block) hold garbage; they are
    never selected, and `where` keeps a NaN there out of the sum.
    """
    block = bias_ref[...].astype(jnp.float32)
    shift = block_shift(block_experts)
    row = lax.broadcasted_iota(jnp.int32, block.shape, 0) + ((expert >> shift) << shift)
    return jnp.sum(jnp.where(row == expert, block, 0.0), axis=0, keepdims=True)


def expert_bias_columns(bias_ref, expert, columns: int, block_experts: int = BIAS_BLOCK_EXPERTS):
    """This expert's bias (or scales) as `[n, columns]` (each column the bias), for the transposed orientation."""
    block = bias_ref[...].astype(jnp.float32)
    shift = block_shift(block_experts)
    row = lax.broadcasted_iota(jnp.int32, block.shape, 0) + ((expert >> shift) << shift)
    selected = jnp.where(row == expert, block, 0.0)
    ones = jnp.ones((block.shape[0], columns), jnp.float32)
    # A transposed-lhs matmul turns the selected row into columns; one nonzero term per sum: exact.
    return dot(selected, ones, 0, 0, lax.Precision.HIGHEST)


class SlotRefs(NamedTuple):
    """The kernel body's refs past the routing that one slot of experts uses, by role (each tuple one per gate_up
    part): its own blocks, then the output and scratch all slots share."""

    gate_up: tuple
    down: object
    gate_up_bias: tuple  # empty without biases
    down_bias: object | None
    gate_up_scales: tuple  # int8, int4: [SCALE_BLOCK_EXPERTS, n] blocks, as the biases; fp8: one whole grid
    down_scales: object | None
    out: object
    out_acc: object
    gate_up_t: object | None  # interleaved but not fp8_matmul: the chunk's gate_up projection, transposed, to split
    rows_cache: object | None  # I tiled: the expert's gathered rows
    partial_out: object | None  # I tiled: the expert's output summed over the I tiles
    dequantized: tuple  # fp8, int4: the step's gate_up part(s), then down, dequantized


def split_refs(refs, plan: FusedPlan) -> tuple[SlotRefs, ...]:
    """The body's refs past the routing, one `SlotRefs` per slot of experts: each its own weights blocks (biases,
    scales), all sharing the output, accumulator and scratch."""
    parts, problem = plan.gate_up_parts, plan.problem
    quantization = scheme_of(problem.weights_dtype)

    def take(count):
        nonlocal refs
        taken, refs = tuple(refs[:count]), refs[count:]
        return taken

    def slot_refs():
        gate_up, (down,) = take(parts), take(1)
        gate_up_bias, down_bias = (take(parts), take(1)[0]) if problem.has_bias else ((), None)
        if per_channel_scales(quantization):
            gate_up_scales, down_scales = take(parts), take(1)[0]
        elif quantization == FP8:
            gate_up_scales, (down_scales,) = take(1), take(1)
        else:
            gate_up_scales, down_scales = (), None
        return gate_up, down, gate_up_bias, down_bias, gate_up_scales, down_scales

    slots = [slot_refs() for _ in range(plan.experts_per_step)]
    out, out_acc, *scratch = refs
    gate_up_t = scratch.pop(0) if problem.gate.interleaved and not plan.fp8_matmul else None
    rows_cache, partial_out = (scratch.pop(0), scratch.pop(0)) if plan.i_tiles_per_core > 1 else (None, None)
    return tuple(SlotRefs(*slot, out, out_acc, gate_up_t, rows_cache, partial_out, tuple(scratch)) for slot in slots)


def _dequantize_step(refs: SlotRefs, i_step, plan: FusedPlan) -> None:
    """fp8, int4: the step's weights blocks dequantized once (not per chunk) into scratch, which the matmuls
    read."""
    gate_up_transposed, down_transposed = plan.orientation
    parts = plan.gate_up_parts
    if scheme_of(plan.problem.weights_dtype) == INT4:
        for ref, unpacked in zip((*refs.gate_up, refs.down), refs.dequantized):
            unpack_int4_block(ref, unpacked)
        return
    width = refs.gate_up[0].shape[1 if gate_up_transposed else 0]
    for part, (ref, dequantized) in enumerate(zip(refs.gate_up, refs.dequantized[:parts])):
        offset = (part * plan.i_tiles + i_step) * width  # along 2I
        offsets = (0, offset) if gate_up_transposed else (offset, 0)
        dequantize_fp8_block(ref, refs.gate_up_scales[0][...], *offsets, dequantized)
    offset = i_step * plan.tile_i  # along I
    offsets = (offset, 0) if down_transposed else (0, offset)
    dequantize_fp8_block(refs.down, refs.down_scales[...], *offsets, refs.dequantized[parts])


def _fp8_step_scales(refs: SlotRefs, i_step, plan: FusedPlan) -> tuple:
    """plan.fp8_matmul: the step's weights windows' scales per K block and output column
    (`common.quant.fp8_window_scales`), once per step for all chunks: each gate_up part's, then down's."""
    gate_up_transposed, down_transposed = plan.orientation
    width = refs.gate_up[0].shape[1 if gate_up_transposed else 0]
    gate_up = [fp8_window_scales(refs.gate_up_scales[0][...], ref.shape, rhs_contract=0 if gate_up_transposed else 1,
                                 k_offset=0, out_offset=(part * plan.i_tiles + i_step) * width)
               for part, ref in enumerate(refs.gate_up)]
    down = fp8_window_scales(refs.down_scales[...], refs.down.shape, rhs_contract=0 if down_transposed else 1,
                             k_offset=i_step * plan.tile_i, out_offset=0)
    return (*gate_up, down)


class Expert(NamedTuple):
    """One item's expert, the I tile's weights blocks the matmuls read, and what their decoder scales them by."""

    index: object  # the expert id
    decoder: "Decoder"
    gate_up: tuple  # refs, one per gate_up part
    down: object
    gate_up_scales: tuple  # per gate_up part: int8, int4 their scales ref; on the fp8 MXU window scales; else None
    down_scales: object
    dtype: object
    precision: object
    valid_i: object | None  # partial I tiles (`fused.tiles.partial_i_tiles`): I's columns from this tile's start on


class Decoder(NamedTuple):
    """How one scheme's weights blocks reach the matmuls, chosen once per plan (`weights_decoder`).

    - `ready(refs, picks, own_tile, i_tile, plan)`: once per step, not per
      chunk, the blocks the matmuls read and their scales, as
      `(gate_up, down, gate_up_scales, down_scales)` (see `Expert`).
    - `project(x, ref, scales, expert, x_contract, w_contract)`: `x` times a
      block, as f32, each output channel scaled.
    - `project_columns(ref, x, scales, expert, w_contract)`: the block times
      `x` (contracted over x's dim 1), the channels being rows (the
      transposed orientation of interleaved gate/up columns).
    """

    ready: Callable
    project: Callable
    project_columns: Callable | None


def _as_stored(refs: SlotRefs, picks, own_tile, i_tile, plan: FusedPlan) -> tuple:
    """The blocks as the pipeline brought them; float weights have no scales."""
    return refs.gate_up, refs.down, (None,) * plan.gate_up_parts, None


def _as_stored_per_channel(refs: SlotRefs, picks, own_tile, i_tile, plan: FusedPlan) -> tuple:
    """int8: the blocks as the pipeline brought them, with their per-channel scales."""
    return refs.gate_up, refs.down, refs.gate_up_scales, refs.down_scales


def _dequantized_blocks(refs: SlotRefs, picks, own_tile, i_tile, plan: FusedPlan) -> tuple:
    """fp8, int4: the step's blocks dequantized (int4 unpacked) into VMEM scratch, for a slot with picks on its own
    I tile: the gate_up parts' and down's scratch refs."""
    pl.when(jnp.logical_and(picks > 0, own_tile))(lambda: _dequantize_step(refs, i_tile, plan))
    return refs.dequantized[: plan.gate_up_parts], refs.dequantized[plan.gate_up_parts]


def _dequantized(refs: SlotRefs, picks, own_tile, i_tile, plan: FusedPlan) -> tuple:
    """fp8: dequantized blocks, their block scales in the values."""
    return *_dequantized_blocks(refs, picks, own_tile, i_tile, plan), (None,) * plan.gate_up_parts, None


def _dequantized_per_channel(refs: SlotRefs, picks, own_tile, i_tile, plan: FusedPlan) -> tuple:
    """int4: unpacked blocks, with their per-channel scales."""
    return *_dequantized_blocks(refs, picks, own_tile, i_tile, plan), refs.gate_up_scales, refs.down_scales


def _fp8_mxu_window(refs: SlotRefs, picks, own_tile, i_tile, plan: FusedPlan) -> tuple:
    """fp8 on the fp8 MXU: the blocks as stored, with the step's window scales (`_fp8_step_scales`)."""
    *gate_up_scales, down_scales = _fp8_step_scales(refs, i_tile, plan)
    return refs.gate_up, refs.down, tuple(gate_up_scales), down_scales


def _channel_scales(scales_ref, expert: Expert, columns: int | None = None):
    """int8, int4: this expert's per-channel scales, as a `[1, n]` row (or `[n, columns]`, each column the
    scales)."""
    if columns is None:
        return expert_bias(scales_ref, expert.index, SCALE_BLOCK_EXPERTS)
    return expert_bias_columns(scales_ref, expert.index, columns, SCALE_BLOCK_EXPERTS)


def _matmul_decoder(ready: Callable, cast: bool, scaled: bool) -> Decoder:
    """A decoder whose blocks the MXU takes in the activation dtype: int8 cast at each matmul (`cast`), the
    others as `ready` leaves them; int8's and int4's channel scales (`scaled`) multiply the result."""

    def weights(ref, expert: Expert):
        return ref[...].astype(expert.dtype) if cast else ref[...]

    def project(x, ref, scales, expert: Expert, x_contract: int, w_contract: int):
        projection = dot(x, weights(ref, expert), x_contract, w_contract, expert.precision)
        return projection * _channel_scales(scales, expert) if scaled else projection

    def project_columns(ref, x, scales, expert: Expert, w_contract: int):
        projection = dot(weights(ref, expert), x, w_contract, 1, expert.precision)
        return projection * _channel_scales(scales, expert, projection.shape[1]) if scaled else projection

    return Decoder(ready, project, project_columns)


def _fp8_mxu_project(x, ref, scales, expert: Expert, x_contract: int, w_contract: int):
    """fp8 weights times fp8-quantized rows on the fp8 MXU (`common.quant.fp8_matmul`; rows on dim 0)."""
    assert x_contract == 1
    return fp8_matmul(x, ref, scales, rhs_contract=w_contract)


_DECODERS = {
    None: _matmul_decoder(_as_stored, cast=False, scaled=False),
    INT8: _matmul_decoder(_as_stored_per_channel, cast=True, scaled=True),
    INT4: _matmul_decoder(_dequantized_per_channel, cast=False, scaled=True),
    FP8: _matmul_decoder(_dequantized, cast=False, scaled=False),
}
_FP8_MXU_DECODER = Decoder(_fp8_mxu_window, _fp8_mxu_project, None)


def weights_decoder(plan: FusedPlan) -> Decoder:
    """The plan's weights decoder: by scheme, fp8 on a generation with an fp8 MXU taking it as it is."""
    return _FP8_MXU_DECODER if plan.fp8_matmul else _DECODERS[scheme_of(plan.problem.weights_dtype)]


def _gate_then_up_rows(rows, refs: SlotRefs, expert: Expert, plan: FusedPlan):
    """`[chunk, H]` f32: this I tile's share of the expert's output for `rows`, the gate's columns before the
    up projection's (one block of both, or one block each)."""
    gate = plan.problem.gate
    gate_up_transposed, down_transposed = plan.orientation
    project = expert.decoder.project
    projections = [project(rows, ref, scales, expert, 1, 0 if gate_up_transposed else 1)
                   for ref, scales in zip(expert.gate_up, expert.gate_up_scales)]
    if refs.gate_up_bias:
        projections = [p + expert_bias(ref, expert.index) for p, ref in zip(projections, refs.gate_up_bias)]
    if plan.gate_up_parts == 2:
        gate_part, up = projections
    else:
        gate_part, up = projections[0][:, : plan.tile_i], projections[0][:, plan.tile_i :]
    hidden_rows = gated(gate_part, up, gate.activation, alpha=gate.alpha, limit=gate.limit).astype(expert.dtype)
    return project(hidden_rows, expert.down, expert.down_scales, expert, 1, 0 if down_transposed else 1)


def _interleaved_rows(rows, refs: SlotRefs, expert: Expert, plan: FusedPlan):
    """`_gate_then_up_rows` with interleaved gate/up columns (GPT-OSS), split in the transposed orientation, a
    loop over the I tile's slabs of `plan.slab_i` columns (`fused.tiles.MAX_SLAB_I`: Mosaic compiles one slab's
    body). Per slab: `gate_up^T` `[2 slab, chunk]` (weights `[2 slab, H]`, or `[H, 2 slab]` transposed, against
    rows `[chunk, H]`), whose even and odd rows Mosaic reads with strided loads, gated, then the slab's `down`
    rows (`[slab, H]` transposed, or columns of `[H, slab]`) against `hidden^T` `[slab, chunk]`, summed in f32."""
    gate = plan.problem.gate
    gate_up_transposed, down_transposed = plan.orientation
    slab = plan.slab_i

    def columns(ref, start, width, transposed=True):
        """The `width` slab columns (rows unless `transposed`) of a block from `start` on."""
        return ref.at[:, pl.ds(start, width)] if transposed else ref.at[pl.ds(start, width), :]

    def add_slab(index, total):
        start = pl.multiple_of(index * slab, slab)
        pair_start = pl.multiple_of(2 * start, 2 * slab)
        scales = expert.gate_up_scales[0]
        gate_up_t = expert.decoder.project_columns(
            columns(expert.gate_up[0], pair_start, 2 * slab, gate_up_transposed), rows,
            None if scales is None else columns(scales, pair_start, 2 * slab), expert, 0 if gate_up_transposed else 1)
        if refs.gate_up_bias:
            gate_up_t = gate_up_t + expert_bias_columns(columns(refs.gate_up_bias[0], pair_start, 2 * slab),
                                                        expert.index, rows.shape[0])
        refs.gate_up_t[pl.ds(0, 2 * slab), :] = gate_up_t
        gate_t = refs.gate_up_t[pl.ds(0, slab, stride=2), :]
        up_t = refs.gate_up_t[pl.ds(1, slab, stride=2), :]
        hidden_t = gated(gate_t, up_t, gate.activation, alpha=gate.alpha, limit=gate.limit).astype(expert.dtype)
        down = columns(expert.down, start, slab, not down_transposed)
        return total + expert.decoder.project(hidden_t, down, expert.down_scales, expert, 0,
                                              0 if down_transposed else 1)

    return lax.fori_loop(0, plan.tile_i // slab, add_slab, jnp.zeros((rows.shape[0], plan.problem.hidden), jnp.float32))


def _interleaved_fp8_rows(rows, refs: SlotRefs, expert: Expert, plan: FusedPlan):
    """`_interleaved_rows` on the fp8 MXU: the chunk's `[chunk, 2 ti]` projection,
    biased, is de-interleaved and gated 256 columns at a time (`common.gates.deinterleaved_gated`, exact), each giving
    the next 128-wide K block of the down projection's input, which that matmul quantizes as it comes.

    In a partial last I tile the projection's columns past I (garbage weights and biases, possibly NaN) are
    zeroed before the de-interleaving matmul would spread them; they gate to zeros, and the down projection
    zeroes its weights' rows past I (`common.quant.fp8_matmul_of_blocks`'s `k_bounds`).
    """
    gate = plan.problem.gate
    gate_up_transposed, down_transposed = plan.orientation
    projection = fp8_matmul(rows, expert.gate_up[0], expert.gate_up_scales[0],
                            rhs_contract=0 if gate_up_transposed else 1)
    if refs.gate_up_bias:
        projection = projection + expert_bias(refs.gate_up_bias[0], expert.index)
    k_bounds = None
    if expert.valid_i is not None:
        column = lax.broadcasted_iota(jnp.int32, projection.shape, 1)
        projection = jnp.where(column < 2 * expert.valid_i, projection, 0.0)
        k_bounds = (expert.valid_i, plan.problem.intermediate - (plan.i_tiles - 1) * plan.tile_i)
    hidden_blocks = (
        deinterleaved_gated(projection[:, start : start + DEINTERLEAVED_COLUMNS], gate.activation, alpha=gate.alpha,
                            limit=gate.limit, exact=True).astype(expert.dtype)
        for start in range(0, projection.shape[1], DEINTERLEAVED_COLUMNS))
    return fp8_matmul_of_blocks(hidden_blocks, expert.down, expert.down_scales,
                                rhs_contract=0 if down_transposed else 1, k_bounds=k_bounds)


def expert_rows_of(plan: FusedPlan) -> Callable:
    """`(rows, refs, expert, plan) -> [chunk, H]` f32, this I tile's share of the expert's output for `rows`,
    by how the plan's gate and up columns are laid out."""
    if plan.problem.gate.interleaved:
        return _interleaved_fp8_rows if plan.fp8_matmul else _interleaved_rows
    return _gate_then_up_rows
