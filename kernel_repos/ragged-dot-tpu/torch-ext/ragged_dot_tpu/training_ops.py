"""Torch ops and autograd formulas of the backward (`backward.py`): torch autograd runs our Pallas kernels.

- `ragged_dot`: `register_autograd` on the forward op (done in `ops.py`,
  where the op lives) with `ragged_dot_backward_formula`, whose op returns
  `(d_lhs, d_rhs)` from the d_lhs grouped matmul and tgmm.
- The experts layer: when a gradient is needed, `ops.gated_experts` runs
  `gated_experts_train`, the grouped forward that also returns its two
  kernel outputs; its backward op differentiates from them (no forward
  matmul runs twice). Inference calls keep the plain op and its fused path.

The backward ops are reached only through autograd, with tensors the
forward ops checked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from . import backward, moe
from ._ops import add_op_namespace_prefix, jax_torch_op


@jax_torch_op(add_op_namespace_prefix("ragged_dot_backward"))
def _ragged_dot_backward(
    d_out: jax.Array, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, transpose_rhs: bool
) -> tuple[jax.Array, jax.Array]:
    return backward.ragged_dot_backward(d_out, lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)


QUANTIZED_BACKWARD_REFUSAL = (
    "no gradient through int8 / float8_e4m3fn weights: one-byte weights serve inference only; "
    "train with bfloat16 or float32 weights (kernelize without quantize_experts)"
)


def save_ragged_dot_inputs(ctx, inputs, output):
    lhs, rhs, group_sizes, rhs_scales, transpose_rhs, _zero_rows_past_groups = inputs
    ctx.save_for_backward(lhs, rhs, group_sizes)
    ctx.transpose_rhs = transpose_rhs
    ctx.quantized = rhs_scales is not None


def ragged_dot_backward_formula(ctx, d_out):
    if ctx.quantized:
        raise NotImplementedError(f"ragged_dot: {QUANTIZED_BACKWARD_REFUSAL}")
    lhs, rhs, group_sizes = ctx.saved_tensors
    d_lhs, d_rhs = _ragged_dot_backward(d_out.contiguous(), lhs, rhs, group_sizes, ctx.transpose_rhs)
    return d_lhs, d_rhs, None, None, None, None


def save_nothing(ctx, inputs, output):
    pass


def refuse_quantized_experts_backward(ctx, d_out):
    raise NotImplementedError(f"gated_experts: {QUANTIZED_BACKWARD_REFUSAL}")


@jax_torch_op(add_op_namespace_prefix("gated_experts_train"))
def _gated_experts_train(
    hidden_states: jax.Array,
    top_k_index: jax.Array,
    top_k_weights: jax.Array,
    gate_up_proj: jax.Array,
    down_proj: jax.Array,
    gate_up_bias: jax.Array | None,
    down_bias: jax.Array | None,
    activation: str,
    weights_transposed: bool,
    interleaved: bool,
    alpha: float,
    limit: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(out, gate_up_out, down_out): the grouped forward and the kernel outputs its backward needs."""
    out, (gate_up_out, down_out) = moe.grouped_experts(
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias,
        activation=activation, weights_transposed=weights_transposed, interleaved=interleaved, alpha=alpha,
        limit=limit, return_residuals=True,
    )
    return out, gate_up_out, down_out


@jax_torch_op(add_op_namespace_prefix("gated_experts_backward"))
def _gated_experts_backward(
    d_out: jax.Array,
    hidden_states: jax.Array,
    top_k_index: jax.Array,
    top_k_weights: jax.Array,
    gate_up_proj: jax.Array,
    down_proj: jax.Array,
    gate_up_bias: jax.Array | None,
    down_bias: jax.Array | None,
    gate_up_out: jax.Array,
    down_out: jax.Array,
    activation: str,
    weights_transposed: bool,
    interleaved: bool,
    alpha: float,
    limit: float,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Gradients of hidden states, routing weights, weights and biases; the bias gradients are float32
    zeros [1] without biases (an op returns tensors)."""
    grads = backward.grouped_experts_backward(
        d_out, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias,
        gate_up_out, down_out, activation=activation, weights_transposed=weights_transposed, interleaved=interleaved,
        alpha=alpha, limit=limit,
    )
    no_bias = jnp.zeros((1,), jnp.float32)
    return tuple(no_bias if grad is None else grad for grad in grads)


def _save_experts_inputs(ctx, inputs, output):
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, *options = inputs
    _, gate_up_out, down_out = output
    ctx.save_for_backward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias,
                          down_bias, gate_up_out, down_out)
    ctx.options = options
    ctx.mark_non_differentiable(gate_up_out, down_out)


def _experts_backward_formula(ctx, d_out, _d_gate_up_out, _d_down_out):
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, gate_up_out, \
        down_out = ctx.saved_tensors
    d_hidden, d_weights, d_gate_up, d_down, d_gate_up_bias, d_down_bias = _gated_experts_backward(
        d_out.contiguous(), hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias,
        down_bias, gate_up_out, down_out, *ctx.options,
    )
    has_bias = gate_up_bias is not None
    # The expert ids and the static options get no gradient.
    return (d_hidden, None, d_weights, d_gate_up, d_down, d_gate_up_bias if has_bias else None,
            d_down_bias if has_bias else None, None, None, None, None, None)


_gated_experts_train.register_autograd(_experts_backward_formula, setup_context=_save_experts_inputs)


def gated_experts_train(*args) -> torch.Tensor:
    """The experts layer through the differentiable op (arguments as `ops._gated_experts`): its output."""
    out, _gate_up_out, _down_out = _gated_experts_train(*args)
    return out
