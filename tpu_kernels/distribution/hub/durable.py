"""Writes that survive a crash or a power cut: fsynced files renamed into place, fsynced folders."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """mkdir -p, fsyncing each parent that gains an entry, so new folders survive a power cut. New
    folders are 0700: other users list no repo names or commit ids."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)
            fsync_dir(folder.parent)


def write_atomically(target: Path, content: bytes, staging_folder: Path) -> None:
    """`target` holds all of `content` or what it held before, whenever the process or machine stops.

    `staging_folder` must be on the file system of `target`: the file is written there, then renamed.
    """
    make_dirs(target.parent)
    fd, staging = tempfile.mkstemp(dir=staging_folder)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(content)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)
        raise
    fsync_dir(target.parent)
