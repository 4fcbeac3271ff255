"""Torch ops of this kernel and their input checks."""

from __future__ import annotations

import jax
import torch

from . import kernel, moe
from ._ops import add_op_namespace_prefix, jax_torch_op

FLOAT_DTYPES = (torch.float32, torch.bfloat16)


@jax_torch_op(add_op_namespace_prefix("ragged_dot"))
def _ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, transpose_rhs: bool) -> jax.Array:
    return kernel.ragged_dot(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)


@jax_torch_op(add_op_namespace_prefix("gated_experts"))
def _gated_experts(
    hidden_states: jax.Array,
    top_k_index: jax.Array,
    top_k_weights: jax.Array,
    gate_up_proj: jax.Array,
    down_proj: jax.Array,
    activation: str,
    weights_transposed: bool,
    interleaved: bool,
    alpha: float,
    limit: float,
) -> jax.Array:
    return moe.gated_experts(
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
        activation=activation, weights_transposed=weights_transposed, interleaved=interleaved, alpha=alpha, limit=limit,
    )


@jax_torch_op(add_op_namespace_prefix("gated_experts_with_bias"))
def _gated_experts_with_bias(
    hidden_states: jax.Array,
    top_k_index: jax.Array,
    top_k_weights: jax.Array,
    gate_up_proj: jax.Array,
    down_proj: jax.Array,
    gate_up_bias: jax.Array,
    down_bias: jax.Array,
    activation: str,
    weights_transposed: bool,
    interleaved: bool,
    alpha: float,
    limit: float,
) -> jax.Array:
    return moe.gated_experts(
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias,
        activation=activation, weights_transposed=weights_transposed, interleaved=interleaved, alpha=alpha, limit=limit,
    )


def check_ragged_dot_args(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, transpose_rhs: bool) -> None:
    for name, tensor in (("lhs", lhs), ("rhs", rhs), ("group_sizes", group_sizes)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if lhs.dim() != 2:
        raise ValueError(f"lhs must be 2-D [M, K], got shape {tuple(lhs.shape)}")
    if rhs.dim() != 3:
        layout = "[G, N, K]" if transpose_rhs else "[G, K, N]"
        raise ValueError(f"rhs must be 3-D {layout}, got shape {tuple(rhs.shape)}")
    if group_sizes.dim() != 1:
        raise ValueError(f"group_sizes must be 1-D [G], got shape {tuple(group_sizes.shape)}")
    if lhs.dtype not in FLOAT_DTYPES:
        raise TypeError(f"lhs must be float32 or bfloat16, got {lhs.dtype}")
    if rhs.dtype != lhs.dtype:
        raise TypeError(f"rhs dtype {rhs.dtype} must match lhs dtype {lhs.dtype}")
    if group_sizes.dtype != torch.int32:
        raise TypeError(f"group_sizes must be int32, got {group_sizes.dtype}")
    rhs_k = rhs.shape[2] if transpose_rhs else rhs.shape[1]
    if lhs.shape[1] != rhs_k:
        axis = "rhs.shape[2]" if transpose_rhs else "rhs.shape[1]"
        raise ValueError(f"K mismatch: lhs.shape[1]={lhs.shape[1]} but {axis}={rhs_k} (transpose_rhs={transpose_rhs})")
    if group_sizes.shape[0] != rhs.shape[0]:
        raise ValueError(f"group_sizes has {group_sizes.shape[0]} groups but rhs has {rhs.shape[0]}")
    if lhs.shape[0] == 0:
        raise ValueError("lhs must have at least one row")
    if len({lhs.device, rhs.device, group_sizes.device}) != 1:
        raise ValueError(f"lhs, rhs and group_sizes must be on one device, got {lhs.device}, {rhs.device}, {group_sizes.device}")
    # Value checks read the sizes back to the host; a compiled graph skips them
    # rather than break on a data-dependent branch.
    if not torch.compiler.is_compiling():
        if bool((group_sizes < 0).any()):
            raise ValueError(f"group_sizes must be non-negative, got {group_sizes.tolist()}")
        total = int(group_sizes.sum())
        if total > lhs.shape[0]:
            raise ValueError(f"group_sizes sum to {total}, past the {lhs.shape[0]} rows of lhs")


def ragged_dot(
    lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, *, transpose_rhs: bool = False
) -> torch.Tensor:
    """Grouped matmul: rows of `lhs[M, K]`, sorted by group, times their group's `rhs`.

    `rhs` is `[G, K, N]`, or `[G, N, K]` with `transpose_rhs=True` (transformers'
    own expert weight layout, used without a transposed copy). `group_sizes[G]`
    is int32, non-negative, summing to at most M; rows past the sum come out
    as zeros. Accumulates in float32; returns `[M, N]` in the input dtype.
    """
    check_ragged_dot_args(lhs, rhs, group_sizes, transpose_rhs)
    return _ragged_dot(lhs, rhs, group_sizes, transpose_rhs)


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
) -> torch.Tensor:
    """The fused experts op (see `moe.gated_experts`); biases come as a pair or not at all."""
    if activation not in moe.GATES:
        raise ValueError(f"activation must be one of {moe.GATES}, got {activation!r}")
    if (gate_up_bias is None) != (down_bias is None):
        raise ValueError("pass both gate_up_bias and down_bias, or neither")
    index = top_k_index.to(torch.int32)
    static = (activation, weights_transposed, interleaved, float(alpha), float(limit))
    if gate_up_bias is None:
        return _gated_experts(hidden_states, index, top_k_weights, gate_up_proj, down_proj, *static)
    return _gated_experts_with_bias(
        hidden_states, index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, *static
    )
