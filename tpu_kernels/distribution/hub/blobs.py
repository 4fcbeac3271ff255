"""File contents of the local Hub: received into staging files, installed as content-addressed blobs
shared by all repos, and removed again when the commit that installed them fails and no other needs them.

    blobs/<sha256[:2]>/<sha256>     one file's content
    tmp/                            files of commits being received
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .durable import fsync_dir, make_dirs
from .errors import HubError

_SHA256 = re.compile(r"[0-9a-f]{64}")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    git_oid: str
    size: int

    def to_json(self) -> dict:
        return {"sha256": self.sha256, "oid": self.git_oid, "size": self.size}

    @staticmethod
    def from_json(data: dict) -> FileEntry:
        return FileEntry(sha256=data["sha256"], git_oid=data["oid"], size=data["size"])


@dataclass(frozen=True)
class StagedFile:
    """A file of a commit being received: its content is in tmp/ until the commit lands."""

    path: str
    entry: FileEntry
    staged_at: Path


class StagingWriter:
    """One uploaded file, received in pieces: memory stays at one piece whatever the file's size."""

    def __init__(self, folder: Path):
        fd, name = tempfile.mkstemp(dir=folder)
        self.path = Path(name)
        self._file = os.fdopen(fd, "wb")
        self._sha256 = hashlib.sha256()
        self.size = 0
        self.entry: FileEntry | None = None

    def write(self, data: bytes) -> None:
        self._file.write(data)
        self._sha256.update(data)
        self.size += len(data)

    def finish(self) -> FileEntry:
        """fsync the staged bytes and name them; the writer is closed."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        # A git blob id hashes the size before the content: a second pass, over the page cache.
        git_oid = hashlib.sha1(b"blob %d\0" % self.size)
        with open(self.path, "rb") as staged:
            while chunk := staged.read(1 << 20):
                git_oid.update(chunk)
        self.entry = FileEntry(sha256=self._sha256.hexdigest(), git_oid=git_oid.hexdigest(), size=self.size)
        return self.entry

    def staged_as(self, path: str) -> StagedFile:
        """The finished file, as the file a commit adds at `path`."""
        return StagedFile(path=path, entry=self.entry, staged_at=self.path)

    def abort(self) -> None:
        self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class BlobStore:
    """The blobs under `folder`, and the files of commits being received, staged in `staging`."""

    def __init__(self, folder: Path, staging: Path):
        self.folder = folder
        self.staging = staging
        self._ledger = _BlobLedger(self._file)

    def path(self, entry: FileEntry) -> Path:
        if not _SHA256.fullmatch(entry.sha256):
            raise HubError(500, "Corrupted file entry")
        return self._file(entry.sha256)

    def _file(self, sha256: str) -> Path:
        return self.folder / sha256[:2] / sha256

    def start_staging(self) -> StagingWriter:
        """A file of a commit being received, written piece by piece into tmp/; a blob only if its commit lands."""
        return StagingWriter(self.staging)

    def discard(self, staged: Iterable[StagedFile]) -> None:
        for file in staged:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(file.staged_at)

    def install(self, staged: StagedFile) -> None:
        target = self.path(staged.entry)
        if target.is_file():
            os.unlink(staged.staged_at)
            return
        make_dirs(target.parent)
        os.replace(staged.staged_at, target)
        fsync_dir(target.parent)

    @contextlib.contextmanager
    def installed(self, additions: list[StagedFile], referenced: set[str]) -> Iterator[None]:
        """Install the blobs of a commit's `additions`, for the block that records the commit.

        If the block raises, the blobs it installed are removed again, unless another commit relies on
        them; once it returns, the blobs in `referenced` (those its files name) are the commit's.
        """
        blobs = {addition.entry.sha256 for addition in additions}
        self._ledger.acquire(blobs)
        try:
            for addition in additions:
                self.install(addition)
            yield
            self._ledger.stored(referenced)
        finally:
            self._ledger.release(blobs)

    def collect_orphans(self, commit_files: Iterable[Path]) -> int:
        """Remove the blobs none of `commit_files` references; how many. Only while no commit is under way.

        Every commit object counts, reachable from a ref or not (a lock file may pin a commit of a
        deleted branch). If one cannot be read, nothing is removed.
        """
        referenced = set()
        for commit_file in commit_files:
            try:
                referenced.update(entry["sha256"] for entry in json.loads(commit_file.read_bytes())["files"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
                logger.warning("orphan blobs kept: cannot read %s (%s)", commit_file, error)
                return 0
        removed = 0
        for blob in self.folder.glob("*/*"):
            if _SHA256.fullmatch(blob.name) and blob.name not in referenced:
                blob.unlink()
                removed += 1
        return removed


class _BlobLedger:
    """The blobs commits under way rely on, so that a failed commit removes only blobs no one needs.

    A commit `acquire`s its blobs before installing any. One missing from the store then is
    unreferenced until a commit relying on it is `stored`; when the last commit relying on an
    unreferenced blob `release`s it, having failed, the blob is removed. A blob installed by one
    commit and found present by another is therefore kept while either may still reference it.
    """

    def __init__(self, blob_file):
        self._blob_file = blob_file
        self._lock = threading.Lock()
        self._users: collections.Counter[str] = collections.Counter()
        self._unreferenced: set[str] = set()

    def acquire(self, blobs: set[str]) -> None:
        with self._lock:
            for sha256 in blobs:
                self._users[sha256] += 1
                if not self._blob_file(sha256).is_file():
                    self._unreferenced.add(sha256)

    def stored(self, blobs: set[str]) -> None:
        with self._lock:
            self._unreferenced -= blobs

    def release(self, blobs: set[str]) -> None:
        with self._lock:
            for sha256 in blobs:
                self._users[sha256] -= 1
                if self._users[sha256]:
                    continue
                del self._users[sha256]
                if sha256 in self._unreferenced:
                    self._unreferenced.discard(sha256)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._blob_file(sha256))
