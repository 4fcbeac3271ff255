"""`get_kernel` and lock-file loads: the `kernels` library's loader, plus a digest check before import.

Resolution, trust, version lookup, variant choice, download and import are
`kernels` 0.17.2's own (its resolvers, validators and dependency tree, used
exactly as `kernels.get_kernel` and `kernels.get_locked_kernel` wire them).
What this module adds between download and import:

* the selected variant is checked against the digest of its metadata.json with
  `tpu_kernels.digest`: every file listed with its sha256, no other file or
  folder, no symbolic link but the cache's own file links into `blobs/`, and a
  digest present (`kernels` parses the digest but never checks it). In the cache,
  metadata.json must be the blob whose id it links to; online, also the blob the
  Hub serves for it at that commit (one paths-info request). Any difference stops
  the load with `KernelIntegrityError` naming the files;
* bytecode in the variant is removed before import and none is written: the
  digest leaves `__pycache__` out, so a planted `.pyc` whose header matches its
  source would otherwise run instead of the verified source;
* `force_download=True` deletes, before resolving, the cached snapshot of the
  commit to load and every blob of the repo that does not hold what its name
  (the Hub's ETag) says, so the load downloads afresh and leaves what a first
  download leaves, even when the cached metadata.json no longer parses;
* offline (HF_HUB_OFFLINE=1), the cached snapshot is checked for the selected
  variant only: `kernels`' own offline resolver asks huggingface_hub for the whole
  snapshot, which huggingface_hub >= 1.22 refuses as incomplete when the repo has
  other variants (a download fetches only one), so unmodified `kernels` 0.17.2
  cannot load a multi-variant kernel offline;
* a load by `version=` records `refs/v<N>` in the cache, so the same call works
  offline afterwards (`kernels` looks versions up there but never writes them);
* no build variant for this system raises `VariantNotFoundError` (a
  FileNotFoundError), which `kernelize` reports as "this kernel cannot serve".

The environment is read as huggingface_hub and kernels read it: HF_ENDPOINT,
HF_HUB_OFFLINE and KERNELS_CACHE (else HF_HUB_CACHE) when they are first
imported, so set them before; HF_TOKEN and LOCAL_KERNELS at each call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from huggingface_hub import HfApi, RepoFile, constants
from huggingface_hub.errors import LocalEntryNotFoundError
from huggingface_hub.file_download import REGEX_COMMIT_HASH, repo_folder_name
from kernels import resolver as kernels_resolver
from kernels._rust import KernelDependency, KernelLocks, KernelVersion, Metadata
from kernels._versions import resolve_kernel_version, revision_or_version
from kernels.deps import DepTreeNode, resolve_kernel_tree
from kernels.hf_hub import _check_trust_remote_code, _get_hf_api
from kernels.load import _get_local_kernel_overrides
from kernels.locking import get_locked_kernel_revision
from kernels.resolver import HubResolver, LocalKernel, LockedHubResolver, Resolver, SequentialResolver, resolve_local_kernel
from kernels.validate import AllValidator, ArchValidator, MetadataValidator, default_metadata_validators
from kernels.variants import get_variants_local, resolve_variant, variants_trace_str

from .digest import BYTECODE_FOLDER, METADATA_FILE, KernelIntegrityError, blob_name_matches
from .digest import verify_variant as _verify_digest

logger = logging.getLogger(__name__)

# Imports toggle the process-wide sys.dont_write_bytecode and fill kernels' module
# registry: one load at a time (re-entrant, for a kernel that loads another on import).
_LOAD_LOCK = threading.RLock()
# How kernels 0.17.2 (and CachedVariantResolver) word "no variant for this system".
_NO_VARIANT_MESSAGES = ("Cannot find a build variant for this system", "Cannot find a cached build variant")

__all__ = [
    "KernelIntegrityError",
    "VariantNotFoundError",
    "get_kernel",
    "get_local_kernel",
    "get_locked_kernel",
    "load_kernel",
    "verify_variant",
]


class VariantNotFoundError(FileNotFoundError):
    """The kernel has no build variant for this system (backend, torch, arch)."""


def get_kernel(
    repo_id: str,
    *,
    version: int | None = None,
    revision: str | None = None,
    backend: str | None = None,
    trust_remote_code: bool | list[str] = False,
    force_download: bool = False,
) -> ModuleType:
    """Load a kernel from the Hub (or HF_ENDPOINT) like `kernels.get_kernel`, after checking its digests.

    Args:
        repo_id: `namespace/name` of the kernel repo.
        version: major version, served from branch `v<version>`. Exactly one of version/revision.
        revision: branch, tag or commit sha.
        backend: `cpu`, `tpu`, ...; detected when None.
        trust_remote_code: True, or a list of repo ids allowed besides trusted publishers.
        force_download: clear the cached commit and download it again (repairs a damaged cache).

    Raises:
        KernelIntegrityError: the selected variant differs from its digest, or has none.
        VariantNotFoundError: the kernel has no build for this system.
        ValueError: untrusted publisher, unknown version (the message lists the available ones),
            or both/neither of version and revision.
    """
    kernel = KernelDependency(repo_id=repo_id, version=revision_or_version(revision=revision, version=version))
    if _offline(force_download):
        hub_resolver = CachedVariantResolver(trust_remote_code=trust_remote_code)
    else:
        hub_resolver = HubResolver(trust_remote_code=trust_remote_code)
        if force_download:
            hub_resolver = FreshDownloadResolver(hub_resolver)
    installed = _install(
        kernel,
        SequentialResolver(resolvers=[_get_local_kernel_overrides(), hub_resolver]),
        backend=backend,
        validator=AllValidator(validators=[*default_metadata_validators(), ArchValidator()]),
    )
    if isinstance(kernel.version, KernelVersion.Version) and installed.location.origin is not None:
        _remember_version(repo_id, kernel.version.version, installed.location.origin.revision)
    return _import(installed)


def get_locked_kernel(
    repo_id: str,
    *,
    lockfile: str | Path,
    backend: str | None = None,
    trust_remote_code: bool | list[str] = False,
    force_download: bool = False,
) -> ModuleType:
    """Load the commit that `lockfile` (a `kernels.lock` from `kernels lock`) pins, after checking its digests.

    `kernels.get_locked_kernel` with a digest check; downloads when needed, reads only the
    cache when HF_HUB_OFFLINE is set. Raises as `get_kernel`, and ValueError if the lock
    file does not lock `repo_id`.
    """
    locks, kernel = get_locked_kernel_revision(repo_id, Path(lockfile))
    if _offline(force_download):
        resolver = CachedVariantResolver(trust_remote_code=trust_remote_code, locks=locks)
    else:
        resolver = LockedHubResolver(kernel_locks=locks, trust_remote_code=trust_remote_code)
        if force_download:
            resolver = FreshDownloadResolver(resolver, locks=locks)
    installed = _install(
        kernel, resolver, backend=backend, validator=AllValidator(validators=default_metadata_validators()))
    return _import(installed)


def load_kernel(repo_id: str, *, lockfile: str | Path, backend: str | None = None) -> ModuleType:
    """Load the commit that `lockfile` pins from the cache only (no request), after checking its digests.

    `kernels.load_kernel` with a digest check, for kernels fetched beforehand (`kernels download`,
    or a `get_locked_kernel` call). FileNotFoundError if the variant is not cached.
    """
    locks, kernel = get_locked_kernel_revision(repo_id, Path(lockfile))
    installed = _install(
        kernel, CachedVariantResolver(trust_remote_code=False, locks=locks), backend=backend,
        validator=AllValidator(validators=default_metadata_validators()),
    )
    return _import(installed)


def get_local_kernel(repo_path: str | Path, *, backend: str | None = None) -> ModuleType:
    """`kernels.get_local_kernel` (a build folder, or one variant of it), after checking its digests."""
    try:
        location = resolve_local_kernel(Path(repo_path), backend=backend)
    except FileNotFoundError as error:
        raise _name_missing_variant(error) from None
    tree = DepTreeNode(location=location, deps={})
    _verify_tree(tree, api=None)
    return _import(tree)


def _offline(force_download: bool) -> bool:
    offline = constants.HF_HUB_OFFLINE
    if force_download and offline:
        raise ValueError("force_download=True needs the Hub, but HF_HUB_OFFLINE is set")
    return offline


def _name_missing_variant(error: FileNotFoundError) -> FileNotFoundError:
    if str(error).startswith(_NO_VARIANT_MESSAGES):
        return VariantNotFoundError(str(error))
    return error


def _install(
    kernel: KernelDependency,
    resolver: Resolver,
    *,
    backend: str | None,
    validator: MetadataValidator,
) -> DepTreeNode[LocalKernel]:
    """Resolve, validate and download the kernel and its dependencies; then check every variant's digest."""
    api = _get_hf_api()
    try:
        tree = resolve_kernel_tree(api=api, backend=backend, kernel=kernel, resolver=resolver)
    except FileNotFoundError as error:
        raise _name_missing_variant(error) from None
    tree.validate_metadata(validator)
    installed = tree.install(api=api)
    _verify_tree(installed, api)
    return installed


def _import(tree: DepTreeNode[LocalKernel]) -> ModuleType:
    with _LOAD_LOCK, _bytecode_writing_disabled():
        return tree.load()


@dataclass
class FreshDownloadResolver:
    """`force_download=True`: a Hub resolver that first clears what the cache holds of the commit it resolves.

    Clearing comes before `kernels` reads the cached metadata.json, which may be the damaged file.
    Every kernel of the dependency tree goes through here.
    """

    inner: Resolver
    locks: KernelLocks | None = None

    def resolve(self, *, api: HfApi, backend: str | None, kernel: KernelDependency):
        if self.locks is not None:
            revision = _locked_commit(self.locks, kernel)
        else:
            revision = resolve_kernel_version(kernel, local_files_only=False)
        if not REGEX_COMMIT_HASH.fullmatch(revision):
            revision = api.repo_info(kernel.repo_id, repo_type="kernel", revision=revision).sha
        _clear_cached_commit(kernel.repo_id, revision)
        return self.inner.resolve(api=api, backend=backend, kernel=kernel)


def _clear_cached_commit(repo_id: str, commit: str) -> None:
    """Delete the snapshot of `commit` (its tree listing and recorded misses too) and the repo's damaged blobs.

    A blob is kept only if its content is what its name, the ETag the Hub sent, says: those
    are exactly the Hub's bytes, and other snapshots may link to them.
    """
    repo = _download_cache() / repo_folder_name(repo_id=repo_id, repo_type="kernel")
    blobs = repo / "blobs"
    for path in (repo, blobs, repo / "snapshots", repo / "trees", repo / ".no_exist"):
        if path.is_symlink():  # drop a linked cache folder, never what it points to
            path.unlink()
    for path in (repo / "snapshots" / commit, repo / "trees" / f"{commit}.json", repo / ".no_exist" / commit):
        _remove(path)
    if blobs.is_dir():
        for blob in blobs.iterdir():
            if blob.is_symlink() or not blob.is_file() or not blob_name_matches(blob.name, blob.read_bytes()):
                _remove(blob)


def _remove(path: Path) -> None:
    """Delete a file, link or folder tree, never following a link."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _locked_commit(locks: KernelLocks, kernel: KernelDependency) -> str:
    lock = locks.get(kernel, None)
    if lock is None:
        raise ValueError(f"Kernel `{kernel.repo_id}` is not locked in the lock file.")
    return lock.commit


@dataclass
class CachedVariantResolver:
    """Offline loads from the cache (`kernels`' HubCacheResolver and LockedHubCacheResolver), for one variant.

    The revision comes from `locks` when given (a lock file), else from the kernel's version or revision.
    """

    trust_remote_code: bool | list[str]
    locks: KernelLocks | None = None

    def resolve(self, *, api: HfApi, backend: str | None, kernel: KernelDependency) -> LocalKernel:
        _check_trust_remote_code(kernel.repo_id, local_files_only=True, trust_remote_code=self.trust_remote_code)
        if self.locks is None:
            revision = resolve_kernel_version(kernel, local_files_only=True)
        else:
            revision = _locked_commit(self.locks, kernel)
        storage = _download_cache() / repo_folder_name(repo_id=kernel.repo_id, repo_type="kernel")
        commit = revision if REGEX_COMMIT_HASH.fullmatch(revision) else _read_ref(storage / "refs" / revision)
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


def _read_ref(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return None


def verify_variant(variant_path: Path, *, source: str | None = None) -> None:
    """Check a variant folder against its metadata.json's digest (`tpu_kernels.digest`); KernelIntegrityError if not.

    A variant of a Hub cache snapshot (`<repo folder>/snapshots/<commit>/build/<variant>`) is
    checked as one (file links into the repo's `blobs/`, metadata.json against its blob id),
    any other folder as a plain one (no link at all).
    """
    _verify_digest(Path(variant_path), source=source, blobs=_cache_blobs(Path(variant_path)))


def _nodes(tree: DepTreeNode[LocalKernel]) -> Iterator[LocalKernel]:
    yield tree.location
    for dep in tree.deps.values():
        yield from _nodes(dep)


def _verify_tree(tree: DepTreeNode[LocalKernel], api: HfApi | None) -> None:
    for kernel in _nodes(tree):
        origin = kernel.origin
        blobs = _cache_blobs(kernel.variant_path)
        metadata_blob_id = None
        if origin is not None:
            source = f"{origin.repo_id} (revision {origin.revision}, variant {kernel.variant_str})"
            remedy = f"Download it again: tpu_kernels.get_kernel({origin.repo_id!r}, ..., force_download=True)."
            if blobs is None:
                raise KernelIntegrityError(
                    f"Refusing to import {source}: {kernel.variant_path} is not in a Hub cache snapshot",
                    [kernel.variant_path],
                )
            metadata_blob_id = _hub_metadata_blob_id(api, origin.repo_id, kernel)
        elif blobs is not None:
            source = f"cached kernel {kernel.variant_path}"
            remedy = "Download it again, online: tpu_kernels.get_kernel(..., force_download=True)."
        else:
            source, remedy = f"local kernel {kernel.variant_path}", "Rebuild it."
        try:
            _verify_digest(kernel.variant_path, source=source, blobs=blobs, metadata_blob_id=metadata_blob_id)
        except KernelIntegrityError as error:
            raise KernelIntegrityError(f"{error}\n{remedy}", error.files) from None
        _remove_bytecode(kernel.variant_path)


def _hub_metadata_blob_id(api: HfApi, repo_id: str, kernel: LocalKernel) -> str:
    """The blob the Hub serves as this variant's metadata.json at the commit of its snapshot."""
    commit = kernel.variant_path.parents[1].name
    path = f"build/{kernel.variant_str}/{METADATA_FILE}"
    files = [info for info in api.get_paths_info(repo_id, [path], repo_type="kernel", revision=commit)
             if isinstance(info, RepoFile)]
    if len(files) != 1:
        raise KernelIntegrityError(f"The Hub lists no file {path} in {repo_id} at {commit}", [kernel.variant_path])
    (file,) = files
    return file.lfs.sha256 if file.lfs is not None else file.blob_id


def _download_cache() -> Path:
    return Path(kernels_resolver.CACHE_DIR or constants.HF_HUB_CACHE).expanduser().resolve()


def _cache_blobs(variant_path: Path) -> Path | None:
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


def _remove_bytecode(variant_path: Path) -> None:
    """Drop `__pycache__` folders so that only the verified sources get executed."""
    for folder, subfolders, _ in os.walk(variant_path):
        if BYTECODE_FOLDER in subfolders:
            # Best effort: a read-only cache keeps its bytecode, written by its owner.
            shutil.rmtree(Path(folder) / BYTECODE_FOLDER, ignore_errors=True)
            subfolders.remove(BYTECODE_FOLDER)


@contextlib.contextmanager
def _bytecode_writing_disabled() -> Iterator[None]:
    previous = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        yield
    finally:
        sys.dont_write_bytecode = previous


def _remember_version(repo_id: str, version: int, commit: str) -> None:
    """Write refs/v<version> -> commit in the cache, where `kernels` looks versions up when offline."""
    ref = _download_cache() / repo_folder_name(repo_id=repo_id, repo_type="kernel") / "refs" / f"v{version}"
    with contextlib.suppress(FileNotFoundError):
        if ref.read_text() == commit:
            return
    ref.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(dir=ref.parent, prefix=f".v{version}.")
    with os.fdopen(fd, "w") as handle:
        handle.write(commit)
    os.replace(staging, ref)
