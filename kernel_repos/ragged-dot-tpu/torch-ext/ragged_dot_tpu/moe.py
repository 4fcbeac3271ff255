"""The whole routed-experts computation of a gated MoE layer as one JAX function.

Sort the token-expert picks by expert, both grouped matmuls (with per-expert
biases if the model has them), the gate, the routing weights, the un-sort and
the f32 sum over picks: on a TPU this is one compiled program per layer
instead of a chain of small torch ops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .pallas_tpu import ragged_dot

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}
# GPT-OSS: clamped SwiGLU, `(clip(up) + 1) * g * sigmoid(alpha * g)` with g = min(gate, limit).
CLAMPED_SWIGLU = "clamped_swiglu"
GATES = (*ACTIVATIONS, CLAMPED_SWIGLU)


def sort_by_expert(top_k_index: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Pick order sorted by expert, and the picks per expert.

    Expert-parallel sentinels (id == num_experts) sort to the tail and belong
    to no group, so the grouped matmuls leave their rows at zero.
    """
    expert_ids = top_k_index.reshape(-1)
    order = jnp.argsort(expert_ids, stable=True)
    counts = jnp.zeros(num_experts + 1, jnp.int32).at[expert_ids].add(1)
    return order, counts[:num_experts]


def apply_gate(gate_up: jax.Array, gate: str, *, interleaved: bool, alpha: float, limit: float) -> jax.Array:
    """The gated intermediate from the f32 gate_up projection."""
    if interleaved:
        gate_part, up = gate_up[:, 0::2], gate_up[:, 1::2]
    else:
        gate_part, up = jnp.split(gate_up, 2, axis=-1)
    if gate == CLAMPED_SWIGLU:
        gate_part = jnp.minimum(gate_part, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1.0) * gate_part * jax.nn.sigmoid(gate_part * alpha)
    return ACTIVATIONS[gate](gate_part) * up


def gated_experts(
    hidden_states: jax.Array,
    top_k_index: jax.Array,
    top_k_weights: jax.Array,
    gate_up_proj: jax.Array,
    down_proj: jax.Array,
    gate_up_bias: jax.Array | None = None,
    down_bias: jax.Array | None = None,
    *,
    activation: str,
    weights_transposed: bool,
    interleaved: bool = False,
    alpha: float = 1.0,
    limit: float = float("inf"),
    generation: str | None = None,
) -> jax.Array:
    """Gated experts per pick, weighted and summed per token.

    Weights follow transformers' layouts: `gate_up_proj[E, 2I, H]` and
    `down_proj[E, H, I]`, or `[E, H, 2I]` / `[E, I, H]` when transposed. The
    gate is the first half of the gate_up output, or the even columns when
    `interleaved`. `activation` is one of GATES.
    """
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[1]
    num_experts = gate_up_proj.shape[0]
    order, group_sizes = sort_by_expert(top_k_index, num_experts)
    rows = hidden_states[order // top_k]
    # Sentinel rows sit past the groups; biases must not turn their zeros into values.
    in_groups = (jnp.arange(rows.shape[0]) < group_sizes.sum())[:, None]
    bias_rows = jnp.minimum(top_k_index.reshape(-1)[order], num_experts - 1)

    gate_up = ragged_dot(rows, gate_up_proj, group_sizes, transpose_rhs=not weights_transposed, generation=generation)
    gate_up = gate_up.astype(jnp.float32)
    if gate_up_bias is not None:
        gate_up = jnp.where(in_groups, gate_up + gate_up_bias[bias_rows].astype(jnp.float32), 0.0)
    intermediate = apply_gate(gate_up, activation, interleaved=interleaved, alpha=alpha, limit=limit)
    out = ragged_dot(
        intermediate.astype(hidden_states.dtype), down_proj, group_sizes,
        transpose_rhs=not weights_transposed, generation=generation,
    ).astype(jnp.float32)
    if down_bias is not None:
        out = jnp.where(in_groups, out + down_bias[bias_rows].astype(jnp.float32), 0.0)
    weighted = out * top_k_weights.reshape(-1)[order].astype(jnp.float32)[:, None]
    unsorted = jnp.zeros_like(weighted).at[order].set(weighted)
    return unsorted.reshape(num_tokens, top_k, hidden).sum(axis=1).astype(hidden_states.dtype)
