"""The download cache as the loader uses it: where it is, which variant folders are snapshots of it, what it
holds for offline loads (refs, variants), the refs it records, and what a refused load and
`force_download=True` clear. The layout is the one huggingface_hub documents for its cache."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

from huggingface_hub import constants

from ...folders import make_private_dirs
from ..digest import blob_name_matches
from .ids import REGEX_COMMIT_HASH, UnsafeIdError, checked_commit, is_ref_name

logger = logging.getLogger(__name__)


class CacheNotWritableError(PermissionError):
    """`force_download=True` cannot change the cache: a folder of it is read-only and someone else's."""


def download_cache() -> Path:
    """Where kernels keep their downloads: KERNELS_CACHE (read at each call, as kernels does), else the Hub cache."""
    return Path(os.environ.get("KERNELS_CACHE") or constants.HF_HUB_CACHE).expanduser().resolve()


def repo_folder(repo_id: str) -> Path:
    """`kernels--<org>--<name>`: the cache folder of a kernel repo."""
    return download_cache() / ("kernels--" + repo_id.replace("/", "--"))


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


def cached_commit(repo_id: str, *, version: int | None, revision: str | None) -> str:
    """The commit a version or revision names in the cache (offline): a commit id as is, else what
    `refs/v<N>` or `refs/<revision>` holds, which must be a commit id. FileNotFoundError if no such ref."""
    if version is not None:
        commit = _cached_ref(repo_id, f"v{version}")
        if commit is None:
            raise FileNotFoundError(
                f"Version {version} of '{repo_id}' is not available in the local cache and Hugging Face Hub is in "
                "offline mode. Load it once online first, or pass an explicit `revision=<commit>`."
            )
        return checked_commit(commit, "The cache", f"{repo_id}'s ref v{version}")
    commit = revision if REGEX_COMMIT_HASH.fullmatch(revision) else _cached_ref(repo_id, revision)
    if commit is None:
        raise FileNotFoundError(
            f"Cannot find a local snapshot for {repo_id} (revision: {revision}). When Hugging Face Hub is in offline "
            "mode the kernel must already be present in the local cache."
        )
    return commit


def cached_variants(repo_id: str, commit: str) -> list[Path]:
    """The variant folders the cache holds for `commit` (real folders only; a link is left for the check)."""
    build = repo_folder(repo_id) / "snapshots" / commit / "build"
    variants = sorted(entry for entry in build.iterdir() if not entry.name.startswith(".")) if build.is_dir() else []
    if not variants:
        raise FileNotFoundError(
            f"Cannot find a local snapshot for {repo_id} (revision: {commit}). When Hugging Face Hub is in offline "
            "mode the kernel must already be present in the local cache."
        )
    return variants


def _cached_ref(repo_id: str, revision: str) -> str | None:
    """What refs/<revision> holds in the cache (checked: a commit id), None if no such ref."""
    if not is_ref_name(revision):
        raise UnsafeIdError(f"{revision!r} is not a branch or tag name; refusing to read it as a path of the cache")
    path = repo_folder(repo_id) / "refs" / revision
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
    ref = repo_folder(repo_id) / "refs" / name
    with contextlib.suppress(OSError):
        if ref.read_text() == commit:
            return
    try:
        make_private_dirs(ref.parent)
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
    repo = repo_folder(repo_id)
    folder_name = repo.name
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


def drop_refused_variant(repo_id: str, commit: str, variant: str) -> None:
    """After a refused load: the variant's snapshot folder and every blob of the repo that does not hold what its
    name says go, so the next load downloads them again instead of refusing the same bytes forever. Blobs that
    hold their own id are the Hub's bytes and stay (other snapshots may link to them)."""
    repo = repo_folder(repo_id)
    with contextlib.suppress(OSError):
        _remove(repo / "snapshots" / checked_commit(commit, "The caller", repo_id) / "build" / variant)
    blobs = repo / "blobs"
    if blobs.is_dir() and not blobs.is_symlink():
        for blob in blobs.iterdir():
            with contextlib.suppress(OSError):
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
