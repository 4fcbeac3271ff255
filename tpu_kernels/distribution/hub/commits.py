"""Commit objects and the folders of their files.

A commit id is the sha1 of the commit object's canonical JSON, which is also the file's exact content:
commits are content-addressed and self-verifying. A new commit is checked here (deletions that delete
something, no path both a file and a folder, no two paths one file on macOS or Windows) before any of
its files is stored.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from types import MappingProxyType

from .blobs import FileEntry
from .errors import HubError
from .names import name_key


def now_iso() -> str:
    """The Hub's timestamp format: milliseconds, UTC, trailing Z."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def canonical_json(data) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class Commit:
    id: str
    parent: str | None
    files: Mapping[str, FileEntry]
    title: str
    message: str
    author: str
    date: str


@dataclass(frozen=True)
class Refs:
    branches: Mapping[str, str]
    tags: Mapping[str, str]


@dataclass(frozen=True)
class Deletion:
    path: str
    is_folder: bool


def new_commit(
    parent: str | None, files: Mapping[str, FileEntry], title: str, message: str, author: str, date: str
) -> tuple[Commit, bytes]:
    """A commit object and its canonical JSON (the bytes its id hashes)."""
    body = {
        "parent": parent,
        "files": {path: files[path].to_json() for path in sorted(files)},
        "title": title,
        "message": message,
        "author": author,
        "date": date,
    }
    try:
        raw = canonical_json(body)
    except UnicodeEncodeError:
        raise HubError(400, "Invalid commit: its title, message or a path is not valid Unicode") from None
    commit = Commit(id=hashlib.sha1(raw).hexdigest(), parent=parent, files=MappingProxyType(dict(files)),
                    title=title, message=message, author=author, date=date)
    return commit, raw


def apply_deletion(files: dict[str, FileEntry], deletion: Deletion) -> None:
    if not deletion.is_folder:
        if files.pop(deletion.path, None) is None:
            raise HubError(404, f"A file with this name doesn't exist: {deletion.path}", code="EntryNotFound")
        return
    prefix = deletion.path.rstrip("/") + "/"
    doomed = [path for path in files if path.startswith(prefix)]
    if not doomed:
        raise HubError(404, f"A folder with this name doesn't exist: {deletion.path}", code="EntryNotFound")
    for path in doomed:
        del files[path]


def refuse_file_folder_clash(files: Mapping[str, FileEntry]) -> None:
    """A path cannot be a file and a folder at once: git could not store it, clients could not download it."""
    for path in files:
        folder = path
        while "/" in folder:
            folder = folder.rsplit("/", 1)[0]
            if folder in files:
                raise HubError(400, f"Invalid commit: {folder!r} would be both a file and a folder (of {path!r})")


def refuse_name_twins(files: Mapping[str, FileEntry], added: set[str]) -> None:
    """An added path may not land where another file or folder does on a file system that folds
    case and Unicode normalisation or drops trailing dots and spaces (macOS, Windows): a client
    writing the repo to disk there would get one file for two. Twins already in the branch stay."""
    seen: dict[str, str] = {}
    for path in sorted(files, key=lambda name: name in added):
        prefix, key = "", ""
        for part in path.split("/"):
            prefix, key = (f"{prefix}/{part}", f"{key}/{name_key(part)}") if prefix else (part, name_key(part))
            other = seen.setdefault(key, prefix)
            if other != prefix and path in added:
                raise HubError(400, f"Invalid commit: {prefix!r} and {other!r} differ only in case, Unicode "
                                    "normalisation or trailing dots and spaces: on macOS and Windows they are one")


_FILE_MODE, _FOLDER_MODE = b"100644", b"40000"


class Tree:
    """A commit's files seen as folders: each folder's entries and its git tree id, computed in
    one pass over the files (time linear in files plus folders), then listed in pages."""

    def __init__(self, files: Mapping[str, FileEntry]):
        self._files = files
        children: dict[str, list[str]] = {"": []}
        for path in files:
            while True:
                parent = path.rpartition("/")[0]
                known = parent in children
                children.setdefault(parent, []).append(path)
                if known:
                    break
                path = parent
        self._children = {folder: sorted(entries) for folder, entries in children.items()}
        self._paths = sorted(path for entries in children.values() for path in entries)
        self._folder_ids: dict[str, bytes] = {}
        # Deepest first: a folder's id hashes its subfolders' ids.
        for folder in sorted(children, key=lambda name: (name == "", -name.count("/"))):
            self._folder_ids[folder] = self._git_tree_id(self._children[folder])

    def _git_tree_id(self, entries: list[str]) -> bytes:
        records = []
        for path in entries:
            name = path.rpartition("/")[2].encode()
            entry = self._files.get(path)
            if entry is not None:
                records.append((name, _FILE_MODE + b" " + name + b"\0" + bytes.fromhex(entry.git_oid)))
            else:  # git orders a folder as if its name ended with '/'
                records.append((name + b"/", _FOLDER_MODE + b" " + name + b"\0" + self._folder_ids[path]))
        content = b"".join(record for _, record in sorted(records))
        return hashlib.sha1(b"tree %d\0" % len(content) + content).digest()

    def is_folder(self, path: str) -> bool:
        """Whether `path` is a folder below the root."""
        return bool(path) and path in self._folder_ids and path not in self._files

    def entry(self, path: str) -> FileEntry | None:
        """The file at `path`; None for a folder."""
        return self._files.get(path)

    def folder_id(self, folder: str) -> str:
        """The folder's git tree id, as the Hub reports it."""
        return self._folder_ids[folder].hex()

    def listing(self, folder: str, recursive: bool) -> Sequence[str]:
        """Paths of the files and folders in `folder` ("" for the root), or below it, in order; 404 if
        there is no such folder."""
        if folder and not self.is_folder(folder):
            raise HubError(404, f"Entry not found: {folder}", code="EntryNotFound")
        if not recursive:
            return self._children[folder]
        if not folder:
            return self._paths
        # '0' follows '/': the paths below `folder` sit between the two in sorted order.
        return self._paths[bisect.bisect_left(self._paths, folder + "/"):bisect.bisect_left(self._paths, folder + "0")]
