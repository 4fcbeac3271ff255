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


def _dot(lhs, rhs):
    return lax.dot_general(lhs, rhs, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                           precision=lax.Precision.HIGHEST)


def expand_block_scales(scales: jax.Array, rows: int, cols: int, row_offset, col_offset) -> jax.Array:
    """`[rows, cols]` f32: each weight's block scale, for the window at (row_offset, col_offset) of one expert.

    `scales` is the expert's whole `[ceil(D1/128), ceil(D2/128)]` grid. Two
    one-hot matmuls pick every weight's block (one nonzero term per sum:
    exact); rows or columns past the grid get 0.
    """
    row_blocks, col_blocks = scales.shape
    row_pick = (row_offset + lax.broadcasted_iota(jnp.int32, (rows, row_blocks), 0)) >> _FP8_BLOCK_SHIFT
    row_pick = (row_pick == lax.broadcasted_iota(jnp.int32, (rows, row_blocks), 1)).astype(jnp.float32)
    col_pick = (col_offset + lax.broadcasted_iota(jnp.int32, (col_blocks, cols), 1)) >> _FP8_BLOCK_SHIFT
    col_pick = (col_pick == lax.broadcasted_iota(jnp.int32, (col_blocks, cols), 0)).astype(jnp.float32)
    return _dot(_dot(row_pick, scales.astype(jnp.float32)), col_pick)


def dequantize_fp8_block(q: jax.Array, scales: jax.Array, row_offset, col_offset, dtype) -> jax.Array:
    """A window of one expert's fp8 weights, dequantized as transformers does: `(q.f32 * scale).astype(dtype)`."""
    rows, cols = q.shape
    return (q.astype(jnp.float32) * expand_block_scales(scales, rows, cols, row_offset, col_offset)).astype(dtype)

