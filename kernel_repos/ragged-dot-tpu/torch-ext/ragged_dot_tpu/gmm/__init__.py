"""The grouped matmul (ragged dot) kernel: `kernel.py` runs it (its rows copied from their tokens by
`gathered_rows.py`, its output written by the plan's `epilogue.py`), `schedule.py` lays its work items and the
blocks each operand moves, `plan.py` plans one call from the tiles `tiles.py` selects (`tuned_tiles.json`: the
tuned table)."""
