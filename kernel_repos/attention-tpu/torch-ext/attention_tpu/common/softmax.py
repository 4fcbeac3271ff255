"""The online softmax both forward kernels run (`flash`, `paged`): per query row a running max, a running sum of
exponentials and an accumulator of probability-weighted values, float32 in VMEM scratch, updated one block of keys
at a time and normalized once every key is seen.

K and V tiles come row-major ([block_kv, D]) or keys-minor ([D, block_kv]: `key_axis` 1), as each kernel reads
them."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class SoftmaxState(NamedTuple):
    """The scratch refs of the state, indexed alike: max and sum [..., rows, 1], acc [..., rows, D]."""

    max: object
    sum: object
    acc: object


def start(state: SoftmaxState, sinks=None) -> None:
    """Every row's state before its first key: max -inf and sum 0, or with `sinks` (an array broadcasting onto
    the max) max = sink and sum 1: the sink is one more logit in the row's softmax, over a zero value."""
    if sinks is None:
        state.max[...] = jnp.full(state.max.shape, -jnp.inf, jnp.float32)
        state.sum[...] = jnp.zeros(state.sum.shape, jnp.float32)
    else:
        state.max[...] = jnp.broadcast_to(sinks, state.max.shape)
        state.sum[...] = jnp.ones(state.sum.shape, jnp.float32)
    state.acc[...] = jnp.zeros(state.acc.shape, jnp.float32)


def raw_logits(q, k, *, key_axis: int, precision):
    """q [rows, D] . k over D, float32: [rows, block_kv]."""
    return jax.lax.dot_general(q, k, (((1,), (1 - key_axis,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=precision)


def update(state: SoftmaxState, index, logits, v, *, key_axis: int, precision) -> None:
    """The state at `index` (its rows) after one block: `logits` [rows, block_kv] float32 (-inf where a key is not
    visible), v that block's values."""
    max_prev = state.max[index]
    max_next = jnp.maximum(max_prev, jnp.max(logits, axis=1, keepdims=True))
    # A row that has seen no visible key yet keeps max -inf; shift by 0
    # instead so exp() gives 0 rather than exp(-inf + inf) = NaN.
    shift = jnp.where(max_next == -jnp.inf, 0.0, max_next)
    probs = jnp.exp(logits - shift)
    rescale = jnp.exp(max_prev - shift)
    state.sum[index] = rescale * state.sum[index] + jnp.sum(probs, axis=1, keepdims=True)
    state.acc[index] = rescale * state.acc[index] + jax.lax.dot_general(
        probs.astype(v.dtype), v, (((1,), (key_axis,)), ((), ())), preferred_element_type=jnp.float32,
        precision=precision)
    state.max[index] = max_next


def normalized(state: SoftmaxState, index):
    """The accumulator at `index` over its rows' sums: the attention output, float32; 0 for a row that saw
    nothing."""
    total = state.sum[index]
    return jnp.where(total == 0.0, 0.0, state.acc[index] / jnp.where(total == 0.0, 1.0, total))
