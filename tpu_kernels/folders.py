"""Folders this package makes: 0700 whatever the umask, the parents it makes on the way included.

`Path.mkdir(parents=True, mode=0o700)` gives the mode to the last folder only: each parent it makes gets
0777 less the umask, so under umask 002 (the default of user-private-group systems: Fedora, RHEL) a fresh
`~/.cache/tpu-kernels` came out 0775, and the cache checks then refused the folder just made. Standard
library only: the loader, the Hub server and the caches all use it.
"""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_MODE = 0o700


def make_private_dirs(folder: Path | str) -> Path:
    """mkdir -p `folder`, every folder it makes (parents included) 0700; folders that exist are left as they
    are. Returns `folder` as a Path."""
    folder = Path(folder)
    missing = []
    walk = folder
    while not walk.is_dir():
        missing.append(walk)
        if walk.parent == walk:
            break
        walk = walk.parent
    for path in reversed(missing):
        try:
            path.mkdir(mode=PRIVATE_MODE)
        except FileExistsError:  # made meanwhile by another process, or not a folder (is_dir below says)
            continue
        _set_private_mode(path)
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder} is not a folder")
    return folder


def _set_private_mode(folder: Path) -> None:
    """0700 on the folder just made (a umask that takes the owner's bits too, 0277, leaves less), through a
    descriptor: a link put in its place meanwhile is not followed."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, PRIVATE_MODE)
    finally:
        os.close(fd)
