"""The experts layer of a decode step as one Pallas TPU kernel.

`fused_experts(hidden_states[T, H], top_k_index[T, K], top_k_weights[T, K],
gate_up_proj, down_proj, biases...) -> [T, H]`: for each active expert,
gate_up -> gated activation -> down on the rows that picked it, weighted by
their routing weights and summed into the tokens' outputs, with every
intermediate in VMEM.

Schedule: the grid is (items, I tiles), one item per active expert
(`routing.expert_plan`), so:
- an expert without picks has no grid step and its weights are never read;
  other ranks' sentinel picks reach no item at all;
- each active expert's weights are read exactly once (one block per I tile);
- the hidden states are one resident block read once, and the output one
  resident block written once, at the last step.
A call without live picks runs one empty item over one I tile (Pallas
fetches the blocks of a grid's first step; a zero-step grid is not relied
upon): it writes zeros and reads one block of one expert's weights.

The routing (`top_k_index`, `top_k_weights`) is resident too. At each item
the kernel sums each token's weights for the item's expert; the expert's
rows are the tokens of nonzero weight, in token order (a row's rank is the
count of such tokens before it, a matmul with a triangular matrix). Rows are
worked in static chunks of `chunk_rows`, each under a `pl.when` that skips
chunks past the expert's picks. A chunk gathers its rows from the resident
hidden states with a one-hot matmul (`[T, c]` one-hot, contracted over the
tokens: exact), runs the expert, and scatters its results back with the
one-hot scaled by the routing weights (exact for weights the activation
dtype holds; f32 weights under bf16 activations go in two bf16 parts). The
one-hot matmuls cost 2 x T x H multiply-adds per row, which decode hides
under the weights' DMA (see config.FUSED_MAX_TOKENS).

Interleaved gate/up columns (GPT-OSS) are split in the transposed
orientation: the chunk's gate_up projection is computed as `[2 I, c]`, whose
even and odd rows Mosaic reads with strided loads (lanes have no strided
load). Biases come in blocks of config.BIAS_BLOCK_EXPERTS experts and the
kernel selects its expert's row.

Quantized weights (`quant.py`) are read as one byte each: int8 blocks are
cast to the activation dtype at each matmul and their per-channel scales
multiply its result (as the biases, in blocks of BIAS_BLOCK_EXPERTS experts);
fp8 blocks are dequantized once per step into VMEM scratch, which the
matmuls read.

Tiles come from `config.fused_config`; inputs are assumed valid (`ops.py`
checks them).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .config import (
    BIAS_BLOCK_EXPERTS, FusedConfig, check_fused_config, expected_active_groups, fused_chunks, fused_config,
    fused_vmem_limit, weights_as_stored,
)
from .gates import gated
from .quant import FP8, INT8, dequantize_fp8_block, scheme_of
from .routing import expert_plan

_BIAS_BLOCK_SHIFT = BIAS_BLOCK_EXPERTS.bit_length() - 1
assert 1 << _BIAS_BLOCK_SHIFT == BIAS_BLOCK_EXPERTS


class _Layout(NamedTuple):
    """What the kernel body needs to know about the layer, all static."""

    tokens: int
    chunk_rows: int
    chunks: int
    tile_i: int
    i_tiles: int
    gate_up_parts: int  # 2: gate and up blocks apart (concatenated, I tiled); 1: one block of both
    gate_up_transposed: bool  # as the kernel reads it (config.weights_orientation): [E, H, 2I], else [E, 2I, H]
    down_transposed: bool  # [E, I, H], else [E, H, I]
    interleaved: bool
    has_bias: bool
    activation: str
    alpha: float
    limit: float
    split_weights: bool  # f32 routing weights under a narrower activation dtype: scatter in two parts
    quantization: str | None  # the weights' scheme (quant.py): None, "int8" or "fp8"


def _dot(lhs, rhs, lhs_contract: int, rhs_contract: int, precision):
    return lax.dot_general(
        lhs, rhs, (((lhs_contract,), (rhs_contract,)), ((), ())), preferred_element_type=jnp.float32,
        precision=precision,
    )


def _expert_bias(bias_ref, expert):
    """This expert's row of a `[BIAS_BLOCK_EXPERTS, n]` bias block, as a `[1, n]` f32 row.

    Rows past the last expert (a partial last block) hold garbage; they are
    never selected, and `where` keeps a NaN there out of the sum.
    """
    block = bias_ref[...].astype(jnp.float32)
    row = lax.broadcasted_iota(jnp.int32, block.shape, 0) + ((expert >> _BIAS_BLOCK_SHIFT) << _BIAS_BLOCK_SHIFT)
    return jnp.sum(jnp.where(row == expert, block, 0.0), axis=0, keepdims=True)


def _expert_bias_columns(bias_ref, expert, columns: int):
    """This expert's bias as `[n, columns]` (each column the bias), for the transposed orientation."""
    block = bias_ref[...].astype(jnp.float32)
    row = lax.broadcasted_iota(jnp.int32, block.shape, 0) + ((expert >> _BIAS_BLOCK_SHIFT) << _BIAS_BLOCK_SHIFT)
    selected = jnp.where(row == expert, block, 0.0)
    ones = jnp.ones((block.shape[0], columns), jnp.float32)
    # A transposed-lhs matmul turns the selected row into columns; one nonzero term per sum: exact.
    return _dot(selected, ones, 0, 0, lax.Precision.HIGHEST)


def _token_columns(index_ref, weights_ref, expert, tokens: int):
    """This expert's routing weight per token and each token's rank among its rows, as `[T, 1]` f32 columns.

    A token's weight is the sum of its picks of the expert (repeated picks
    add up); its rows are the tokens of nonzero weight. The rank is a prefix
    count, a matmul of the 0/1 mask with a strictly lower triangle: 0/1
    operands in one bf16 pass and sums below 2^24, exact.
    """
    weights = jnp.sum(jnp.where(index_ref[...] == expert, weights_ref[...].astype(jnp.float32), 0.0), axis=1,
                      keepdims=True)
    row = lax.broadcasted_iota(jnp.int32, (tokens, tokens), 0)
    col = lax.broadcasted_iota(jnp.int32, (tokens, tokens), 1)
    picked = (weights != 0.0).astype(jnp.float32)
    rank = _dot((col < row).astype(jnp.float32), picked, 1, 0, lax.Precision.DEFAULT)
    return weights, rank


def _body(expert_ref, rows_ref, count_ref, hidden_ref, index_ref, weights_ref, *refs, layout: _Layout):
    del count_ref  # the grid's size
    parts = layout.gate_up_parts
    gate_up_refs, down_ref = refs[:parts], refs[parts]
    refs = refs[parts + 1 :]
    if layout.has_bias:
        gate_up_bias_refs, down_bias_ref = refs[:parts], refs[parts]
        refs = refs[parts + 1 :]
    quantization = layout.quantization
    gate_up_scale_refs, down_scale_ref = (None,) * parts, None
    if quantization == INT8:  # [BIAS_BLOCK_EXPERTS, n] blocks, as the biases
        gate_up_scale_refs, down_scale_ref = refs[:parts], refs[parts]
        refs = refs[parts + 1 :]
    elif quantization == FP8:  # the expert's whole grids of block scales
        gate_up_scale_ref, down_scale_ref, *refs = refs
    out_ref, out_acc, *scratch = refs
    gate_up_t_ref = scratch.pop(0) if layout.interleaved else None
    rows_cache, partial_out = (scratch.pop(0), scratch.pop(0)) if layout.i_tiles > 1 else (None, None)

    dtype = hidden_ref.dtype
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT
    item, i_step = pl.program_id(0), pl.program_id(1)
    expert = expert_ref[item]
    picks = rows_ref[item]
    last_i = pl.num_programs(1) - 1
    chunk = layout.chunk_rows
    gate_up_transposed, down_transposed = layout.gate_up_transposed, layout.down_transposed

    @pl.when(jnp.logical_and(item == 0, i_step == 0))
    def _():
        out_acc[...] = jnp.zeros_like(out_acc)

    if quantization == FP8:
        # Dequantized once per step (not per chunk) into scratch, which the matmuls then read.
        dequantized_gate_up, dequantized_down = scratch[:parts], scratch[parts]

        @pl.when(picks > 0)
        def _():
            width = gate_up_refs[0].shape[1 if gate_up_transposed else 0]
            for part, (ref, dequantized) in enumerate(zip(gate_up_refs, dequantized_gate_up)):
                offset = (part * layout.i_tiles + i_step) * width  # along 2I
                offsets = (0, offset) if gate_up_transposed else (offset, 0)
                dequantize_fp8_block(ref, gate_up_scale_ref[...], *offsets, dequantized)
            offset = i_step * layout.tile_i  # along I
            offsets = (offset, 0) if down_transposed else (0, offset)
            dequantize_fp8_block(down_ref, down_scale_ref[...], *offsets, dequantized_down)

        gate_up_refs, down_ref = dequantized_gate_up, dequantized_down

    def weights(ref):
        """A weights block in the activation dtype; int8 as its integers (the scales come after the dot)."""
        return ref[...].astype(dtype) if quantization == INT8 else ref[...]

    def scaled(projection, scale_ref, columns: bool = False):
        """int8: the projection's output channels times their scales (as a column when the channels are rows)."""
        if quantization != INT8:
            return projection
        if columns:
            return projection * _expert_bias_columns(scale_ref, expert, projection.shape[1])
        return projection * _expert_bias(scale_ref, expert)

    weight_column, rank_column = _token_columns(index_ref, weights_ref, expert, layout.tokens)

    def one_hot(first):
        """[T, chunk]: column r is the one-hot of the expert's row first + r (none past its rows)."""
        slot = (first + lax.broadcasted_iota(jnp.int32, (1, chunk), 1)).astype(jnp.float32)
        return jnp.logical_and(weight_column != 0.0, rank_column == slot)

    def gather(first):
        rows = _dot(one_hot(first).astype(dtype), hidden_ref[...], 0, 0, precision)
        return rows.astype(dtype)

    def expert_rows(rows):
        """[chunk, H] f32: this I tile's share of the expert's output for `rows`."""
        if layout.interleaved:
            # gate_up^T [2 ti, chunk]: weights [2 ti, H] (or [H, 2 ti] transposed) against rows [chunk, H].
            gate_up_t = scaled(_dot(weights(gate_up_refs[0]), rows, 0 if gate_up_transposed else 1, 1, precision),
                               gate_up_scale_refs[0], columns=True)
            if layout.has_bias:
                gate_up_t = gate_up_t + _expert_bias_columns(gate_up_bias_refs[0], expert, chunk)
            gate_up_t_ref[...] = gate_up_t
            gate_t = gate_up_t_ref[pl.ds(0, layout.tile_i, stride=2), :]
            up_t = gate_up_t_ref[pl.ds(1, layout.tile_i, stride=2), :]
            hidden_t = gated(gate_t, up_t, layout.activation, alpha=layout.alpha, limit=layout.limit).astype(dtype)
            # down [ti, H] (transposed) or [H, ti] against hidden^T [ti, chunk].
            return scaled(_dot(hidden_t, weights(down_ref), 0, 0 if down_transposed else 1, precision),
                          down_scale_ref)
        projections = [scaled(_dot(rows, weights(ref), 1, 0 if gate_up_transposed else 1, precision), scale_ref)
                       for ref, scale_ref in zip(gate_up_refs, gate_up_scale_refs)]
        if layout.has_bias:
            projections = [p + _expert_bias(ref, expert) for p, ref in zip(projections, gate_up_bias_refs)]
        if parts == 2:
            gate, up = projections
        else:
            gate, up = projections[0][:, : layout.tile_i], projections[0][:, layout.tile_i :]
        hidden_rows = gated(gate, up, layout.activation, alpha=layout.alpha, limit=layout.limit).astype(dtype)
        return scaled(_dot(hidden_rows, weights(down_ref), 1, 0 if down_transposed else 1, precision), down_scale_ref)

    def scatter(first, out_rows):
        """Adds the chunk's rows, times their routing weights, to their tokens' outputs."""
        if layout.has_bias:
            out_rows = out_rows + _expert_bias(down_bias_ref, expert)
        out_rows = out_rows.astype(dtype)
        weighted = jnp.where(one_hot(first), weight_column, 0.0)  # [T, chunk] f32
        high = weighted.astype(dtype)
        total = _dot(high, out_rows, 1, 0, precision)
        if layout.split_weights:
            low = (weighted - high.astype(jnp.float32)).astype(dtype)
            total = total + _dot(low, out_rows, 1, 0, precision)
        out_acc[...] += total

    for j in range(layout.chunks):
        first = j * chunk
        live = first < picks
        if layout.i_tiles == 1:

            @pl.when(live)
            def _(first=first):
                scatter(first, expert_rows(gather(first)))

            continue

        # I tiled: the rows are gathered at the first I tile, the output summed over the tiles and
        # scattered at the last. Each phase is its own top-level pl.when, so that the traffic model
        # evaluates which steps run which matmuls.
        @pl.when(jnp.logical_and(live, i_step == 0))
        def _(first=first):
            rows_cache[first : first + chunk, :] = gather(first)

        @pl.when(live)
        def _(first=first):
            part = expert_rows(rows_cache[first : first + chunk, :])
            earlier = partial_out[first : first + chunk, :]
            partial_out[first : first + chunk, :] = jnp.where(i_step == 0, part, earlier + part)

        @pl.when(jnp.logical_and(live, i_step == last_i))
        def _(first=first):
            scatter(first, partial_out[first : first + chunk, :])

    @pl.when(jnp.logical_and(item == pl.num_programs(0) - 1, i_step == last_i))
    def _():
        out_ref[...] = out_acc[...].astype(out_ref.dtype)


def fused_experts(
    hidden_states: jax.Array,
    top_k_index: jax.Array,
    top_k_weights: jax.Array,
    gate_up_proj: jax.Array,
    down_proj: jax.Array,
    gate_up_bias: jax.Array | None = None,
    down_bias: jax.Array | None = None,
    gate_up_scales: jax.Array | None = None,
    down_scales: jax.Array | None = None,
    *,
    activation: str,
    weights_transposed: bool,
    interleaved: bool = False,
    alpha: float = 1.0,
    limit: float = float("inf"),
    config: FusedConfig | None = None,
) -> jax.Array:
    """Gated experts per pick, weighted and summed per token, in one pallas_call (see the module docstring).

    Weights in transformers' layouts: `gate_up_proj[E, 2I, H]` and
    `down_proj[E, H, I]`, or `[E, H, 2I]` / `[E, I, H]` when transposed;
    optional `gate_up_bias[E, 2I]` and `down_bias[E, H]`. Quantized weights
    (int8 or float8_e4m3fn) come with their scales (`quant.py`: int8
    `[E, 2I]` and `[E, H]`; fp8 block grids over each weight's own dims).
    Picks with id == E are sentinels. Inputs are assumed valid (`ops.py`).
    Each projection is read in the order XLA stores it
    (`config.weights_orientation`). Without tokens, picks, hidden size or
    experts there is nothing to compute: the result is zeros and no kernel runs.
    """
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[1]
    num_experts = gate_up_proj.shape[0]
    if 0 in (tokens, top_k, hidden, num_experts):
        return jnp.zeros((tokens, hidden), hidden_states.dtype)
    intermediate = down_proj.shape[1] if weights_transposed else down_proj.shape[2]
    orientation, gate_up_proj, down_proj, gate_up_scales, down_scales = weights_as_stored(
        gate_up_proj, down_proj, gate_up_scales, down_scales, weights_transposed=weights_transposed)
    dtype = hidden_states.dtype
    has_bias = gate_up_bias is not None
    quantization = scheme_of(gate_up_proj.dtype)
    shape = dict(weights_transposed=weights_transposed, interleaved=interleaved, has_bias=has_bias,
                 weights_dtype=gate_up_proj.dtype)
    if config is None:
        config = fused_config(tokens, hidden, intermediate, num_experts, dtype, **shape)
        if config is None:
            raise ValueError(
                f"fused_experts: no I tiling of T={tokens}, H={hidden}, I={intermediate} fits VMEM; use the grouped path"
            )
    check_fused_config(config, tokens, hidden, intermediate, num_experts, dtype, **shape)
    chunk, tile_i = config
    chunks = fused_chunks(config, tokens)
    rows = chunks * chunk
    i_tiles = intermediate // tile_i
    parts = 2 if (i_tiles > 1 and not interleaved) else 1
    items = expert_plan(top_k_index, num_experts)
    layout = _Layout(
        tokens=tokens, chunk_rows=chunk, chunks=chunks, tile_i=tile_i, i_tiles=i_tiles, gate_up_parts=parts,
        gate_up_transposed=orientation.gate_up_transposed, down_transposed=orientation.down_transposed,
        interleaved=interleaved, has_bias=has_bias, activation=activation,
        alpha=float(alpha), limit=float(limit),
        split_weights=jnp.dtype(top_k_weights.dtype).itemsize > jnp.dtype(dtype).itemsize,
        quantization=quantization,
    )

    # Index maps get (item, I tile, *scalar prefetch). A gate_up part spans `width` columns of 2I:
    # gate and up apart (parts == 2: up starts I / tile_i blocks later), or both in one block.
    width = tile_i if parts == 2 else 2 * tile_i

    def gate_up_spec(block_offset):
        if orientation.gate_up_transposed:  # [E, H, 2I]
            return pl.BlockSpec((None, hidden, width), lambda item, i, expert, *_: (expert[item], 0, block_offset + i))
        return pl.BlockSpec((None, width, hidden), lambda item, i, expert, *_: (expert[item], block_offset + i, 0))

    if orientation.down_transposed:  # [E, I, H]
        down_spec = pl.BlockSpec((None, tile_i, hidden), lambda item, i, expert, *_: (expert[item], i, 0))
    else:  # [E, H, I]
        down_spec = pl.BlockSpec((None, hidden, tile_i), lambda item, i, expert, *_: (expert[item], 0, i))
    def resident(shape):
        return pl.BlockSpec(shape, lambda *_: (0,) * len(shape), pipeline_mode=pl.Buffered(1))

    in_specs = [
        resident((tokens, hidden)),
        resident((tokens, top_k)),
        resident((tokens, top_k)),
        *(gate_up_spec(part * i_tiles) for part in range(parts)),
        down_spec,
    ]
    operands = [hidden_states, top_k_index, top_k_weights, *([gate_up_proj] * parts), down_proj]
    bias_rows = min(num_experts, BIAS_BLOCK_EXPERTS)

    def bias_spec(columns, block_offset):
        return pl.BlockSpec(
            (bias_rows, columns),
            lambda item, i, expert, *_: (expert[item] >> _BIAS_BLOCK_SHIFT, block_offset + i),
        )

    def bias_specs():
        return [*(bias_spec(width, part * i_tiles) for part in range(parts)),
                pl.BlockSpec((bias_rows, hidden), lambda item, i, expert, *_: (expert[item] >> _BIAS_BLOCK_SHIFT, 0))]

    if has_bias:
        in_specs += bias_specs()
        operands += [*([gate_up_bias] * parts), down_bias]
    if quantization == INT8:  # [E, 2I] and [E, H], blocked as the biases
        in_specs += bias_specs()
        operands += [*([gate_up_scales] * parts), down_scales]
    elif quantization == FP8:
        in_specs += [pl.BlockSpec((None, *scales.shape[1:]), lambda item, i, expert, *_: (expert[item], 0, 0))
                     for scales in (gate_up_scales, down_scales)]
        operands += [gate_up_scales, down_scales]

    scratch = [pltpu.VMEM((tokens, hidden), jnp.float32)]
    if interleaved:
        scratch.append(pltpu.VMEM((2 * tile_i, chunk), jnp.float32))
    if i_tiles > 1:
        scratch += [pltpu.VMEM((rows, hidden), dtype), pltpu.VMEM((rows, hidden), jnp.float32)]
    if quantization == FP8:
        gate_up_block = (hidden, width) if orientation.gate_up_transposed else (width, hidden)
        down_block = (tile_i, hidden) if orientation.down_transposed else (hidden, tile_i)
        scratch += [*(pltpu.VMEM(gate_up_block, dtype) for _ in range(parts)), pltpu.VMEM(down_block, dtype)]

    # A call without live picks runs its one empty item over one I tile only: one block of weights read.
    i_grid = i_tiles if i_tiles == 1 else jnp.where(items.rows[0] > 0, i_tiles, 1)
    picks = tokens * top_k
    active = expected_active_groups(picks, num_experts)
    itemsize = jnp.dtype(dtype).itemsize
    scale_bytes = sum(scales[0].size * 4 for scales in (gate_up_scales, down_scales) if scales is not None)
    bytes_per_expert = (3 * intermediate * hidden * jnp.dtype(gate_up_proj.dtype).itemsize
                        + ((2 * intermediate + hidden) * itemsize if has_bias else 0) + scale_bytes)
    call = pl.pallas_call(
        functools.partial(_body, layout=layout),
        out_shape=jax.ShapeDtypeStruct((tokens, hidden), dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(items.count[0], i_grid),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((tokens, hidden), lambda *_: (0, 0)),
            scratch_shapes=scratch,
        ),
        compiler_params=pltpu.CompilerParams(
            # Every step adds into the one resident output: no axis can be split across cores.
            dimension_semantics=("arbitrary", "arbitrary"),
            vmem_limit_bytes=fused_vmem_limit(config, tokens, hidden, intermediate, num_experts, dtype,
                                              interleaved=interleaved, has_bias=has_bias,
                                              weights_dtype=gate_up_proj.dtype),
        ),
        # What is read: the tokens and the routing once, the weights of the experts expected active (which
        # experts are picked is data, unknown when this is traced; `expected_active_groups`), the output once.
        cost_estimate=pl.CostEstimate(
            flops=int(2 * picks * (3 * intermediate * hidden + 2 * tokens * hidden)),
            transcendentals=int(picks * intermediate),
            bytes_accessed=int(2 * tokens * hidden * itemsize + active * bytes_per_expert
                               + top_k_index.size * 4 + top_k_weights.size * top_k_weights.dtype.itemsize),
        ),
        name="fused_experts",
    )
    return call(items.expert, items.rows, items.count, *operands)
