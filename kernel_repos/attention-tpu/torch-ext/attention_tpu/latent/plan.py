"""The plan of latent attention: a `LatentProblem` and its tiles (a `LatentConfig`, by default `tiles.select`'s) go
in, the grid the kernel walks comes out."""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

from .._hardware import TpuGeneration
from ..common import masking
from ..common.latent import LatentProblem
from .tiles import LatentConfig, check_config, packs_queries, q_rope_queries_minor, rope_keys_minor, select


@dataclasses.dataclass(frozen=True)
class LatentPlan:
    """The latent kernel's tiling of one call."""

    problem: LatentProblem
    packed: bool  # a step's rows are its heads x all the queries (`tiles.packs_queries`)
    block_q: int  # queries per step (packed: all of them)
    block_kv: int
    heads_per_step: int
    num_q_blocks: int
    num_kv_steps: int  # grid steps along the KV axis: at most the KV blocks of the cache
    vmem_limit_bytes: int
    rope_keys_minor: bool  # rope read as [B, 1, R, S] blocks of [R, block_kv] (`tiles.rope_keys_minor`)
    q_rope_queries_minor: bool  # a prefill's q_rope read as [B, H, R, Sq] (`tiles.q_rope_queries_minor`)

    @property
    def slices(self) -> int:
        """Row blocks of a step's softmax state: one (packed), or one per head."""
        return 1 if self.packed else self.heads_per_step

    @property
    def rows(self) -> int:
        """Query rows of one slice: heads x queries (packed, head-major), or a query block."""
        return self.heads_per_step * self.problem.attention.q_len if self.packed else self.block_q


def make(problem: LatentProblem, target: TpuGeneration, config: LatentConfig | None = None) -> LatentPlan:
    """The grid for `problem` at `config`'s tiles (checked), else `select`'s on `target` (a generation's facts,
    resolved once by the caller): the KV axis only as long as a query block's visible keys span
    (`masking.kv_steps`)."""
    if config is None:
        config = select(problem, target)
    else:
        check_config(config, problem)
    attention = problem.attention
    num_kv_blocks = pl.cdiv(attention.kv_len, config.block_kv)
    return LatentPlan(
        problem=problem,
        packed=packs_queries(problem),
        block_q=config.block_q,
        block_kv=config.block_kv,
        heads_per_step=config.heads_per_step,
        num_q_blocks=pl.cdiv(attention.q_len, config.block_q),
        num_kv_steps=masking.kv_steps(attention, num_kv_blocks, config.block_q, config.block_kv),
        vmem_limit_bytes=config.vmem_limit_bytes,
        rope_keys_minor=rope_keys_minor(problem, config.block_kv),
        q_rope_queries_minor=q_rope_queries_minor(problem, config.block_q),
    )
