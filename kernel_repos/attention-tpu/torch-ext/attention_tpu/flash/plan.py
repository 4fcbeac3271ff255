"""The forward's plan: a `Problem` and its tiles (an `AttentionConfig`, by default `tiles.select`'s) go in, the grid
the kernel walks comes out."""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

from .._hardware import TpuGeneration
from ..common import masking
from ..common.layout import SequenceMinor, sequence_minor_reads
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
    # Each of K and V read as XLA stores it by default when that is keys-minor (`layout.sequence_minor_reads`):
    # [B, Hkv, D, Skv] blocks of [D, block_kv], block_kv a multiple of 128. Likewise q read, and the output
    # written, queries-minor in prefill: [B, Hq, D, Sq] blocks of [group, D, block_q], block_q a multiple of 128.
    sequence_minor: SequenceMinor


def make(problem: Problem, target: TpuGeneration, config: AttentionConfig | None = None) -> ForwardPlan:
    """The forward's grid for `problem` at `config`'s tiles (checked), else `select`'s on `target` (a generation's
    facts, resolved once by the caller): the KV axis only as long as a query block's visible keys span
    (`masking.kv_steps`). K and V are each read keys-minor where XLA stores it so and the KV blocks are whole lane
    tiles (a config whose block_kv is the whole, shorter key length reads them row-major: XLA copies them then); q
    and the output of a prefill each likewise queries-minor, by its query blocks."""
    if config is None:
        config = select(problem, target)
    else:
        check_config(config, problem)
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
        sequence_minor=sequence_minor_reads(problem, block_q, config.block_kv),
    )
