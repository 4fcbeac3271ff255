"""The weights' gradient's plan: a `TgmmProblem` goes in, the `TgmmPlan` its kernel runs comes out."""

from __future__ import annotations

from typing import NamedTuple

from .._hardware import TpuGeneration
from ..common.vmem import Buffer
from ..problem import TgmmProblem
from .tiles import TgmmConfig, check_tgmm_config, select, tgmm_blocks, tgmm_buffers, tgmm_vmem_limit


class TgmmPlan(NamedTuple):
    """One weights' gradient as `tgmm.kernel.call` runs it (blocks of `tgmm_blocks`)."""

    problem: TgmmProblem
    tile_m: int
    tile_k: int
    tile_n: int
    chunk_m: int
    group_chunks: bool  # chunks laid from each group's first row (only with more than one chunk per tile)
    buffers: tuple[Buffer, ...]  # what the pipeline holds in VMEM (`tgmm_buffers`)
    vmem_limit_bytes: int


def make(problem: TgmmProblem, target: TpuGeneration, config: TgmmConfig | None = None) -> TgmmPlan:
    """The plan of one tgmm call on `target`: `config`'s tiles (checked), else
    `select`'s."""
    if config is None:
        config = select(problem, target)
    check_tgmm_config(config, problem, target)
    tile_m, tile_k, tile_n, chunk_m = tgmm_blocks(config, problem)
    return TgmmPlan(problem, tile_m, tile_k, tile_n, chunk_m, config.group_chunks and chunk_m < tile_m,
                    tgmm_buffers(config, problem), tgmm_vmem_limit(config, problem, target))
