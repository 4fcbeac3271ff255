"""`tpu-kernels upload build/<name> --repo-id ORG/NAME`: publish a build through huggingface_hub.

The Hub layout `kernels` expects:

    main    README.md (the kernel card)
    v<N>    README.md, build/<variant>/..., benchmarks/...   (N: the kernel's major version)

An upload makes one commit on `v<N>` that turns its tree into exactly the build
(files the build lacks are deleted in the same commit; `.gitattributes`, which
the Hub manages, stays), then one commit of the card on `main`. Both commits
name their parent (`parent_commit`), so a concurrent upload cannot slip in
between reading a branch and committing to it: the Hub refuses the commit (412)
and the upload reads the branch again and retries, up to MAX_ATTEMPTS times,
then fails saying so. A new `v<N>` is born holding the build: the commit goes to
a temporary branch, and `v<N>` is created at that commit. The card goes on
`main` only while `v<N>` still holds this upload's build, so `main` ends with the
card of the build that `v<N>` ends with. Unchanged files, and an unchanged card
or build, make no commit.

Everything goes through `HfApi` (create_repo, create_branch, list_repo_tree,
create_commit, ...), so the same command publishes to huggingface.co or to a
`tpu-kernels serve` hub (HF_ENDPOINT or --endpoint); the token comes from
HF_TOKEN or `hf auth login`.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import CommitInfo, CommitOperationAdd, CommitOperationDelete, HfApi, RepoFile
from huggingface_hub.errors import HfHubHTTPError, RevisionNotFoundError
from kernels import Metadata

from .digest import METADATA_FILE, KernelIntegrityError, backend_mismatch, git_blob_id, verify_variant
from .links import refuse_links_out

PUBLISHED_FOLDERS = ("build", "benchmarks")
CARD = "README.md"
MAIN_BRANCH = "main"
# Files the Hub itself keeps in a repo's tree; an upload leaves them in place.
HUB_MANAGED_FILES = frozenset({".gitattributes"})
MAX_ATTEMPTS = 8
# What the Hub answers a commit whose parent_commit is no longer the branch head.
_MOVED_STATUSES = (409, 412)


class UploadConflictError(RuntimeError):
    """The branch kept moving under concurrent uploads: this upload made no commit there."""


@dataclass(frozen=True)
class KernelBuild:
    """What `tpu-kernels build` wrote for one kernel."""

    root: Path
    name: str
    version: int
    variants: tuple[str, ...]

    @classmethod
    def open(cls, root: Path) -> KernelBuild:
        root = Path(root)
        variant_dirs = sorted(path.parent for path in (root / "build").glob(f"*/{METADATA_FILE}"))
        if not variant_dirs:
            raise FileNotFoundError(f"{root} is not a kernel build: no build/<variant>/metadata.json")
        metadata = {path.name: Metadata.read_from_file(path / METADATA_FILE) for path in variant_dirs}
        names = {str(meta.name) for meta in metadata.values()}
        versions = {meta.version for meta in metadata.values()}
        if len(names) != 1 or len(versions) != 1 or None in versions:
            raise ValueError(
                f"{root}: variants disagree on name/version or lack a version: "
                + ", ".join(f"{variant}: {meta.name} v{meta.version}" for variant, meta in metadata.items())
            )
        for path in variant_dirs:
            try:
                verify_variant(path)
            except KernelIntegrityError as error:
                raise KernelIntegrityError(f"{error}\nRebuild before uploading.", error.files) from None
            mismatch = backend_mismatch(path)
            if mismatch is not None:
                raise KernelIntegrityError(f"{path}: {mismatch}. Rebuild before uploading.", [path / METADATA_FILE])
        return cls(root=root, name=names.pop(), version=versions.pop(), variants=tuple(p.name for p in variant_dirs))

    def published_files(self) -> dict[str, Path]:
        """Repo path -> local file, without bytecode (a load writes it next to the sources)."""
        files = {}
        for folder in PUBLISHED_FOLDERS:
            for path in sorted((self.root / folder).rglob("*")):
                relative = path.relative_to(self.root)
                if path.is_file() and "__pycache__" not in relative.parts and path.suffix != ".pyc":
                    files[relative.as_posix()] = path
        if (self.root / CARD).is_file():
            files[CARD] = self.root / CARD
        return files


@dataclass(frozen=True)
class Publication:
    """What an upload left: `build_oid` is the head of `branch` holding the build, made by this
    upload (`build_commit`) or already there (`build_commit` None); `card_commit` None when `main`
    already had the card, or a later upload of the branch took over the card."""

    repo_id: str
    branch: str
    build_oid: str
    build_commit: CommitInfo | None
    card_commit: CommitInfo | None


def upload_kernel(
    build_dir: str | Path,
    repo_id: str,
    *,
    version: int | None = None,
    endpoint: str | None = None,
    token: str | None = None,
) -> Publication:
    """Publish `build_dir` (the build on v<version>, its README on main) and return the commits made.

    `version` defaults to the version in the build's metadata; `endpoint` to
    HF_ENDPOINT; `token` to HF_TOKEN or the stored login.

    Raises:
        UploadConflictError: other uploads kept moving the branch (or main) for MAX_ATTEMPTS tries.
    """
    refuse_links_out(Path(build_dir), (*PUBLISHED_FOLDERS, CARD), "tpu-kernels upload")
    build = KernelBuild.open(Path(build_dir))
    version = build.version if version is None else version
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f"version must be a non-negative int, got {version!r}")
    branch = f"v{version}"
    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, repo_type="kernel", exist_ok=True)
    files = {path: _LocalFile(local) for path, local in build.published_files().items()}
    upload = _BranchUpload(api, repo_id, branch, build, files)
    build_oid, build_commit = upload.commit_build()
    card_commit = upload.commit_card(build_oid) if CARD in files else None
    return Publication(repo_id, branch, build_oid, build_commit, card_commit)


@dataclass(frozen=True)
class _LocalFile:
    path: Path

    def matches(self, remote: RepoFile) -> bool:
        data = self.path.read_bytes()
        if remote.lfs is not None:
            return hashlib.sha256(data).hexdigest() == remote.lfs.sha256
        return git_blob_id(data) == remote.blob_id


@dataclass
class _BranchUpload:
    api: HfApi
    repo_id: str
    branch: str
    build: KernelBuild
    files: dict[str, _LocalFile]

    def commit_build(self) -> tuple[str, CommitInfo | None]:
        """Make `branch` hold exactly the build; its head and the commit made (None if it held it already)."""
        for attempt in range(MAX_ATTEMPTS):
            head = self._head(self.branch)
            if head is not None and self._holds_build(head):
                return head, None
            try:
                commit = self._commit_to_existing(head) if head is not None else self._commit_to_new_branch()
            except HfHubHTTPError as error:
                if _status(error) not in _MOVED_STATUSES:
                    raise
            else:
                # huggingface_hub drops additions the branch already has (asked before the
                # commit) and skips a commit left empty: trust the branch, not the reply.
                if self._holds_build(commit.oid):
                    return commit.oid, commit
            _back_off(attempt)
        raise UploadConflictError(
            f"{self.repo_id}@{self.branch} kept moving under concurrent uploads: no commit of this build "
            f"after {MAX_ATTEMPTS} attempts. Run the upload again."
        )

    def commit_card(self, build_oid: str) -> CommitInfo | None:
        """Put the build's card on main, unless `branch` moved on to another upload's build (whose card it is)."""
        card = self.files[CARD]
        for attempt in range(MAX_ATTEMPTS):
            main_head = self._head(MAIN_BRANCH)
            # Read main's head before the branch's: a later upload that takes the branch
            # then commits its card after ours, or makes ours fail on parent_commit.
            if self._head(self.branch) != build_oid:
                return None
            remote = self._tree(main_head, CARD)
            if CARD in remote and card.matches(remote[CARD]):
                return None
            try:
                return self.api.create_commit(
                    self.repo_id,
                    repo_type="kernel",
                    revision=MAIN_BRANCH,
                    operations=[CommitOperationAdd(path_in_repo=CARD, path_or_fileobj=card.path)],
                    commit_message=f"Update the {self.build.name} card ({self.branch})",
                    parent_commit=main_head,
                )
            except HfHubHTTPError as error:
                if _status(error) not in _MOVED_STATUSES:
                    raise
            _back_off(attempt)
        raise UploadConflictError(
            f"{self.repo_id}@{MAIN_BRANCH} kept moving: the build is on {self.branch} ({build_oid}) but its "
            f"{CARD} is not on {MAIN_BRANCH} after {MAX_ATTEMPTS} attempts. Run the upload again."
        )

    def _commit_to_existing(self, head: str) -> CommitInfo:
        return self._commit(self.branch, head)

    def _commit_to_new_branch(self) -> CommitInfo:
        """Commit on a temporary branch, then create `branch` at that commit: never a tree without the build.

        A temporary branch is not a version: `kernels` reads only branches named v<int>.
        """
        staging = f"upload-{uuid.uuid4().hex}"
        self.api.create_branch(self.repo_id, repo_type="kernel", branch=staging, revision=MAIN_BRANCH)
        try:
            commit = self._commit(staging, self._head(staging))
            # 409 if a concurrent upload created it first: the caller retries on the branch.
            self.api.create_branch(self.repo_id, repo_type="kernel", branch=self.branch, revision=commit.oid)
        finally:
            self.api.delete_branch(self.repo_id, repo_type="kernel", branch=staging)
        return commit

    def _commit(self, branch: str, parent: str) -> CommitInfo:
        stale = sorted(path for path in self._tree(parent) if path not in self.files and path not in HUB_MANAGED_FILES)
        operations = [CommitOperationDelete(path_in_repo=path) for path in stale]
        operations += [CommitOperationAdd(path_in_repo=path, path_or_fileobj=f.path) for path, f in self.files.items()]
        return self.api.create_commit(
            self.repo_id,
            repo_type="kernel",
            revision=branch,
            operations=operations,
            commit_message=f"Upload {self.build.name} {self.branch} ({', '.join(self.build.variants)})",
            commit_description=(
                f"{len(self.files)} files from {self.build.root.name}/"
                + (f", {len(stale)} stale files removed: {', '.join(stale)}" if stale else "")
            ),
            parent_commit=parent,
        )

    def _holds_build(self, commit: str) -> bool:
        remote = {path: file for path, file in self._tree(commit).items() if path not in HUB_MANAGED_FILES}
        return remote.keys() == self.files.keys() and all(self.files[p].matches(f) for p, f in remote.items())

    def _head(self, branch: str) -> str | None:
        try:
            return self.api.repo_info(self.repo_id, repo_type="kernel", revision=branch).sha
        except RevisionNotFoundError:
            return None

    def _tree(self, commit: str, path: str | None = None) -> dict[str, RepoFile]:
        if path is not None:
            entries = self.api.get_paths_info(self.repo_id, [path], repo_type="kernel", revision=commit)
        else:
            entries = self.api.list_repo_tree(self.repo_id, repo_type="kernel", revision=commit, recursive=True)
        return {entry.path: entry for entry in entries if isinstance(entry, RepoFile)}


def _status(error: HfHubHTTPError) -> int | None:
    return error.response.status_code if error.response is not None else None


def _back_off(attempt: int) -> None:
    """Sleep before retrying, randomised so that racing uploads spread out."""
    time.sleep(random.uniform(0, 0.05 * 2**attempt))


def upload_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tpu-kernels upload",
        description="Publish a kernel build: build/ and benchmarks/ on branch v<N>, README.md on main. "
        "The token comes from HF_TOKEN (or `hf auth login`).",
    )
    parser.add_argument("build_dir", type=Path, help="build/<name>, as written by `tpu-kernels build`")
    parser.add_argument("--repo-id", required=True, help="ORG/NAME of the kernel repo (created if missing)")
    parser.add_argument("--version", type=int, help="major version N, published on branch vN (default: from metadata)")
    parser.add_argument("--endpoint", help="Hub URL, e.g. a `tpu-kernels serve` hub (default: HF_ENDPOINT)")
    args = parser.parse_args(argv)
    try:
        publication = upload_kernel(args.build_dir, args.repo_id, version=args.version, endpoint=args.endpoint)
    except (FileNotFoundError, ValueError, KernelIntegrityError, UploadConflictError, HfHubHTTPError) as error:
        print(f"upload failed: {error}", file=sys.stderr)
        return 1
    if publication.build_commit is not None:
        print(f"build on {publication.branch}: {publication.build_commit.commit_url}")
    else:
        print(f"build on {publication.branch}: unchanged, already at {publication.build_oid}")
    if publication.card_commit is not None:
        print(f"{CARD} on {MAIN_BRANCH}: {publication.card_commit.commit_url}")
    return 0
