"""The whole routed-experts computation of a gated MoE layer as one JAX function.

Two ways to run it, picked by `config.use_fused_experts`:
- decode-sized calls: one fused kernel (`pallas_fused.fused_experts`) that
  streams each active expert's weights once and keeps everything else in VMEM;
- larger calls: sort the picks by expert, two grouped matmuls
  (`pallas_tpu.ragged_dot`) with the biases and the gate between them in XLA,
  the routing weights, and each token gathering and summing its picks in f32.
Either way, on a TPU this is one compiled program per layer instead of a
chain of small torch ops, and expert-parallel sentinel picks
(id == num_experts) get no kernel work.

`gated_experts` is differentiable (`jax.custom_vjp`). Under differentiation
the forward always takes the grouped path, whose two kernel outputs are the
residuals the backward needs (`backward.grouped_experts_backward`: two d_lhs
grouped matmuls and two tgmm, nothing recomputed but the elementwise gate).
The fused decode kernel keeps nothing of its intermediate (that is its
point), so it has no backward of its own: its backward would have to run the
grouped forward anyway, and training calls are large (T in the thousands),
where the rule picks the grouped path regardless.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .backward import grouped_experts_backward, without_gradient
from .config import use_fused_experts, weights_as_stored
from .gates import gated, split_gate_up
from .pallas_fused import fused_experts
from .pallas_tpu import ragged_dot
from .routing import sort_by_expert


def gated_experts(
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
    fused: bool | None = None,
    generation: str | None = None,
) -> jax.Array:
    """Gated experts per pick, weighted and summed per token.

    Weights follow transformers' layouts: `gate_up_proj[E, 2I, H]` and
    `down_proj[E, H, I]`, or `[E, H, 2I]` / `[E, I, H]` when transposed. The
    gate is the first half of the gate_up output, or the even columns when
    `interleaved`. Quantized weights (int8, float8_e4m3fn) come with their
    scales (`quant.py`). `activation` is one of `gates.GATES`. `fused` forces one
    of the two paths (None: the rule, `config.use_fused_experts`);
    `generation` picks the grouped path's tiles (None: this device's).
    Differentiable in hidden_states, top_k_weights, the weights and biases
    (module docstring); sentinel picks get a zero weight gradient. Without
    tokens, picks, hidden size or experts the result is zeros and no kernel
    runs.
    """
    if 0 in (*hidden_states.shape, top_k_index.shape[1], gate_up_proj.shape[0]):
        return jnp.zeros(hidden_states.shape, hidden_states.dtype)
    options = _ExpertsOptions(activation, bool(weights_transposed), bool(interleaved), float(alpha), float(limit),
                              fused, generation)
    if gate_up_scales is not None or down_scales is not None:
        return without_gradient("gated_experts", functools.partial(_experts, options), hidden_states, top_k_index,
                                top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, gate_up_scales,
                                down_scales)
    return _differentiable_experts(options, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                   gate_up_bias, down_bias)


class _ExpertsOptions(NamedTuple):
    """The static arguments of `gated_experts` (hashable: custom_vjp keeps them apart from the arrays)."""

    activation: str
    weights_transposed: bool
    interleaved: bool
    alpha: float
    limit: float
    fused: bool | None
    generation: str | None

    def gate(self) -> dict:
        return dict(activation=self.activation, weights_transposed=self.weights_transposed,
                    interleaved=self.interleaved, alpha=self.alpha, limit=self.limit)


def _experts(options: _ExpertsOptions, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
             gate_up_bias, down_bias, gate_up_scales=None, down_scales=None):
    tokens, hidden = hidden_states.shape
    weights_transposed, interleaved, fused = options.weights_transposed, options.interleaved, options.fused
    intermediate = down_proj.shape[1] if weights_transposed else down_proj.shape[2]
    gate = options.gate()
    if fused is None:
        fused = use_fused_experts(tokens, hidden, intermediate, gate_up_proj.shape[0], hidden_states.dtype,
                                  weights_transposed=weights_transposed, interleaved=interleaved,
                                  has_bias=gate_up_bias is not None, weights_dtype=gate_up_proj.dtype)
    weights = (gate_up_proj, down_proj, gate_up_bias, down_bias, gate_up_scales, down_scales)
    if fused:
        return fused_experts(hidden_states, top_k_index, top_k_weights, *weights, **gate)
    return grouped_experts(hidden_states, top_k_index, top_k_weights, *weights, **gate, generation=options.generation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _differentiable_experts(options: _ExpertsOptions, hidden_states, top_k_index, top_k_weights, gate_up_proj,
                            down_proj, gate_up_bias, down_bias):
    return _experts(options, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias,
                    down_bias)


def _experts_vjp_forward(options: _ExpertsOptions, *arrays):
    out, kernel_outputs = grouped_experts(*arrays, **options.gate(), generation=options.generation,
                                          return_residuals=True)
    return out, (arrays, kernel_outputs)


def _experts_vjp_backward(options: _ExpertsOptions, residuals, d_out):
    arrays, kernel_outputs = residuals
    d_hidden, d_weights, d_gate_up, d_down, d_gate_up_bias, d_down_bias = grouped_experts_backward(
        d_out, *arrays, *kernel_outputs, **options.gate(), generation=options.generation)
    # The expert ids are integers: no cotangent.
    return d_hidden, None, d_weights, d_gate_up, d_down, d_gate_up_bias, d_down_bias


_differentiable_experts.defvjp(_experts_vjp_forward, _experts_vjp_backward)


def grouped_experts(
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
    generation: str | None = None,
    return_residuals: bool = False,
) -> jax.Array | tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """`gated_experts` as two grouped matmuls around XLA ops (arguments as there).

    With `return_residuals`, also the two kernels' outputs `(gate_up_out,
    down_out)` that `backward.grouped_experts_backward` differentiates from.

    The grouped matmuls compute only the rows of live picks: sentinels sort
    to the tail, past every group, and the kernels leave those rows unwritten
    (`zero_rows_past_groups=False`); everything that reads them here masks
    them first. The XLA ops around the kernels (gather, gate, per-token sum) are
    shaped by all T x K picks. Each projection is read in the order XLA
    stores it (`config.weights_orientation`).
    """
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[1]
    num_experts = gate_up_proj.shape[0]
    orientation, gate_up_proj, down_proj, gate_up_scales, down_scales = weights_as_stored(
        gate_up_proj, down_proj, gate_up_scales, down_scales, weights_transposed=weights_transposed)
    order, group_sizes = sort_by_expert(top_k_index, num_experts)
    rows = hidden_states[order // top_k]
    live = (jnp.arange(rows.shape[0]) < group_sizes.sum())[:, None]
    bias_rows = jnp.minimum(top_k_index.reshape(-1)[order], num_experts - 1)
    grouped = dict(zero_rows_past_groups=False, generation=generation)

    gate_up_out = ragged_dot(rows, gate_up_proj, group_sizes, gate_up_scales,
                             transpose_rhs=not orientation.gate_up_transposed, **grouped)
    # Split before anything else (the [E, 2I] biases too): XLA then fuses the split, the casts, the biases
    # and the gate into one pass over the kernel's bf16 output, where splitting the f32 sum made it
    # write and reread [M, 2I] f32 copies (GPT-OSS's even/odd columns: 4 of them).
    gate_part, up = (part.astype(jnp.float32) for part in split_gate_up(gate_up_out, interleaved=interleaved))
    if gate_up_bias is not None:
        gate_bias, up_bias = split_gate_up(gate_up_bias, interleaved=interleaved)
        gate_part = gate_part + gate_bias[bias_rows].astype(jnp.float32)
        up = up + up_bias[bias_rows].astype(jnp.float32)
    # Rows past the groups were never written: keep whatever they hold out of the gate.
    activated = gated(jnp.where(live, gate_part, 0.0), jnp.where(live, up, 0.0), activation, alpha=alpha,
                      limit=limit)
    down_out = ragged_dot(activated.astype(hidden_states.dtype), down_proj, group_sizes, down_scales,
                          transpose_rhs=not orientation.down_transposed, **grouped)
    # Each token gathers its picks' rows and sums them, weighted, one pick slot at a time: XLA fuses the
    # gathers, the biases, the masks and the sum into one pass that reads each pick's row once and writes
    # [T, H]. (Un-sorting by a scatter instead wrote and reread T x K f32 rows three times, most of a prefill
    # layer's HBM traffic; a [T, K, H] gather is relaid out when K is not a multiple of 8.)
    position = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    position = position.reshape(num_tokens, top_k)
    live_picks = position < group_sizes.sum()
    pick_weights = jnp.where(live_picks, top_k_weights.astype(jnp.float32), 0.0)
    pick_experts = jnp.minimum(top_k_index, num_experts - 1)
    result = jnp.zeros((num_tokens, hidden), jnp.float32)
    for slot in range(top_k):
        # Rows past the groups were never written: masked before they are weighted.
        picked = jnp.where(live_picks[:, slot, None], down_out[position[:, slot]].astype(jnp.float32), 0.0)
        if down_bias is not None:
            picked = picked + down_bias[pick_experts[:, slot]].astype(jnp.float32)
        result = result + pick_weights[:, slot, None] * picked
    result = result.astype(hidden_states.dtype)
    return (result, (gate_up_out, down_out)) if return_residuals else result
