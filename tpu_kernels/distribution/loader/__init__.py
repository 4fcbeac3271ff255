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
  them (`hub_commits._guard_kernel_downloads`). Anything else raises `UnsafeIdError`, before any file is written;
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

This module wires the loads; ids.py checks ids, hub_commits.py asks the Hub, cache.py reads and
clears the cache, private_copies.py verifies, copies and imports.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import kernels
from huggingface_hub import HfApi, constants
from huggingface_hub.file_download import REGEX_COMMIT_HASH
from kernels._rust import KernelDependency
from kernels._versions import revision_or_version
from kernels.deps import DepTreeNode, resolve_kernel_tree
from kernels.hf_hub import _get_hf_api
from kernels.load import _get_local_kernel_overrides
from kernels.locking import get_locked_kernel_revision
from kernels.resolver import LocalKernel, Resolver, SequentialResolver, resolve_local_kernel
from kernels.validate import AllValidator, ArchValidator, MetadataValidator, default_metadata_validators

from ..digest import KernelIntegrityError
from .cache import CachedVariantResolver, CacheNotWritableError, remember_ref
from .hub_commits import CheckedHubResolver, HubUnreachableError, network_failures_named
from .ids import UnsafeIdError
from .private_copies import import_verified, verified_copies, verify_variant

# How kernels 0.17.2 (and CachedVariantResolver) word "no variant for this system".
_NO_VARIANT_MESSAGES = ("Cannot find a build variant for this system", "Cannot find a cached build variant")

__all__ = [
    "CacheNotWritableError",
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
            remember_ref(repo_id, name, origin.revision)
    return import_verified(installed)


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
    return import_verified(installed)


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
    return import_verified(installed)


def get_local_kernel(repo_path: str | Path, *, backend: str | None = None) -> ModuleType:
    """`kernels.get_local_kernel` (a build folder, or one variant of it), after checking its digests."""
    try:
        location = resolve_local_kernel(Path(repo_path), backend=backend)
    except FileNotFoundError as error:
        raise _name_missing_variant(error) from None
    return import_verified(verified_copies(DepTreeNode(location=location, deps={}), api=None))


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
    with network_failures_named(api.endpoint):
        try:
            tree = resolve_kernel_tree(api=api, backend=backend, kernel=kernel, resolver=resolver)
        except FileNotFoundError as error:
            raise _name_missing_variant(error) from None
        tree.validate_metadata(validator)
        verified = verified_copies(tree.install(api=api), api)
    verified.validate_metadata(validator)  # the metadata read from the copies, which is what gets imported
    return verified
