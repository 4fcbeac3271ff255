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
    (a GET or HEAD of a model repo that does not exist, or is hidden from the caller, reads the kernel repo of that
    id if the caller may see it: `kernels benchmark` asks so)
    GET|HEAD /kernels/{ns}/{name}/resolve/{rev}/{path}
    GET  /api/tpu-kernels/stats                         request counters (not counted themselves)
    GET  /, /kernels/{ns}/{name}[/tree/{rev}|/commit/{id}], /{ns}/{name}[...]   web pages (pages.py)

A revision may be a branch, a tag, a commit id or a full ref name (`refs/heads/v1`,
`refs/tags/x`). What the server does not support is refused with a 400 whose message
says so and why (REFUSED below, and any other /api/ path): never with a 404, which
clients would read as a missing repo, file or revision.

Requests carry the token as `Authorization: Bearer <token>`. Without a valid one,
a private repo answers 404 as a missing one does, as on the Hub.

This module routes, frames and counts requests; the handlers are in repo_reads.py and repo_writes.py,
the checks of the token, the Host and the refused endpoints in access.py, and a request's body is read
by request.py.

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
import logging
import threading
from dataclasses import dataclass, field

import anyio
import anyio.to_thread
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response

from .access import LOOPBACK_NAMES, REFUSED, REPO_API, Access
from .errors import NOT_SUPPORTED, HubError
from .limits import Limits
from .names import RESERVED_NAMESPACES
from .pages import Pages
from .repo_reads import RepoReads
from .repo_writes import RepoWrites
from .request import ClientGone, HubRequest
from .routing import Route, find_route, path_segments, route
from .storage import Storage

STATS_PATH = "/api/tpu-kernels/stats"
_URL_TYPES = {"kernels": "kernel", "models": "model"}
_ANY_METHOD = "GET HEAD POST PUT PATCH DELETE"

logger = logging.getLogger(__name__)


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


def _header_text(text: str) -> str:
    """`text` as a header value h11 sends: runs of whitespace one space, anything but printable ASCII '?'."""
    return "".join(char if " " <= char <= "~" else "?" for char in " ".join(text.split()))


def _error_response(error: HubError) -> Response:
    headers = {"X-Error-Message": _header_text(error.message)}
    if error.code:
        headers["X-Error-Code"] = error.code
    if error.commit:
        headers["X-Repo-Commit"] = error.commit
    return JSONResponse({"error": error.message}, status_code=error.status, headers=headers)


class HubApp:
    """The ASGI application: routing, framing checks, request counts; access, reads and writes delegated."""

    def __init__(self, storage: Storage, token: str | None, trusted_orgs, limits: Limits,
                 host_names=LOOPBACK_NAMES):
        """`host_names`: the names a request's Host may give besides IP addresses ("*": any name)."""
        self.storage = storage
        self.limits = limits
        self.access = Access(storage, token, host_names)
        trusted_orgs = frozenset(trusted_orgs)
        self.reads = RepoReads(storage, trusted_orgs)
        self.writes = RepoWrites(storage, limits)
        self.stats = RequestStats()
        self.pages = Pages(storage, trusted_orgs)
        self.routes = self._routes()
        self._commit_slots: anyio.CapacityLimiter | None = None
        self._large_body_slots: anyio.CapacityLimiter | None = None

    def _routes(self) -> list[Route]:
        repo = REPO_API
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
            route("whoami", "GET", "/api/whoami-v2", self.reads.whoami, needs_token=True),
            route("create_repo", "POST", "/api/repos/create", self.writes.create_repo,
                  needs_token=True, reads_body=True),
            route("delete_repo", "DELETE", "/api/repos/delete", self.writes.delete_repo,
                  needs_token=True, reads_body=True),
            route("move_repo", "POST", "/api/repos/move", self.writes.move_repo, needs_token=True, reads_body=True),
            route("validate_yaml", "POST", "/api/validate-yaml", self.writes.validate_yaml,
                  needs_token=True, reads_body=True),
            route("agent_harnesses", "GET", "/api/agent-harnesses", self.reads.agent_harnesses),
            route("organization", "GET", "/api/organizations/{org}/overview", self.reads.organization),
            route("list_repos", "GET", "/api/{repo_type}", self.reads.list_repos, choices=listings),
            *(route(name, _ANY_METHOD, path, functools.partial(self.access.refuse, reason=reason),
                    choices=types if path.startswith(repo) else None)
              for name, path, reason in REFUSED),
            route("info", "GET", repo, self.reads.info, choices=types),
            route("info", "GET", repo + "/revision/{revision}", self.reads.info, choices=types),
            route("settings", "PUT", repo + "/settings", self.writes.update_settings, needs_token=True, reads_body=True,
                  choices=types),
            route("auth_check", "GET", repo + "/auth-check", self.reads.auth_check, choices=types),
            route("auth_check", "GET", repo + "/auth-check/write", self.reads.auth_check,
                  needs_token=True, choices=types),
            route("tree", "GET", repo + "/tree/{revision}/{path*}", self.reads.tree, choices=types),
            route("paths_info", "POST", repo + "/paths-info/{revision}", self.reads.paths_info, reads_body=True,
                  choices=types),
            route("refs", "GET", repo + "/refs", self.reads.refs, choices=types),
            route("commits", "GET", repo + "/commits/{revision}", self.reads.commits, choices=types),
            route("preupload", "POST", repo + "/preupload/{revision}", self.writes.preupload, needs_token=True,
                  reads_body=True, choices=types),
            route("commit", "POST", repo + "/commit/{branch}", self.writes.commit, needs_token=True, reads_body=True,
                  choices=types),
            route("branch", "POST", repo + "/branch/{branch}", self.writes.create_branch,
                  needs_token=True, reads_body=True,
                  choices=types),
            route("branch", "DELETE", repo + "/branch/{branch}", self.writes.delete_branch,
                  needs_token=True, choices=types),
            route("tag", "POST", repo + "/tag/{revision}", self.writes.create_tag, needs_token=True, reads_body=True,
                  choices=types),
            route("tag", "DELETE", repo + "/tag/{tag}", self.writes.delete_tag, needs_token=True, choices=types),
            route("resolve", "GET", "/kernels/{namespace}/{name}/resolve/{revision}/{path+}", self.reads.resolve),
            route("resolve", "GET", "/{namespace}/{name}/resolve/{revision}/{path+}", self.reads.resolve),
            *pages,
        ]

    # -- ASGI -----------------------------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        authenticated = self.access.authenticated(Headers(scope=scope))
        request = HubRequest(scope, receive, self.limits, authenticated, self.storage.tmp)
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
                self.access.require_token(request)
            if "namespace" in params:
                params["repo_id"] = f"{params.pop('namespace')}/{params.pop('name')}"
                params.setdefault("repo_type", "kernel" if matched.pattern[0] == "kernels" else "model")
            if matched.handler == self.writes.commit:
                return await self._commit_streamed(request, params)
            if matched.reads_body:
                await request.read_body(self.limits.max_json_bytes)
            # kernels 0.19's `kernels benchmark` downloads a kernel repo as a model repo (no repo_type): a read of a
            # model repo that does not exist is answered by the kernel repo of that id, if there is one.
            kernel_alias = request.method in ("GET", "HEAD") and not matched.page and params.get("repo_type") == "model"
            call = functools.partial(self._handle, matched.handler, request, params, kernel_alias)
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
        self.access.check_host(request)

    def _handle(self, handler, request: HubRequest, params: dict, kernel_alias: bool = False) -> Response:
        if "repo_id" in params:
            # The alias answers only for a kernel repo this client may see, and where it may see no model repo: a
            # hidden repo of either type answers as no repo at all would.
            if kernel_alias and not self.access.visible(request, "model", params["repo_id"]) \
                    and self.access.visible(request, "kernel", params["repo_id"]):
                params["repo_type"] = "kernel"
            self.access.check_visible(request, params["repo_type"], params["repo_id"])
        return handler(request, **params)

    async def _commit_streamed(self, request: HubRequest, params: dict) -> Response:
        if self._commit_slots is None:
            self._commit_slots = anyio.CapacityLimiter(self.limits.max_concurrent_commits)
        call = functools.partial(self._handle, self.writes.commit, request, params)
        return await anyio.to_thread.run_sync(call, limiter=self._commit_slots)

    # -- web pages ------------------------------------------------------------------------------

    # A HEAD answers what its GET would (200 or the error) without rendering the page.

    def front_page(self, request: HubRequest) -> Response:
        return self.pages.front(request.authenticated, head=request.method == "HEAD")

    def repo_page(self, request: HubRequest, repo_type: str, repo_id: str, revision: str | None = None) -> Response:
        return self.pages.repo(repo_type, repo_id, request.base_url(), revision, head=request.method == "HEAD")

    def commit_page(self, request: HubRequest, repo_type: str, repo_id: str, commit_id: str) -> Response:
        return self.pages.commit(repo_type, repo_id, commit_id, head=request.method == "HEAD")
