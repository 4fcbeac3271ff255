"""The download cache as the loader uses it: where it is, which variant folders are snapshots of it, the
offline resolver that reads one variant from it, the refs it records for offline loads, and what
`force_download=True` clears."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

from huggingface_hub import HfApi, constants
from huggingface_hub.errors import LocalEntryNotFoundError
from huggingface_hub.file_download import REGEX_COMMIT_HASH, repo_folder_name
from kernels import resolver as kernels_resolver
from kernels._rust import KernelDependency, KernelLocks, KernelVersion, Metadata
from kernels._versions import resolve_kernel_version
from kernels.hf_hub import _check_trust_remote_code
from kernels.resolver import LocalKernel
from kernels.variants import get_variants_local, resolve_variant, variants_trace_str

from ..digest import METADATA_FILE, blob_name_matches
from .ids import UnsafeIdError, checked_commit, is_ref_name, locked_commit

logger = logging.getLogger(__name__)


class CacheNotWritableError(PermissionError):
    """`force_download=True` cannot change the cache: a folder of it is read-only and someone else's."""


def download_cache() -> Path:
    return Path(kernels_resolver.CACHE_DIR or constants.HF_HUB_CACHE).expanduser().resolve()


def cache_blobs(variant_path: Path) -> Path | None:
    """`<repo folder>/blobs` if `variant_path` is a variant of a Hub cache snapshot, else None.

    Read from the path as written (`<repo folder>/snapshots/<commit>/build/<variant>`), never
    by following links; `verify_variant` then refuses linked folders on that way.
    """
    path = Path(os.path.abspath(variant_path))
    if (
        len(path.parents) > 3
        and path.parent.name == "build"
        and REGEX_COMMIT_HASH.fullmatch(path.parents[1].name)
        and path.parents[2].name == "snapshots"
    ):
        return path.parents[3] / "blobs"
    return None


@dataclasses.dataclass
class CachedVariantResolver:
    """Offline loads from the cache (`kernels`' HubCacheResolver and LockedHubCacheResolver), for one variant.

    The revision comes from `locks` when given (a lock file), else from the kernel's version or revision;
    a ref read from the cache must hold a commit id.
    """

    trust_remote_code: bool | list[str]
    locks: KernelLocks | None = None

    def resolve(self, *, api: HfApi, backend: str | None, kernel: KernelDependency) -> LocalKernel:
        _check_trust_remote_code(kernel.repo_id, local_files_only=True, trust_remote_code=self.trust_remote_code)
        storage = download_cache() / repo_folder_name(repo_id=kernel.repo_id, repo_type="kernel")
        if self.locks is not None:
            revision = commit = locked_commit(self.locks, kernel)
        elif isinstance(kernel.version, KernelVersion.Version):  # kernels reads refs/v<N> of the cache
            revision = f"v{kernel.version.version}"
            commit = checked_commit(resolve_kernel_version(kernel, local_files_only=True), "The cache",
                                     f"{kernel.repo_id}'s ref {revision}")
        else:
            revision = kernel.version.revision
            commit = _cached_commit(storage, revision, kernel.repo_id)
        missing = FileNotFoundError(
            f"Cannot find a local snapshot for {kernel.repo_id} (revision: {revision}). When Hugging Face Hub "
            "is in offline mode the kernel must already be present in the local cache."
        )
        if commit is None:
            raise missing
        variant, trace = resolve_variant(get_variants_local(storage / "snapshots" / commit / "build"), backend)
        if variant is None:
            raise FileNotFoundError(
                f"Cannot find a cached build variant for this system in {kernel.repo_id} "
                f"(revision: {revision}):\n\n{variants_trace_str(trace)}"
            )
        try:
            snapshot = api.snapshot_download(
                kernel.repo_id,
                repo_type="kernel",
                revision=commit,
                cache_dir=kernels_resolver.CACHE_DIR,
                allow_patterns=[f"build/{variant.variant_str}/*"],
                ignore_patterns=kernels_resolver._BYTECODE_IGNORE_PATTERNS,
                local_files_only=True,
            )
        except LocalEntryNotFoundError as error:
            raise missing from error
        variant_path = Path(snapshot) / "build" / variant.variant_str
        return LocalKernel(variant_path=variant_path, metadata=Metadata.read_from_file(variant_path / METADATA_FILE))


def _cached_commit(storage: Path, revision: str, repo_id: str) -> str | None:
    """The commit `revision` names in the cache: itself if a commit id, else what refs/<revision> holds;
    None if no such ref."""
    if REGEX_COMMIT_HASH.fullmatch(revision):
        return revision
    if not is_ref_name(revision):
        raise UnsafeIdError(f"{revision!r} is not a branch or tag name; refusing to read it as a path of the cache")
    path = storage / "refs" / revision
    try:
        content = path.read_text().strip()
    except FileNotFoundError:
        return None
    return checked_commit(content, f"The cache file {path}", f"{repo_id}'s ref {revision}")


def remember_ref(repo_id: str, name: str, commit: str) -> None:
    """Write refs/<name> -> commit in the cache, where offline loads look versions and branches up.

    Only for a plain branch or tag name. A cache we cannot write keeps loading: the load itself is done.
    """
    if not is_ref_name(name):
        return
    ref = download_cache() / repo_folder_name(repo_id=repo_id, repo_type="kernel") / "refs" / name
    with contextlib.suppress(OSError):
        if ref.read_text() == commit:
            return
    try:
        ref.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(dir=ref.parent, prefix=f".{ref.name}.")
        with os.fdopen(fd, "w") as handle:
            handle.write(commit)
        os.replace(staging, ref)
    except OSError as error:
        logger.warning("Could not record %s %s -> %s in the cache (%s); offline loads by that name will not "
                       "find it.", repo_id, name, commit, error)


def clear_cached_commit(repo_id: str, commit: str) -> None:
    """Delete the snapshot of `commit` (its tree listing and recorded misses too) and the repo's damaged blobs.

    A blob is kept only if its content is what its name, the ETag the Hub sent, says: those
    are exactly the Hub's bytes, and other snapshots may link to them. The folders the download then
    writes to are made writable first when they are ours (a cache restored read-only).
    """
    commit = checked_commit(commit, "The caller", repo_id)
    cache = download_cache()
    folder_name = repo_folder_name(repo_id=repo_id, repo_type="kernel")
    repo = cache / folder_name
    blobs = repo / "blobs"
    for path in (repo, blobs, repo / "snapshots", repo / "trees", repo / ".no_exist"):
        if path.is_symlink():  # drop a linked cache folder, never what it points to
            path.unlink()
    for folder in (cache, cache / ".locks", cache / ".locks" / folder_name, repo, blobs, repo / "snapshots",
                   repo / "trees", repo / ".no_exist", repo / "refs"):
        _make_writable(folder)
    for path in (repo / "snapshots" / commit, repo / "trees" / f"{commit}.json", repo / ".no_exist" / commit):
        _remove(path)
    if blobs.is_dir():
        for blob in blobs.iterdir():
            if blob.is_symlink() or not blob.is_file() or not blob_name_matches(blob.name, blob.read_bytes()):
                _remove(blob)


def _make_writable(folder: Path) -> None:
    """Let us create and delete entries in `folder` (a real folder, or nothing): add owner rights if it is ours."""
    try:
        info = folder.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        return
    if info.st_uid == os.geteuid():
        if info.st_mode & 0o700 != 0o700:
            os.chmod(folder, stat.S_IMODE(info.st_mode) | 0o700)
    elif not os.access(folder, os.W_OK | os.X_OK):
        raise CacheNotWritableError(
            f"force_download cannot change the cache folder {folder}: it is read-only and owned by user "
            f"{info.st_uid}, not by this user ({os.geteuid()}). Ask its owner to fix it, or use another "
            "cache (KERNELS_CACHE)."
        )


def _remove(path: Path) -> None:
    """Delete a file, link or folder tree, never following a link; read-only folders of ours made writable."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        for folder, subfolders, _ in os.walk(path):  # top-down, so each folder is writable before it is entered
            _make_writable(Path(folder))
            for subfolder in subfolders:
                _make_writable(Path(folder) / subfolder)
        shutil.rmtree(path)
