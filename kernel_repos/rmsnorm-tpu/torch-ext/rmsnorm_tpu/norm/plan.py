"""A call's plan: the op, the [rows, hidden] it streams and its row block (a `RowBlockConfig`) go in, the grid the
kernel walks comes out."""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

from .tiles import OPS, OpShape, RowBlockConfig


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


def plan_rows(op: str, rows: int, hidden: int, config: RowBlockConfig) -> RowPlan:
    """The grid of `op` over [rows, hidden] at `config`'s row block: one step per row block."""
    return RowPlan(op, rows, hidden, config.block_rows, pl.cdiv(rows, config.block_rows), config.vmem_limit_bytes)
