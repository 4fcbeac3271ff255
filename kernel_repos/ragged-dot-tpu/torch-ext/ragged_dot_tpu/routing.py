"""From a router's picks to what the kernels schedule: small XLA work on the `[T, K]` routing only.

A pick is one (token, k) entry of `top_k_index[T, K]`. Picks with
id == num_experts are expert-parallel sentinels (another rank's experts):
they belong to no expert, so no kernel gives them a row, a grid step, MXU
work or HBM traffic.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def sort_by_expert(top_k_index: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Pick order sorted by expert, and the picks per expert.

    Sentinels (id == num_experts) sort to the tail, past every group: the
    grouped matmuls give them no work item.
    """
    expert_ids = top_k_index.reshape(-1)
    order = jnp.argsort(expert_ids, stable=True)
    counts = jnp.zeros(num_experts + 1, jnp.int32).at[expert_ids].add(1)
    return order, counts[:num_experts]


class ExpertItems(NamedTuple):
    """The fused kernel's work items: up to `block_rows` picks of one expert each, active experts only.

    The first three are scalar-prefetch operands; `tokens` and `weights` are
    fetched one item (a `[1, block_rows]` row) per grid step.
    """

    expert: jax.Array  # [max_items] int32: the expert of each item
    rows: jax.Array  # [max_items] int32: picks in each item (0 past `count`)
    count: jax.Array  # [1] int32: items, at least 1 (a call without live picks runs one empty item)
    tokens: jax.Array  # [max_items, 1, block_rows] int32: token of each row slot, -1 for an empty slot
    weights: jax.Array  # [max_items, 1, block_rows] float32: routing weight of each row slot, 0 for an empty slot


def max_expert_items(picks: int, num_experts: int, block_rows: int) -> int:
    """Items an expert split of `picks` picks can need: one per active expert, plus one per full block."""
    return min(num_experts, picks) + picks // block_rows


def expert_items(top_k_index: jax.Array, top_k_weights: jax.Array, num_experts: int, block_rows: int) -> ExpertItems:
    """Items of the live picks, expert by expert in expert order; an expert's picks in token order.

    An expert with p picks takes ceil(p / block_rows) consecutive items;
    experts without picks take none.
    """
    tokens, top_k = top_k_index.shape
    picks = tokens * top_k
    capacity = max_expert_items(picks, num_experts, block_rows)
    order, counts = sort_by_expert(top_k_index, num_experts)
    sorted_ids = top_k_index.reshape(-1)[order]
    live = sorted_ids < num_experts
    expert = jnp.minimum(sorted_ids, num_experts - 1)

    group_end = jnp.cumsum(counts)
    rank = jnp.arange(picks, dtype=jnp.int32) - (group_end - counts)[expert]
    items_per_expert = (counts + block_rows - 1) // block_rows
    item_end = jnp.cumsum(items_per_expert)
    item_begin = item_end - items_per_expert
    item = jnp.where(live, item_begin[expert] + rank // block_rows, capacity)  # sentinels: dropped below
    slot = rank % block_rows

    token_of_slot = jnp.full((capacity, block_rows), -1, jnp.int32).at[item, slot].set(
        (order // top_k).astype(jnp.int32), mode="drop"
    )
    weight_of_slot = jnp.zeros((capacity, block_rows), jnp.float32).at[item, slot].set(
        top_k_weights.reshape(-1)[order].astype(jnp.float32), mode="drop"
    )

    count = item_end[-1]
    index = jnp.arange(capacity, dtype=jnp.int32)
    item_expert = jnp.minimum(jnp.searchsorted(item_end, index, side="right"), num_experts - 1).astype(jnp.int32)
    item_rows = jnp.clip(counts[item_expert] - (index - item_begin[item_expert]) * block_rows, 0, block_rows)
    item_rows = jnp.where(index < count, item_rows, 0).astype(jnp.int32)
    return ExpertItems(
        expert=item_expert,
        rows=item_rows,
        count=jnp.maximum(count, 1).astype(jnp.int32).reshape(1),
        tokens=token_of_slot.reshape(capacity, 1, block_rows),
        weights=weight_of_slot.reshape(capacity, 1, block_rows),
    )
