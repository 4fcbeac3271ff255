"""`get_kernel` and lock-file loads: `kernels`' semantics, with every id from the server checked and the digest
checked on exactly the bytes that get imported. Built on the public APIs of `kernels` and huggingface_hub.

From `kernels` (its public API): which variant this system takes (`kernels.get_kernel_variants` online; offline,
`kernels.get_local_kernel` picks among the cached variants), the metadata validators, its own digest check,
and the import (`kernels.get_local_kernel`, one module per kernel id). What this module adds:

* ids are checked before they name a path. The commit to load is resolved here (the `v<N>` branch's
  `targetCommit`, a revision's `sha`, a lock file's pin, a cached ref) and must be 40 lowercase hex digits;
  the files of the variant come from the Hub's tree listing at that commit, each path a plain relative
  path and each blob id a blob id (`hub_commits`), or UnsafeIdError before anything is written;
* downloads are ours (`downloads`): every file must hash to the blob id it is stored under before it
  enters the cache, so a Hub that sends other bytes than it lists leaves nothing behind;
* publisher trust is asked here, in kernels' terms. A Hub that cannot be reached raises
  `HubUnreachableError` naming the endpoint and the network failure, never advice to trust the code;
* the variant is read once, checked against the digest of its metadata.json with
  `tpu_kernels.distribution.digest` (every file listed with its sha256, no other file or folder, no symbolic
  link but the cache's own file links into `blobs/`, a digest present; in the cache metadata.json must be the
  blob whose id it links to, and online the blob the Hub lists for it at that commit), and the very bytes
  checked are written to a private copy, a new folder (mode 0700) of this process; the import reads that
  copy, with no bytecode: a file changed in the cache after the check, or a `__pycache__` planted there,
  is never read. A refused variant is dropped from the cache, with every blob that is not what its name says;
* `force_download=True` deletes, before downloading, the cached snapshot of the commit to load and every
  blob of the repo that does not hold what its name says;
* a load by `version=` (or by branch or tag) records `refs/<name>` in the cache, so the same call works
  offline afterwards;
* no build variant for this system raises `VariantNotFoundError` (a FileNotFoundError), which
  `kernelize` reports as "this kernel cannot serve";
* a module loaded here can be handed to a caller that loads kernels by name through plain `kernels`
  (transformers' flash path): `kernels_name` gives a repo id that `kernels.get_kernel` resolves to that very
  module, never to the cache or the Hub (`kernels_names`).

The environment is read as huggingface_hub and kernels read it: HF_ENDPOINT, HF_HUB_OFFLINE and
HF_HUB_DISABLE_TELEMETRY when huggingface_hub is first imported, so set them before; HF_TOKEN, KERNELS_CACHE
(else HF_HUB_CACHE) and LOCAL_KERNELS at each call.

This module wires the loads; ids.py checks ids, hub_commits.py asks the Hub, downloads.py fetches,
cache.py reads and clears the cache, private_copies.py verifies, copies and imports.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from types import ModuleType

from huggingface_hub import HfApi, constants

from ..digest import METADATA_FILE, KernelIntegrityError
from .cache import (
    CacheNotWritableError,
    cached_commit,
    cached_variants,
    clear_cached_commit,
    drop_refused_variant,
    remember_ref,
    repo_folder,
)
from .downloads import download_variant
from .hub_commits import (
    HubUnreachableError,
    VariantNotFoundError,
    check_publisher_trust,
    chosen_variant,
    hub_commit,
    network_failures_named,
    variant_files,
)
from .ids import REGEX_COMMIT_HASH, UnsafeIdError, locked_commit
from .kernels_names import NotServableByNameError, served_name
from .private_copies import import_copy, verified_copy, verify_variant

# How kernels words "no variant for this system" when get_local_kernel finds none.
_NO_VARIANT_MESSAGE = "Cannot find a build variant for this system"

__all__ = [
    "CacheNotWritableError",
    "HubUnreachableError",
    "KernelIntegrityError",
    "NotServableByNameError",
    "UnsafeIdError",
    "VariantNotFoundError",
    "get_kernel",
    "get_local_kernel",
    "get_locked_kernel",
    "kernels_name",
    "load_kernel",
    "loaded_commit",
    "verify_variant",
]

# The Hub commit each module loaded here came from: a caller that hands the kernel's name to another loader
# (transformers loads attention kernels by name) pins that commit, not a branch that may have moved since.
_COMMITS: weakref.WeakKeyDictionary[ModuleType, str] = weakref.WeakKeyDictionary()
# The variant folder of the private copy each module loaded here was verified in and imported from.
_VARIANTS: weakref.WeakKeyDictionary[ModuleType, Path] = weakref.WeakKeyDictionary()


def loaded_commit(module: ModuleType) -> str | None:
    """The commit `module` was verified and imported at by `get_kernel`, `get_locked_kernel` or `load_kernel`;
    None for a local build folder (`get_local_kernel`, or LOCAL_KERNELS) and for modules not loaded here."""
    return _COMMITS.get(module)


def kernels_name(module: ModuleType, repo_id: str) -> str:
    """A repo id under which plain `kernels.get_kernel` (as transformers calls it) returns `module`, a kernel of
    `repo_id` loaded here, in this process, whatever kernels' cache holds or kernels' environment switches say:
    `<repo_id>--<commit>--<kernel id>`, recorded in LOCAL_KERNELS (`kernels_names`).

    NotServableByNameError if `module` was not loaded here, or its copy's path cannot be named in LOCAL_KERNELS.
    """
    return served_name(module, repo_id, _COMMITS.get(module), _VARIANTS.get(module))


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
        backend: `cpu`, `tpu`, ...; detected (by `kernels`) when None.
        trust_remote_code: True, or a list of repo ids allowed besides trusted publishers.
        force_download: clear the cached commit and download it again (repairs a damaged cache).

    Raises:
        KernelIntegrityError: the selected variant differs from its digest, or has none.
        VariantNotFoundError: the kernel has no build for this system.
        UnsafeIdError: the Hub sent a commit id, path or blob id that is not one.
        HubUnreachableError: the Hub cannot be reached (the message names it and why).
        ValueError: untrusted publisher, unknown version (the message lists the available ones),
            or both/neither of version and revision.
    """
    _one_of(version, revision)
    override = _local_override(repo_id)
    if override is not None:
        return get_local_kernel(override, backend=backend)
    if _offline(force_download):
        commit = cached_commit(repo_id, version=version, revision=revision)
        return _load_cached(repo_id, commit, backend=backend)
    api = _hub_api()
    with network_failures_named(api.endpoint):
        check_publisher_trust(api, repo_id, trust_remote_code)
        commit = hub_commit(api, repo_id, version=version, revision=revision)
        module = _load_from_hub(api, repo_id, commit, backend=backend, fresh=force_download)
    name = f"v{version}" if version is not None else revision
    if not REGEX_COMMIT_HASH.fullmatch(name):
        remember_ref(repo_id, name, commit)
    return module


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
    commit = locked_commit(Path(lockfile), repo_id)
    if _offline(force_download):
        return _load_cached(repo_id, commit, backend=backend)
    api = _hub_api()
    with network_failures_named(api.endpoint):
        check_publisher_trust(api, repo_id, trust_remote_code)
        return _load_from_hub(api, repo_id, commit, backend=backend, fresh=force_download)


def load_kernel(repo_id: str, *, lockfile: str | Path, backend: str | None = None) -> ModuleType:
    """Load the commit that `lockfile` pins from the cache only (no request), after checking its digests.

    `kernels.load_kernel` with a digest check, for kernels fetched beforehand (`kernels download`,
    or a `get_locked_kernel` call). FileNotFoundError if the variant is not cached.
    """
    return _load_cached(repo_id, locked_commit(Path(lockfile), repo_id), backend=backend)


def get_local_kernel(repo_path: str | Path, *, backend: str | None = None) -> ModuleType:
    """`kernels.get_local_kernel` (a build folder, or one variant of it), after checking its digests."""
    path = Path(repo_path)
    if (path / METADATA_FILE).is_file():
        variants = [path]
    else:
        build = path / "build" if (path / "build").is_dir() else path
        variants = sorted(entry for entry in build.iterdir() if entry.is_dir() and not entry.name.startswith("."))
    copy = verified_copy(variants, source=f"local kernel {path}", remedy="Rebuild it.")
    return _import(copy, backend, where=str(path))


def _load_from_hub(api: HfApi, repo_id: str, commit: str, *, backend: str | None, fresh: bool) -> ModuleType:
    """Download the variant kernels picks at `commit` into the cache, then verify, copy and import it."""
    variant = chosen_variant(repo_id, commit, backend)
    files = variant_files(api, repo_id, commit, variant)
    if fresh:
        clear_cached_commit(repo_id, commit)
    repo = repo_folder(repo_id)
    download_variant(api, repo, repo_id, commit, files)
    metadata_blob = next(file.blob_id for file in files if file.path == f"build/{variant}/{METADATA_FILE}")
    try:
        copy = verified_copy(
            [repo / "snapshots" / commit / "build" / variant],
            source=f"{repo_id} (revision {commit})",
            remedy=f"It was dropped from the cache; a new load downloads it again from {api.endpoint}.",
            metadata_blob_ids={variant: metadata_blob},
        )
    except KernelIntegrityError:
        drop_refused_variant(repo_id, commit, variant)
        raise
    return _remember_commit(_import(copy, backend, where=f"{repo_id} (revision {commit})"), commit)


def _load_cached(repo_id: str, commit: str, *, backend: str | None) -> ModuleType:
    """Offline: verify and copy every variant the cache holds at `commit`; kernels picks among them."""
    copy = verified_copy(
        cached_variants(repo_id, commit),
        source=f"cached kernel {repo_id} (revision {commit})",
        remedy="Download it again, online: tpu_kernels.get_kernel(..., force_download=True).",
    )
    return _remember_commit(_import(copy, backend, where=f"{repo_id} (revision {commit}) in the cache"), commit)


def _remember_commit(module: ModuleType, commit: str) -> ModuleType:
    _COMMITS[module] = commit
    return module


def _import(copy: Path, backend: str | None, *, where: str) -> ModuleType:
    _refuse_kernel_dependencies(copy, where)
    try:
        module = import_copy(copy, backend=backend)
    except FileNotFoundError as error:
        if str(error).startswith(_NO_VARIANT_MESSAGE):
            raise VariantNotFoundError(str(error).replace(str(copy), where)) from None
        raise
    variant = _imported_variant(copy, module)
    if variant is not None:
        _VARIANTS[module] = variant
    return module


def _imported_variant(copy: Path, module: ModuleType) -> Path | None:
    """The variant of `copy` kernels imported `module` from: the one whose kernel id is the module's name."""
    import kernels

    return next((variant for variant in sorted((copy / "build").iterdir())
                 if kernels.Metadata.read_from_file(variant / METADATA_FILE).id == module.__name__), None)


def _refuse_kernel_dependencies(copy: Path, where: str) -> None:
    """kernels would fetch a kernel's dependencies itself, past every check here: refuse such kernels clearly."""
    import kernels

    for variant in sorted((copy / "build").iterdir()):
        depends = kernels.Metadata.read_from_file(variant / METADATA_FILE).kernel_depends
        if depends:
            raise ValueError(
                f"{where} (variant {variant.name}) depends on other kernels ({', '.join(d.repo_id for d in depends)}); "
                "tpu_kernels.get_kernel does not load kernel dependencies. Use kernels.get_kernel for it."
            )


def _one_of(version: int | None, revision: str | None) -> None:
    """kernels' rule and words: exactly one of version and revision."""
    if version is not None and revision is not None:
        raise ValueError("Only one of `revision` or `version` must be specified.")
    if version is None and revision is None:
        raise ValueError(
            "A kernel version or revision must be specified. Use `version=<major>` for a stable kernel API version "
            "or `revision=<branch/tag/commit>` for an explicit Hub revision."
        )


def _local_override(repo_id: str) -> Path | None:
    """The folder LOCAL_KERNELS (`repo_id=path:repo_id=path`, kernels' format) names for `repo_id`."""
    overrides = os.environ.get("LOCAL_KERNELS")
    if not overrides:
        return None
    for entry in overrides.split(":"):
        name, separator, path = entry.partition("=")
        if not separator:
            raise ValueError(f"Invalid LOCAL_KERNELS entry: {entry}. Expected format: repo_id_1=path_1:repo_id_2=path_2")
        if name == repo_id:
            return Path(path)
    return None


def _offline(force_download: bool) -> bool:
    offline = constants.is_offline_mode()
    if force_download and offline:
        raise ValueError("force_download=True needs the Hub, but HF_HUB_OFFLINE is set")
    return offline


def _hub_api() -> HfApi:
    import kernels

    return HfApi(library_name="kernels", library_version=kernels.__version__)
