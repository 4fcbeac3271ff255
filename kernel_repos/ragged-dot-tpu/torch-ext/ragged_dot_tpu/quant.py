"""Quantized expert weights: read from HBM as one byte per weight, dequantized in VMEM.

Two schemes, named by the weights' dtype; the scales are float32 multipliers
(weight = q x scale, transformers' `weight_scale_inv` convention):

- int8, symmetric, one scale per output channel: `scales[G, N]`. An output
  channel's scale is common to its whole dot product, so the kernels multiply
  it into the matmul's result columns: the weights reach the MXU as their
  integer values (exact in bf16 and f32) and the scale costs one multiply per
  output element, not one per weight.
- float8_e4m3fn in 128 x 128 blocks: transformers' fine-grained FP8 layout,
  over the weight's own two dims as stored: `scales[G, ceil(D1/128),
  ceil(D2/128)]`, weight[g, i, j] = q[g, i, j] x scales[g, i // 128, j // 128]
  (a dim that is not a multiple of 128 ends in a partial block). A block scale
  varies along the contraction, so the kernels dequantize the weights block in
  VMEM, `(q.f32 x scale).astype(activation dtype)`, exactly as transformers'
  `Fp8Dequantize` does when it loads an FP8 checkpoint off GPU, and run the
  unquantized matmul on it.

Neither scheme feeds int8 or fp8 operands to the MXU: that would need the
activations quantized too (a different result), and decode is bound by the
weights' HBM traffic, which one byte per weight already halves (see CARD.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

FP8_BLOCK = 128
# `>>` rather than `//`: Mosaic lowers integer floor division through `sign`, which needs a TPU to look up.
_FP8_BLOCK_SHIFT = FP8_BLOCK.bit_length() - 1
assert 1 << _FP8_BLOCK_SHIFT == FP8_BLOCK

INT8 = "int8"
FP8 = "fp8"
SCHEMES = {jnp.dtype(jnp.int8): INT8, jnp.dtype(jnp.float8_e4m3fn): FP8}


def scheme_of(dtype) -> str | None:
    """"int8", "fp8", or None for unquantized (float) weights."""
    return SCHEMES.get(jnp.dtype(dtype))


def blocks(size: int) -> int:
    """FP8 scale blocks along a dim of `size` weights (the last one partial)."""
    return -(-size // FP8_BLOCK)


def expected_scales_shape(scheme: str, weight_shape: tuple[int, ...], out_axis: int) -> tuple[int, ...]:
    """The scales of `weight[G, D1, D2]` whose output channels run along `out_axis` (1 or 2)."""
    if scheme == INT8:
        return (weight_shape[0], weight_shape[out_axis])
    return (weight_shape[0], blocks(weight_shape[1]), blocks(weight_shape[2]))


def swapped_minor_dims(weights: jax.Array, scales: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
    """`weights[G, D1, D2]` as `[G, D2, D1]`, with its scales: an fp8 block grid swaps with it, int8's
    per-output-channel scales do not depend on the order (`weights_layout.weights_orientation` says when)."""
    if scales is not None and scales.ndim == 3:
        scales = jnp.swapaxes(scales, 1, 2)
    return jnp.swapaxes(weights, 1, 2), scales


def _dot(lhs, rhs):
    return lax.dot_general(lhs, rhs, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                           precision=lax.Precision.HIGHEST)


def dequantize_fp8_block(q_ref, scales: jax.Array, row_offset, col_offset, out_ref) -> None:
    """Writes a window of one expert's fp8 weights, dequantized as transformers does (`(q.f32 * s).astype`),
    to `out_ref` (same shape, the activation dtype).

    The window is `q_ref` (`[rows, cols]`) at element offsets (row_offset,
    col_offset) of the expert's weight; `scales` is the expert's whole
    `[ceil(D1/128), ceil(D2/128)]` grid (`row_offset` a multiple of the
    sublane tile). Each scale is spread over its 128 columns by a one-hot
    matmul with a handful of rows (one nonzero term per sum: exact), then
    multiplied into 128 rows at a time on the vector unit: a window's 128-row
    slab spans at most two blocks, picked per row with one select. The MXU
    does ~(rows / 128 + grid rows) x cols multiply-adds for it, against the
    weights' rows x cols on the vector unit.
    """
    rows, cols = q_ref.shape
    row_blocks, col_blocks = scales.shape
    slabs = -(-rows // FP8_BLOCK)
    # Each grid row's scales spread over the window's columns: [row_blocks, cols].
    col_block = (col_offset + lax.broadcasted_iota(jnp.int32, (col_blocks, cols), 1)) >> _FP8_BLOCK_SHIFT
    col_pick = (col_block == lax.broadcasted_iota(jnp.int32, (col_blocks, cols), 0)).astype(jnp.float32)
    spread = _dot(scales.astype(jnp.float32), col_pick)
    # The grid rows the window's slabs start in, and the next ones: [slabs + 1, cols] (past the grid: 0).
    first = row_offset >> _FP8_BLOCK_SHIFT
    slab_block = first + lax.broadcasted_iota(jnp.int32, (slabs + 1, row_blocks), 0)
    slab_pick = (slab_block == lax.broadcasted_iota(jnp.int32, (slabs + 1, row_blocks), 1)).astype(jnp.float32)
    slab_scales = _dot(slab_pick, spread)
    for slab in range(slabs):
        start, stop = slab * FP8_BLOCK, min(rows, (slab + 1) * FP8_BLOCK)
        row_block = (row_offset + start + lax.broadcasted_iota(jnp.int32, (stop - start, 1), 0)) >> _FP8_BLOCK_SHIFT
        scale = jnp.where(row_block == first + slab, slab_scales[slab : slab + 1], slab_scales[slab + 1 : slab + 2])
        out_ref[start:stop, :] = (q_ref[start:stop, :].astype(jnp.float32) * scale).astype(out_ref.dtype)
