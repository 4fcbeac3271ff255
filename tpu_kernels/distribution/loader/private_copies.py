"""Verified private copies: each kernel variant is read once, checked against its digest, and the very bytes
checked are written to a new folder of this process (mode 0700, on a path no other user can change). That
copy is what `kernels.get_local_kernel` then picks from and imports, with no bytecode written."""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import stat
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from ..digest import METADATA_FILE, KernelIntegrityError, backend_mismatch, copy_verified_variant
from ..digest import verify_variant as _verify_digest
from .cache import cache_blobs

# Imports toggle the process-wide sys.dont_write_bytecode and fill kernels' module registry, and private
# copies are registered by content: one at a time.
_LOAD_LOCK = threading.RLock()
_PRIVATE_FOLDER_PREFIX = "tpu-kernels-verified-"
# A root is made under this name and renamed once its owner holds its lock.
_STAGING_PREFIX = ".tpu-kernels-staging-"
# Held (flock) by the process that owns a private root for as long as it lives: a root whose lock can be
# taken belongs to a process that is gone (killed before its exit handler ran), and is removed.
_OWNER_LOCK = ".owner.lock"
# A digest of every verified metadata.json in a copy -> that copy. metadata.json lists every file with its
# digest, so equal metadata means equal files: a kernel loaded again reuses its copy.
_PRIVATE_COPIES: dict[str, Path] = {}
_private_root: Path | None = None
# The open lock files of every root this process made, kept open (so locked) for the life of the process: a
# root made later (a new TMPDIR) must not release an earlier one that copies still live in.
_owner_locks: list = []


def verify_variant(variant_path: Path, *, source: str | None = None) -> None:
    """Check a variant folder against its metadata.json's digest (`tpu_kernels.distribution.digest`);
    KernelIntegrityError if not.

    A variant of a Hub cache snapshot (`<repo folder>/snapshots/<commit>/build/<variant>`) is
    checked as one (file links into the repo's `blobs/`, metadata.json against its blob id),
    any other folder as a plain one (no link at all).
    """
    _verify_digest(Path(variant_path), source=source, blobs=cache_blobs(Path(variant_path)))


def verified_copy(variants: list[Path], *, source: str, remedy: str, metadata_blob_ids: dict[str, str] | None = None
                  ) -> Path:
    """A private folder holding `build/<variant>` for each of `variants`, each exactly the bytes checked against
    its digest; KernelIntegrityError (with `remedy`) if any variant does not match.

    `metadata_blob_ids`: per variant name, the blob id the Hub lists for its metadata.json, which the cached
    metadata.json must link to.
    """
    staging = Path(tempfile.mkdtemp(dir=_private_copies_root()))
    (staging / "build").mkdir(mode=0o700)
    try:
        for variant in variants:
            blob_id = (metadata_blob_ids or {}).get(variant.name)
            copy_verified_variant(variant, staging / "build" / variant.name, source=f"{source}, variant {variant.name}",
                                  blobs=cache_blobs(variant), metadata_blob_id=blob_id)
        for variant in variants:
            _check_backend(staging / "build" / variant.name, source)
    except KernelIntegrityError as error:
        shutil.rmtree(staging)
        raise KernelIntegrityError(f"{error}\n{remedy}", error.files) from None
    except OSError as error:  # an entry vanished or changed kind while being read, or the copy failed
        shutil.rmtree(staging)
        raise KernelIntegrityError(
            f"Refusing to import {source}: it could not be read and copied whole ({error}). {remedy}", variants,
        ) from None
    key = hashlib.sha256(b"".join(
        variant.name.encode() + b"\0" + (staging / "build" / variant.name / METADATA_FILE).read_bytes() + b"\0"
        for variant in sorted(variants))).hexdigest()
    with _LOAD_LOCK:
        existing = _PRIVATE_COPIES.setdefault(key, staging)
    if existing != staging:
        shutil.rmtree(staging)
    return existing


def _check_backend(variant: Path, source: str) -> None:
    mismatch = backend_mismatch(variant)
    if mismatch is not None:
        raise KernelIntegrityError(f"Refusing to import {source}, variant {variant.name}: {mismatch}",
                                   [variant / METADATA_FILE])


def import_copy(copy: Path, *, backend: str | None) -> ModuleType:
    """`kernels.get_local_kernel` on a verified copy: kernels picks the variant for this system, checks its
    metadata and its digest again, and imports it (one module per kernel id, kept by kernels)."""
    import kernels

    with _LOAD_LOCK, _bytecode_writing_disabled():
        return kernels.get_local_kernel(copy, backend=backend)


def _private_copies_root() -> Path:
    """This process's folder of verified copies: new, mode 0700, ours, on a path no other user can change.

    Removed at exit; those of processes that died without exiting are removed when the next one is made.
    KernelIntegrityError if the temporary folder does not give that (set TMPDIR).
    """
    global _private_root
    with _LOAD_LOCK:
        if _private_root is None:
            root, handle = _locked_root()
            atexit.register(shutil.rmtree, root, True)
            _owner_locks.append(handle)
            _private_root = root
            _remove_abandoned_roots(root.parent, keep=root)
        return _private_root


def _locked_root() -> tuple[Path, object]:
    """A new private root and its lock file, held: made under a name other loaders do not look at, locked, then
    renamed to its own, so no other process ever sees it unlocked (and takes it for abandoned)."""
    while True:
        staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX)).resolve()
        try:
            _check_private(staging)
            handle = open(staging / _OWNER_LOCK, "x")
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            shutil.rmtree(staging)
            raise
        root = staging.with_name(_PRIVATE_FOLDER_PREFIX + staging.name.removeprefix(_STAGING_PREFIX))
        try:
            os.rename(staging, root)  # refused if `root` exists: an earlier root of that name is never empty
        except OSError as error:
            handle.close()
            shutil.rmtree(staging)
            if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            continue
        return root, handle


def _remove_abandoned_roots(temporary: Path, keep: Path) -> None:
    """Remove our private roots in `temporary` whose owner process is gone (its lock is free)."""
    me = os.geteuid()
    for root in temporary.glob(_PRIVATE_FOLDER_PREFIX + "*"):
        if root == keep:
            continue
        with contextlib.suppress(OSError):
            info = root.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != me:
                continue
            fd = os.open(root / _OWNER_LOCK, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while the owner lives
            finally:
                os.close(fd)
            shutil.rmtree(root)


def _check_private(root: Path) -> None:
    """`root` is ours and closed to others, and no folder above it lets another user rename or replace it."""
    me = os.geteuid()

    def refuse(problem: str) -> None:
        raise KernelIntegrityError(
            f"Refusing to import kernels: the copies they are imported from would not be private: {problem}. "
            "Set TMPDIR to a folder only this user can change.",
            [root],
        )

    info = root.lstat()
    if info.st_uid != me or stat.S_IMODE(info.st_mode) & 0o077:
        refuse(f"{root} has mode {stat.S_IMODE(info.st_mode):o} and owner {info.st_uid}")
    for parent in root.parents:
        info = parent.lstat()
        if info.st_uid not in (0, me) or (info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX):
            refuse(f"{parent} can be changed by other users (mode {stat.S_IMODE(info.st_mode):o}, "
                   f"owner {info.st_uid})")


@contextlib.contextmanager
def _bytecode_writing_disabled() -> Iterator[None]:
    previous = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        yield
    finally:
        sys.dont_write_bytecode = previous
