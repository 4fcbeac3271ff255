"""The backward kernels (dq, and dk/dv): `kernel.py` runs them, `plan.py` lays each one's grid from the tiles
`tiles.py` selects."""

# Its seams (`tiles.select`, `plan.make`, `kernel.call`), bound by name (the package's `__init__.py` says why).
from . import kernel, plan, tiles

__all__ = ["kernel", "plan", "tiles"]
