"""The backward's plan: a `Problem` and the two kernels' tiles (a `BackwardConfig`, by default `tiles.select`'s) go
in, the grid each kernel walks comes out."""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

from .._hardware import TpuGeneration
from ..common import masking
from ..common.layout import SequenceMinor, sequence_minor_reads
from ..common.masking import Problem
from ..common.tiles import AttentionConfig
from .tiles import BackwardConfig, check_backward_config, select


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """The tiling of one backward kernel's call: dq walks KV blocks per query block, dk/dv query blocks per KV
    block."""

    block_q: int
    block_kv: int
    num_q_blocks: int
    num_kv_blocks: int
    num_steps: int  # grid length of the walked axis (KV blocks for dq, query blocks for dk/dv)
    kv_heads_per_step: int
    vmem_limit_bytes: int
    # Each of q (and dq), k (dk), v (dv) and d_out read and written as XLA stores it by default when that is
    # sequence-minor (`layout.sequence_minor_reads`): its swapped view [B, H, D, S], in blocks of [D, block].
    sequence_minor: SequenceMinor


@dataclasses.dataclass(frozen=True)
class BackwardPlans:
    """The backward of one call: its problem, and the plans of its dq and dk/dv kernels."""

    problem: Problem
    dq: BackwardPlan
    dkv: BackwardPlan


def make(problem: Problem, target: TpuGeneration, config: BackwardConfig | None = None) -> BackwardPlans:
    """The backward's kernels for `problem` at `config`'s tiles (checked), else `select`'s on `target` (a
    generation's facts, resolved once by the caller)."""
    if config is None:
        config = select(problem, target)
    else:
        check_backward_config(config, problem)
    return BackwardPlans(problem, _kernel_plan(problem, config.dq, for_dq=True),
                         _kernel_plan(problem, config.dkv, for_dq=False))


def _kernel_plan(problem: Problem, config: AttentionConfig, *, for_dq: bool) -> BackwardPlan:
    """The grid of the dq kernel (for_dq) or the dk/dv kernel for `problem` at `config`'s tiles: the walked axis only
    as long as the visible pairs of one block of the other axis span (`masking.kv_steps`, `masking.q_steps`)."""
    block_q, block_kv = config.block_q, config.block_kv
    nq, nkv = pl.cdiv(problem.q_len, block_q), pl.cdiv(problem.kv_len, block_kv)
    if for_dq:
        steps = masking.kv_steps(problem, nkv, block_q, block_kv)
    else:
        steps = masking.q_steps(problem, nq, block_q, block_kv)
    sequence_minor = sequence_minor_reads(problem, block_q, block_kv)
    return BackwardPlan(block_q, block_kv, nq, nkv, steps, config.kv_heads_per_step, config.vmem_limit_bytes,
                        sequence_minor)
