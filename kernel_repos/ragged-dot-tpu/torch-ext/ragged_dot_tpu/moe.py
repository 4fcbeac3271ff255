"""The whole routed-experts computation of a gated MoE layer as one JAX function.

Sort the token-expert picks by expert, both grouped matmuls, the gate, the
routing weights, the un-sort and the f32 sum over picks: on a TPU this is one
compiled program per layer instead of a chain of small torch ops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .kernel import ragged_dot

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


def sort_by_expert(top_k_index: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Pick order sorted by expert, and the picks per expert.

    Expert-parallel sentinels (id == num_experts) sort to the tail and belong
    to no group, so the grouped matmuls leave their rows at zero.
    """
    expert_ids = top_k_index.reshape(-1)
    order = jnp.argsort(expert_ids, stable=True)
    counts = jnp.zeros(num_experts + 1, jnp.int32).at[expert_ids].add(1)
    return order, counts[:num_experts]


def gated_experts(
    hidden_states: jax.Array,
    top_k_index: jax.Array,
    top_k_weights: jax.Array,
    gate_up_proj: jax.Array,
    down_proj: jax.Array,
    *,
    activation: str,
    weights_transposed: bool,
    generation: str | None = None,
) -> jax.Array:
    """`act(x W_gate) * (x W_up) W_down` per pick, weighted and summed per token.

    Weights follow transformers' layouts: `gate_up_proj[E, 2I, H]` and
    `down_proj[E, H, I]`, or `[E, H, 2I]` / `[E, I, H]` when transposed; the
    gate is the first half of the gate_up output.
    """
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[1]
    order, group_sizes = sort_by_expert(top_k_index, gate_up_proj.shape[0])
    rows = hidden_states[order // top_k]
    gate_up = ragged_dot(rows, gate_up_proj, group_sizes, transpose_rhs=not weights_transposed, generation=generation)
    gate, up = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
    intermediate = (ACTIVATIONS[activation](gate) * up).astype(hidden_states.dtype)
    out = ragged_dot(intermediate, down_proj, group_sizes, transpose_rhs=not weights_transposed, generation=generation)
    weighted = out.astype(jnp.float32) * top_k_weights.reshape(-1)[order].astype(jnp.float32)[:, None]
    unsorted = jnp.zeros_like(weighted).at[order].set(weighted)
    return unsorted.reshape(num_tokens, top_k, hidden).sum(axis=1).astype(hidden_states.dtype)
