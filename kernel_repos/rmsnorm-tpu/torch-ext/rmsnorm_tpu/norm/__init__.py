"""The norm kernels, RMSNorm and fused residual-add + RMSNorm with their backward: `kernel.py` runs them (and joins
each forward to its backward as one differentiable function), `plan.py` lays a call's grid from the row block
`tiles.py` selects (`tuned_tiles.json`: the tuned table)."""

# Its seams (`tiles.select`, `plan.make`, `kernel.call`), bound by name (the package's `__init__.py` says why).
from . import kernel, plan, tiles

__all__ = ["kernel", "plan", "tiles"]
