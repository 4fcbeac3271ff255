"""The plan of ragged paged attention: a `PagedProblem` and its tiles (a `PagedConfig`, by default `tiles.select`'s)
go in, the grid and the K/V blocks' DMAs come out."""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

from .._hardware import TpuGeneration
from ..common.paged import PagedProblem
from .tiles import PagedConfig, check_config, chunk_tokens, min_tile_q, select


@dataclasses.dataclass(frozen=True)
class PagedPlan:
    """The kernel's tiling of one call."""

    problem: PagedProblem
    block_q: int  # packed query rows per grid step
    tile_q: int  # query rows per matmul
    min_tile_q: int  # query rows per matmul of a sequence with fewer rows in tiles this small (a decode row)
    block_kv: int  # keys per K/V block
    chunk: int  # keys per DMA: a page, or a part of one
    num_q_blocks: int  # grid length
    vmem_limit_bytes: int

    @property
    def chunks_per_block(self) -> int:
        return self.block_kv // self.chunk

    @property
    def tiles_per_block(self) -> int:
        return self.block_q // self.tile_q


def make(problem: PagedProblem, target: TpuGeneration, config: PagedConfig | None = None) -> PagedPlan:
    """The grid for `problem` at `config`'s tiles (checked), else `select`'s on `target` (a generation's facts,
    resolved once by the caller): one step per block of packed query rows."""
    if config is None:
        config = select(problem, target)
    else:
        check_config(config, problem)
    return PagedPlan(
        problem=problem,
        block_q=config.block_q,
        tile_q=config.tile_q,
        min_tile_q=min_tile_q(problem),
        block_kv=config.block_kv,
        chunk=chunk_tokens(problem, config.block_kv),
        num_q_blocks=max(1, pl.cdiv(problem.total_q, config.block_q)),
        vmem_limit_bytes=config.vmem_limit_bytes,
    )
