"""What a norm kernel call computes: the op, and the [rows, hidden] row arrays it streams. Its row block
(`norm/tiles.py`) and its grid (`norm/plan.py`) follow from it."""

from __future__ import annotations

from typing import NamedTuple


class NormProblem(NamedTuple):
    """One call of `op` (`norm.tiles.OPS`: rms_norm, fused_add_rms_norm and their backward) over row arrays viewed
    as [rows, hidden] of `dtype` (its name, as `jnp.dtype(...).name`)."""

    op: str
    rows: int
    hidden: int
    dtype: str
