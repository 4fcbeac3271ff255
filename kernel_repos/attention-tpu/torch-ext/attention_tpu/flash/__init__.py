"""The forward kernel (prefill, chunked prefill and decode): `kernel.py` runs it (and joins it to the backward
kernels as one differentiable function), `plan.py` lays its grid from the tiles `tiles.py` selects
(`tuned_tiles.json`: the tuned table)."""

# Its seams (`tiles.select`, `plan.make`, `kernel.call`), bound by name (the package's `__init__.py` says why).
from . import kernel, plan, tiles

__all__ = ["kernel", "plan", "tiles"]
