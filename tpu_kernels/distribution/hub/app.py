"""The local Hub's HTTP API, as an ASGI application: the endpoints huggingface_hub 2.4 and kernels 0.17 call.

Routes (`{t}` is `kernels` or `models`; T: needs the token; every GET route answers HEAD too):

    GET  /api/whoami-v2                              T
    POST /api/repos/create                           T  (a private repo is invisible without the token)
    DELETE /api/repos/delete, POST /api/repos/move   T  delete a repo; rename it (within or across namespaces)
    PUT  /api/{t}/{ns}/{name}/settings               T  visibility (private or public); nothing else
    GET  /api/{t}                                       list repos (?author=, ?search=, ?sort=, ?limit=), paginated
    GET  /api/{t}/{ns}/{name}/auth-check[/write]        (T for write) may the caller read (write) the repo
    POST /api/validate-yaml                          T  README front matter check (huggingface_hub sends the token)
    GET  /api/agent-harnesses                           empty registry (huggingface_hub telemetry)
    GET  /api/organizations/{org}/overview              trustedKernelPublisher
    GET  /api/{t}/{ns}/{name}[/revision/{rev}]          repo info at a revision (sha, siblings)
    GET  /api/{t}/{ns}/{name}/tree/{rev}[/{path}]       tree listing (?recursive=true), paginated
    POST /api/{t}/{ns}/{name}/paths-info/{rev}          info on given paths
    GET  /api/{t}/{ns}/{name}/refs                      branches and tags
    GET  /api/{t}/{ns}/{name}/commits/{rev}             history, newest first, paginated
    POST /api/{t}/{ns}/{name}/preupload/{rev}        T  upload mode per file (always "regular")
    POST /api/{t}/{ns}/{name}/commit/{rev}           T  NDJSON commit, streamed to disk
    POST|DELETE /api/{t}/{ns}/{name}/branch/{branch} T
    POST /api/{t}/{ns}/{name}/tag/{rev}, DELETE .../tag/{tag}   T
    GET|HEAD /{ns}/{name}/resolve/{rev}/{path}          model file (X-Repo-Commit, ETag, Range)
    GET|HEAD /kernels/{ns}/{name}/resolve/{rev}/{path}
    GET  /api/tpu-kernels/stats                         request counters (not counted themselves)
    GET  /, /kernels/{ns}/{name}[/tree/{rev}|/commit/{id}], /{ns}/{name}[...]   web pages (pages.py)

A revision may be a branch, a tag, a commit id or a full ref name (`refs/heads/v1`,
`refs/tags/x`). What the server does not support is refused with a 400 whose message
says so and why (REFUSED below, and any other /api/ path): never with a 404, which
clients would read as a missing repo, file or revision.

Requests carry the token as `Authorization: Bearer <token>`. Without a valid one,
a private repo answers 404 as a missing one does, as on the Hub.

Handlers are plain functions run in worker threads (storage does blocking file
I/O and fsyncs). Only the routes that take a body read one (any other request
body is left unread and its connection closed after the answer). A body is read
here, bounded in size and in pace (`Limits.body_timeout`, `Limits.min_rate`),
kept in memory up to 64 KiB and on disk beyond, before its handler runs; only the
commit body streams into its handler, which stages files on disk as they arrive.

Before routing, a request is refused if its headers pass `Limits.max_header_bytes`
(431; h11 only bounds headers still arriving), if it carries both Content-Length
and Transfer-Encoding (400, connection closed: RFC 9112 section 6.1), or if its Host
is not a name this server answers to (400: a DNS-rebinding page cannot read it).
"""

from __future__ import annotations

import collections
import functools
import hmac
import ipaddress
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

import anyio
import anyio.from_thread
import anyio.to_thread
import yaml
from starlette.datastructures import Headers, QueryParams
from starlette.responses import FileResponse, JSONResponse, Response

from .card import split_front_matter
from .commit_payload import read_commit_payload
from .limits import Limits, TransferClock
from .pages import Pages
from .routing import Route, find_route, path_segments, route
from .commits import Tree
from .errors import NOT_SUPPORTED, HubError
from .names import (
    MAIN_BRANCH,
    RESERVED_NAMESPACES,
    branch_name,
    validate_path,
    validate_repo_id,
    validate_repo_type,
)
from .storage import Storage

PAGE_SIZE = 1000
# A request body beyond this waits on disk (tmp/) until its handler reads it.
BODY_MEMORY_BYTES = 64 << 10
LOOPBACK_NAMES = frozenset({"localhost"})
MAX_CURSOR_DIGITS = 15
DOWNLOAD_CHUNK_BYTES = 256 << 10
USER_NAME = "local"
STATS_PATH = "/api/tpu-kernels/stats"
INVALID_CREDENTIALS = "Invalid credentials in Authorization header"
_URL_TYPES = {"kernels": "kernel", "models": "model"}
_RESOLVE_PREFIXES = {"kernel": "kernels/", "model": ""}
_ANY_METHOD = "GET HEAD POST PUT PATCH DELETE"
_REPO_API = "/api/{repo_type}/{namespace}/{name}"
_OTHER_TYPES = "dataset and Space repos: this server holds kernel and model repos only"
_GIT = "git over HTTP: download with huggingface_hub (hf download, snapshot_download), publish with tpu-kernels upload"
# Hub endpoints huggingface_hub can call that this server refuses, and why: (route name, path, reason).
REFUSED = (
    ("pull_requests", _REPO_API + "/discussions/{rest*}",
     "pull requests and discussions: commit to a branch (a kernel version is branch v<N>)"),
    ("super_squash", _REPO_API + "/super-squash/{rest*}",
     "squashing history: history is append-only, so every commit a lock file pins stays in its branch"),
    ("lfs_files", _REPO_API + "/lfs-files/{rest*}", "LFS files: files travel inside the commit; there is no LFS storage"),
    ("xet", _REPO_API + "/xet-read-token/{rest*}", "Xet storage: files travel inside the commit"),
    ("xet", _REPO_API + "/xet-write-token/{rest*}", "Xet storage: files travel inside the commit"),
    ("duplicate", _REPO_API + "/duplicate", "duplicating a repo: publish the build to the new repo (tpu-kernels upload)"),
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
LISTING_SORTS = ("id", "createdAt", "lastModified")
# Files a browser may show inline; every other file is served as application/octet-stream.
_INLINE_TYPES = {
    ".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".gif": "image/gif", ".webp": "image/webp",
    ".svg": "image/svg+xml", ".md": "text/plain; charset=utf-8", ".txt": "text/plain; charset=utf-8",
    ".py": "text/plain; charset=utf-8", ".json": "text/plain; charset=utf-8", ".toml": "text/plain; charset=utf-8",
}
# A repo file opened in a browser runs nothing in this origin (an SVG could hold a script).
_FILE_SECURITY_HEADERS = {"Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; sandbox",
                          "X-Content-Type-Options": "nosniff"}

logger = logging.getLogger(__name__)


def normalize_token(token: str | None) -> str | None:
    """The token writes need; None (a read-only server) for a missing, empty or blank one."""
    token = (token or "").strip()
    return token or None


class ClientGone(Exception):
    """The client closed the connection while its request was being read."""


@dataclass
class RequestStats:
    """Requests served, in total and by route; thread-safe."""

    total: int = 0
    by_route: collections.Counter = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, route_name: str) -> None:
        with self.lock:
            self.total += 1
            self.by_route[route_name] += 1

    def snapshot(self) -> dict:
        with self.lock:
            return {"requests": self.total, "by_route": dict(self.by_route)}


class HubRequest:
    """One request: its headers and query, the caller's standing, and its body read under limits."""

    def __init__(self, scope, receive, limits: Limits, authenticated: bool, spool_folder: Path):
        self.scope = scope
        self.method: str = scope["method"]
        self.headers = Headers(scope=scope)
        self.query = QueryParams(scope["query_string"])
        self.authenticated = authenticated
        self._receive = receive
        self._limits = limits
        self._spool_folder = spool_folder
        length = self.headers.get("content-length")  # the HTTP layer admits one, all digits
        self.body_length = int(length) if length else None
        self.body_complete = not (self.body_length or "transfer-encoding" in self.headers)
        self.keep_alive = True
        self._clock = TransferClock(limits.body_timeout, limits.min_rate)
        self._received = 0
        self._body: tempfile.SpooledTemporaryFile | None = None

    async def next_chunk(self, limit: int) -> bytes:
        """The next piece of the body, b"" at its end: 413 past `limit` bytes, 408 if it stalls or
        drips slower than the limits allow."""
        if self.body_length is not None and self.body_length > limit:
            raise HubError(413, f"Request body larger than {limit} bytes")
        while not self.body_complete:
            started = time.monotonic()
            try:
                with anyio.fail_after(max(self._clock.remaining(), 0)):
                    message = await self._receive()
            except TimeoutError:
                raise HubError(408, f"Request body stalled or too slow: it may pause {self._limits.body_timeout:g} s "
                                    f"at most, and must average {self._limits.min_rate:g} bytes/s beyond its first "
                                    f"{self._limits.body_timeout:g} s") from None
            if message["type"] == "http.disconnect":
                raise ClientGone()
            self.body_complete = not message.get("more_body", False)
            chunk = message.get("body", b"")
            self._clock.record(time.monotonic() - started, len(chunk))
            self._received += len(chunk)
            if self._received > limit:
                raise HubError(413, f"Request body larger than {limit} bytes")
            if chunk:
                return chunk
        return b""

    async def read_body(self, limit: int) -> None:
        """Receive the whole body: in memory up to BODY_MEMORY_BYTES, on disk beyond."""
        self._body = tempfile.SpooledTemporaryFile(max_size=BODY_MEMORY_BYTES, dir=self._spool_folder)
        while chunk := await self.next_chunk(limit):
            if self._received > BODY_MEMORY_BYTES:
                await anyio.to_thread.run_sync(self._body.write, chunk)
            else:
                self._body.write(chunk)

    @property
    def body_in_memory(self) -> bool:
        return self._received <= BODY_MEMORY_BYTES

    def body(self) -> bytes:
        if self._body is None:
            return b""
        self._body.seek(0)
        return self._body.read()

    def close(self) -> None:
        if self._body is not None:
            self._body.close()

    def read_chunk_from_thread(self, limit: int) -> bytes:
        """next_chunk, for a handler running in a worker thread."""
        return anyio.from_thread.run(self.next_chunk, limit)

    def json(self) -> dict:
        """The body as a JSON object ({} if empty)."""
        try:
            data = json.loads(self.body() or b"{}")
            # json.loads lets a lone surrogate through, escaped (\ud800) or UTF-8-encoded.
            json.dumps(data, ensure_ascii=False).encode()
        except UnicodeError:
            raise HubError(400, "Invalid JSON body: not valid Unicode (invalid UTF-8, or a lone surrogate)") from None
        except (ValueError, RecursionError) as error:  # RecursionError: nested too deep for the decoder
            raise HubError(400, f"Invalid JSON body: {error}") from None
        if not isinstance(data, dict):
            raise HubError(400, "Invalid JSON body: expected an object")
        return data

    def form_values(self, name: str) -> Iterator[str]:
        """The values of one field of the urlencoded body, parsed a piece of the body at a time: an
        anonymous request's body never sits in memory whole."""
        if self._body is None:
            return
        self._body.seek(0)
        pending = b""
        while True:
            piece = self._body.read(BODY_MEMORY_BYTES)
            fields = (pending + piece).split(b"&")
            pending = fields.pop() if piece else b""
            try:
                for key, value in parse_qsl(b"&".join(fields).decode(), errors="strict"):
                    if key == name:
                        yield value
            except UnicodeDecodeError:
                raise HubError(400, "Invalid form body: not UTF-8") from None
            if not piece:
                return


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


def _field(payload: dict, name: str, kinds: type | tuple[type, ...], where: str = ""):
    """payload[name] if it is one of `kinds` (missing counts as None); else a 400 naming the field."""
    value = payload.get(name)
    if not isinstance(value, kinds):
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        expected = " or ".join("null" if kind is type(None) else kind.__name__ for kind in kinds)
        label = f"{where}{name}"
        raise HubError(400, f"Invalid field {label!r}: expected {expected}, got {type(value).__name__}")
    return value


def _error_response(error: HubError) -> Response:
    headers = {"X-Error-Message": " ".join(error.message.split()).encode("ascii", "replace").decode()}
    if error.code:
        headers["X-Error-Code"] = error.code
    if error.commit:
        headers["X-Repo-Commit"] = error.commit
    return JSONResponse({"error": error.message}, status_code=error.status, headers=headers)


def _requested_privacy(payload: dict) -> bool | None:
    """The visibility a create or settings request asks for; None if it names none."""
    # huggingface_hub 2.x sends "visibility"; older clients and curl users send "private".
    visibility = _field(payload, "visibility", (str, type(None)))
    if visibility not in (None, "public", "private"):
        raise HubError(400, f"Invalid field 'visibility': expected 'public' or 'private', got {visibility[:40]!r}")
    private_flag = _field(payload, "private", (bool, type(None)))
    return visibility == "private" if visibility is not None else private_flag


def _named_repo(payload: dict) -> tuple[str, str]:
    """(repo type, repo id) of a create or delete request: `type`, `organization` (else the user), `name`."""
    repo_type = validate_repo_type(_field(payload, "type", (str, type(None))) or "model")
    namespace = _field(payload, "organization", (str, type(None))) or USER_NAME
    repo_id = f"{namespace}/{_field(payload, 'name', str)}"
    validate_repo_id(repo_id)
    return repo_type, repo_id


def _repo_of(payload: dict, field: str) -> str:
    repo_id = _field(payload, field, str)
    validate_repo_id(repo_id)
    return repo_id


class HubApp:
    """The ASGI application: routing, authentication, limits and the handlers."""

    def __init__(self, storage: Storage, token: str | None, trusted_orgs, limits: Limits,
                 host_names=LOOPBACK_NAMES):
        """`host_names`: the names a request's Host may give besides IP addresses ("*": any name)."""
        self.storage = storage
        self.token = normalize_token(token)
        self.trusted_orgs = frozenset(trusted_orgs)
        self.limits = limits
        self.host_names = frozenset(name.lower() for name in host_names)
        self.stats = RequestStats()
        self.pages = Pages(storage, self.trusted_orgs)
        self.routes = self._routes()
        self._commit_slots: anyio.CapacityLimiter | None = None
        self._large_body_slots: anyio.CapacityLimiter | None = None

    def _routes(self) -> list[Route]:
        repo = _REPO_API
        types = {"repo_type": _URL_TYPES}
        listings = {"repo_type": {"models": "model", "kernels": "kernel"}}
        pages = [
            route("page_front", "GET", "/", self.front_page, page=True),
            *(route(name, "GET", prefix + path, handler, page=True)
              for prefix in ("/kernels/{namespace}/{name}", "/{namespace}/{name}")
              for name, path, handler in (("page_repo", "", self.repo_page),
                                          ("page_repo", "/tree/{revision}", self.repo_page),
                                          ("page_commit", "/commit/{commit_id}", self.commit_page))),
        ]
        return [
            route("whoami", "GET", "/api/whoami-v2", self.whoami, needs_token=True),
            route("create_repo", "POST", "/api/repos/create", self.create_repo, needs_token=True, reads_body=True),
            route("delete_repo", "DELETE", "/api/repos/delete", self.delete_repo, needs_token=True, reads_body=True),
            route("move_repo", "POST", "/api/repos/move", self.move_repo, needs_token=True, reads_body=True),
            route("validate_yaml", "POST", "/api/validate-yaml", self.validate_yaml, needs_token=True, reads_body=True),
            route("agent_harnesses", "GET", "/api/agent-harnesses", self.agent_harnesses),
            route("organization", "GET", "/api/organizations/{org}/overview", self.organization),
            route("list_repos", "GET", "/api/{repo_type}", self.list_repos, choices=listings),
            *(route(name, _ANY_METHOD, path, functools.partial(self.refuse, reason=reason),
                    choices=types if path.startswith(repo) else None)
              for name, path, reason in REFUSED),
            route("info", "GET", repo, self.info, choices=types),
            route("info", "GET", repo + "/revision/{revision}", self.info, choices=types),
            route("settings", "PUT", repo + "/settings", self.update_settings, needs_token=True, reads_body=True,
                  choices=types),
            route("auth_check", "GET", repo + "/auth-check", self.auth_check, choices=types),
            route("auth_check", "GET", repo + "/auth-check/write", self.auth_check, needs_token=True, choices=types),
            route("tree", "GET", repo + "/tree/{revision}/{path*}", self.tree, choices=types),
            route("paths_info", "POST", repo + "/paths-info/{revision}", self.paths_info, reads_body=True,
                  choices=types),
            route("refs", "GET", repo + "/refs", self.refs, choices=types),
            route("commits", "GET", repo + "/commits/{revision}", self.commits, choices=types),
            route("preupload", "POST", repo + "/preupload/{revision}", self.preupload, needs_token=True,
                  reads_body=True, choices=types),
            route("commit", "POST", repo + "/commit/{branch}", self.commit, needs_token=True, reads_body=True,
                  choices=types),
            route("branch", "POST", repo + "/branch/{branch}", self.create_branch, needs_token=True, reads_body=True,
                  choices=types),
            route("branch", "DELETE", repo + "/branch/{branch}", self.delete_branch, needs_token=True, choices=types),
            route("tag", "POST", repo + "/tag/{revision}", self.create_tag, needs_token=True, reads_body=True,
                  choices=types),
            route("tag", "DELETE", repo + "/tag/{tag}", self.delete_tag, needs_token=True, choices=types),
            route("resolve", "GET", "/kernels/{namespace}/{name}/resolve/{revision}/{path+}", self.resolve),
            route("resolve", "GET", "/{namespace}/{name}/resolve/{revision}/{path+}", self.resolve),
            *pages,
        ]

    # -- ASGI -----------------------------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        request = HubRequest(scope, receive, self.limits, self._authenticated(Headers(scope=scope)), self.storage.tmp)
        try:
            response = await self._respond(request)
        except ClientGone:
            return
        finally:
            request.close()
        if not (request.body_complete and request.keep_alive):
            # uvicorn would read an unread body at whatever pace the client sends it, only to discard
            # it; a request refused for its framing may hide another: this connection is done.
            response.headers["Connection"] = "close"
        await response(scope, receive, send)

    async def _respond(self, request: HubRequest) -> Response:
        segments = path_segments(request.scope["raw_path"])
        stats = request.method in ("GET", "HEAD") and segments == STATS_PATH.split("/")[1:]
        found = None if stats else find_route(self.routes, request.method, segments or [])
        if found and found[0].page and found[1].get("namespace", "").lower() in RESERVED_NAMESPACES:
            found = None  # /api/<word>, /kernels/<name>: not a model repo's page
        if not stats:
            self.stats.count(found[0].name if found else "unknown")
        api = bool(segments) and segments[0] == "api"
        page = found[0].page if found else not api
        try:
            self._check_framing(request)
            if stats:
                return JSONResponse(self.stats.snapshot())
            if found is None:
                where = f"{request.method} {request.scope['path'][:200]}"
                if api:
                    raise HubError(400, f"{NOT_SUPPORTED}: {where}: it implements the Hub API that huggingface_hub "
                                        "and kernels use to publish and load kernel and model repos (see the "
                                        "README's compatibility table)")
                raise HubError(404, f"No page here: {where}")
            matched, params = found
            if matched.needs_token:
                self._require_token(request)
            if "namespace" in params:
                params["repo_id"] = f"{params.pop('namespace')}/{params.pop('name')}"
                params.setdefault("repo_type", "kernel" if matched.pattern[0] == "kernels" else "model")
            if matched.handler == self.commit:
                return await self._commit_streamed(request, params)
            if matched.reads_body:
                await request.read_body(self.limits.max_json_bytes)
            call = functools.partial(self._handle, matched.handler, request, params)
            if request.body_in_memory:
                return await anyio.to_thread.run_sync(call)
            if self._large_body_slots is None:
                self._large_body_slots = anyio.CapacityLimiter(self.limits.max_large_bodies)
            return await anyio.to_thread.run_sync(call, limiter=self._large_body_slots)
        except HubError as error:
            return self.pages.error(error) if page else _error_response(error)
        except ClientGone:
            raise
        except Exception as error:  # a bug answers 500 and is logged, the connection stays usable
            logger.exception("internal error on %s %s", request.method, request.scope["path"])
            error = HubError(500, f"Internal server error: {type(error).__name__}")
            return self.pages.error(error) if page else _error_response(error)

    def _check_framing(self, request: HubRequest) -> None:
        """Refuse what h11 lets through: headers past the cap that arrived whole, a body framed two
        ways, and a Host this server does not answer to."""
        scope = request.scope
        header_bytes = (len(request.method) + len(scope["raw_path"]) + len(scope["query_string"]) + 12
                        + sum(len(name) + len(value) + 4 for name, value in scope["headers"]) + 2)
        if header_bytes > self.limits.max_header_bytes:
            request.keep_alive = False
            raise HubError(431, f"Request headers larger than {self.limits.max_header_bytes} bytes")
        if "content-length" in request.headers and "transfer-encoding" in request.headers:
            request.keep_alive = False
            raise HubError(400, "A request may not carry both Content-Length and Transfer-Encoding (RFC 9112 6.1)")
        host = request.headers.get("host")
        if host is None or "*" in self.host_names:
            return  # HTTP/1.0 may omit it; no browser does
        name = host_name(host)
        if name is None or not (name in self.host_names or _is_ip_address(name)):
            names = ", ".join(sorted(name for name in self.host_names if not _is_ip_address(name)))
            raise HubError(400, f"Invalid Host header {host[:100]!r}: this server answers to IP addresses and "
                                f"{names} (more: tpu-kernels serve --allowed-host NAME)")

    def _handle(self, handler, request: HubRequest, params: dict) -> Response:
        if "repo_id" in params:
            self._check_visible(request, params["repo_type"], params["repo_id"])
        return handler(request, **params)

    async def _commit_streamed(self, request: HubRequest, params: dict) -> Response:
        if self._commit_slots is None:
            self._commit_slots = anyio.CapacityLimiter(self.limits.max_concurrent_commits)
        call = functools.partial(self._handle, self.commit, request, params)
        return await anyio.to_thread.run_sync(call, limiter=self._commit_slots)

    # -- access ---------------------------------------------------------------------------------

    def _authenticated(self, headers: Headers) -> bool:
        scheme, _, given = headers.get("authorization", "").partition(" ")
        return (
            self.token is not None
            and scheme.lower() == "bearer"
            and hmac.compare_digest(given.strip().encode(), self.token.encode())
        )

    def _require_token(self, request: HubRequest) -> None:
        if self.token is None:
            raise HubError(401, f"{INVALID_CREDENTIALS}: this server was started without a token and is read-only")
        if not request.authenticated:
            raise HubError(401, f"{INVALID_CREDENTIALS}: writes need the server's token (set HF_TOKEN)")

    def _check_visible(self, request: HubRequest, repo_type: str, repo_id: str) -> None:
        """A private repo is, to a caller without the token, a repo that does not exist."""
        if self.storage.is_private(repo_type, repo_id) and not request.authenticated:
            raise HubError(404, f"Repository {repo_type}/{repo_id} not found", code="RepoNotFound")

    def _organizations(self, request: HubRequest) -> set[str]:
        return (self.storage.namespaces(include_private=request.authenticated) | self.trusted_orgs) - {USER_NAME}

    # -- helpers --------------------------------------------------------------------------------

    @staticmethod
    def _base_url(request: HubRequest) -> str:
        host = request.headers.get("host")
        if not host:
            address, port = request.scope["server"][:2]
            host = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        return f"http://{host}"

    def _repo_url(self, request: HubRequest, repo_type: str, repo_id: str) -> str:
        return f"{self._base_url(request)}/{_RESOLVE_PREFIXES[repo_type]}{repo_id}"

    def _paginated(self, request: HubRequest, items: Sequence, base_path: str,
                   render: Callable = lambda item: item) -> Response:
        """Cursor pagination with a `Link: <...>; rel="next"` header, as the Hub does; `render` makes the
        JSON of one item, for the items of the page only."""
        cursor = request.query.get("cursor", "0")
        if not (cursor.isascii() and cursor.isdigit() and len(cursor) <= MAX_CURSOR_DIGITS):
            raise HubError(400, f"Invalid query parameter 'cursor': {cursor[:40]!r} is not a non-negative integer")
        start = int(cursor)
        headers = {}
        if start + PAGE_SIZE < len(items):
            query = dict(request.query)
            query["cursor"] = str(start + PAGE_SIZE)
            headers["Link"] = f'<{self._base_url(request)}{base_path}?{urlencode(query)}>; rel="next"'
        return JSONResponse([render(item) for item in items[start:start + PAGE_SIZE]], headers=headers)

    @staticmethod
    def _tree_item(tree: Tree, path: str) -> dict:
        entry = tree.entry(path)
        if entry is None:
            return {"type": "directory", "oid": tree.folder_id(path), "size": 0, "path": path}
        return {"type": "file", "oid": entry.git_oid, "size": entry.size, "path": path}

    # -- account and organizations --------------------------------------------------------------

    def whoami(self, request: HubRequest) -> Response:
        return JSONResponse({
            "type": "user",
            "id": USER_NAME,
            "name": USER_NAME,
            "fullname": "tpu-kernels local hub user",
            "isPro": False,
            "orgs": [{"type": "org", "name": org, "fullname": org} for org in sorted(self._organizations(request))],
            "auth": {"type": "access_token", "accessToken": {"displayName": "tpu-kernels hub token", "role": "write"}},
        })

    def agent_harnesses(self, request: HubRequest) -> Response:
        # huggingface_hub's once-a-day telemetry lookup; an empty registry detects no agent.
        return JSONResponse({"standardEnvVars": [], "harnesses": {}})

    def organization(self, request: HubRequest, org: str) -> Response:
        if org not in self._organizations(request):
            raise HubError(404, f"Organization {org} not found")
        counts = self.storage.count_repos(org, include_private=request.authenticated)
        return JSONResponse({
            "name": org,
            "fullname": org,
            "avatarUrl": "",
            "type": "org",
            "isVerified": False,
            "numModels": counts["model"],
            "numKernels": counts["kernel"],
            "numDatasets": 0,
            "numSpaces": 0,
            "trustedKernelPublisher": org in self.trusted_orgs,
        })

    # -- repos ----------------------------------------------------------------------------------

    def create_repo(self, request: HubRequest) -> Response:
        payload = request.json()
        repo_type, repo_id = _named_repo(payload)
        private = bool(_requested_privacy(payload))
        url = self._repo_url(request, repo_type, repo_id)
        try:
            self.storage.create_repo(repo_type, repo_id, author=USER_NAME, private=private)
        except HubError as error:
            if error.status == 409:
                return JSONResponse({"error": error.message, "url": url}, status_code=409)
            raise
        return JSONResponse({"url": url, "name": repo_id, "id": repo_id})

    def delete_repo(self, request: HubRequest) -> Response:
        self.storage.delete_repo(*_named_repo(request.json()))
        return JSONResponse({})

    def move_repo(self, request: HubRequest) -> Response:
        payload = request.json()
        repo_type = validate_repo_type(_field(payload, "type", (str, type(None))) or "model")
        self.storage.move_repo(repo_type, _repo_of(payload, "fromRepo"), _repo_of(payload, "toRepo"))
        return JSONResponse({})

    def update_settings(self, request: HubRequest, repo_type: str, repo_id: str) -> Response:
        payload = request.json()
        unknown = sorted(set(payload) - {"visibility", "private", "gated"})
        if unknown:
            raise HubError(400, f"{NOT_SUPPORTED}: the repo setting(s) {', '.join(unknown)[:200]}: "
                                "only the visibility (private or public) can be set")
        if payload.get("gated", False) is not False:
            raise HubError(400, f"{NOT_SUPPORTED}: gated repos: reads are open, or need the token for a "
                                "private repo; there are no access requests to approve")
        private = _requested_privacy(payload)
        if private is not None:
            self.storage.set_private(repo_type, repo_id, private)
        return JSONResponse({})

    def auth_check(self, request: HubRequest, repo_type: str, repo_id: str) -> Response:
        # Reaching here means the caller may: the repo is visible to it (and, for /write, it has the token).
        self.storage.existing_repo_dir(repo_type, repo_id)
        return JSONResponse({})

    def list_repos(self, request: HubRequest, repo_type: str) -> Response:
        """Repos of one type visible to the caller, as `HfApi.list_models` reads them; `?author=` is a namespace."""
        query = request.query
        unknown = sorted(set(query) - {"author", "search", "sort", "direction", "limit", "cursor"})
        if unknown:
            raise HubError(400, f"{NOT_SUPPORTED}: the listing parameter(s) {', '.join(unknown)[:200]}: "
                                "it filters by author and search, sorts by id, createdAt or lastModified")
        sort = query.get("sort", "id")
        if sort not in LISTING_SORTS:
            raise HubError(400, f"{NOT_SUPPORTED}: sorting by {sort[:40]!r}: sort by {', '.join(LISTING_SORTS)}")
        limit = query.get("limit")
        if limit is not None and not (limit.isascii() and limit.isdigit() and len(limit) <= MAX_CURSOR_DIGITS):
            raise HubError(400, f"Invalid query parameter 'limit': {limit[:40]!r} is not a non-negative integer")
        author, search = query.get("author"), query.get("search", "").lower()
        items = []
        for repo_id in self.storage.repo_ids(repo_type, "*"):
            if author is not None and repo_id.split("/")[0] != author:
                continue
            if search not in repo_id.lower():
                continue
            if self.storage.is_private(repo_type, repo_id) and not request.authenticated:
                continue
            items.append(self._listed_repo(repo_type, repo_id))
        # As on the Hub: dates newest first unless `direction=1`; ids in order unless `direction=-1`.
        direction = query.get("direction")
        items.sort(key=lambda item: item[sort], reverse=direction == "-1" if direction else sort != "id")
        return self._paginated(request, items[:int(limit) if limit is not None else None], f"/api/{repo_type}s")

    def _listed_repo(self, repo_type: str, repo_id: str) -> dict:
        return {
            "id": repo_id,
            "author": repo_id.split("/")[0],
            "sha": self.storage.refs(repo_type, repo_id).branches[MAIN_BRANCH],
            "private": self.storage.is_private(repo_type, repo_id),
            "createdAt": self.storage.repo_created_at(repo_type, repo_id),
            "lastModified": self.storage.last_modified(repo_type, repo_id),
            "tags": [], "downloads": 0, "likes": 0, "gated": False, "disabled": False,
        }

    def refuse(self, request: HubRequest, reason: str, **params) -> Response:
        raise HubError(400, f"{NOT_SUPPORTED}: {reason}")

    def validate_yaml(self, request: HubRequest) -> Response:
        content = _field(request.json(), "content", (str, type(None))) or ""
        front_matter, _ = split_front_matter(content)
        if front_matter is None:
            return JSONResponse({"errors": [], "warnings": []})
        if len(front_matter.encode()) > self.limits.max_front_matter_bytes:
            raise HubError(400, f"README front matter larger than {self.limits.max_front_matter_bytes} bytes")
        try:
            metadata = yaml.load(front_matter, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        except (yaml.YAMLError, RecursionError) as error:
            problem = f"Invalid YAML front matter: {error}"[:2000]
            return JSONResponse({"errors": [{"message": problem}], "warnings": []}, status_code=400)
        if metadata is not None and not isinstance(metadata, dict):
            return JSONResponse(
                {"errors": [{"message": "YAML front matter must be a mapping"}], "warnings": []}, status_code=400
            )
        return JSONResponse({"errors": [], "warnings": []})

    def info(self, request: HubRequest, repo_type: str, repo_id: str, revision: str = MAIN_BRANCH) -> Response:
        commit = self.storage.resolve_revision(repo_type, repo_id, revision)
        return JSONResponse({
            "id": repo_id,
            "author": repo_id.split("/")[0],
            "sha": commit.id,
            "lastModified": commit.date,
            "createdAt": self.storage.repo_created_at(repo_type, repo_id),
            "private": self.storage.is_private(repo_type, repo_id),
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": [
                {"rfilename": path, "size": entry.size, "blobId": entry.git_oid}
                for path, entry in sorted(commit.files.items())
            ],
        })

    def tree(self, request: HubRequest, repo_type: str, repo_id: str, revision: str, path: str) -> Response:
        commit = self.storage.resolve_revision(repo_type, repo_id, revision)
        folder = path.strip("/")
        if folder:
            validate_path(folder)
        recursive = request.query.get("recursive", "false").lower() in ("1", "true")
        tree = self.storage.tree(commit)
        base = f"/api/{repo_type}s/{quote(repo_id)}/tree/{quote(revision, safe='')}"
        return self._paginated(request, tree.listing(folder, recursive),
                               base + (f"/{quote(folder, safe='')}" if folder else ""),
                               render=functools.partial(self._tree_item, tree))

    def paths_info(self, request: HubRequest, repo_type: str, repo_id: str, revision: str) -> Response:
        commit = self.storage.resolve_revision(repo_type, repo_id, revision)
        tree = self.storage.tree(commit)
        items = []
        for path in request.form_values("paths"):
            path = path.strip("/")
            if path in commit.files or tree.is_folder(path):
                items.append(self._tree_item(tree, path))
        return JSONResponse(items)

    def refs(self, request: HubRequest, repo_type: str, repo_id: str) -> Response:
        refs = self.storage.refs(repo_type, repo_id)

        def listed(names, kind):
            return [{"name": name, "ref": f"refs/{kind}/{name}", "targetCommit": target}
                    for name, target in sorted(names.items())]

        return JSONResponse({
            "branches": listed(refs.branches, "heads"),
            "tags": listed(refs.tags, "tags"),
            "converts": [],
            "pullRequests": [],
        })

    def commits(self, request: HubRequest, repo_type: str, repo_id: str, revision: str) -> Response:
        items = [
            {
                "id": commit.id,
                "title": commit.title,
                "message": commit.message,
                "date": commit.date,
                "authors": [{"user": commit.author}],
            }
            for commit in self.storage.history(repo_type, repo_id, revision)
        ]
        return self._paginated(request, items, f"/api/{repo_type}s/{quote(repo_id)}/commits/{quote(revision, safe='')}")

    # -- writes ---------------------------------------------------------------------------------

    @staticmethod
    def _refuse_pull_requests(request: HubRequest) -> None:
        if request.query.get("create_pr", "0") not in ("0", "false", "False", ""):
            raise HubError(400, f"{NOT_SUPPORTED}: pull requests: commit to a branch (a kernel version is branch v<N>)")

    def preupload(self, request: HubRequest, repo_type: str, repo_id: str, revision: str) -> Response:
        self._refuse_pull_requests(request)
        files = _field(request.json(), "files", list)
        commit = self.storage.resolve_revision(repo_type, repo_id, revision)
        answers = []
        for index, item in enumerate(files):
            if not isinstance(item, dict):
                raise HubError(400, f"Invalid field 'files[{index}]': expected an object")
            path = validate_path(_field(item, "path", str, where=f"files[{index}]."))
            existing = commit.files.get(path)
            answers.append({
                "path": path,
                "uploadMode": "regular",
                "shouldIgnore": False,
                "oid": existing.git_oid if existing else None,
            })
        return JSONResponse({"files": answers, "commitOid": commit.id})

    def commit(self, request: HubRequest, repo_type: str, repo_id: str, branch: str) -> Response:
        self._refuse_pull_requests(request)
        branch = branch_name(branch)
        # Refused before a byte of the body is read, not after a large upload.
        self.storage.require_branch(repo_type, repo_id, branch)
        payload = read_commit_payload(
            lambda: request.read_chunk_from_thread(self.limits.max_commit_bytes), self.storage.blob_store
        )
        commit = self.storage.commit_operations(
            repo_type,
            repo_id,
            branch,
            additions=payload.additions,
            deletions=payload.deletions,
            title=payload.summary,
            message=payload.description,
            author=USER_NAME,
            parent_commit=payload.parent_commit,
        )
        return JSONResponse({
            "success": True,
            "commitOid": commit.id,
            "commitUrl": f"{self._repo_url(request, repo_type, repo_id)}/commit/{commit.id}",
            "hookOutput": "",
        })

    def create_branch(self, request: HubRequest, repo_type: str, repo_id: str, branch: str) -> Response:
        starting_point = _field(request.json(), "startingPoint", (str, type(None))) or MAIN_BRANCH
        self.storage.create_branch(repo_type, repo_id, branch, starting_point)
        return JSONResponse({})

    def delete_branch(self, request: HubRequest, repo_type: str, repo_id: str, branch: str) -> Response:
        self.storage.delete_ref(repo_type, repo_id, "branches", branch)
        return JSONResponse({})

    def create_tag(self, request: HubRequest, repo_type: str, repo_id: str, revision: str) -> Response:
        tag = _field(request.json(), "tag", str)
        self.storage.create_tag(repo_type, repo_id, tag, revision)
        return JSONResponse({})

    def delete_tag(self, request: HubRequest, repo_type: str, repo_id: str, tag: str) -> Response:
        self.storage.delete_ref(repo_type, repo_id, "tags", tag)
        return JSONResponse({})

    # -- downloads ------------------------------------------------------------------------------

    def resolve(self, request: HubRequest, repo_type: str, repo_id: str, revision: str, path: str) -> Response:
        commit = self.storage.resolve_revision(repo_type, repo_id, revision)
        validate_path(path)
        entry = commit.files.get(path)
        if entry is None:
            raise HubError(404, f"Entry not found: {path}", code="EntryNotFound", commit=commit.id)
        blob = self.storage.blob_store.path(entry)
        stat = os.stat(blob)
        if stat.st_size != entry.size:
            raise HubError(500, f"The stored content of {path} does not have its recorded size")
        response = FileResponse(
            blob,
            stat_result=stat,
            media_type=_INLINE_TYPES.get(Path(path).suffix.lower(), "application/octet-stream"),
            headers={
                "X-Repo-Commit": commit.id,
                "ETag": f'"{entry.git_oid}"',
                "Content-Disposition": f"inline; filename*=UTF-8''{quote(Path(path).name)}",
                **_FILE_SECURITY_HEADERS,
            },
        )
        # Each chunk is a hop to a worker thread and back, and what a client that stops reading leaves
        # in memory until its send timeout: 256 KiB ones download as fast as 1 MiB ones (~750 MiB/s
        # here; 64 KiB: ~380) and 250 stalled downloads hold +166 MiB (1 MiB: +418).
        response.chunk_size = DOWNLOAD_CHUNK_BYTES
        return response

    # -- web pages ------------------------------------------------------------------------------

    # A HEAD answers what its GET would (200 or the error) without rendering the page.

    def front_page(self, request: HubRequest) -> Response:
        return self.pages.front(request.authenticated, head=request.method == "HEAD")

    def repo_page(self, request: HubRequest, repo_type: str, repo_id: str, revision: str | None = None) -> Response:
        return self.pages.repo(repo_type, repo_id, self._base_url(request), revision, head=request.method == "HEAD")

    def commit_page(self, request: HubRequest, repo_type: str, repo_id: str, commit_id: str) -> Response:
        return self.pages.commit(repo_type, repo_id, commit_id, head=request.method == "HEAD")

