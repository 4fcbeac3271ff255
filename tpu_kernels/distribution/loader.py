"""`get_kernel` and lock-file loads: the `kernels` library's loader, with every id from the server checked
and the digest checked on exactly the bytes that get imported.

Variant choice, metadata validators, download and import are `kernels` 0.17.2's own (its
`resolve_hub_kernel`, validators, dependency tree and importer, used as `kernels.get_kernel` and
`kernels.get_locked_kernel` wire them). What this module adds:

* ids are checked before they name a path. The commit to load is resolved here (the `v<N>` branch's
  `targetCommit`, a revision's `sha`, a lock file's pin, a cached ref) and must be 40 lowercase hex
  digits; kernels and huggingface_hub then only ever see that commit. For each file huggingface_hub
  downloads from a kernel repo, the commit the server answers for (X-Repo-Commit) must be the one asked
  for and the ETag a blob id (git blob id, or sha256), before huggingface_hub names cache files after
  them (`_guard_kernel_downloads`). Anything else raises `UnsafeIdError`, before any file is written;
* publisher trust and versions are asked for here, in kernels' terms, through an HfApi that works
  with HF_HUB_DISABLE_TELEMETRY=1 (kernels 0.17.2 then sends an empty user-agent extension that
  huggingface_hub turns into a header httpx refuses). A Hub that cannot be reached raises
  `HubUnreachableError` naming the endpoint and the network failure, never advice to trust the code;
* the selected variant (and each kernel it depends on) is read once, checked against the digest of
  its metadata.json with `tpu_kernels.distribution.digest` (every file listed with its sha256, no other file or
  folder, no symbolic link but the cache's own file links into `blobs/`, a digest present; in the
  cache metadata.json must be the blob whose id it links to, and online the blob the Hub serves for it
  at that commit), and the very bytes checked are written to a private copy, a new folder (mode 0700)
  of this process; the import reads that copy, with no bytecode: a file changed in the cache after
  the check, or a `__pycache__` planted there (even in a read-only folder), is never read;
* `force_download=True` deletes, before downloading, the cached snapshot of the commit to load and every
  blob of the repo that does not hold what its name (the Hub's ETag) says, making the folders of the
  repo's cache that it must change writable first when they are ours (a cache restored read-only);
* offline (HF_HUB_OFFLINE=1), the cached snapshot is checked for the selected variant only: `kernels`'
  own offline resolver asks huggingface_hub for the whole snapshot, which huggingface_hub >= 1.22
  refuses as incomplete when the repo has other variants (a download fetches only one);
* a load by `version=` (or by branch or tag) records `refs/<name>` in the cache, so the same call works
  offline afterwards (`kernels` looks versions up there but never writes them);
* no build variant for this system raises `VariantNotFoundError` (a FileNotFoundError), which
  `kernelize` reports as "this kernel cannot serve".

The environment is read as huggingface_hub and kernels read it: HF_ENDPOINT, HF_HUB_OFFLINE,
HF_HUB_DISABLE_TELEMETRY and KERNELS_CACHE (else HF_HUB_CACHE) when they are first imported, so set
them before; HF_TOKEN and LOCAL_KERNELS at each call.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import hashlib
import inspect
import logging
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx2
import kernels
from huggingface_hub import HfApi, RepoFile, constants, file_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
from huggingface_hub.file_download import REGEX_COMMIT_HASH, repo_folder_name
from huggingface_hub.hf_api import GitRefInfo
from kernels import resolver as kernels_resolver
from kernels._rust import KernelDependency, KernelLocks, KernelVersion, Metadata
from kernels._versions import resolve_kernel_version, revision_or_version
from kernels.deps import DepTreeNode, resolve_kernel_tree
from kernels.hf_hub import _check_trust_remote_code, _get_hf_api
from kernels.load import _get_local_kernel_overrides
from kernels.locking import get_locked_kernel_revision
from kernels.resolver import (
    LocalKernel,
    RemoteKernel,
    Resolver,
    SequentialResolver,
    resolve_hub_kernel,
    resolve_local_kernel,
)
from kernels.validate import AllValidator, ArchValidator, MetadataValidator, default_metadata_validators
from kernels.variants import get_variants_local, resolve_variant, variants_trace_str

from .digest import METADATA_FILE, KernelIntegrityError, blob_name_matches, copy_verified_variant, is_blob_id
from .digest import verify_variant as _verify_digest

logger = logging.getLogger(__name__)

# Imports toggle the process-wide sys.dont_write_bytecode and fill kernels' module registry, and
# private copies are registered by content: one at a time (re-entrant, for a kernel that loads
# another on import).
_LOAD_LOCK = threading.RLock()
# How kernels 0.17.2 (and CachedVariantResolver) word "no variant for this system".
_NO_VARIANT_MESSAGES = ("Cannot find a build variant for this system", "Cannot find a cached build variant")
_VERSION_BRANCH = re.compile(r"v(0|[1-9][0-9]*)")
# A part of a branch or tag name that may name a file under the cache's refs/: not empty, not `.`-led
# (so neither `.` nor `..`), no separator or control character.
_REF_NAME_PART = re.compile(r"[A-Za-z0-9_+@-][A-Za-z0-9_.+@-]*")
_PRIVATE_FOLDER_PREFIX = "tpu-kernels-verified-"

__all__ = [
    "HubUnreachableError",
    "KernelIntegrityError",
    "UnsafeIdError",
    "VariantNotFoundError",
    "get_kernel",
    "get_local_kernel",
    "get_locked_kernel",
    "load_kernel",
    "verify_variant",
]


class VariantNotFoundError(FileNotFoundError):
    """The kernel has no build variant for this system (backend, torch, arch)."""


class UnsafeIdError(ValueError):
    """A commit id, ETag or ref from the Hub, a lock file or the cache that is not one (or not the one asked
    for); it is never used as a path."""


class HubUnreachableError(ConnectionError):
    """The Hub (HF_ENDPOINT) could not be reached; the message names it and the network failure."""


class CacheNotWritableError(PermissionError):
    """`force_download=True` cannot change the cache: a folder of it is read-only and someone else's."""


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
        UnsafeIdError: the Hub sent a commit id or ETag that is not one.
        HubUnreachableError: the Hub cannot be reached (the message names it and why).
        ValueError: untrusted publisher, unknown version (the message lists the available ones),
            or both/neither of version and revision.
    """
    kernel = KernelDependency(repo_id=repo_id, version=revision_or_version(revision=revision, version=version))
    if _offline(force_download):
        hub_resolver = CachedVariantResolver(trust_remote_code=trust_remote_code)
    else:
        hub_resolver = CheckedHubResolver(trust_remote_code=trust_remote_code, fresh=force_download)
    installed = _install(
        kernel,
        SequentialResolver(resolvers=[_get_local_kernel_overrides(), hub_resolver]),
        backend=backend,
        validator=AllValidator(validators=[*default_metadata_validators(), ArchValidator()]),
    )
    origin = installed.location.origin
    if origin is not None:
        name = f"v{version}" if version is not None else revision
        if not REGEX_COMMIT_HASH.fullmatch(name):
            _remember_ref(repo_id, name, origin.revision)
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
        resolver = CheckedHubResolver(trust_remote_code=trust_remote_code, locks=locks, fresh=force_download)
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
    return _import(_verified_copies(DepTreeNode(location=location, deps={}), api=None))


def _offline(force_download: bool) -> bool:
    offline = constants.HF_HUB_OFFLINE
    if force_download and offline:
        raise ValueError("force_download=True needs the Hub, but HF_HUB_OFFLINE is set")
    return offline


def _name_missing_variant(error: FileNotFoundError) -> FileNotFoundError:
    if str(error).startswith(_NO_VARIANT_MESSAGES):
        return VariantNotFoundError(str(error))
    return error


def _hub_api() -> HfApi:
    """kernels' HfApi; with HF_HUB_DISABLE_TELEMETRY set, one without the user-agent extension kernels then
    leaves empty (huggingface_hub appends it after "; ", and httpx refuses the header's trailing space)."""
    if constants.HF_HUB_DISABLE_TELEMETRY:
        return HfApi(library_name="kernels", library_version=kernels.__version__)
    return _get_hf_api()


def _install(
    kernel: KernelDependency,
    resolver: Resolver,
    *,
    backend: str | None,
    validator: MetadataValidator,
) -> DepTreeNode[LocalKernel]:
    """Resolve, validate and download the kernel and its dependencies; then a verified private copy of each."""
    api = _hub_api()
    with _network_failures_named(api.endpoint):
        try:
            tree = resolve_kernel_tree(api=api, backend=backend, kernel=kernel, resolver=resolver)
        except FileNotFoundError as error:
            raise _name_missing_variant(error) from None
        tree.validate_metadata(validator)
        verified = _verified_copies(tree.install(api=api), api)
    verified.validate_metadata(validator)  # the metadata read from the copies, which is what gets imported
    return verified


def _import(tree: DepTreeNode[LocalKernel]) -> ModuleType:
    with _LOAD_LOCK, _bytecode_writing_disabled():
        return tree.load()


# -- the Hub: trust, commits, network failures ------------------------------------------------------


@dataclasses.dataclass
class CheckedHubResolver:
    """kernels' HubResolver (or LockedHubResolver, with `locks`), with the commit resolved and checked here.

    In this order: the publisher trust check; the commit (the lock file's pin, or the Hub's answer for the
    version or revision), which must be a commit id; with `fresh` (force_download), the cache's copy of
    that commit cleared; then kernels' `resolve_hub_kernel` at that commit. Every kernel of the dependency
    tree goes through here.
    """

    trust_remote_code: bool | list[str]
    locks: KernelLocks | None = None
    fresh: bool = False

    def resolve(self, *, api: HfApi, backend: str | None, kernel: KernelDependency) -> RemoteKernel:
        _check_publisher_trust(api, kernel.repo_id, self.trust_remote_code)
        commit = _locked_commit(self.locks, kernel) if self.locks is not None else _hub_commit(api, kernel)
        if self.fresh:
            _clear_cached_commit(kernel.repo_id, commit)
        return resolve_hub_kernel(kernel.repo_id, api=api, revision=commit, backend=backend)


def _check_publisher_trust(api: HfApi, repo_id: str, trust_remote_code: bool | list[str]) -> None:
    """kernels' rule: a publisher the Hub marks trustedKernelPublisher, or trust_remote_code True or listing
    the repo. Network failures propagate (`_network_failures_named` names them): they are no verdict."""
    if trust_remote_code is True or (isinstance(trust_remote_code, list) and repo_id in trust_remote_code):
        return
    publisher = repo_id.split("/", 1)[0]
    untrusted = ValueError(
        f"Kernel repository '{repo_id}' is not from a trusted publisher. "
        "Set trust_remote_code=True or add the repository ID to the trust_remote_code allowlist "
        "to allow loading kernels from untrusted sources."
    )
    try:
        overview = api.get_organization_overview(publisher)
    except HfHubHTTPError as error:
        if error.response is not None and error.response.status_code == 404:  # no such organization
            raise untrusted from None
        raise
    if getattr(overview, "trustedKernelPublisher", False) is not True:
        raise untrusted


def _hub_commit(api: HfApi, kernel: KernelDependency) -> str:
    """The commit id the Hub gives the kernel's version (its `v<N>` branch) or revision."""
    if isinstance(kernel.version, KernelVersion.Version):
        branch = _version_branch(api, kernel.repo_id, kernel.version.version)
        return _checked_commit(branch.target_commit, f"The Hub at {api.endpoint}",
                               f"branch {branch.name} of {kernel.repo_id}")
    revision = kernel.version.revision
    if REGEX_COMMIT_HASH.fullmatch(revision):
        return revision
    info = api.repo_info(kernel.repo_id, repo_type="kernel", revision=revision)
    return _checked_commit(info.sha, f"The Hub at {api.endpoint}", f"revision {revision!r} of {kernel.repo_id}")


def _version_branch(api: HfApi, repo_id: str, version: int) -> GitRefInfo:
    """The branch `v<version>`, as kernels' version lookup finds it, with the same messages.

    Only canonical names count (`v1`, not `v01` or `v+1`), so one version is one branch.
    """
    branches = {int(branch.name[1:]): branch for branch in api.list_repo_refs(repo_id, repo_type="kernel").branches
                if isinstance(branch.name, str) and _VERSION_BRANCH.fullmatch(branch.name)}
    if version not in branches:
        raise ValueError(f"Version {version} not found, available versions: {', '.join(map(str, sorted(branches)))}")
    latest = max(branches)
    if version < latest:
        logger.warning("You are using version %d of '%s', but version %d is available.", version, repo_id, latest)
    return branches[version]


def _checked_commit(value: object, source: str, what: str) -> str:
    if isinstance(value, str) and REGEX_COMMIT_HASH.fullmatch(value):
        return value
    raise UnsafeIdError(
        f"{source} gives {what} the commit id {value!r}, which is not one (40 lowercase hex digits). "
        "Refusing to load it: a commit id names a folder of the cache."
    )


def _locked_commit(locks: KernelLocks, kernel: KernelDependency) -> str:
    lock = locks.get(kernel, None)
    if lock is None:
        raise ValueError(f"Kernel `{kernel.repo_id}` is not locked in the lock file.")
    return _checked_commit(lock.commit, "The lock file", kernel.repo_id)


@contextlib.contextmanager
def _network_failures_named(endpoint: str) -> Iterator[None]:
    """Turn a network failure, raw (httpx) or wrapped by huggingface_hub, into HubUnreachableError."""
    try:
        yield
    except (HubUnreachableError, UnsafeIdError, KernelIntegrityError):
        raise
    except Exception as error:
        failure = _network_failure(error)
        if failure is None:
            raise
        raise HubUnreachableError(
            f"Cannot reach the Hub at {endpoint}: {type(failure).__name__}: {failure}. Check the network, "
            "HF_ENDPOINT and any proxy settings. Kernels already in the cache load without the network "
            "with HF_HUB_OFFLINE=1."
        ) from error


def _network_failure(error: BaseException) -> httpx2.TransportError | None:
    """The httpx transport error `error` is, or was raised from (huggingface_hub chains it as the cause)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, httpx2.TransportError):
            return error
        seen.add(id(error))
        error = error.__cause__
    return None


def _guard_kernel_downloads() -> None:
    """Have huggingface_hub check the ids of each kernel-repo file it downloads before it names paths after them.

    huggingface_hub asks the server for a file's ETag and commit (X-Repo-Commit), or reads them from its
    cached tree listing, in `file_download._get_metadata_or_catch_error`, and joins both into cache paths
    unchecked (`blobs/<etag>`, `.locks/.../<etag>.lock`, `snapshots/<commit>/...`, and on a 404
    `.no_exist/<commit>/...`). Wrapped here, for kernel repos only: the commit must be a commit id, and
    the one asked for when a commit was asked for; the ETag a blob id; a 404 records no miss. Other repo
    types are left as huggingface_hub handles them. Raises at import if huggingface_hub no longer has
    that step in that shape: the loader would then not know its downloads are checked.
    """
    original = getattr(file_download, "_get_metadata_or_catch_error", None)
    if getattr(original, "checks_kernel_ids", False):
        return
    parameters = inspect.signature(original).parameters if callable(original) else {}
    if not {"repo_id", "repo_type", "revision", "filename", "storage_folder"} <= parameters.keys():
        raise ImportError(
            "tpu_kernels.distribution.loader cannot check the ids huggingface_hub turns into cache paths: "
            "huggingface_hub.file_download._get_metadata_or_catch_error is missing or changed. "
            "Install a huggingface_hub this package supports (see its requirements)."
        )
    signature = inspect.signature(original)

    @functools.wraps(original)
    def checked(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        if call.arguments.get("repo_type") != "kernel":
            return original(*args, **kwargs)
        call.arguments["storage_folder"] = None  # on a 404, record no miss under the server's commit id
        result = original(*call.args, **call.kwargs)
        _url, etag, commit, _size, _xet, error = result
        if error is None:
            _check_file_ids(call.arguments, etag, commit)
        return result

    checked.checks_kernel_ids = True
    file_download._get_metadata_or_catch_error = checked


def _check_file_ids(call: dict, etag: object, commit: object) -> None:
    source = f"The Hub at {call.get('endpoint') or constants.ENDPOINT}"
    what = f"{call['filename']} of {call['repo_id']}"
    requested = call["revision"]
    _checked_commit(commit, source, what)
    if REGEX_COMMIT_HASH.fullmatch(requested) and commit != requested:
        raise UnsafeIdError(f"{source} answers for commit {commit} when asked for {what} at commit {requested}")
    if not is_blob_id(etag):
        raise UnsafeIdError(
            f"{source} gives {what} the ETag {etag!r}, which is not a blob id (40 or 64 lowercase hex digits). "
            "Refusing to download it: the ETag names a file of the cache."
        )


_guard_kernel_downloads()


# -- force_download ---------------------------------------------------------------------------------


def _clear_cached_commit(repo_id: str, commit: str) -> None:
    """Delete the snapshot of `commit` (its tree listing and recorded misses too) and the repo's damaged blobs.

    A blob is kept only if its content is what its name, the ETag the Hub sent, says: those
    are exactly the Hub's bytes, and other snapshots may link to them. The folders the download then
    writes to are made writable first when they are ours (a cache restored read-only).
    """
    commit = _checked_commit(commit, "The caller", repo_id)
    cache = _download_cache()
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


# -- offline ----------------------------------------------------------------------------------------


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
        storage = _download_cache() / repo_folder_name(repo_id=kernel.repo_id, repo_type="kernel")
        if self.locks is not None:
            revision = commit = _locked_commit(self.locks, kernel)
        elif isinstance(kernel.version, KernelVersion.Version):  # kernels reads refs/v<N> of the cache
            revision = f"v{kernel.version.version}"
            commit = _checked_commit(resolve_kernel_version(kernel, local_files_only=True), "The cache",
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
    if not _is_ref_name(revision):
        raise UnsafeIdError(f"{revision!r} is not a branch or tag name; refusing to read it as a path of the cache")
    path = storage / "refs" / revision
    try:
        content = path.read_text().strip()
    except FileNotFoundError:
        return None
    return _checked_commit(content, f"The cache file {path}", f"{repo_id}'s ref {revision}")


def _is_ref_name(name: str) -> bool:
    return all(_REF_NAME_PART.fullmatch(part) for part in name.split("/"))


def _remember_ref(repo_id: str, name: str, commit: str) -> None:
    """Write refs/<name> -> commit in the cache, where offline loads look versions and branches up.

    Only for a plain branch or tag name. A cache we cannot write keeps loading: the load itself is done.
    """
    if not _is_ref_name(name):
        return
    ref = _download_cache() / repo_folder_name(repo_id=repo_id, repo_type="kernel") / "refs" / name
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


# -- verification and the private copies ------------------------------------------------------------


def verify_variant(variant_path: Path, *, source: str | None = None) -> None:
    """Check a variant folder against its metadata.json's digest (`tpu_kernels.distribution.digest`); KernelIntegrityError if not.

    A variant of a Hub cache snapshot (`<repo folder>/snapshots/<commit>/build/<variant>`) is
    checked as one (file links into the repo's `blobs/`, metadata.json against its blob id),
    any other folder as a plain one (no link at all).
    """
    _verify_digest(Path(variant_path), source=source, blobs=_cache_blobs(Path(variant_path)))


# (variant name, sha256 of its verified metadata.json) -> the private copy holding it. metadata.json lists
# every file with its digest, so equal metadata means equal files: a kernel loaded again reuses its copy,
# and kernels' importer, which caches modules by path, returns the module already imported.
_PRIVATE_COPIES: dict[tuple[str, str], Path] = {}
_private_root: Path | None = None


def _verified_copies(tree: DepTreeNode[LocalKernel], api: HfApi | None) -> DepTreeNode[LocalKernel]:
    """The tree with each kernel's variant replaced by a private copy of exactly the bytes checked against
    its digest, and its metadata read from that copy."""
    deps = {repo_id: _verified_copies(dep, api) for repo_id, dep in tree.deps.items()}
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


@contextlib.contextmanager
def _bytecode_writing_disabled() -> Iterator[None]:
    previous = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        yield
    finally:
        sys.dont_write_bytecode = previous
