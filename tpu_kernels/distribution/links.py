"""No symbolic link takes a build or an upload out of its folder.

`tpu-kernels build` copies a kernel repo's files into the build, and `tpu-kernels upload` sends a
build's files to a Hub, where anyone may download them. Both read files through the file system,
which follows symbolic links: a package file, a `benchmarks/data` folder or `CARD.md` linked to a
private key would publish the key (the digest covers the copied bytes, so nothing flags it).

`refuse_links_out` walks what will be read, without following links, and refuses, naming the link:
a link to a folder (it could lead anywhere, itself included), and a link whose target, all links
resolved, is not a file inside the folder. A link to a file inside the folder is read as that file.
It also refuses, naming it, a special file (a named pipe, device or socket): reading one would wait
forever or read what is not a file of the kernel.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path


class LinkOutError(ValueError):
    """A symbolic link that would take a build or an upload out of its folder; `link` is the link."""

    def __init__(self, message: str, link: Path):
        super().__init__(message)
        self.link = link


class SpecialFileError(ValueError):
    """A named pipe, device or socket where a build or an upload reads files; `path` is the entry."""

    def __init__(self, message: str, path: Path):
        super().__init__(message)
        self.path = path


def refuse_links_out(root: Path, names: Iterable[str | Path], what: str) -> None:
    """Raise LinkOutError for the first symbolic link met on the way from `root` to each of `names`
    (paths relative to `root`; missing ones are skipped) or anywhere below them, unless it leads to a
    file inside `root`; SpecialFileError for a special file among them. `what` names the command in the
    message ("tpu-kernels build")."""
    real_root = Path(os.path.realpath(root))
    for name in names:
        path = Path(root)
        for part in Path(name).parts:
            path = path / part
            if path.is_symlink():
                _check_link(path, real_root, what)
            elif not path.exists():
                break
        else:
            _refuse_special(path, what)
            if path.is_dir() and not path.is_symlink():
                for folder, folders, files in os.walk(path, followlinks=False):
                    for entry in sorted(folders + files):
                        candidate = Path(folder) / entry
                        if candidate.is_symlink():
                            _check_link(candidate, real_root, what)
                        else:
                            _refuse_special(candidate, what)


def _refuse_special(path: Path, what: str) -> None:
    mode = path.lstat().st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
        raise SpecialFileError(f"{path} is not a file or a folder (a named pipe, device or socket): {what} reads "
                               "only files; remove it", path)


def _check_link(link: Path, real_root: Path, what: str) -> None:
    target = Path(os.path.realpath(link))
    fix = "replace the link with a copy of what it points to"
    if target.is_dir():
        raise LinkOutError(f"{link} is a symbolic link to a folder ({target}): {what} follows no link to a "
                           f"folder; {fix}", link)
    if not target.is_file():
        raise LinkOutError(f"{link} is a symbolic link to {target}, which is not a file: {fix}", link)
    if real_root not in target.parents:
        raise LinkOutError(f"{link} is a symbolic link to {target}, outside {real_root}: {what} reads no file "
                           f"from outside the folder it publishes; {fix}", link)
