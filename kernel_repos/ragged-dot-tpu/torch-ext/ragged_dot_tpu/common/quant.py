"""Quantized expert weights: read from HBM as one byte (or half a byte) per weight, dequantized in VMEM.

Three schemes, named by the weights' dtype; the scales are float32 multipliers
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
- int4 (stored as uint8, two weights per byte), symmetric, one scale per
  output channel as int8: `scales[G, N]`. The weights are packed along the
  dimension the kernels read on sublanes (`int4_packed_axis`: D1 of the
  stored `[G, D1, D2]`, or D2 where XLA keeps that array's last two
  dimensions swapped), in blocks of INT4_PACK_ROWS: byte r of a block's
  INT4_PACK_ROWS / 2 holds row r in its low nibble and row r +
  INT4_PACK_ROWS / 2 in its high one, two's complement (-8..7). A block
  unpacks into two whole 32-row slabs of the native int8 tile, with shifts
  on the vector unit and no relayout (`unpack_int4_block`); the kernels
  unpack each weights block once per grid step into VMEM scratch, in the
  activation dtype (exact: small integers), and multiply the scales into
  the matmul's result columns as for int8. On the torch side `pack_int4`
  packs a weight's integer codes in this layout and `unpack_int4` unpacks
  them.

int8 and int4 do not feed int8 or int4 operands to the MXU: that would need
the activations quantized too (a different result), and decode is bound by
the weights' HBM traffic, which one byte per weight already halves (see
CARD.md). fp8 does where the MXU multiplies fp8 natively (TPU7x,
FP8_MXU_GENERATIONS): `fp8_matmul` quantizes the activations per row and
128-column block of the contraction (the weights' K blocks), to float8_e4m3fn
with the scale amax / 448, and runs one fp8 x fp8 matmul per K block with f32
results, which both scales then multiply; nothing is dequantized to the
activation dtype. The fused kernel takes that path on those generations
(`fused.plan.FusedPlan.fp8_matmul`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax
from jax.experimental import pallas as pl

from .._hardware import TpuGeneration, default_layout_swaps_minor_dims, resolve_target, sublane_multiple

FP8_BLOCK = 128
# `>>` rather than `//`: Mosaic lowers integer floor division through `sign`, which needs a TPU to look up.
_FP8_BLOCK_SHIFT = FP8_BLOCK.bit_length() - 1
assert 1 << _FP8_BLOCK_SHIFT == FP8_BLOCK

INT8 = "int8"
FP8 = "fp8"
INT4 = "int4"
SCHEMES = {jnp.dtype(jnp.int8): INT8, jnp.dtype(jnp.float8_e4m3fn): FP8, jnp.dtype(jnp.uint8): INT4}
# Rows of one packed int4 block: two slabs of the uint8 native tile (32 sublanes), one per nibble.
INT4_PACK_ROWS = 64
_INT4_SLAB = INT4_PACK_ROWS // 2
# The integer codes one int4 weight holds (two's complement nibbles).
INT4_MIN, INT4_MAX = -8, 7


# Mosaic lowers an fp8 x fp8 dot to the MXU's own fp8 matmul on TPU7x (its LLO: `vmatmul...f8e4m3fn`); on v5e,
# v5p and v6e to bf16-rate matmuls of converted operands (`vmatmul...f8e4m3b11.bf16`), where fp8 activations
# would only cost accuracy.
FP8_MXU_GENERATIONS = frozenset({"tpu7x"})


def scheme_of(dtype) -> str | None:
    """"int8", "fp8", "int4" (packed in uint8), or None for unquantized (float) weights."""
    return SCHEMES.get(jnp.dtype(dtype))


# Generations whose chip a scheme is not served on, with what to use there instead.
NOT_SERVED = {(INT4, "tpu7x"): "TPU7x has no int4 MXU path and its fp8 MXU serves 8-bit weights: use fp8 weights "
                               "(kernelize(..., quantize_experts=\"fp8\"))"}


def check_scheme_served(scheme: str | None, generation: str | TpuGeneration | None = None) -> None:
    """Raises ValueError if `scheme` ("int8", "fp8", "int4") is not served on `generation` (a name or a target;
    default: this device's; NOT_SERVED says why)."""
    name = resolve_target(generation).name
    reason = NOT_SERVED.get((scheme, name))
    if reason is not None:
        raise ValueError(f"{scheme} expert weights are not served on {name}: {reason}")


def check_served(dtype, target: TpuGeneration) -> None:
    """`check_scheme_served` for weights of `dtype` on `target`."""
    check_scheme_served(scheme_of(dtype), target)


def per_channel_scales(scheme: str | None) -> bool:
    """Whether the scales are one per output channel, multiplied into the matmul's result (int8, int4)."""
    return scheme in (INT8, INT4)


def dequantized_in_vmem(scheme: str | None) -> bool:
    """Whether the kernels dequantize each weights block once per grid step into VMEM scratch (fp8, int4)."""
    return scheme in (FP8, INT4)


def stored_rows(rows: int, scheme: str | None) -> int:
    """Rows of a weights block as stored (HBM, and its VMEM buffer): half as many for packed int4."""
    return rows // 2 if scheme == INT4 else rows


def weight_row_multiple(dtype) -> int:
    """What a weights block's rows (as the kernels read them: sublanes) must be a multiple of when it is cut:
    the dtype's native sublane tile, or a whole packed int4 block."""
    return INT4_PACK_ROWS if scheme_of(dtype) == INT4 else sublane_multiple(dtype)


def int4_packed_axis(shape: tuple[int, ...]) -> int:
    """The axis of a `[G, D1, D2]` weight (unpacked shape) that int4 packs: the one the kernels read on sublanes,
    D1 unless XLA stores that array's last two dimensions swapped (`default_layout_swaps_minor_dims`, on the
    packed shape, which for our models' dims decides as on the unpacked one)."""
    return 2 if default_layout_swaps_minor_dims(shape[1:]) else 1


def int4_packable(shape: tuple[int, ...]) -> str | None:
    """None if int4 can pack a `[G, D1, D2]` weight; else why not."""
    axis = int4_packed_axis(shape)
    if shape[axis] % INT4_PACK_ROWS:
        return (f"int4 packs blocks of {INT4_PACK_ROWS} rows along dim {axis} (the dim the kernels read on "
                f"sublanes), and {shape[axis]} is not a multiple of {INT4_PACK_ROWS}")
    packed = list(shape)
    packed[axis] //= 2
    if int4_packed_axis(tuple(packed)) != axis:
        return f"XLA would store the packed weight {tuple(packed)} in another order than the kernels read it"
    return None


def int4_unpacked_shape(packed_shape: tuple[int, ...], known_dim: int, known_axis: int) -> tuple[int, ...] | None:
    """The unpacked shape of a packed int4 `[G, a, b]` weight whose dim `known_axis` (1 or 2) is `known_dim`
    unpacked, if one packing (`int4_packed_axis`) explains it; else None."""
    for axis in (1, 2):
        shape = list(packed_shape)
        shape[axis] *= 2
        if shape[known_axis] == known_dim and int4_packed_axis(tuple(shape)) == axis:
            return tuple(shape)
    return None



# int4 on the torch side: `pack_int4` is what a checkpoint converter (or `kernelize(...,
# quantize_experts="int4")`) calls on a weight's integer codes; the kernels read its output as they stream weights.
def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Integer codes in [-8, 7] of a `[G, D1, D2]` weight (any integer dtype) -> its packed uint8 form: half as
    long along `int4_packed_axis`, whose length must be a multiple of `INT4_PACK_ROWS`."""
    if codes.dim() != 3 or codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise ValueError(f"int4 codes must be an integer [G, D1, D2] tensor, got {codes.dtype} {list(codes.shape)}")
    why = int4_packable(tuple(codes.shape))
    if why is not None:
        raise ValueError(f"cannot pack a {list(codes.shape)} weight as int4: {why}")
    if codes.numel() and (codes.min() < INT4_MIN or codes.max() > INT4_MAX):
        raise ValueError(f"int4 codes must lie in [{INT4_MIN}, {INT4_MAX}]")
    axis = int4_packed_axis(tuple(codes.shape))
    # [.., blocks, 2 (low / high nibble), INT4_PACK_ROWS / 2, ..] along the packed axis.
    shape = list(codes.shape)
    blocked = codes.to(torch.int32).unflatten(axis, (shape[axis] // INT4_PACK_ROWS, 2, INT4_PACK_ROWS // 2))
    low, high = blocked.unbind(axis + 1)
    packed = (low & 0xF) | ((high & 0xF) << 4)
    return packed.flatten(axis, axis + 1).to(torch.uint8)


def unpack_int4(packed: torch.Tensor, known_dim: int, known_axis: int) -> torch.Tensor:
    """The int8 codes of a packed `[G, a, b]` uint8 weight whose dim `known_axis` (1 or 2) is `known_dim` unpacked
    (`int4_unpacked_shape`)."""
    shape = int4_unpacked_shape(tuple(packed.shape), known_dim, known_axis)
    if shape is None:
        raise ValueError(f"a packed int4 weight of shape {list(packed.shape)} cannot have dim {known_axis} = "
                         f"{known_dim} unpacked")
    axis = 1 if shape[1] != packed.shape[1] else 2
    blocked = packed.to(torch.int32).unflatten(axis, (packed.shape[axis] // (INT4_PACK_ROWS // 2),
                                                      INT4_PACK_ROWS // 2))
    low = ((blocked & 0xF) ^ 8) - 8
    high = ((blocked >> 4) ^ 8) - 8
    return torch.stack([low, high], axis + 1).flatten(axis, axis + 2).to(torch.int8)

def unpack_int4_block(q_ref, out_ref) -> None:
    """Writes a packed int4 window (`q_ref`, `[rows / 2, cols]` uint8, whole INT4_PACK_ROWS blocks) to `out_ref`
    (`[rows, cols]`, the activation dtype) as the integers it holds. Per block: the bytes as int32, each nibble
    sign-extended by two shifts, each written as a 32-row slab (aligned: no relayout)."""
    def block(index, carry):
        packed = q_ref[pl.ds(pl.multiple_of(index * _INT4_SLAB, _INT4_SLAB), _INT4_SLAB), :].astype(jnp.int32)
        low = lax.shift_right_arithmetic(lax.shift_left(packed, 28), 28)
        high = lax.shift_right_arithmetic(lax.shift_left(packed, 24), 28)
        first = pl.multiple_of(index * INT4_PACK_ROWS, INT4_PACK_ROWS)
        out_ref[pl.ds(first, _INT4_SLAB), :] = low.astype(out_ref.dtype)
        out_ref[pl.ds(first + _INT4_SLAB, _INT4_SLAB), :] = high.astype(out_ref.dtype)
        return carry

    lax.fori_loop(0, q_ref.shape[0] // _INT4_SLAB, block, 0)


def blocks(size: int) -> int:
    """FP8 scale blocks along a dim of `size` weights (the last one partial)."""
    return -(-size // FP8_BLOCK)


def expected_scales_shape(scheme: str, weight_shape: tuple[int, ...], out_axis: int) -> tuple[int, ...]:
    """The scales of `weight[G, D1, D2]` (unpacked shape) whose output channels run along `out_axis` (1 or 2)."""
    if per_channel_scales(scheme):
        return (weight_shape[0], weight_shape[out_axis])
    return (weight_shape[0], blocks(weight_shape[1]), blocks(weight_shape[2]))


def swapped_minor_dims(weights: jax.Array, scales: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
    """`weights[G, D1, D2]` as `[G, D2, D1]`, with its scales: an fp8 block grid swaps with it, int8's
    per-output-channel scales do not depend on the order (`common.weights_layout.weights_orientation` says when)."""
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


def quantize_fp8_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`x` (`[m, k]` f32) as float8_e4m3fn codes and one f32 scale per row (`[m, 1]`, x ~ codes x scale).

    The scale is a power of two: the smallest that keeps the row's amax
    within 448 (e4m3's largest), which puts it in (224, 448]. Scaling by it is
    exact, so the codes are x's own rounding to e4m3 on every backend (a
    scale of amax / 448 takes a division, which backends round differently:
    XLA's CPU one moves ties to other codes), and it loses nothing an amax
    scale would keep: e4m3's relative precision is the same in every binade
    above its subnormals. Taken from amax's float32 bits; an all-zero row
    gets the smallest normal scale (its codes are zeros).
    """
    amax = jnp.max(jnp.abs(x), axis=1, keepdims=True)
    bits = lax.bitcast_convert_type(amax, jnp.int32)
    # amax = 1.f x 2^(biased - 127): within 448 at 2^(biased - 135) while 1.f <= 1.75, else at 2^(biased - 134).
    biased, fraction = bits >> _F32_MANTISSA_BITS, bits & _F32_MANTISSA_MASK
    scale_biased = jnp.clip(biased - jnp.where(fraction <= _F32_FRACTION_1_75, 8, 7), 1, 253)
    scale = lax.bitcast_convert_type(scale_biased << _F32_MANTISSA_BITS, jnp.float32)
    inverse = lax.bitcast_convert_type((254 - scale_biased) << _F32_MANTISSA_BITS, jnp.float32)
    return (x * inverse).astype(jnp.float8_e4m3fn), scale


_F32_MANTISSA_BITS = 23
_F32_MANTISSA_MASK = (1 << _F32_MANTISSA_BITS) - 1
_F32_FRACTION_1_75 = 3 << (_F32_MANTISSA_BITS - 2)  # the fraction bits of 1.75


def fp8_window_scales(scales: jax.Array, window_shape: tuple[int, int], *, rhs_contract: int, k_offset,
                      out_offset) -> jax.Array:
    """The weight scale of each 128-wide K block of a window of one expert's fp8 weights, per output column:
    `[ceil(K / 128), out]` f32, what `fp8_matmul` multiplies its blocks' products by.

    The window (`window_shape`: `[out, K]` if `rhs_contract` is 1, else `[K,
    out]`) sits at element offsets `k_offset` (a multiple of FP8_BLOCK) and
    `out_offset` of the expert's weight; `scales` is the expert's whole block
    grid in the window's orientation. A one-hot matmul picks the grid's rows
    of the window's K blocks (one nonzero term per sum: exact); one select
    per output block of the grid spreads them over the columns (on the
    vector unit: matmuls spreading them cost more MXU passes than the fp8
    matmuls themselves).
    """
    k, out = (window_shape[1], window_shape[0]) if rhs_contract == 1 else window_shape
    grid = scales.astype(jnp.float32)
    grid_out_blocks, grid_k_blocks = grid.shape if rhs_contract == 1 else grid.shape[::-1]
    window_blocks = blocks(k)
    k_block = (k_offset >> _FP8_BLOCK_SHIFT) + lax.broadcasted_iota(jnp.int32, (window_blocks, grid_k_blocks), 0)
    k_pick = (k_block == lax.broadcasted_iota(jnp.int32, (window_blocks, grid_k_blocks), 1)).astype(jnp.float32)
    # [window K blocks, grid out blocks]
    by_block = lax.dot_general(k_pick, grid, (((1,), (1 if rhs_contract == 1 else 0,)), ((), ())),
                               preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
    out_block = (out_offset + lax.broadcasted_iota(jnp.int32, (window_blocks, out), 1)) >> _FP8_BLOCK_SHIFT
    spread = jnp.zeros((window_blocks, out), jnp.float32)
    for block in range(grid_out_blocks):
        spread = jnp.where(out_block == block, by_block[:, block : block + 1], spread)
    return spread


def fp8_matmul(x: jax.Array, w_ref, window_scales: jax.Array, *, rhs_contract: int) -> jax.Array:
    """`x` (`[m, K]`) times a window of one expert's fp8 weights (`w_ref`, a ref or an array, `[out, K]` if
    `rhs_contract` is 1, else `[K, out]`) on the fp8 MXU, as `[m, out]` f32.

    Per 128-wide K block b: x's columns are quantized per row
    (`quantize_fp8_rows`), multiplied with the weights' rows of the block in
    fp8 with f32 results, and scaled by the rows' scales and by row b of
    `window_scales` (`fp8_window_scales`).
    """
    k = x.shape[1]
    return fp8_matmul_of_blocks((x[:, b * FP8_BLOCK : min(k, (b + 1) * FP8_BLOCK)] for b in range(blocks(k))),
                                w_ref, window_scales, rhs_contract=rhs_contract)


def fp8_matmul_of_blocks(x_blocks, w_ref, window_scales: jax.Array, *, rhs_contract: int,
                         k_bounds: tuple | None = None) -> jax.Array:
    """`fp8_matmul` of the `x` whose 128-wide K blocks `x_blocks` yields in order (the last may be narrower): for a
    caller that computes x one block at a time and never holds it whole.

    `k_bounds`, (valid, fewest valid): a window past the weight's end (a
    partial last tile) has only `valid` (traced) K rows of real weights and
    garbage after them, possibly NaN; it has at least `fewest valid`
    (static). Blocks that may reach past it multiply in bf16 with the rows
    past `valid` zeroed: fp8 values are exact in bf16 and their products in
    f32, so the result is the fp8 MXU's.
    """
    result = None
    for block, x_block in enumerate(x_blocks):
        start = block * FP8_BLOCK
        stop = start + x_block.shape[1]
        codes, row_scales = quantize_fp8_rows(x_block.astype(jnp.float32))
        weights = w_ref[:, start:stop] if rhs_contract == 1 else w_ref[start:stop, :]
        if k_bounds is not None and stop > k_bounds[1]:
            k = start + lax.broadcasted_iota(jnp.int32, weights.shape, rhs_contract)
            weights = jnp.where(k < k_bounds[0], weights.astype(jnp.float32), 0.0).astype(jnp.bfloat16)
            codes = codes.astype(jnp.float32).astype(jnp.bfloat16)
        product = lax.dot_general(codes, weights, (((1,), (rhs_contract,)), ((), ())),
                                  preferred_element_type=jnp.float32)
        term = product * row_scales * window_scales[block : block + 1]
        result = term if result is None else result + term
    return result
