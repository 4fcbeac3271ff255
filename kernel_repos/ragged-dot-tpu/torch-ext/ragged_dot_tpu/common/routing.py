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


def expected_active_groups(rows: int, num_groups: int) -> float:
    """Groups that receive at least one of `rows` rows routed uniformly at random: G (1 - (1 - 1/G)^rows).

    What a kernel's cost estimate assumes for the weights it reads when the
    group sizes are not known at trace time (they are data). It takes every
    row as live: under expert-parallel router masking (most rows other ranks'
    sentinels) it overestimates the weights read at small batches.
    """
    return num_groups * (1.0 - (1.0 - 1.0 / num_groups) ** rows)


def int32_group_sizes(group_sizes: jax.Array) -> jax.Array:
    """Group sizes of any integer dtype as the int32 the kernels schedule with.

    The kernels take prefix sums of the sizes: in a narrow dtype (uint8) those
    would wrap around; int64 sizes (`jax_enable_x64`) are cast down, their
    values being row counts.
    """
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must have an integer dtype, got {group_sizes.dtype}")
    return group_sizes.astype(jnp.int32)


def sort_by_expert(top_k_index: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Pick order sorted by expert, and the picks per expert.

    Sentinels (id == num_experts) sort to the tail, past every group: the
    grouped matmuls give them no work item.
    """
    expert_ids = top_k_index.reshape(-1)
    order = jnp.argsort(expert_ids, stable=True)
    counts = jnp.zeros(num_experts + 1, jnp.int32).at[expert_ids].add(1)
    return order, counts[:num_experts]


class ExpertPlan(NamedTuple):
    """The fused kernel's grid: one item per active expert (scalar-prefetch operands)."""

    expert: jax.Array  # [E] int32: the active experts in order, then the last one repeated (items past `count`)
    rows: jax.Array  # [E] int32: picks of each item's expert (at least its rows; 0 past `count`)
    count: jax.Array  # [1] int32: items, at least 1 (a call without live picks runs one empty item)


def expert_plan(top_k_index: jax.Array, num_experts: int) -> ExpertPlan:
    """Which experts have picks, in order, and how many: masked sums over [T x K, E] and [E, E] compares.

    Written without scatter, sort or cumsum, which XLA's TPU cost analysis
    counts at hundreds of KiB to MiB for these few values.
    """
    expert_ids = top_k_index.reshape(-1)
    experts = jnp.arange(num_experts, dtype=jnp.int32)
    picks = jnp.sum((expert_ids[:, None] == experts[None, :]).astype(jnp.int32), axis=0)
    active = picks > 0
    # Position of each active expert among the active ones: active experts before it.
    position = jnp.sum(jnp.where((experts[None, :] < experts[:, None]) & active[None, :], 1, 0), axis=1)
    count = jnp.sum(active.astype(jnp.int32))
    nth_active = jnp.sum(
        jnp.where(active[None, :] & (position[None, :] == experts[:, None]), experts[None, :], 0), axis=1
    )
    expert = jnp.where(experts < count, nth_active, jnp.max(jnp.where(active, experts, 0)))
    rows = jnp.where(experts < count, jnp.sum(jnp.where(expert[:, None] == experts[None, :], picks[None, :], 0), axis=1), 0)
    return ExpertPlan(expert=expert.astype(jnp.int32), rows=rows.astype(jnp.int32),
                      count=jnp.maximum(count, 1).reshape(1).astype(jnp.int32))
