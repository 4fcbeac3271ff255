"""Durable storage of the local Hub: repos, their refs and their commits (file contents: blobs.py).

Layout under the root folder:

    blobs/<sha256[:2]>/<sha256>           file contents, content-addressed, shared by all repos
    repos/<type>/<namespace>/<name>/
        repo.json                           type, creation date, private flag
        commits/<commit id>.json            immutable commit objects (full file manifest)
        refs.json                           branches and tags -> commit ids
    tmp/                                    staging area, emptied when the server starts
    server.lock                             one server process per root

Folders are created 0700 (blobs/, repos/ and tmp/ are made 0700 at each start) and files 0600:
other users of the machine read nothing of a root, private repo names and commit ids included.

Crash safety: every file is written to tmp/, fsynced and renamed into place
(then its folder is fsynced), in the order blobs -> commit object -> refs.json.
A branch moves only when refs.json is replaced, so a crash at any point leaves
every ref at a complete commit; what a crashed commit wrote before that is
unreferenced and invisible. Commits to one repo are serialised by a lock.

Ids folded as the file system folds them: on a root that folds case (macOS, Windows), `ACME/x`
and `acme/x` open one folder. A repo's lock is keyed by its id in lower case (ids are ASCII, so
this is how any such file system folds them; on a root that does not fold, two repos whose ids
differ in case merely share a lock), and what is cached about a repo (its privacy) by the
folder actually opened, its device and inode.

Orphan blobs (no commit references them: a crashed commit's, a deleted repo's)
are removed when the server starts, and a commit that fails removes the blobs it
installed unless another commit relies on them (`BlobStore.installed`). A commit is
validated and encoded in full before its first blob is installed.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType

from ...folders import make_private_dirs
from .blobs import BlobStore, FileEntry, StagedFile
from .commits import (
    Commit,
    Deletion,
    Refs,
    Tree,
    apply_deletion,
    canonical_json,
    new_commit,
    now_iso,
    refuse_file_folder_clash,
    refuse_name_twins,
)
from .durable import fsync_dir, make_dirs, write_atomically
from .errors import HubError
from .names import (
    COMMIT_ID,
    MAIN_BRANCH,
    REPO_TYPES,
    split_full_ref,
    validate_ref_name,
    validate_repo_id,
    validate_repo_type,
    validate_revision,
)

TREE_CACHE_COMMITS = 16

logger = logging.getLogger(__name__)


class Storage:
    """Repos, commits, refs and blobs under one root folder, owned by one server process."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        make_private_dirs(self.root)
        self._server_lock = os.fdopen(os.open(self.root / "server.lock", os.O_RDWR | os.O_CREAT, 0o600), "a+")
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
            folder.mkdir(exist_ok=True, mode=0o700)
            # Closed to other users even when an earlier server made it 0755: what is inside names
            # private repos and their commits.
            os.chmod(folder, 0o700)
        self._repo_locks: dict[tuple[str, str], threading.Lock] = {}  # by type and folded id
        self._repo_locks_guard = threading.Lock()
        self._read_commit_cached = functools.lru_cache(maxsize=4096)(self._read_commit)
        # repo.json changes only under the repo's lock: read each once, keyed by the folder opened.
        self._privacy: dict[tuple[int, int], bool] = {}
        self._trees: collections.OrderedDict[str, Tree] = collections.OrderedDict()
        self._trees_guard = threading.Lock()
        self.blob_store = BlobStore(self.blobs, self.tmp)
        removed = self.blob_store.collect_orphans(self.repos.glob("*/*/*/commits/*.json"))
        if removed:
            logger.warning("removed %d orphan blob(s) from %s", removed, self.blobs)

    def close(self) -> None:
        self._server_lock.close()

    def _write_atomically(self, target: Path, content: bytes) -> None:
        write_atomically(target, content, self.tmp)

    # -- repos ----------------------------------------------------------------------------------

    def repo_dir(self, repo_type: str, repo_id: str) -> Path:
        validate_repo_type(repo_type)
        namespace, name = validate_repo_id(repo_id)
        return self.repos / repo_type / namespace / name

    def existing_repo_dir(self, repo_type: str, repo_id: str) -> Path:
        folder = self.repo_dir(repo_type, repo_id)
        if not self.repo_exists(repo_type, repo_id):
            raise HubError(404, f"Repository {repo_type}/{repo_id} not found", code="RepoNotFound")
        return folder

    @staticmethod
    def _folder_key(folder: Path) -> tuple[int, int]:
        """The folder a path opens, as (device, inode): one key for every spelling of it."""
        try:
            found = os.stat(folder)
        except FileNotFoundError:  # deleted since
            raise HubError(404, f"Repository {folder.parent.name}/{folder.name} not found", code="RepoNotFound") from None
        return found.st_dev, found.st_ino

    def repo_exists(self, repo_type: str, repo_id: str) -> bool:
        return (self.repo_dir(repo_type, repo_id) / "refs.json").is_file()

    def is_private(self, repo_type: str, repo_id: str) -> bool:
        folder = self.existing_repo_dir(repo_type, repo_id)
        key = self._folder_key(folder)
        private = self._privacy.get(key)
        if private is None:
            private = self._privacy[key] = bool(json.loads((folder / "repo.json").read_text()).get("private"))
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
    def _repo_lock(self, repo_type: str, *repo_ids: str) -> Iterator[None]:
        """The locks of the repos, each taken once and always in one order: two opposite moves cannot deadlock."""
        with self._repo_locks_guard:
            locks = [self._repo_locks.setdefault((repo_type, folded), threading.Lock())
                     for folded in sorted({repo_id.lower() for repo_id in repo_ids})]
        with contextlib.ExitStack() as held:
            for lock in locks:
                held.enter_context(lock)
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
                folder / "repo.json", canonical_json({"type": repo_type, "id": repo_id, "createdAt": created_at, "private": private})
            )
            self._privacy.pop(self._folder_key(folder), None)
            initial, raw = new_commit(None, {}, "initial commit", "", "system", created_at)
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
            key = self._folder_key(folder)
            doomed = Path(tempfile.mkdtemp(dir=self.tmp)) / "repo"
            os.rename(folder, doomed)
            fsync_dir(folder.parent)
            self._forget(key)
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
        with self._repo_lock(repo_type, repo_id, new_repo_id):
            source = self.existing_repo_dir(repo_type, repo_id)
            key = self._folder_key(source)
            if target.exists():
                if (target / "refs.json").is_file():
                    raise HubError(409, f"A {repo_type} repo {new_repo_id} already exists")
                # A repo whose creation crashed before refs.json: never visible, safe to replace.
                shutil.rmtree(target)
            make_dirs(target.parent)
            os.rename(source, target)
            fsync_dir(target.parent)
            fsync_dir(source.parent)
            record = json.loads((target / "repo.json").read_text())
            self._write_atomically(target / "repo.json", canonical_json({**record, "id": new_repo_id}))
            self._forget(key)

    def set_private(self, repo_type: str, repo_id: str, private: bool) -> None:
        """Make a repo private (invisible without the token) or public."""
        with self._repo_lock(repo_type, repo_id):
            folder = self.existing_repo_dir(repo_type, repo_id)
            record = json.loads((folder / "repo.json").read_text())
            self._write_atomically(folder / "repo.json", canonical_json({**record, "private": private}))
            self._privacy[self._folder_key(folder)] = private

    def _forget(self, key: tuple[int, int]) -> None:
        """Drop what is cached about the repo whose folder had `key` (deleted or moved away)."""
        self._privacy.pop(key, None)
        self._read_commit_cached.cache_clear()

    # -- refs and commits -----------------------------------------------------------------------

    def refs(self, repo_type: str, repo_id: str) -> Refs:
        folder = self.existing_repo_dir(repo_type, repo_id)
        data = json.loads((folder / "refs.json").read_text())
        return Refs(branches=MappingProxyType(data["branches"]), tags=MappingProxyType(data["tags"]))

    def _write_refs(self, folder: Path, refs: Refs) -> None:
        self._write_atomically(
            folder / "refs.json", canonical_json({"branches": dict(refs.branches), "tags": dict(refs.tags)})
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
        validate_revision(revision)
        refs = self.refs(repo_type, repo_id)
        kind, name = split_full_ref(revision)
        if kind is not None:
            commit_id = getattr(refs, kind).get(name)
        else:
            commit_id = refs.branches.get(revision) or refs.tags.get(revision)
        folder = self.existing_repo_dir(repo_type, repo_id)
        if commit_id is None and COMMIT_ID.fullmatch(revision) and (folder / "commits" / f"{revision}.json").is_file():
            commit_id = revision
        if commit_id is None:
            raise HubError(404, f"Invalid rev id: {revision}", code="RevisionNotFound")
        return self._read_commit_cached(folder, commit_id)

    def require_branch(self, repo_type: str, repo_id: str, branch: str) -> None:
        """404 unless `branch` (a name; see `branch_name` for `refs/heads/...`) is a branch."""
        validate_revision(branch)
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
        validate_revision(name)
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

    # -- commits ----------------------------------------------------------------------------------

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
                    apply_deletion(files, deletion)
                for addition in additions:
                    files[addition.path] = addition.entry
                refuse_file_folder_clash(files)
                refuse_name_twins(files, {addition.path for addition in additions})
                commit, raw = new_commit(head.id, files, title, message, author, now_iso())
                with self.blob_store.installed(additions, {files[addition.path].sha256 for addition in additions}):
                    commit_file = folder / "commits" / f"{commit.id}.json"
                    self._write_atomically(commit_file, raw)
                    try:
                        self._write_refs(folder, Refs(branches={**refs.branches, branch: commit.id}, tags=refs.tags))
                    except BaseException:
                        with contextlib.suppress(FileNotFoundError):
                            commit_file.unlink()
                        raise
                return commit
        finally:
            self.blob_store.discard(additions)

