"""The forward kernel (prefill, chunked prefill and decode): `kernel.py` runs it (and joins it to the backward
kernels as one differentiable function), `plan.py` lays its grid from the tiles `tiles.py` selects
(`tuned_tiles.json`: the tuned table)."""
