"""Verified private copies: each kernel variant is read once, checked against its digest, and the very
bytes checked are written to a new folder of this process (mode 0700, on a path no other user can
change), which is what gets imported, with no bytecode."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
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

from huggingface_hub import HfApi
from kernels._rust import Metadata
from kernels.deps import DepTreeNode
from kernels.resolver import LocalKernel

from ..digest import METADATA_FILE, KernelIntegrityError, copy_verified_variant
from ..digest import verify_variant as _verify_digest
from .cache import cache_blobs
from .hub_commits import hub_metadata_blob_id

# Imports toggle the process-wide sys.dont_write_bytecode and fill kernels' module registry, and
# private copies are registered by content: one at a time (re-entrant, for a kernel that loads
# another on import).
_LOAD_LOCK = threading.RLock()
_PRIVATE_FOLDER_PREFIX = "tpu-kernels-verified-"


def verify_variant(variant_path: Path, *, source: str | None = None) -> None:
    """Check a variant folder against its metadata.json's digest (`tpu_kernels.distribution.digest`); KernelIntegrityError if not.

    A variant of a Hub cache snapshot (`<repo folder>/snapshots/<commit>/build/<variant>`) is
    checked as one (file links into the repo's `blobs/`, metadata.json against its blob id),
    any other folder as a plain one (no link at all).
    """
    _verify_digest(Path(variant_path), source=source, blobs=cache_blobs(Path(variant_path)))


# (variant name, sha256 of its verified metadata.json) -> the private copy holding it. metadata.json lists
# every file with its digest, so equal metadata means equal files: a kernel loaded again reuses its copy,
# and kernels' importer, which caches modules by path, returns the module already imported.
_PRIVATE_COPIES: dict[tuple[str, str], Path] = {}
_private_root: Path | None = None


def import_verified(tree: DepTreeNode[LocalKernel]) -> ModuleType:
    with _LOAD_LOCK, _bytecode_writing_disabled():
        return tree.load()


def verified_copies(tree: DepTreeNode[LocalKernel], api: HfApi | None) -> DepTreeNode[LocalKernel]:
    """The tree with each kernel's variant replaced by a private copy of exactly the bytes checked against
    its digest, and its metadata read from that copy."""
    deps = {repo_id: verified_copies(dep, api) for repo_id, dep in tree.deps.items()}
    kernel = tree.location
    copy = _verified_copy(kernel, api)
    metadata = Metadata.read_from_file(copy / METADATA_FILE)
    declared = sorted(dep.repo_id for dep in metadata.kernel_depends)
    if declared != sorted(deps):
        raise KernelIntegrityError(
            f"Refusing to import {kernel.variant_path}: its verified metadata.json depends on {declared}, but "
            f"{sorted(deps)} were resolved from the metadata.json read before (it changed during the load)",
            [kernel.variant_path / METADATA_FILE],
        )
    return DepTreeNode(location=dataclasses.replace(kernel, variant_path=copy, metadata=metadata), deps=deps)


def _verified_copy(kernel: LocalKernel, api: HfApi | None) -> Path:
    origin = kernel.origin
    blobs = cache_blobs(kernel.variant_path)
    metadata_blob_id = None
    if origin is not None:
        source = f"{origin.repo_id} (revision {origin.revision}, variant {kernel.variant_str})"
        remedy = f"Download it again: tpu_kernels.get_kernel({origin.repo_id!r}, ..., force_download=True)."
        if blobs is None:
            raise KernelIntegrityError(
                f"Refusing to import {source}: {kernel.variant_path} is not in a Hub cache snapshot",
                [kernel.variant_path],
            )
        metadata_blob_id = hub_metadata_blob_id(api, origin.repo_id, kernel)
    elif blobs is not None:
        source = f"cached kernel {kernel.variant_path}"
        remedy = "Download it again, online: tpu_kernels.get_kernel(..., force_download=True)."
    else:
        source, remedy = f"local kernel {kernel.variant_path}", "Rebuild it."
    staging = Path(tempfile.mkdtemp(dir=_private_copies_root()))
    copy = staging / kernel.variant_str
    try:
        copy_verified_variant(kernel.variant_path, copy, source=source, blobs=blobs, metadata_blob_id=metadata_blob_id)
    except KernelIntegrityError as error:
        shutil.rmtree(staging)
        raise KernelIntegrityError(f"{error}\n{remedy}", error.files) from None
    except OSError as error:  # an entry vanished or changed kind while being read, or the copy failed
        shutil.rmtree(staging)
        raise KernelIntegrityError(
            f"Refusing to import {source}: it could not be read and copied whole ({error}). {remedy}",
            [kernel.variant_path],
        ) from None
    key = (kernel.variant_str, hashlib.sha256((copy / METADATA_FILE).read_bytes()).hexdigest())
    with _LOAD_LOCK:
        existing = _PRIVATE_COPIES.setdefault(key, copy)
    if existing != copy:
        shutil.rmtree(staging)
    return existing


def _private_copies_root() -> Path:
    """This process's folder of verified copies: new, mode 0700, ours, on a path no other user can change.

    Removed at exit. KernelIntegrityError if the temporary folder does not give that (set TMPDIR).
    """
    global _private_root
    with _LOAD_LOCK:
        if _private_root is None:
            root = Path(tempfile.mkdtemp(prefix=_PRIVATE_FOLDER_PREFIX)).resolve()
            atexit.register(shutil.rmtree, root, True)
            _check_private(root)
            _private_root = root
        return _private_root


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
