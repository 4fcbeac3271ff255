"""Backward of the grouped matmul and of the grouped experts layer, on our Pallas kernels.

For `out = ragged_dot(lhs, rhs, group_sizes)`:
- `d_lhs` is a grouped matmul of `d_out` against the same weights read the
  other way round (`transpose_rhs` flipped): no transposed copy of the
  weights is made;
- `d_rhs` is the transposed grouped matmul (`pallas_tgmm.tgmm`), with its
  operands swapped for the `[G, N, K]` layout.
Rows past `sum(group_sizes)` get a zero `d_lhs` and their `d_out` is never
read. `differentiable_ragged_dot` attaches this backward with `jax.custom_vjp`.

`grouped_experts_backward` differentiates the experts layer of `moe.py` from
the two projections' kernel outputs saved by its forward, so the backward
runs four grouped matmuls (two `d_lhs`, two `tgmm`) and no forward one again.

One-byte (int8 / fp8) weights serve inference: `without_gradient` runs their
forward and refuses a backward instead of differentiating around the scales.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from .config import select_d_lhs_config, weights_as_stored
from .gates import gated, split_gate_up
from .pallas_tgmm import tgmm
from .pallas_tpu import ragged_dot
from .routing import sort_by_expert


QUANTIZED_BACKWARD_REFUSAL = (
    "no gradient through int8 / float8_e4m3fn weights: one-byte weights serve inference only; "
    "train with bfloat16 or float32 weights (kernelize without quantize_experts)"
)


def without_gradient(name: str, compute: Callable, *arrays):
    """`compute(*arrays)`, whose backward raises NotImplementedError (one-byte weights: inference only)."""

    @jax.custom_vjp
    def call(*arrays):
        return compute(*arrays)

    def forward(*arrays):
        return compute(*arrays), None

    def refuse(_residuals, _d_out):
        raise NotImplementedError(f"{name}: {QUANTIZED_BACKWARD_REFUSAL}")

    call.defvjp(forward, refuse)
    return call(*arrays)


def ragged_dot_backward(
    d_out: jax.Array, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool,
    generation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`(d_lhs[M, K], d_rhs)` of `ragged_dot(lhs, rhs, group_sizes, transpose_rhs=...)`; d_rhs has rhs's layout.

    With an empty dimension both are zeros and no kernel runs.
    """
    d_out = d_out.astype(lhs.dtype)
    m, n = d_out.shape
    if 0 in (m, n, lhs.shape[1], rhs.shape[0]):
        return jnp.zeros(lhs.shape, lhs.dtype), jnp.zeros(rhs.shape, rhs.dtype)
    config = select_d_lhs_config(m, n, lhs.shape[1], lhs.dtype, generation=generation, num_groups=rhs.shape[0])
    d_lhs = ragged_dot(d_out, rhs, group_sizes, transpose_rhs=not transpose_rhs, config=config)
    if transpose_rhs:
        d_rhs = tgmm(d_out, lhs, group_sizes, out_dtype=rhs.dtype, generation=generation)
    else:
        d_rhs = tgmm(lhs, d_out, group_sizes, out_dtype=rhs.dtype, generation=generation)
    return d_lhs, d_rhs


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def differentiable_ragged_dot(lhs, rhs, group_sizes, transpose_rhs: bool, zero_rows_past_groups: bool,
                              generation: str | None):
    return ragged_dot(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs,
                      zero_rows_past_groups=zero_rows_past_groups, generation=generation)


def _ragged_dot_vjp_forward(lhs, rhs, group_sizes, transpose_rhs, zero_rows_past_groups, generation):
    out = differentiable_ragged_dot(lhs, rhs, group_sizes, transpose_rhs, zero_rows_past_groups, generation)
    return out, (lhs, rhs, group_sizes)


def _ragged_dot_vjp_backward(transpose_rhs, zero_rows_past_groups, generation, residuals, d_out):
    lhs, rhs, group_sizes = residuals
    d_lhs, d_rhs = ragged_dot_backward(d_out, lhs, rhs, group_sizes, transpose_rhs=transpose_rhs,
                                       generation=generation)
    return d_lhs, d_rhs, None


differentiable_ragged_dot.defvjp(_ragged_dot_vjp_forward, _ragged_dot_vjp_backward)


def grouped_experts_backward(
    d_y: jax.Array,
    hidden_states: jax.Array,
    top_k_index: jax.Array,
    top_k_weights: jax.Array,
    gate_up_proj: jax.Array,
    down_proj: jax.Array,
    gate_up_bias: jax.Array | None,
    down_bias: jax.Array | None,
    gate_up_out: jax.Array,
    down_out: jax.Array,
    *,
    activation: str,
    weights_transposed: bool,
    interleaved: bool,
    alpha: float,
    limit: float,
    generation: str | None = None,
) -> tuple[jax.Array, ...]:
    """Gradients of `moe.grouped_experts` from its saved kernel outputs.

    `gate_up_out[M, 2I]` and `down_out[M, H]` are the two grouped matmuls'
    outputs of the forward (rows sorted by expert, rows past the groups
    unwritten). Returns `(d_hidden_states, d_top_k_weights, d_gate_up_proj,
    d_down_proj, d_gate_up_bias, d_down_bias)`, each in its input's dtype
    (the bias gradients None without biases). Sentinel picks (id ==
    num_experts) get a zero weight gradient and feed no other gradient.
    Each weight is read, and its gradient written, in the order XLA stores it
    (`config.weights_orientation`), as the forward reads it.
    """
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[1]
    num_experts = gate_up_proj.shape[0]
    dtype = hidden_states.dtype
    f32 = jnp.float32
    order, group_sizes = sort_by_expert(top_k_index, num_experts)
    tokens = order // top_k
    live = (jnp.arange(order.shape[0]) < group_sizes.sum())[:, None]
    bias_rows = jnp.minimum(top_k_index.reshape(-1)[order], num_experts - 1)
    orientation, gate_up_read, down_read, _, _ = weights_as_stored(gate_up_proj, down_proj,
                                                                   weights_transposed=weights_transposed)

    # The gate again, elementwise, from the saved projection; its vjp gives d_gate_up.
    gate_up = gate_up_out.astype(f32)
    if gate_up_bias is not None:
        gate_up = gate_up + gate_up_bias[bias_rows].astype(f32)
    gate_up = jnp.where(live, gate_up, 0.0)

    def gate(gate_up):
        return gated(*split_gate_up(gate_up, interleaved=interleaved), activation, alpha=alpha, limit=limit)

    intermediate, gate_vjp = jax.vjp(gate, gate_up)
    out = down_out.astype(f32)
    if down_bias is not None:
        out = out + down_bias[bias_rows].astype(f32)

    d_picked = d_y[tokens].astype(f32)
    d_weights_sorted = jnp.where(live[:, 0], jnp.sum(jnp.where(live, out, 0.0) * d_picked, axis=-1), 0.0)
    d_out = jnp.where(live, d_picked * top_k_weights.reshape(-1)[order].astype(f32)[:, None], 0.0)

    # A swapped weights view's gradient comes in the view's order; swapped back it is again a bitcast.
    d_intermediate, d_down_proj = ragged_dot_backward(
        d_out.astype(dtype), intermediate.astype(dtype), down_read, group_sizes,
        transpose_rhs=not orientation.down_transposed, generation=generation)
    if orientation.down_transposed != weights_transposed:
        d_down_proj = jnp.swapaxes(d_down_proj, 1, 2)
    (d_gate_up,) = gate_vjp(d_intermediate.astype(f32))
    d_gate_up = jnp.where(live, d_gate_up, 0.0)
    rows = hidden_states[tokens]
    d_rows, d_gate_up_proj = ragged_dot_backward(
        d_gate_up.astype(dtype), rows, gate_up_read, group_sizes,
        transpose_rhs=not orientation.gate_up_transposed, generation=generation)
    if orientation.gate_up_transposed != weights_transposed:
        d_gate_up_proj = jnp.swapaxes(d_gate_up_proj, 1, 2)

    d_hidden = jnp.zeros((num_tokens, hidden), f32).at[tokens].add(d_rows.astype(f32))
    d_weights = jnp.zeros(order.shape, f32).at[order].set(d_weights_sorted).reshape(num_tokens, top_k)
    d_gate_up_bias = d_down_bias = None
    if gate_up_bias is not None:
        # Rows past the groups carry zero gradients, so clamping their expert id adds nothing.
        d_gate_up_bias = jnp.zeros(gate_up_bias.shape, f32).at[bias_rows].add(d_gate_up).astype(gate_up_bias.dtype)
        d_down_bias = jnp.zeros(down_bias.shape, f32).at[bias_rows].add(d_out).astype(down_bias.dtype)
    return (d_hidden.astype(dtype), d_weights.astype(top_k_weights.dtype), d_gate_up_proj, d_down_proj,
            d_gate_up_bias, d_down_bias)
