"""A call's plan: its `NormProblem` (the op and the [rows, hidden] it streams) and its row block (a
`RowBlockConfig`, by default `tiles.select`'s) go in, the grid the kernel walks comes out."""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

from .._hardware import TpuGeneration
from ..problem import NormProblem
from .tiles import OPS, OpShape, RowBlockConfig, select


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """One kernel call's tiling: [rows, hidden] in `num_blocks` blocks of `block_rows` rows (the last may be
    ragged), under the scoped VMEM limit its config asks for."""

    op: str
    rows: int
    hidden: int
    block_rows: int
    num_blocks: int
    vmem_limit_bytes: int | None

    @property
    def shape(self) -> OpShape:
        """What the op streams: its row inputs and outputs, and whether it writes weight-gradient partials."""
        return OPS[self.op]


def make(problem: NormProblem, target: TpuGeneration, config: RowBlockConfig | None = None) -> RowPlan:
    """The grid of `problem`'s op over its [rows, hidden] at `config`'s row block, else `select`'s on `target` (a
    generation's facts, resolved once by the caller): one step per row block."""
    if config is None:
        config = select(problem, target)
    return RowPlan(problem.op, problem.rows, problem.hidden, config.block_rows,
                   pl.cdiv(problem.rows, config.block_rows), config.vmem_limit_bytes)
