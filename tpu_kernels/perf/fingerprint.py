"""One fingerprint of the performance model's source, for caches of its grid replays.

A cached replay (`perf.replay_program`'s result) is only valid for the code
that produced it. That code is spread over the modules of this package (the
facade re-exports it), so the fingerprint hashes every `*.py` and `*.json`
file of the package, found through `perf.__path__`: a module added, split,
renamed or edited, or a constant refitted, gives a new fingerprint. Pricing
modules and constants are included although a cached replay is re-priced on
every read: telling replay code from pricing code apart by hand is the
mistake this rule avoids, at the cost of a replay after a refit.

Left out, since no replay or price reads them: `calibration*.py` (the
`tpu-kernels calibrate` harness: its compiles, cache and report) and
`collectives.py` (the multi-chip collective model).
"""

from __future__ import annotations

import hashlib
from fnmatch import fnmatch
from pathlib import Path

NOT_MODEL = ("calibration*.py", "collectives.py")


def package_folder() -> Path:
    """This package's folder, as Python found it."""
    from tpu_kernels import perf

    (folder,) = perf.__path__
    return Path(folder)


def model_files(folder: Path) -> list[Path]:
    """The files under `folder` the fingerprint covers, sorted by their path inside it."""
    found = [path for pattern in ("*.py", "*.json") for path in folder.rglob(pattern)
             if "__pycache__" not in path.parts and not any(fnmatch(path.name, skip) for skip in NOT_MODEL)]
    return sorted(found, key=lambda path: path.relative_to(folder).as_posix())


def model_source_fingerprint(folder: Path | None = None) -> str:
    """16 hex digits of the performance model's files (default: this package's): their paths and bytes."""
    folder = package_folder() if folder is None else Path(folder)
    digest = hashlib.sha256()
    for path in model_files(folder):
        content = path.read_bytes()
        digest.update(f"{path.relative_to(folder).as_posix()}\0{len(content)}\0".encode())
        digest.update(content)
    return digest.hexdigest()[:16]
