"""Compiles and replays kept on disk between runs: what `calibrate` and the moe_layer benchmark share.

A compile of one program for one chip takes seconds to minutes; its analysis inputs and a grid
replay are plain data, so both are pickled under a key of what produced them. The key holds the
library versions (`library_versions`) and, for replays, the replay code's source
(`source_fingerprint`); the caller adds what identifies the program. An entry this code cannot read
back (written by another layout of this package, or cut short) counts as a miss and is computed again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import os
import pickle
import threading
from pathlib import Path

# The libraries whose versions decide what a program compiles to.
COMPILER_PACKAGES = ("jax", "jaxlib", "tokamax", "libtpu", "torch_tpu")


def library_versions() -> str:
    found = []
    for name in COMPILER_PACKAGES:
        try:
            found.append(f"{name}={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ";".join(found)


def source_fingerprint(*objects) -> str:
    """A short hash of the source of modules, classes or functions."""
    digest = hashlib.sha256()
    for obj in objects:
        digest.update(inspect.getsource(obj).encode())
    return digest.hexdigest()[:16]


class DiskCache:
    """Pickled values in a folder (None: nothing is kept), with hit and miss counts; safe across threads."""

    def __init__(self, folder: Path | None):
        self.folder = Path(folder) if folder is not None else None
        self.hits = self.misses = 0
        self._lock = threading.Lock()
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)

    def get(self, key: str):
        """The value stored under `key`, or None."""
        if self.folder is None:
            return None
        path = self.folder / f"{key}.pkl"
        try:
            value = pickle.loads(path.read_bytes())
        except (OSError, EOFError, pickle.UnpicklingError, ImportError, AttributeError):
            value = None
        with self._lock:
            if value is None:
                self.misses += 1
            else:
                self.hits += 1
        return value

    def put(self, key: str, value):
        """Stores `value` under `key` (atomically: readers see the old entry or the whole new one); returns it."""
        if self.folder is not None:
            path = self.folder / f"{key}.pkl"
            staging = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            staging.write_bytes(pickle.dumps(value))
            staging.replace(path)
        return value
