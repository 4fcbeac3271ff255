"""What the loader asks the Hub, in `kernels`' terms: publisher trust, the commit of a version (its `v<N>`
branch) or revision, the blob of a variant's metadata.json; and, for each file huggingface_hub downloads
from a kernel repo, the ids it names cache paths after. Network failures are named, never taken for an
answer."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import re
from collections.abc import Iterator

import httpx2
from huggingface_hub import HfApi, RepoFile, constants, file_download
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.file_download import REGEX_COMMIT_HASH
from huggingface_hub.hf_api import GitRefInfo
from kernels._rust import KernelDependency, KernelLocks, KernelVersion
from kernels.resolver import LocalKernel, RemoteKernel, resolve_hub_kernel

from ..digest import METADATA_FILE, KernelIntegrityError, is_blob_id
from .cache import clear_cached_commit
from .ids import UnsafeIdError, checked_commit, locked_commit

logger = logging.getLogger(__name__)

_VERSION_BRANCH = re.compile(r"v(0|[1-9][0-9]*)")


class HubUnreachableError(ConnectionError):
    """The Hub (HF_ENDPOINT) could not be reached; the message names it and the network failure."""


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
        commit = locked_commit(self.locks, kernel) if self.locks is not None else _hub_commit(api, kernel)
        if self.fresh:
            clear_cached_commit(kernel.repo_id, commit)
        return resolve_hub_kernel(kernel.repo_id, api=api, revision=commit, backend=backend)


def _check_publisher_trust(api: HfApi, repo_id: str, trust_remote_code: bool | list[str]) -> None:
    """kernels' rule: a publisher the Hub marks trustedKernelPublisher, or trust_remote_code True or listing
    the repo. Network failures propagate (`network_failures_named` names them): they are no verdict."""
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
        return checked_commit(branch.target_commit, f"The Hub at {api.endpoint}",
                               f"branch {branch.name} of {kernel.repo_id}")
    revision = kernel.version.revision
    if REGEX_COMMIT_HASH.fullmatch(revision):
        return revision
    info = api.repo_info(kernel.repo_id, repo_type="kernel", revision=revision)
    return checked_commit(info.sha, f"The Hub at {api.endpoint}", f"revision {revision!r} of {kernel.repo_id}")


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


def hub_metadata_blob_id(api: HfApi, repo_id: str, kernel: LocalKernel) -> str:
    """The blob the Hub serves as this variant's metadata.json at the commit of its snapshot."""
    commit = kernel.variant_path.parents[1].name
    path = f"build/{kernel.variant_str}/{METADATA_FILE}"
    files = [info for info in api.get_paths_info(repo_id, [path], repo_type="kernel", revision=commit)
             if isinstance(info, RepoFile)]
    if len(files) != 1:
        raise KernelIntegrityError(f"The Hub lists no file {path} in {repo_id} at {commit}", [kernel.variant_path])
    (file,) = files
    return file.lfs.sha256 if file.lfs is not None else file.blob_id


@contextlib.contextmanager
def network_failures_named(endpoint: str) -> Iterator[None]:
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
    checked_commit(commit, source, what)
    if REGEX_COMMIT_HASH.fullmatch(requested) and commit != requested:
        raise UnsafeIdError(f"{source} answers for commit {commit} when asked for {what} at commit {requested}")
    if not is_blob_id(etag):
        raise UnsafeIdError(
            f"{source} gives {what} the ETag {etag!r}, which is not a blob id (40 or 64 lowercase hex digits). "
            "Refusing to download it: the ETag names a file of the cache."
        )


_guard_kernel_downloads()
