"""The transposed grouped matmul (tgmm, a grouped matmul's weights' gradient) kernel: `kernel.py` runs it,
`plan.py` plans one call from the tiles `tiles.py` selects."""

# Its seams (`tiles.select`, `plan.make`, `kernel.call`), bound by name (the package's `__init__.py` says why).
from . import kernel, plan, tiles

__all__ = ["kernel", "plan", "tiles"]
