"""What the forward's and the backward's tiles share: their type (`AttentionConfig`) and the rules blocks follow."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .._hardware import LANES, sublane_multiple

# Query blocks are multiples of 128 (or the whole query length): the
# log-sum-exp rows the forward writes and the backward kernels read put query
# positions along lanes. That is also a multiple of the int8 sublane tile (32
# rows), so the tiles of an int8 mask block line up with the query rows.
MASK_ROWS = sublane_multiple(jnp.int8)
Q_BLOCK_MULTIPLE = LANES


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Tile sizes of one attention call (the forward, or one backward kernel).

    block_q: query positions per grid step (1 in decode, where the rows of a
      step are the group's query heads instead).
    block_kv: keys per grid step.
    vmem_limit_bytes: scoped VMEM limit requested from Mosaic.
    kv_heads_per_step: KV heads one decode or backward step handles (a divisor
      of the number of KV heads; prefill steps handle one).
    """

    block_q: int
    block_kv: int
    vmem_limit_bytes: int
    kv_heads_per_step: int = 1


def preferred_by_width(problem, by_head_dim: dict, default):
    """The entry of `by_head_dim` (preferred tiles by head dim) for the widest head dim it holds that the problem's
    wider head dim (of q and k, or of v) reaches, else `default`."""
    width = max(problem.head_dim, problem.v_head_dim)
    reached = [head_dim for head_dim in by_head_dim if width >= head_dim]
    return by_head_dim[max(reached)] if reached else default


def shrink_block(block: int, *, multiple: int) -> int:
    """Halve a block size, rounding down to a multiple of ``multiple``."""
    return max(multiple, block // 2 // multiple * multiple)
