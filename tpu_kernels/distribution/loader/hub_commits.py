"""What the loader asks the Hub, through huggingface_hub's public API: publisher trust, the commit of a version
(its `v<N>` branch) or revision, the variant `kernels` picks for this system, and the files of that variant.
Every id is checked before it names anything; network failures are named, never taken for an answer."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator

import httpx2
from huggingface_hub import HfApi, RepoFile, RepoFolder
from huggingface_hub.errors import HfHubHTTPError

from ..digest import METADATA_FILE, KernelIntegrityError, is_blob_id
from ..versions import VERSION_BRANCH
from .ids import REGEX_COMMIT_HASH, UnsafeIdError, checked_commit, checked_relative_path

logger = logging.getLogger(__name__)



class HubUnreachableError(ConnectionError):
    """The Hub (HF_ENDPOINT) could not be reached; the message names it and the network failure."""


class VariantNotFoundError(FileNotFoundError):
    """The kernel has no build variant for this system (backend, torch, arch)."""


@dataclasses.dataclass(frozen=True)
class HubFile:
    """One file of a variant as the Hub lists it at a commit: its path in the repo, size and blob id (the git
    blob id, or the sha256 of an LFS file), which names its blob in the cache."""

    path: str
    size: int
    blob_id: str


def check_publisher_trust(api: HfApi, repo_id: str, trust_remote_code: bool | list[str]) -> None:
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


def hub_commit(api: HfApi, repo_id: str, *, version: int | None, revision: str | None) -> str:
    """The commit id the Hub gives the kernel's version (its `v<N>` branch) or revision."""
    if version is not None:
        branch_name, target = _version_branch(api, repo_id, version)
        return checked_commit(target, f"The Hub at {api.endpoint}", f"branch {branch_name} of {repo_id}")
    if REGEX_COMMIT_HASH.fullmatch(revision):
        return revision
    info = api.repo_info(repo_id, repo_type="kernel", revision=revision)
    return checked_commit(info.sha, f"The Hub at {api.endpoint}", f"revision {revision!r} of {repo_id}")


def _version_branch(api: HfApi, repo_id: str, version: int) -> tuple[str, object]:
    """The branch `v<version>` and the commit it names, as kernels' version lookup finds it, with its messages.

    Only canonical names count (`v1`, not `v01` or `v+1`), so one version is one branch.
    """
    branches = {int(branch.name[1:]): branch for branch in api.list_repo_refs(repo_id, repo_type="kernel").branches
                if isinstance(branch.name, str) and VERSION_BRANCH.fullmatch(branch.name)}
    if version not in branches:
        raise ValueError(f"Version {version} not found, available versions: {', '.join(map(str, sorted(branches)))}")
    latest = max(branches)
    if version < latest:
        logger.warning("You are using version %d of '%s', but version %d is available.", version, repo_id, latest)
    return branches[version].name, branches[version].target_commit


def chosen_variant(repo_id: str, commit: str, backend: str | None) -> str:
    """The variant `kernels` prefers for this system among those the Hub lists at `commit`.

    `kernels.get_kernel_variants` decides (backend detection, noarch and arch rules, preference order);
    VariantNotFoundError, with each variant's verdict, if it accepts none.
    """
    import kernels

    decisions = kernels.get_kernel_variants(repo_id, revision=commit, backend=backend)
    accepted = [decision.variant.variant_str for decision in decisions if isinstance(decision, kernels.VariantAccepted)]
    if not accepted:
        verdicts = "\n".join(f"{decision.variant.variant_str}: {decision.reason}" for decision in decisions)
        raise VariantNotFoundError(
            f"Cannot find a build variant for this system in {repo_id} (revision: {commit}):\n\n{verdicts or '(none)'}"
        )
    return checked_relative_path(accepted[0], "kernels", f"the variant of {repo_id}")


def variant_files(api: HfApi, repo_id: str, commit: str, variant: str) -> list[HubFile]:
    """Every file of `build/<variant>/` at `commit`, with the blob id the Hub lists for it.

    Paths must be plain relative paths inside the variant and blob ids blob ids (UnsafeIdError otherwise);
    the variant must hold metadata.json (KernelIntegrityError otherwise).
    """
    prefix = f"build/{variant}/"
    source = f"The Hub at {api.endpoint}"
    files = []
    for entry in api.list_repo_tree(repo_id, path_in_repo=prefix.rstrip("/"), recursive=True, revision=commit,
                                    repo_type="kernel"):
        if isinstance(entry, RepoFolder):
            continue
        if not isinstance(entry, RepoFile) or not isinstance(entry.path, str) or not entry.path.startswith(prefix):
            raise UnsafeIdError(f"{source} lists {getattr(entry, 'path', entry)!r} in {prefix} of {repo_id}")
        checked_relative_path(entry.path, source, f"a file of {repo_id}")
        blob_id = entry.lfs.sha256 if entry.lfs is not None else entry.blob_id
        if not is_blob_id(blob_id):
            raise UnsafeIdError(
                f"{source} gives {entry.path} of {repo_id} the blob id {blob_id!r}, which is not one (40 or 64 "
                "lowercase hex digits). Refusing to download it: a blob id names a file of the cache."
            )
        if not isinstance(entry.size, int) or entry.size < 0:
            raise UnsafeIdError(f"{source} gives {entry.path} of {repo_id} the size {entry.size!r}")
        files.append(HubFile(entry.path, entry.size, blob_id))
    if prefix + METADATA_FILE not in {file.path for file in files}:
        raise KernelIntegrityError(f"{source} lists no {prefix}{METADATA_FILE} in {repo_id} at {commit}", [])
    return files


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
        error = error.__cause__ or error.__context__
    return None
