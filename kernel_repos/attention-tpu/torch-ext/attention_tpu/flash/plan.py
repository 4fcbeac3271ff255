"""The forward's plan: a `Problem` and its tiles (an `AttentionConfig`, by default `tiles.select`'s) go in, the grid
the kernel walks comes out."""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

from ..common import masking
from ..common.masking import Problem
from ..common.tiles import AttentionConfig
from .tiles import check_config, is_decode, select


@dataclasses.dataclass(frozen=True)
class ForwardPlan:
    """The forward kernel's tiling of one call."""

    problem: Problem
    decode: bool
    block_q: int  # 1 in decode, where a step's rows are the group's query heads
    block_kv: int
    heads_per_step: int  # KV heads per step (decode; prefill steps handle one)
    num_q_blocks: int
    num_kv_blocks: int
    num_kv_steps: int  # grid steps along the KV axis: at most num_kv_blocks
    vmem_limit_bytes: int


def make(problem: Problem, generation: str | None = None, config: AttentionConfig | None = None) -> ForwardPlan:
    """The forward's grid for `problem` at `config`'s tiles (checked), else `select`'s on `generation` (default:
    this device's): the KV axis only as long as a query block's visible keys span (`masking.kv_steps`)."""
    if config is None:
        config = select(problem, generation)
    else:
        check_config(config, q_len=problem.q_len, kv_len=problem.kv_len, kv_heads=problem.kv_heads)
    decode = is_decode(problem.q_len)
    block_q = 1 if decode else config.block_q
    num_kv_blocks = pl.cdiv(problem.kv_len, config.block_kv)
    return ForwardPlan(
        problem=problem,
        decode=decode,
        block_q=block_q,
        block_kv=config.block_kv,
        heads_per_step=config.kv_heads_per_step if decode else 1,
        num_q_blocks=pl.cdiv(problem.q_len, block_q),
        num_kv_blocks=num_kv_blocks,
        num_kv_steps=masking.kv_steps(problem, num_kv_blocks, block_q, config.block_kv),
        vmem_limit_bytes=config.vmem_limit_bytes,
    )
