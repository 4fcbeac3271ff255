"""Durable storage of the local Hub.

Layout under the root folder:

    blobs/<sha256[:2]>/<sha256>           file contents, content-addressed, shared by all repos
    repos/<type>/<namespace>/<name>/
        repo.json                           type, creation date, private flag
        commits/<commit id>.json            immutable commit objects (full file manifest)
        refs.json                           branches and tags -> commit ids
    tmp/                                    staging area, emptied when the server starts
    server.lock                             one server process per root

A commit id is the sha1 of the commit object's canonical JSON, which is also
the file's exact content: commits are content-addressed and self-verifying.

Crash safety: every file is written to tmp/, fsynced and renamed into place
(then its folder is fsynced), in the order blobs -> commit object -> refs.json.
A branch moves only when refs.json is replaced, so a crash at any point leaves
every ref at a complete commit; what a crashed commit wrote before that is
unreferenced and invisible. Commits to one repo are serialised by a lock.

Orphan blobs (no commit references them: a crashed commit's, a deleted repo's)
are removed when the server starts, and a commit that fails removes the blobs it
installed unless another commit relies on them (see `_BlobLedger`). A commit is
validated and encoded in full before its first blob is installed.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import unicodedata
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import MappingProxyType

REPO_TYPES = ("model", "kernel")
MAIN_BRANCH = "main"
# URL prefixes and API words that would make a namespace ambiguous in routes.
RESERVED_NAMESPACES = frozenset({"api", "models", "kernels", "datasets", "spaces", "buckets", "resolve", "tmp"})
MAX_PATH_CHARS = 1024
MAX_REF_CHARS = 255

_REPO_NAME_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")
_REF_CHARS = re.compile(r"[A-Za-z0-9._/-]+")
_COMMIT_ID = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# Control, format (bidi overrides, zero-width joiners, the code points HFS+ ignores in names),
# surrogate and line/paragraph separator characters: none belongs in a file name.
_REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
# The 8.3 short names Windows gives `.git` (GIT~1, or GIT~2... when names collide).
_GIT_SHORT_NAME = re.compile(r"GIT~[0-9]+")
TREE_CACHE_COMMITS = 16

logger = logging.getLogger(__name__)


NOT_SUPPORTED = "Not supported by this local Hub"


class HubError(Exception):
    """An error with the HTTP status and the `X-Error-Code` huggingface_hub maps to its exceptions."""

    def __init__(self, status: int, message: str, code: str | None = None, commit: str | None = None):
        # A message quoting a client's lone surrogate must still encode as UTF-8 in the answer.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.commit = commit


def now_iso() -> str:
    """The Hub's timestamp format: milliseconds, UTC, trailing Z."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def validate_repo_type(repo_type: str) -> str:
    if repo_type not in REPO_TYPES:
        raise HubError(400, f"{NOT_SUPPORTED}: {str(repo_type)[:40]!r} repos: this server holds kernel and model repos only")
    return repo_type


def validate_repo_id(repo_id: str) -> tuple[str, str]:
    """`namespace/name` with the Hub's character rules; returns both parts."""
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(_REPO_NAME_PART.fullmatch(part) for part in parts):
        raise HubError(
            400,
            f"Invalid repo id {repo_id!r}: expected 'namespace/name' made of letters, digits, '-', '_' and '.', "
            "each part starting and ending with a letter or digit, at most 96 characters",
        )
    if any("--" in part or ".." in part for part in parts):
        raise HubError(400, f"Invalid repo id {repo_id!r}: '--' and '..' are not allowed")
    if parts[0].lower() in RESERVED_NAMESPACES:
        raise HubError(400, f"Invalid repo id {repo_id!r}: namespace {parts[0]!r} is reserved")
    return parts[0], parts[1]


def validate_path(path: str) -> str:
    """A file path inside a repo: relative, normalised, never escaping the repo root, and safe to
    write into a local folder on any file system a client may use.

    Refused: control, format (bidi, zero-width), surrogate and line-separator characters; any
    part that git, or a file system folding case, dropping trailing dots and spaces or reading
    `name:stream` as a stream of `name`, would take for `.git` (`.GIT`, `.git.`, `.git `,
    `.git::$INDEX_ALLOCATION`, and the 8.3 short name `GIT~1`).
    """
    if not isinstance(path, str) or not path:
        raise HubError(400, "Invalid path: empty")
    if len(path) > MAX_PATH_CHARS:
        raise HubError(400, f"Invalid path {path[:80]!r}...: longer than {MAX_PATH_CHARS} characters")
    refused = next((char for char in path if unicodedata.category(char) in _REFUSED_CATEGORIES), None)
    if refused is not None:
        raise HubError(400, f"Invalid path {path!r}: control, bidi, zero-width and other invisible characters "
                            f"are not allowed (U+{ord(refused):04X})")
    if "\\" in path:
        raise HubError(400, f"Invalid path {path!r}: use '/' as the separator")
    if path.startswith("/"):
        raise HubError(400, f"Invalid path {path!r}: absolute paths are not allowed")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise HubError(400, f"Invalid path {path!r}: empty, '.' and '..' segments are not allowed")
    if any(_is_git_folder_alias(part) for part in parts):
        raise HubError(400, f"Invalid path {path!r}: '.git' folders are not allowed, in any case or spelling "
                            "a file system would read as '.git'")
    return path


def _is_git_folder_alias(part: str) -> bool:
    name = part.split(":", 1)[0].rstrip(". ")
    return name.upper() == ".GIT" or name.casefold() == ".git" or bool(_GIT_SHORT_NAME.fullmatch(name.upper()))


def name_key(path: str) -> str:
    """What a path is to a file system that folds case and Unicode normalisation and drops each
    name's trailing dots and spaces: two paths with one key land on one file there."""
    return "/".join(
        unicodedata.normalize("NFD", unicodedata.normalize("NFD", part.rstrip(". ")).upper().casefold())
        for part in path.split("/")
    )


def validate_ref_name(name: str) -> str:
    """A branch or tag name: git's check-ref-format rules on a conservative character set.

    Letters, digits, '.', '_', '-' and '/' only (so none of git's forbidden characters
    `~^:?*[\\`, spaces, control characters or `@{`), starting with a letter or digit; no
    empty, '.'-leading or '.lock'-ending component; no '..'; no trailing '.' or '/'. Also
    refused: names that read as a commit id or a full ref (`refs/...`), and `HEAD`.
    """
    if not isinstance(name, str) or not name:
        raise HubError(400, "Invalid branch or tag name: empty")
    problem = None
    components = name.split("/")
    if len(name) > MAX_REF_CHARS:
        problem = f"longer than {MAX_REF_CHARS} characters"
    elif not _REF_CHARS.fullmatch(name):
        problem = "only letters, digits, '.', '_', '-' and '/' are allowed"
    elif not name[0].isalnum():
        problem = "it must start with a letter or digit"
    elif any(not component for component in components):
        problem = "empty component ('//' or a trailing '/')"
    elif any(component.startswith(".") for component in components):
        problem = "a component starts with '.'"
    elif any(component.endswith(".lock") for component in components):
        problem = "a component ends with '.lock'"
    elif ".." in name:
        problem = "'..' is not allowed"
    elif name.endswith("."):
        problem = "it ends with '.'"
    elif _COMMIT_ID.fullmatch(name):
        problem = "it reads as a commit id"
    elif components[0] == "refs" or name == "HEAD":
        problem = "'HEAD' and names under 'refs/' are reserved"
    if problem:
        raise HubError(400, f"Invalid branch or tag name {name!r}: {problem}")
    return name


def split_full_ref(revision: str) -> tuple[str | None, str]:
    """("branches", name) for `refs/heads/<name>`, ("tags", name) for `refs/tags/<name>`, else (None, revision)."""
    for prefix, kind in (("refs/heads/", "branches"), ("refs/tags/", "tags")):
        if revision.startswith(prefix) and len(revision) > len(prefix):
            return kind, revision[len(prefix):]
    return None, revision


def branch_name(revision: str) -> str:
    """The branch a commit targets: `refs/heads/<name>` is `<name>`, as on the Hub."""
    kind, name = split_full_ref(revision)
    return name if kind == "branches" else revision


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
class StagedFile:
    """A file of a commit being received: its content is in tmp/ until the commit lands."""

    path: str
    entry: FileEntry
    staged_at: Path


@dataclass(frozen=True)
class Deletion:
    path: str
    is_folder: bool


class StagingWriter:
    """One uploaded file, received in pieces: memory stays at one piece whatever the file's size."""

    def __init__(self, folder: Path):
        fd, name = tempfile.mkstemp(dir=folder)
        self.path = Path(name)
        self._file = os.fdopen(fd, "wb")
        self._sha256 = hashlib.sha256()
        self.size = 0

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
        return FileEntry(sha256=self._sha256.hexdigest(), git_oid=git_oid.hexdigest(), size=self.size)

    def abort(self) -> None:
        self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs(path: Path) -> None:
    """mkdir -p, fsyncing each parent that gains an entry, so new folders survive a power cut."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):
            folder.mkdir()
            _fsync_dir(folder.parent)


def _canonical_json(data) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


class Storage:
    """Repos, commits, refs and blobs under one root folder, owned by one server process."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self._server_lock = open(self.root / "server.lock", "a+")
        try:
            fcntl.flock(self._server_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._server_lock.close()
            raise RuntimeError(f"another tpu-kernels hub server is already using {self.root}") from None
        self.blobs = self.root / "blobs"
        self.repos = self.root / "repos"
        self.tmp = self.root / "tmp"
        # Leftovers of a crashed commit: never referenced, safe to drop now that we own the root.
        shutil.rmtree(self.tmp, ignore_errors=True)
        for folder in (self.blobs, self.repos, self.tmp):
            folder.mkdir(exist_ok=True)
        self._repo_locks: dict[tuple[str, str], threading.Lock] = {}
        self._repo_locks_guard = threading.Lock()
        self._read_commit_cached = functools.lru_cache(maxsize=4096)(self._read_commit)
        # repo.json never changes once written: read each once.
        self._privacy: dict[Path, bool] = {}
        self._trees: collections.OrderedDict[str, Tree] = collections.OrderedDict()
        self._trees_guard = threading.Lock()
        self._ledger = _BlobLedger(self._blob_file)
        removed = self.collect_orphans()
        if removed:
            logger.warning("removed %d orphan blob(s) from %s", removed, self.blobs)

    def close(self) -> None:
        self._server_lock.close()

    # -- atomic files ---------------------------------------------------------------------------

    def _write_atomically(self, target: Path, content: bytes) -> None:
        _make_dirs(target.parent)
        fd, staging = tempfile.mkstemp(dir=self.tmp)
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
        _fsync_dir(target.parent)

    # -- repos ----------------------------------------------------------------------------------

    def repo_dir(self, repo_type: str, repo_id: str) -> Path:
        validate_repo_type(repo_type)
        namespace, name = validate_repo_id(repo_id)
        return self.repos / repo_type / namespace / name

    def existing_repo_dir(self, repo_type: str, repo_id: str) -> Path:
        folder = self.repo_dir(repo_type, repo_id)
        if not (folder / "refs.json").is_file():
            raise HubError(404, f"Repository {repo_type}/{repo_id} not found", code="RepoNotFound")
        return folder

    def is_private(self, repo_type: str, repo_id: str) -> bool:
        folder = self.existing_repo_dir(repo_type, repo_id)
        private = self._privacy.get(folder)
        if private is None:
            private = self._privacy[folder] = bool(json.loads((folder / "repo.json").read_text()).get("private"))
        return private

    def repo_ids(self, repo_type: str, namespace: str = "*") -> Iterator[str]:
        """Ids of the repos of one type (in one namespace), private ones included, in no order."""
        for refs in (self.repos / repo_type).glob(f"{namespace}/*/refs.json"):
            yield f"{refs.parent.parent.name}/{refs.parent.name}"

    def namespaces(self, include_private: bool) -> set[str]:
        return {
            repo_id.split("/")[0]
            for repo_type in REPO_TYPES
            for repo_id in self.repo_ids(repo_type)
            if include_private or not self.is_private(repo_type, repo_id)
        }

    def count_repos(self, namespace: str, include_private: bool) -> dict[str, int]:
        return {
            repo_type: sum(
                1 for repo_id in self.repo_ids(repo_type, namespace)
                if include_private or not self.is_private(repo_type, repo_id)
            )
            for repo_type in REPO_TYPES
        }

    def repo_created_at(self, repo_type: str, repo_id: str) -> str:
        folder = self.existing_repo_dir(repo_type, repo_id)
        return json.loads((folder / "repo.json").read_text())["createdAt"]

    def last_modified(self, repo_type: str, repo_id: str) -> str:
        """The date of the newest commit a branch points at."""
        folder = self.existing_repo_dir(repo_type, repo_id)
        return max(self._read_commit_cached(folder, head).date for head in self.refs(repo_type, repo_id).branches.values())

    @contextlib.contextmanager
    def _repo_lock(self, repo_type: str, repo_id: str) -> Iterator[None]:
        with self._repo_locks_guard:
            lock = self._repo_locks.setdefault((repo_type, repo_id), threading.Lock())
        with lock:
            yield

    def create_repo(self, repo_type: str, repo_id: str, author: str, private: bool = False) -> None:
        """A new repo whose `main` holds an empty initial commit, as on the Hub. 409 if it exists.

        A private repo is invisible (404) to requests without the token.
        """
        folder = self.repo_dir(repo_type, repo_id)
        with self._repo_lock(repo_type, repo_id):
            if (folder / "refs.json").is_file():
                raise HubError(409, f"You already created this {repo_type} repo: {repo_id}")
            created_at = now_iso()
            self._write_atomically(
                folder / "repo.json", _canonical_json({"type": repo_type, "id": repo_id, "createdAt": created_at, "private": private})
            )
            self._privacy.pop(folder, None)
            initial, raw = _new_commit(None, {}, "initial commit", "", "system", created_at)
            self._write_atomically(folder / "commits" / f"{initial.id}.json", raw)
            # refs.json last: its presence is what makes the repo exist.
            self._write_refs(folder, Refs(branches={MAIN_BRANCH: initial.id}, tags={}))

    def delete_repo(self, repo_type: str, repo_id: str) -> None:
        """Remove a repo with its refs and commits at once; 404 if missing.

        Its folder is first renamed into tmp/ (one atomic step: the repo is gone for every
        request after it), then removed. Blobs stay: they are shared by content with other repos.
        """
        with self._repo_lock(repo_type, repo_id):
            folder = self.existing_repo_dir(repo_type, repo_id)
            doomed = Path(tempfile.mkdtemp(dir=self.tmp)) / "repo"
            os.rename(folder, doomed)
            _fsync_dir(folder.parent)
            self._forget(folder)
        shutil.rmtree(doomed.parent, ignore_errors=True)

    def move_repo(self, repo_type: str, repo_id: str, new_repo_id: str) -> None:
        """Rename a repo, within or across namespaces: 404 if missing, 409 if the new id is taken.

        One rename moves refs and commits together; commit ids do not change, so lock files that
        pin them still resolve under the new id. Requests to the old id answer 404 (the Hub
        redirects them; this server does not).
        """
        source = self.existing_repo_dir(repo_type, repo_id)
        target = self.repo_dir(repo_type, new_repo_id)
        if source == target:
            raise HubError(400, f"Cannot move {repo_type} repo {repo_id} onto itself")
        # Both locks, always in one order: two opposite moves cannot deadlock.
        first, second = sorted([repo_id, new_repo_id])
        with self._repo_lock(repo_type, first), self._repo_lock(repo_type, second):
            source = self.existing_repo_dir(repo_type, repo_id)
            if target.exists():
                if (target / "refs.json").is_file():
                    raise HubError(409, f"A {repo_type} repo {new_repo_id} already exists")
                # A repo whose creation crashed before refs.json: never visible, safe to replace.
                shutil.rmtree(target)
            _make_dirs(target.parent)
            os.rename(source, target)
            _fsync_dir(target.parent)
            _fsync_dir(source.parent)
            record = json.loads((target / "repo.json").read_text())
            self._write_atomically(target / "repo.json", _canonical_json({**record, "id": new_repo_id}))
            self._forget(source)
            self._forget(target)

    def set_private(self, repo_type: str, repo_id: str, private: bool) -> None:
        """Make a repo private (invisible without the token) or public."""
        with self._repo_lock(repo_type, repo_id):
            folder = self.existing_repo_dir(repo_type, repo_id)
            record = json.loads((folder / "repo.json").read_text())
            self._write_atomically(folder / "repo.json", _canonical_json({**record, "private": private}))
            self._privacy[folder] = private

    def _forget(self, folder: Path) -> None:
        """Drop what is cached about the repo that was at `folder` (deleted or moved away)."""
        self._privacy.pop(folder, None)
        self._read_commit_cached.cache_clear()

    # -- refs and commits -----------------------------------------------------------------------

    def refs(self, repo_type: str, repo_id: str) -> Refs:
        folder = self.existing_repo_dir(repo_type, repo_id)
        data = json.loads((folder / "refs.json").read_text())
        return Refs(branches=MappingProxyType(data["branches"]), tags=MappingProxyType(data["tags"]))

    def _write_refs(self, folder: Path, refs: Refs) -> None:
        self._write_atomically(
            folder / "refs.json", _canonical_json({"branches": dict(refs.branches), "tags": dict(refs.tags)})
        )

    def _read_commit(self, folder: Path, commit_id: str) -> Commit:
        raw = (folder / "commits" / f"{commit_id}.json").read_bytes()
        if hashlib.sha1(raw).hexdigest() != commit_id:
            raise HubError(500, f"Commit {commit_id} is corrupted on disk")
        data = json.loads(raw)
        return Commit(
            id=commit_id,
            parent=data["parent"],
            files=MappingProxyType({path: FileEntry.from_json(entry) for path, entry in data["files"].items()}),
            title=data["title"],
            message=data["message"],
            author=data["author"],
            date=data["date"],
        )

    def commit(self, repo_type: str, repo_id: str, commit_id: str) -> Commit:
        return self._read_commit_cached(self.existing_repo_dir(repo_type, repo_id), commit_id)

    def resolve_revision(self, repo_type: str, repo_id: str, revision: str) -> Commit:
        """What the Hub accepts in `revision`: a branch, then a tag, then a full commit id; or a
        full ref name, `refs/heads/<branch>` or `refs/tags/<tag>`, which names only that kind."""
        refs = self.refs(repo_type, repo_id)
        kind, name = split_full_ref(revision)
        if kind is not None:
            commit_id = getattr(refs, kind).get(name)
        else:
            commit_id = refs.branches.get(revision) or refs.tags.get(revision)
        folder = self.existing_repo_dir(repo_type, repo_id)
        if commit_id is None and _COMMIT_ID.fullmatch(revision) and (folder / "commits" / f"{revision}.json").is_file():
            commit_id = revision
        if commit_id is None:
            raise HubError(404, f"Invalid rev id: {revision}", code="RevisionNotFound")
        return self._read_commit_cached(folder, commit_id)

    def require_branch(self, repo_type: str, repo_id: str, branch: str) -> None:
        """404 unless `branch` (a name; see `branch_name` for `refs/heads/...`) is a branch."""
        if branch not in self.refs(repo_type, repo_id).branches:
            raise HubError(404, f"Invalid rev id: {branch} (commits go to an existing branch)", code="RevisionNotFound")

    def history(self, repo_type: str, repo_id: str, revision: str) -> Iterator[Commit]:
        commit: Commit | None = self.resolve_revision(repo_type, repo_id, revision)
        while commit is not None:
            yield commit
            commit = self.commit(repo_type, repo_id, commit.parent) if commit.parent else None

    def create_branch(self, repo_type: str, repo_id: str, branch: str, starting_point: str) -> None:
        self._create_ref(repo_type, repo_id, "branches", branch, starting_point)

    def create_tag(self, repo_type: str, repo_id: str, tag: str, revision: str) -> None:
        self._create_ref(repo_type, repo_id, "tags", tag, revision)

    def _create_ref(self, repo_type: str, repo_id: str, kind: str, name: str, revision: str) -> None:
        validate_ref_name(name)
        folder = self.existing_repo_dir(repo_type, repo_id)
        with self._repo_lock(repo_type, repo_id):
            target = self.resolve_revision(repo_type, repo_id, revision)
            refs = self.refs(repo_type, repo_id)
            if name in refs.branches or name in refs.tags:
                raise HubError(409, f"Reference already exists: {name}")
            # As in git, `a` and `a/b` cannot both be refs of one kind.
            clash = next((other for other in getattr(refs, kind)
                          if other.startswith(name + "/") or name.startswith(other + "/")), None)
            if clash is not None:
                raise HubError(409, f"Reference {name!r} conflicts with the existing {clash!r}")
            updated = {"branches": dict(refs.branches), "tags": dict(refs.tags)}
            updated[kind][name] = target.id
            self._write_refs(folder, Refs(**updated))

    def delete_ref(self, repo_type: str, repo_id: str, kind: str, name: str) -> None:
        """Delete branch or tag `name` (`kind` "branches" or "tags"; its full ref name works too)."""
        full_kind, short = split_full_ref(name)
        if full_kind == kind:
            name = short
        folder = self.existing_repo_dir(repo_type, repo_id)
        if kind == "branches" and name == MAIN_BRANCH:
            raise HubError(403, "The main branch cannot be deleted")
        with self._repo_lock(repo_type, repo_id):
            refs = self.refs(repo_type, repo_id)
            updated = {"branches": dict(refs.branches), "tags": dict(refs.tags)}
            if updated[kind].pop(name, None) is None:
                raise HubError(404, f"Invalid rev id: {name}", code="RevisionNotFound")
            self._write_refs(folder, Refs(**updated))

    # -- blobs ----------------------------------------------------------------------------------

    def blob_path(self, entry: FileEntry) -> Path:
        if not _SHA256.fullmatch(entry.sha256):
            raise HubError(500, "Corrupted file entry")
        return self._blob_file(entry.sha256)

    def _blob_file(self, sha256: str) -> Path:
        return self.blobs / sha256[:2] / sha256

    def start_staging(self) -> StagingWriter:
        """A file of a commit being received, written piece by piece into tmp/; a blob only if its commit lands."""
        return StagingWriter(self.tmp)

    def discard(self, staged: Iterable[StagedFile]) -> None:
        for file in staged:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(file.staged_at)

    def _install_blob(self, staged: StagedFile) -> None:
        target = self.blob_path(staged.entry)
        if target.is_file():
            os.unlink(staged.staged_at)
            return
        _make_dirs(target.parent)
        os.replace(staged.staged_at, target)
        _fsync_dir(target.parent)

    def collect_orphans(self) -> int:
        """Remove the blobs no commit references; how many. Only while no commit is under way (at start).

        Every commit object counts, reachable from a ref or not (a lock file may pin a commit of a
        deleted branch). If one cannot be read, nothing is removed.
        """
        referenced = set()
        for commit_file in self.repos.glob("*/*/*/commits/*.json"):
            try:
                referenced.update(entry["sha256"] for entry in json.loads(commit_file.read_bytes())["files"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
                logger.warning("orphan blobs kept: cannot read %s (%s)", commit_file, error)
                return 0
        removed = 0
        for blob in self.blobs.glob("*/*"):
            if _SHA256.fullmatch(blob.name) and blob.name not in referenced:
                blob.unlink()
                removed += 1
        return removed

    def tree(self, commit: Commit) -> Tree:
        """The commit's folders (listings, git tree ids), computed once per commit while it is in use."""
        with self._trees_guard:
            tree = self._trees.get(commit.id)
            if tree is not None:
                self._trees.move_to_end(commit.id)
                return tree
        tree = Tree(commit.files)
        with self._trees_guard:
            self._trees[commit.id] = tree
            while len(self._trees) > TREE_CACHE_COMMITS:
                self._trees.popitem(last=False)
        return tree

    # -- commits --------------------------------------------------------------------------------

    def commit_operations(
        self,
        repo_type: str,
        repo_id: str,
        branch: str,
        *,
        additions: list[StagedFile],
        deletions: list[Deletion],
        title: str,
        message: str,
        author: str,
        parent_commit: str | None,
    ) -> Commit:
        """Apply deletions then additions on top of the branch head, as one new commit.

        Concurrent commits to one repo are serialised; each applies to the head it
        finds, so none is lost. With `parent_commit`, the commit is refused (412)
        if the branch has moved since, as on the Hub. The new commit is checked and
        encoded before its first blob is installed; if it fails after that, the blobs
        it installed go again unless another commit relies on them.
        """
        folder = self.existing_repo_dir(repo_type, repo_id)
        try:
            with self._repo_lock(repo_type, repo_id):
                self.require_branch(repo_type, repo_id, branch)
                refs = self.refs(repo_type, repo_id)
                head = self._read_commit_cached(folder, refs.branches[branch])
                if parent_commit is not None and not head.id.startswith(parent_commit.lower()):
                    raise HubError(
                        412,
                        f"A commit has happened since. Please refresh and try again. "
                        f"(branch {branch} is at {head.id}, parentCommit was {parent_commit})",
                        commit=head.id,
                    )
                files = dict(head.files)
                for deletion in deletions:
                    _apply_deletion(files, deletion)
                for addition in additions:
                    files[addition.path] = addition.entry
                _refuse_file_folder_clash(files)
                _refuse_name_twins(files, {addition.path for addition in additions})
                commit, raw = _new_commit(head.id, files, title, message, author, now_iso())
                blobs = {addition.entry.sha256 for addition in additions}
                referenced = {files[addition.path].sha256 for addition in additions}
                self._ledger.acquire(blobs)
                try:
                    for addition in additions:
                        self._install_blob(addition)
                    commit_file = folder / "commits" / f"{commit.id}.json"
                    self._write_atomically(commit_file, raw)
                    try:
                        self._write_refs(folder, Refs(branches={**refs.branches, branch: commit.id}, tags=refs.tags))
                    except BaseException:
                        with contextlib.suppress(FileNotFoundError):
                            commit_file.unlink()
                        raise
                    self._ledger.stored(referenced)
                finally:
                    self._ledger.release(blobs)
                return commit
        finally:
            self.discard(additions)


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


def _new_commit(
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
        raw = _canonical_json(body)
    except UnicodeEncodeError:
        raise HubError(400, "Invalid commit: its title, message or a path is not valid Unicode") from None
    commit = Commit(id=hashlib.sha1(raw).hexdigest(), parent=parent, files=MappingProxyType(dict(files)),
                    title=title, message=message, author=author, date=date)
    return commit, raw


def _apply_deletion(files: dict[str, FileEntry], deletion: Deletion) -> None:
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


def _refuse_file_folder_clash(files: Mapping[str, FileEntry]) -> None:
    """A path cannot be a file and a folder at once: git could not store it, clients could not download it."""
    for path in files:
        folder = path
        while "/" in folder:
            folder = folder.rsplit("/", 1)[0]
            if folder in files:
                raise HubError(400, f"Invalid commit: {folder!r} would be both a file and a folder (of {path!r})")


def _refuse_name_twins(files: Mapping[str, FileEntry], added: set[str]) -> None:
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
