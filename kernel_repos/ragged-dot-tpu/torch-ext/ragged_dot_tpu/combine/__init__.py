"""The combine kernel (each token's picks, weighted and summed): `kernel.py` runs it, `plan.py` plans one call
from the token tile `tiles.py` selects."""
