"""The transposed grouped matmul (tgmm, a grouped matmul's weights' gradient) kernel: `kernel.py` runs it,
`plan.py` plans one call from the tiles `tiles.py` selects."""
