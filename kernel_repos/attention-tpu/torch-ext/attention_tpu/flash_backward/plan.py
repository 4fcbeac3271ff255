"""A backward kernel's plan: a `Problem` and the kernel's tiles (an `AttentionConfig`) go in, the grid it walks
comes out."""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

from ..common import masking
from ..common.masking import Problem
from ..common.tiles import AttentionConfig


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """The tiling of one backward kernel's call: dq walks KV blocks per query block, dk/dv query blocks per KV
    block."""

    block_q: int
    block_kv: int
    num_q_blocks: int
    num_kv_blocks: int
    num_steps: int  # grid length of the walked axis (KV blocks for dq, query blocks for dk/dv)


def plan_backward(problem: Problem, config: AttentionConfig, *, for_dq: bool) -> BackwardPlan:
    """The grid of the dq kernel (for_dq) or the dk/dv kernel for `problem` at `config`'s tiles: the walked axis only
    as long as the visible pairs of one block of the other axis span (`masking.kv_steps`, `masking.q_steps`)."""
    block_q, block_kv = config.block_q, config.block_kv
    nq, nkv = pl.cdiv(problem.q_len, block_q), pl.cdiv(problem.kv_len, block_kv)
    if for_dq:
        steps = masking.kv_steps(problem, nkv, block_q, block_kv)
    else:
        steps = masking.q_steps(problem, nq, block_q, block_kv)
    return BackwardPlan(block_q, block_kv, nq, nkv, steps)
