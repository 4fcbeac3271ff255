"""Torch ops of this kernel and the one place their inputs are checked.

Every torch-facing entry checks its inputs here before any kernel runs; the
JAX functions (`gmm/kernel.py`, `layer.py`) assume valid inputs. The checks
that read values back to the host (group sizes) run once per public call;
an experts layer that counts its own group sizes uses `routed_ragged_dot`,
which checks shapes only (see there).
"""

from __future__ import annotations

import functools

import jax
import torch

from . import backward, layer
from ._ops import add_op_namespace_prefix, jax_torch_op
from .common import quant
from .common.gates import GATES
from .gmm.kernel import grouped_matmul
from .problem import ExpertWeights

FLOAT_DTYPES = (torch.float32, torch.bfloat16)
# uint8: int4 codes packed two per byte (`common/quant.py`; `common.quant.pack_int4` packs them).
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.uint8)
_SCHEMES = {torch.int8: quant.INT8, torch.float8_e4m3fn: quant.FP8, torch.uint8: quant.INT4}
_WEIGHT_DTYPES = "float32, bfloat16, int8, float8_e4m3fn or uint8 (packed int4)"


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    """Any of torch's integer dtypes, signed or unsigned (bool is not one)."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


@jax_torch_op(add_op_namespace_prefix("ragged_dot"))
def _ragged_dot(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, rhs_scales: jax.Array | None, transpose_rhs: bool,
    zero_rows_past_groups: bool,
) -> jax.Array:
    if rhs_scales is not None:
        quantized = functools.partial(grouped_matmul, transpose_rhs=transpose_rhs,
                                      zero_rows_past_groups=zero_rows_past_groups)
        return backward.without_gradient("ragged_dot", quantized, lhs, rhs, group_sizes, rhs_scales)
    return backward.differentiable_ragged_dot(lhs, rhs, group_sizes, transpose_rhs, zero_rows_past_groups, None)


@jax_torch_op(add_op_namespace_prefix("gated_experts"))
def _gated_experts(
    hidden_states: jax.Array,
    top_k_index: jax.Array,
    top_k_weights: jax.Array,
    gate_up_proj: jax.Array,
    down_proj: jax.Array,
    gate_up_bias: jax.Array | None,
    down_bias: jax.Array | None,
    gate_up_scales: jax.Array | None,
    down_scales: jax.Array | None,
    activation: str,
    weights_transposed: bool,
    interleaved: bool,
    alpha: float,
    limit: float,
) -> jax.Array:
    return layer.experts_layer(
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, gate_up_scales,
        down_scales, activation=activation, weights_transposed=weights_transposed, interleaved=interleaved,
        alpha=alpha, limit=limit,
    )


def _check_tensors(**tensors) -> None:
    """Each argument is a torch.Tensor, and all of them are on one device."""
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    devices = {tensor.device for tensor in tensors.values()}
    if len(devices) != 1:
        listed = ", ".join(f"{name} on {tensor.device}" for name, tensor in tensors.items())
        raise ValueError(f"{', '.join(tensors)} must be on one device, got {listed}")


def weight_shape(name: str, weight: torch.Tensor, known_dim: int, known_axis: int, what: str) -> tuple[int, ...]:
    """The `[G, D1, D2]` shape `weight` stands for: its own, or packed int4's unpacked, given that its dim
    `known_axis` is `known_dim` (`what` names that dim in the error)."""
    if weight.dtype != torch.uint8:
        return tuple(weight.shape)
    shape = quant.int4_unpacked_shape(tuple(weight.shape), known_dim, known_axis)
    if shape is None:
        raise ValueError(
            f"{name} is uint8, int4 packed two per byte along the dim the kernels read on sublanes "
            f"(int4_packed_axis; pack_int4 packs it), but no packing of its shape {list(weight.shape)} "
            f"has dim {known_axis} = {known_dim} ({what})"
        )
    why = quant.int4_packable(shape)
    if why is not None:
        raise ValueError(f"{name}: a {list(shape)} weight cannot be int4: {why}")
    return shape


def check_scales(name: str, scales: torch.Tensor | None, weight_name: str, weight: torch.Tensor, out_axis: int,
                 shape: tuple[int, ...]) -> None:
    """`scales` of a `[G, D1, D2]` weight (`shape`, unpacked): required for quantized weights (with the shape of
    `common/quant.py`'s layout: int8 and int4 per output channel, dim `out_axis`; fp8 per 128 x 128 block), refused for
    float weights."""
    if weight.dtype not in QUANTIZED_DTYPES:
        if scales is not None:
            raise ValueError(f"{name} are for int8, float8_e4m3fn or uint8 (packed int4) weights; {weight_name} is "
                             f"{weight.dtype}")
        return
    if scales is None:
        raise ValueError(f"{weight_name} is {weight.dtype}: it needs {name}")
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(scales).__name__}")
    if scales.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {scales.dtype}")
    scheme = _SCHEMES[weight.dtype]
    expected = quant.expected_scales_shape(scheme, shape, out_axis)
    if tuple(scales.shape) != expected:
        what = ("one per output channel" if quant.per_channel_scales(scheme)
                else f"one per {quant.FP8_BLOCK}x{quant.FP8_BLOCK} block")
        raise ValueError(
            f"{name} must be {list(expected)} ({what} of {weight_name} {list(shape)}, {scheme}), got "
            f"{list(scales.shape)}"
        )


def check_ragged_dot_shapes(
    lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, transpose_rhs: bool,
    rhs_scales: torch.Tensor | None = None,
) -> None:
    """Types, ranks, dtypes and sizes of ragged_dot's arguments: all that needs no value read back."""
    _check_tensors(lhs=lhs, rhs=rhs, group_sizes=group_sizes)
    if lhs.dim() != 2:
        raise ValueError(f"lhs must be 2-D [M, K], got shape {tuple(lhs.shape)}")
    if rhs.dim() != 3:
        layout = "[G, N, K]" if transpose_rhs else "[G, K, N]"
        raise ValueError(f"rhs must be 3-D {layout}, got shape {tuple(rhs.shape)}")
    if group_sizes.dim() != 1:
        raise ValueError(f"group_sizes must be 1-D [G], got shape {tuple(group_sizes.shape)}")
    if lhs.dtype not in FLOAT_DTYPES:
        raise TypeError(f"lhs must be float32 or bfloat16, got {lhs.dtype}")
    if rhs.dtype not in FLOAT_DTYPES + QUANTIZED_DTYPES:
        raise TypeError(f"rhs must be {_WEIGHT_DTYPES}, got {rhs.dtype}")
    if rhs.dtype in FLOAT_DTYPES and rhs.dtype != lhs.dtype:
        raise TypeError(f"rhs dtype {rhs.dtype} must match lhs dtype {lhs.dtype}")
    if not _is_integer_dtype(group_sizes.dtype):
        raise TypeError(f"group_sizes must have an integer dtype (int32, int64, ...), got {group_sizes.dtype}")
    k_axis = 2 if transpose_rhs else 1
    shape = weight_shape("rhs", rhs, lhs.shape[1], k_axis, "K, lhs.shape[1]")
    rhs_k = shape[k_axis]
    if lhs.shape[1] != rhs_k:
        axis = "rhs.shape[2]" if transpose_rhs else "rhs.shape[1]"
        raise ValueError(f"K mismatch: lhs.shape[1]={lhs.shape[1]} but {axis}={rhs_k} (transpose_rhs={transpose_rhs})")
    if group_sizes.shape[0] != rhs.shape[0]:
        raise ValueError(f"group_sizes has {group_sizes.shape[0]} groups but rhs has {rhs.shape[0]}")
    check_scales("rhs_scales", rhs_scales, "rhs", rhs, 1 if transpose_rhs else 2, shape)
    if rhs_scales is not None and rhs_scales.device != rhs.device:
        raise ValueError(f"rhs_scales must be on rhs's device {rhs.device}, got {rhs_scales.device}")


def check_group_sizes(group_sizes: torch.Tensor, rows: int) -> None:
    """group_sizes non-negative and summing to at most `rows`.

    Reads the sizes back to the host; a compiled graph skips the check rather
    than break on a data-dependent branch.
    """
    if torch.compiler.is_compiling():
        return
    # int64 holds every size a row count can be, and torch compares int64 where it cannot compare uint16-64.
    group_sizes = group_sizes.to(torch.int64)
    if bool((group_sizes < 0).any()):
        raise ValueError(f"group_sizes must be non-negative, got {group_sizes.tolist()}")
    total = int(group_sizes.sum())
    if total > rows:
        raise ValueError(f"group_sizes sum to {total}, past the {rows} rows of lhs")


def ragged_dot(
    lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, *, rhs_scales: torch.Tensor | None = None,
    transpose_rhs: bool = False,
) -> torch.Tensor:
    """Grouped matmul: rows of `lhs[M, K]`, sorted by group, times their group's `rhs`.

    `rhs` is `[G, K, N]`, or `[G, N, K]` with `transpose_rhs=True` (transformers'
    own expert weight layout, used without a transposed copy). `group_sizes[G]`
    has any integer dtype (int64 from `torch.bincount` as well as int32), is
    non-negative and sums to at most M; rows past the sum come out as zeros.
    Accumulates in float32; returns `[M, N]` in the input dtype. An empty
    dimension (M, K, N or G zero) gives zeros without running a kernel.
    Quantized `rhs` (int8 or float8_e4m3fn, read as one byte per weight, or
    int4 packed two per byte in uint8 by `common.quant.pack_int4`; dequantized in
    VMEM) needs float32 `rhs_scales`: `[G, N]` per output channel for int8
    and int4, `[G, ceil(D1/128), ceil(D2/128)]` per 128 x 128 block of rhs's
    own dims for fp8 (transformers' `weight_scale_inv`).
    """
    check_ragged_dot_shapes(lhs, rhs, group_sizes, transpose_rhs, rhs_scales)
    check_group_sizes(group_sizes, lhs.shape[0])
    return _ragged_dot(lhs, rhs, group_sizes.to(torch.int32), rhs_scales, transpose_rhs, True)


def routed_ragged_dot(
    lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, transpose_rhs: bool
) -> torch.Tensor:
    """ragged_dot inside an experts layer whose `group_sizes` count the layer's own routing.

    Counts of routed picks are non-negative and sum to at most the picks (the
    rows) by construction, so only the shapes are checked: reading the sizes
    back for `check_group_sizes` would stall the device at every call.
    Rows past the groups (expert-parallel sentinel picks) are left unwritten,
    so they cost the kernel nothing: the caller masks them.
    """
    check_ragged_dot_shapes(lhs, rhs, group_sizes, transpose_rhs)
    return _ragged_dot(lhs, rhs, group_sizes.to(torch.int32), None, transpose_rhs, False)


def check_routing(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
    """The token-side arguments of an experts layer: `[T, H]`, `[T, K]` integer ids, `[T, K]` float weights.

    Expert ids are not read back (that would stall the device once per layer):
    the router produces them in `[0, num_experts]`.
    """
    _check_tensors(hidden_states=hidden_states, top_k_index=top_k_index, top_k_weights=top_k_weights)
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be 2-D [T, H], got shape {tuple(hidden_states.shape)}")
    tokens = hidden_states.shape[0]
    if top_k_index.dim() != 2 or top_k_index.shape[0] != tokens:
        raise ValueError(f"top_k_index must be [T, K] with T={tokens}, got shape {tuple(top_k_index.shape)}")
    if not _is_integer_dtype(top_k_index.dtype):
        raise TypeError(f"top_k_index must have an integer dtype (int64 from torch.topk, int32, ...), got {top_k_index.dtype}")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"top_k_weights must have top_k_index's shape {tuple(top_k_index.shape)}, got {tuple(top_k_weights.shape)}"
        )
    if not top_k_weights.dtype.is_floating_point:
        raise TypeError(f"top_k_weights must be floating point, got {top_k_weights.dtype}")


def check_gated_experts_args(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                             weights: ExpertWeights, *, activation: str, weights_transposed: bool) -> None:
    """The experts op's arguments, in transformers' weight layouts (see `problem.ExpertWeights`)."""
    gate_up_proj, down_proj, gate_up_bias, down_bias, gate_up_scales, down_scales = weights
    check_routing(hidden_states, top_k_index, top_k_weights)
    if activation not in GATES:
        raise ValueError(f"activation must be one of {GATES}, got {activation!r}")
    if (gate_up_bias is None) != (down_bias is None):
        raise ValueError("pass both gate_up_bias and down_bias, or neither")
    weights = dict(gate_up_proj=gate_up_proj, down_proj=down_proj)
    if gate_up_bias is not None:
        weights.update(gate_up_bias=gate_up_bias, down_bias=down_bias)
    _check_tensors(hidden_states=hidden_states, **weights)
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(
            f"gate_up_proj and down_proj must be 3-D [E, out, in] (or [E, in, out] when transposed), got "
            f"{tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}"
        )
    if gate_up_proj.dtype not in FLOAT_DTYPES + QUANTIZED_DTYPES or down_proj.dtype != gate_up_proj.dtype:
        raise TypeError(
            f"gate_up_proj and down_proj must share one dtype, {_WEIGHT_DTYPES}, got {gate_up_proj.dtype} and "
            f"{down_proj.dtype}"
        )
    if gate_up_proj.dtype in QUANTIZED_DTYPES:
        if hidden_states.dtype not in FLOAT_DTYPES:
            raise TypeError(f"hidden_states must be float32 or bfloat16, got {hidden_states.dtype}")
    elif hidden_states.dtype != gate_up_proj.dtype:
        raise TypeError(f"hidden_states dtype {hidden_states.dtype} must match the weights' dtype {gate_up_proj.dtype}")
    hidden = hidden_states.shape[1]
    in_axis, out_axis = (1, 2) if weights_transposed else (2, 1)
    gate_up_shape = weight_shape("gate_up_proj", gate_up_proj, hidden, in_axis, "H, hidden_states.shape[1]")
    down_shape = weight_shape("down_proj", down_proj, hidden, out_axis, "H, hidden_states.shape[1]")
    if weights_transposed:
        (experts, gate_up_in, gate_up_out), (down_experts, down_in, down_out) = gate_up_shape, down_shape
        layout = "gate_up_proj [E, H, 2I] and down_proj [E, I, H] (weights_transposed=True)"
    else:
        (experts, gate_up_out, gate_up_in), (down_experts, down_out, down_in) = gate_up_shape, down_shape
        layout = "gate_up_proj [E, 2I, H] and down_proj [E, H, I] (weights_transposed=False)"
    if (down_experts, gate_up_in, down_out, gate_up_out) != (experts, hidden, hidden, 2 * down_in):
        raise ValueError(
            f"expected {layout} with H={hidden} (hidden_states), got gate_up_proj {tuple(gate_up_proj.shape)} and "
            f"down_proj {tuple(down_proj.shape)}"
        )
    if gate_up_bias is not None and (
        tuple(gate_up_bias.shape) != (experts, gate_up_out) or tuple(down_bias.shape) != (experts, hidden)
    ):
        raise ValueError(
            f"gate_up_bias must be [{experts}, {gate_up_out}] and down_bias [{experts}, {hidden}], got "
            f"{tuple(gate_up_bias.shape)} and {tuple(down_bias.shape)}"
        )
    check_scales("gate_up_scales", gate_up_scales, "gate_up_proj", gate_up_proj, out_axis, gate_up_shape)
    check_scales("down_scales", down_scales, "down_proj", down_proj, out_axis, down_shape)
    scales = {name: t for name, t in (("gate_up_scales", gate_up_scales), ("down_scales", down_scales)) if t is not None}
    _check_tensors(hidden_states=hidden_states, **scales)


def gated_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    *,
    activation: str,
    weights_transposed: bool,
    interleaved: bool = False,
    alpha: float = 1.0,
    limit: float = float("inf"),
    gate_up_scales: torch.Tensor | None = None,
    down_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts layer as one op (see `layer.experts_layer`); biases come as a pair or not at all.

    int8, float8_e4m3fn or packed int4 (uint8) weights need their float32
    scales (layouts as for `ragged_dot`'s `rhs_scales`, over each weight's own
    dims, unpacked); the output is in hidden_states' dtype.

    Differentiable with float weights (`layer.experts_layer` says how); one-byte
    weights serve inference only.
    """
    weights = ExpertWeights(gate_up_proj, down_proj, gate_up_bias, down_bias, gate_up_scales, down_scales)
    check_gated_experts_args(hidden_states, top_k_index, top_k_weights, weights, activation=activation,
                             weights_transposed=weights_transposed)
    return _gated_experts(hidden_states, top_k_index.to(torch.int32), top_k_weights, *weights, activation,
                          weights_transposed, interleaved, float(alpha), float(limit))
