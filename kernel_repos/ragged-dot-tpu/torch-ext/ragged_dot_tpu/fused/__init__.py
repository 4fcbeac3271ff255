"""The fused experts kernel (decode-sized experts layers in one kernel): `kernel.py` runs it, `plan.py` plans one
call from the blocks `tiles.py` selects."""
