"""Who may do what on the local Hub: the token writes (and private repos) need, the Host names it answers
to, and the Hub endpoints it refuses, each with the reason its answer gives."""

from __future__ import annotations

import hmac
import ipaddress
from urllib.parse import urlsplit

from starlette.datastructures import Headers

from .errors import NOT_SUPPORTED, HubError
from .request import HubRequest
from .storage import Storage

LOOPBACK_NAMES = frozenset({"localhost"})
# The one user the token stands for; repos created without an organization go to this namespace.
USER_NAME = "local"
INVALID_CREDENTIALS = "Invalid credentials in Authorization header"
REPO_API = "/api/{repo_type}/{namespace}/{name}"
_OTHER_TYPES = "dataset and Space repos: this server holds kernel and model repos only"
_GIT = "git over HTTP: download with huggingface_hub (hf download, snapshot_download), publish with tpu-kernels upload"
# Hub endpoints huggingface_hub can call that this server refuses, and why: (route name, path, reason).
REFUSED = (
    ("pull_requests", REPO_API + "/discussions/{rest*}",
     "pull requests and discussions: commit to a branch (a kernel version is branch v<N>)"),
    ("super_squash", REPO_API + "/super-squash/{rest*}",
     "squashing history: history is append-only, so every commit a lock file pins stays in its branch"),
    ("lfs_files", REPO_API + "/lfs-files/{rest*}", "LFS files: files travel inside the commit; there is no LFS storage"),
    ("xet", REPO_API + "/xet-read-token/{rest*}", "Xet storage: files travel inside the commit"),
    ("xet", REPO_API + "/xet-write-token/{rest*}", "Xet storage: files travel inside the commit"),
    ("duplicate", REPO_API + "/duplicate", "duplicating a repo: publish the build to the new repo (tpu-kernels upload)"),
    ("storage_listing", "/api/settings/repositories",
     "the storage listing of repos: list repos with HfApi.list_models(author=...) or on the front page"),
    ("storage_listing", "/api/organizations/{org}/settings/repositories",
     "the storage listing of repos: list repos with HfApi.list_models(author=...) or on the front page"),
    ("other_repo_types", "/api/datasets/{rest*}", _OTHER_TYPES),
    ("other_repo_types", "/api/spaces/{rest*}", _OTHER_TYPES),
    ("other_repo_types", "/datasets/{rest*}", _OTHER_TYPES),
    ("other_repo_types", "/spaces/{rest*}", _OTHER_TYPES),
    *(("git", f"{prefix}/{{namespace}}/{{name}}/{tail}", _GIT)
      for prefix in ("/kernels", "") for tail in ("info/refs", "git-upload-pack", "git-receive-pack")),
)


def normalize_token(token: str | None) -> str | None:
    """The token writes need; None (a read-only server) for a missing, empty or blank one."""
    token = (token or "").strip()
    return token or None



def host_name(value: str) -> str | None:
    """The name in a Host header (lowercased, an IPv6 address without brackets); None if it is not one."""
    try:
        parts = urlsplit("//" + value)
        parts.port  # noqa: B018 (raises ValueError unless the port is a number in range)
    except ValueError:
        return None
    if not parts.hostname or "@" in value or parts.path or parts.query or parts.fragment:
        return None
    return parts.hostname


def _is_ip_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class Access:
    """The checks a request passes before its handler runs."""

    def __init__(self, storage: Storage, token: str | None, host_names=LOOPBACK_NAMES):
        """`host_names`: the names a request's Host may give besides IP addresses ("*": any name)."""
        self.storage = storage
        self.token = normalize_token(token)
        self.host_names = frozenset(name.lower() for name in host_names)

    def authenticated(self, headers: Headers) -> bool:
        scheme, _, given = headers.get("authorization", "").partition(" ")
        return (
            self.token is not None
            and scheme.lower() == "bearer"
            and hmac.compare_digest(given.strip().encode(), self.token.encode())
        )

    def require_token(self, request: HubRequest) -> None:
        if self.token is None:
            raise HubError(401, f"{INVALID_CREDENTIALS}: this server was started without a token and is read-only")
        if not request.authenticated:
            raise HubError(401, f"{INVALID_CREDENTIALS}: writes need the server's token (set HF_TOKEN)")

    def visible(self, request: HubRequest, repo_type: str, repo_id: str) -> bool:
        """Whether the repo exists for this caller: it exists, and is public or the caller holds the token."""
        return self.storage.repo_exists(repo_type, repo_id) and (
            request.authenticated or not self.storage.is_private(repo_type, repo_id))

    def check_visible(self, request: HubRequest, repo_type: str, repo_id: str) -> None:
        """A private repo is, to a caller without the token, a repo that does not exist."""
        if self.storage.is_private(repo_type, repo_id) and not request.authenticated:
            raise HubError(404, f"Repository {repo_type}/{repo_id} not found", code="RepoNotFound")

    def check_host(self, request: HubRequest) -> None:
        """400 for a Host this server does not answer to: a DNS-rebinding page cannot read it."""
        host = request.headers.get("host")
        if host is None or "*" in self.host_names:
            return  # HTTP/1.0 may omit it; no browser does
        name = host_name(host)
        if name is None or not (name in self.host_names or _is_ip_address(name)):
            names = ", ".join(sorted(name for name in self.host_names if not _is_ip_address(name)))
            raise HubError(400, f"Invalid Host header {host[:100]!r}: this server answers to IP addresses and "
                                f"{names} (more: tpu-kernels serve --allowed-host NAME)")

    @staticmethod
    def refuse(request: HubRequest, reason: str, **params) -> None:
        """The handler of the REFUSED endpoints."""
        raise HubError(400, f"{NOT_SUPPORTED}: {reason}")
