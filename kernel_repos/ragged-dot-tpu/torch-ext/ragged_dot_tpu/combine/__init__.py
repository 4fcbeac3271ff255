"""The combine kernel (each token's picks, weighted and summed): `kernel.py` runs it, `plan.py` plans one call
from the token tile `tiles.py` selects."""

# Its seams (`tiles.select`, `plan.make`, `kernel.call`), bound by name (the package's `__init__.py` says why).
from . import kernel, plan, tiles

__all__ = ["kernel", "plan", "tiles"]
