"""The grouped matmul (ragged dot) kernel: `kernel.py` runs it (its rows copied from their tokens by
`gathered_rows.py`, its output written by the plan's `epilogue.py`), `schedule.py` lays its work items and the
blocks each operand moves, `plan.py` plans one call from the tiles `tiles.py` selects (`tuned_tiles.json`: the
tuned table)."""

# Its seams (`tiles.select`, `plan.make`, `kernel.call`) and its schedule, bound by name (the package's `__init__.py`
# says why).
from . import kernel, plan, schedule, tiles

__all__ = ["kernel", "plan", "schedule", "tiles"]
