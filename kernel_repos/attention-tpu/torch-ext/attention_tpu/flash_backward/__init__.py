"""The backward kernels (dq, and dk/dv): `kernel.py` runs them, `plan.py` lays each one's grid from the tiles
`tiles.py` selects."""
