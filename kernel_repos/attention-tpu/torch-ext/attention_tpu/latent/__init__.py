"""Latent attention (multi-head latent attention in its absorbed form, over transformers' compressed MLA cache):
`kernel.py` runs it, `plan.py` lays its grid from the tiles `tiles.py` selects."""

# Its seams (`tiles.select`, `plan.make`, `kernel.call`), bound by name (the package's `__init__.py` says why).
from . import kernel, plan, tiles

__all__ = ["kernel", "plan", "tiles"]
