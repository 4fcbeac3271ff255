"""Tuning as data: tiles searched per shape, kept in a JSON table beside the kernel code that reads them.

Shipped into every built kernel as `_tuning.py` (beside `_hardware.py`); each kernel reads its table with
`read_tuned_tiles`, so all tables have one form:

    {"what": "where the entries come from",
     "entries": [{"key": {the shape: the fields of the kernel's key type},
                  "tiles": {the tiles: the fields of the kernel's tiles type},
                  ...notes for readers (labels, timings): not read}]}

A kernel takes an entry's tiles over its heuristic for that shape, checked like a caller's own config. A table
holds tiles only: the VMEM limit a kernel asks for follows from its tiles by the one policy
(`_hardware.vmem_limit_bytes`). Imports only the standard library.
"""

from __future__ import annotations

import json
from pathlib import Path


def tuned_tiles(entries, key_type, tiles_type) -> dict:
    """{key: tiles} of a table's `entries`, each entry's "key" and "tiles" made into `key_type` and `tiles_type` by
    field name."""
    return {key_type(**entry["key"]): tiles_type(**entry["tiles"]) for entry in entries}


def read_tuned_tiles(path: Path, key_type, tiles_type) -> dict:
    """`tuned_tiles` of the table in the file at `path`."""
    return tuned_tiles(json.loads(Path(path).read_text())["entries"], key_type, tiles_type)
