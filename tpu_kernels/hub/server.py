"""The HTTP side of the local Hub: the endpoints huggingface_hub 2.4 and kernels 0.17 call.

Built on the standard library's ThreadingHTTPServer: the server must start on a
TPU VM or an air-gapped pod where nothing beyond Python (and this package) is
installed, the request volume is that of a model registry, not a web site, and
every endpoint is a short synchronous file operation. A thread per connection
with HTTP/1.1 keep-alive is all the concurrency it needs.

Routes (repo types: kernel, model; `{t}` is `kernels` or `models`):

    GET  /api/whoami-v2                              needs the token
    POST /api/repos/create                           needs the token
    POST /api/validate-yaml                          README front matter check
    GET  /api/agent-harnesses                        empty registry (huggingface_hub telemetry)
    GET  /api/organizations/{org}/overview           trustedKernelPublisher
    GET  /api/{t}/{ns}/{name}[/revision/{rev}]       repo info at a revision (sha, siblings)
    GET  /api/{t}/{ns}/{name}/tree/{rev}[/{path}]    tree listing (?recursive=true), paginated
    POST /api/{t}/{ns}/{name}/paths-info/{rev}       info on given paths
    GET  /api/{t}/{ns}/{name}/refs                   branches and tags
    GET  /api/{t}/{ns}/{name}/commits/{rev}          history, newest first, paginated
    POST /api/{t}/{ns}/{name}/preupload/{rev}        upload mode per file (always "regular")
    POST /api/{t}/{ns}/{name}/commit/{rev}           NDJSON commit, needs the token
    POST|DELETE /api/{t}/{ns}/{name}/branch/{branch} needs the token
    POST /api/{t}/{ns}/{name}/tag/{rev}, DELETE .../tag/{tag}   needs the token
    GET|HEAD /{ns}/{name}/resolve/{rev}/{path}       model file (X-Repo-Commit, ETag, Range)
    GET|HEAD /kernels/{ns}/{name}/resolve/{rev}/{path}
    GET  /api/tpu-kernels/stats                      request counters (not counted themselves)

Uploads: the server answers "regular" to every preupload question, so clients
send file contents base64-encoded inside the commit request and never use
LFS or Xet (neither is implemented). A commit request may carry up to
MAX_COMMIT_BYTES; files are staged on disk one by one, so memory stays at
about one file.
"""

from __future__ import annotations

import argparse
import collections
import hmac
import json
import os
import re
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

import yaml

from .storage import (
    MAIN_BRANCH,
    Commit,
    Deletion,
    FileEntry,
    HubError,
    StagedFile,
    Storage,
    folder_oid,
    tree_entries,
    validate_path,
    validate_repo_id,
    validate_repo_type,
)

MAX_COMMIT_BYTES = 1 << 30
MAX_JSON_BYTES = 16 << 20
PAGE_SIZE = 1000
USER_NAME = "local"
STATS_PATH = "/api/tpu-kernels/stats"
DEFAULT_PORT = 8765
TOKEN_ENV = "TPU_KERNELS_HUB_TOKEN"
INVALID_CREDENTIALS = "Invalid credentials in Authorization header"
_PARENT_COMMIT = re.compile(r"[0-9a-fA-F]{5,40}")
_URL_TYPES = {"kernels": "kernel", "models": "model"}
_RESOLVE_PREFIXES = {"kernel": "kernels/", "model": ""}
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


@dataclass
class RequestStats:
    """Requests served, in total and by route; thread-safe."""

    total: int = 0
    by_route: collections.Counter = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, route: str) -> None:
        with self.lock:
            self.total += 1
            self.by_route[route] += 1

    def snapshot(self) -> dict:
        with self.lock:
            return {"requests": self.total, "by_route": dict(self.by_route)}


class HubHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # Many clients (e.g. 8 processes x 8 download threads) connect at once.
    request_queue_size = 128

    def __init__(self, address, storage: Storage, token: str | None, trusted_orgs, log_requests: bool):
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.storage = storage
        self.token = token
        self.trusted_orgs = frozenset(trusted_orgs)
        self.log_requests = log_requests
        self.stats = RequestStats()
        super().__init__(address, HubRequestHandler)


class HubRequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "tpu-kernels-hub"
    # Headers and body leave in separate writes: with Nagle's algorithm the body
    # would wait for the client's delayed ACK, ~40 ms per request on loopback.
    disable_nagle_algorithm = True
    server: HubHTTPServer

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def log_message(self, format, *args):
        if self.server.log_requests:
            super().log_message(format, *args)

    # -- plumbing -------------------------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        length = self.headers.get("Content-Length") or "0"
        self._body_remaining = int(length) if length.isdigit() else 0
        if self.headers.get("Transfer-Encoding", "identity").lower() != "identity" or not length.isdigit():
            self.close_connection = True
            self._send_error(HubError(411, "Send a body with a Content-Length (chunked bodies are not supported)"))
            return
        url = urlsplit(self.path)
        if url.path == STATS_PATH and method == "GET":
            self._send_json(200, self.server.stats.snapshot())
            return
        # Percent-decode each segment on its own: a quoted '/' (%2F) inside a
        # revision or path_in_repo must not split it.
        segments = [unquote(segment) for segment in url.path.split("/")[1:]]
        self._query = parse_qs(url.query)
        route, handler, args = self._route(method, segments)
        self.server.stats.count(route)
        try:
            handler(*args)
        except ConnectionError:
            # The client went away mid-response: nothing left to tell it.
            self.close_connection = True
        except HubError as error:
            self._send_error(error)
        except Exception as error:  # a bug must answer 500, not kill the connection silently
            self.log_error("internal error on %s %s: %r", method, self.path, error)
            self._send_error(HubError(500, f"Internal server error: {type(error).__name__}"))
        finally:
            if self._body_remaining:
                # The body was not read: the connection cannot be reused.
                self.close_connection = True

    def _route(self, method: str, s: list[str]):
        if s[:1] == ["api"]:
            rest = s[1:]
            if rest == ["whoami-v2"] and method == "GET":
                return "whoami", self._whoami, ()
            if rest == ["repos", "create"] and method == "POST":
                return "create_repo", self._create_repo, ()
            if rest == ["validate-yaml"] and method == "POST":
                return "validate_yaml", self._validate_yaml, ()
            if rest == ["agent-harnesses"] and method == "GET":
                return "agent_harnesses", self._agent_harnesses, ()
            if len(rest) == 3 and rest[0] == "organizations" and rest[2] == "overview" and method == "GET":
                return "organization", self._organization, (rest[1],)
            if len(rest) >= 3 and rest[0] in _URL_TYPES:
                repo_type, repo_id, action = _URL_TYPES[rest[0]], f"{rest[1]}/{rest[2]}", rest[3:]
                repo_route = self._repo_route(method, repo_type, repo_id, action)
                if repo_route is not None:
                    return repo_route
        else:
            repo_type = "kernel" if s[:1] == ["kernels"] else "model"
            parts = s[1:] if repo_type == "kernel" else s
            if len(parts) >= 5 and parts[2] == "resolve" and method in ("GET", "HEAD"):
                repo_id = f"{parts[0]}/{parts[1]}"
                return "resolve", self._resolve, (repo_type, repo_id, parts[3], "/".join(parts[4:]), method)
        return "unknown", self._not_found, ()

    def _repo_route(self, method: str, repo_type: str, repo_id: str, action: list[str]):
        get, post, delete = method in ("GET", "HEAD"), method == "POST", method == "DELETE"
        if not action and get:
            return "info", self._info, (repo_type, repo_id, MAIN_BRANCH)
        if len(action) == 2 and action[0] == "revision" and get:
            return "info", self._info, (repo_type, repo_id, action[1])
        if len(action) >= 2 and action[0] == "tree" and get:
            return "tree", self._tree, (repo_type, repo_id, action[1], "/".join(action[2:]))
        if len(action) == 2 and action[0] == "paths-info" and post:
            return "paths_info", self._paths_info, (repo_type, repo_id, action[1])
        if action == ["refs"] and get:
            return "refs", self._refs, (repo_type, repo_id)
        if len(action) == 2 and action[0] == "commits" and get:
            return "commits", self._commits, (repo_type, repo_id, action[1])
        if len(action) == 2 and action[0] == "preupload" and post:
            return "preupload", self._preupload, (repo_type, repo_id, action[1])
        if len(action) == 2 and action[0] == "commit" and post:
            return "commit", self._commit, (repo_type, repo_id, action[1])
        if len(action) == 2 and action[0] == "branch" and (post or delete):
            handler = self._create_branch if post else self._delete_branch
            return "branch", handler, (repo_type, repo_id, action[1])
        if len(action) == 2 and action[0] == "tag" and (post or delete):
            handler = self._create_tag if post else self._delete_tag
            return "tag", handler, (repo_type, repo_id, action[1])
        return None

    def _base_url(self) -> str:
        return f"http://{self.headers.get('Host') or '%s:%d' % self.server.server_address[:2]}"

    def _repo_url(self, repo_type: str, repo_id: str) -> str:
        return f"{self._base_url()}/{_RESOLVE_PREFIXES[repo_type]}{repo_id}"

    def _read_body(self, limit: int) -> bytes:
        if self._body_remaining > limit:
            raise HubError(413, f"Request body larger than {limit} bytes")
        body = self.rfile.read(self._body_remaining)
        self._body_remaining = 0
        return body

    def _read_json(self) -> dict:
        try:
            data = json.loads(self._read_body(MAX_JSON_BYTES) or b"{}")
        except json.JSONDecodeError as error:
            raise HubError(400, f"Invalid JSON body: {error}") from None
        if not isinstance(data, dict):
            raise HubError(400, "Expected a JSON object")
        return data

    def _body_lines(self, limit: int):
        """NDJSON lines, streamed: one file's base64 content is held at a time."""
        if self._body_remaining > limit:
            raise HubError(413, f"Commit larger than {limit} bytes: this server does not take LFS uploads")
        while self._body_remaining:
            line = self.rfile.readline(self._body_remaining)
            if not line:
                raise HubError(400, "Truncated request body")
            self._body_remaining -= len(line)
            if line.strip():
                yield line

    def _require_token(self) -> None:
        expected = self.server.token
        if expected is None:
            raise HubError(401, f"{INVALID_CREDENTIALS}: this server was started without --token and is read-only")
        header = self.headers.get("Authorization", "")
        given = header[len("Bearer "):] if header.startswith("Bearer ") else ""
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise HubError(401, f"{INVALID_CREDENTIALS}: writes need the server's token (set HF_TOKEN)")

    def _send_bytes(self, status: int, body: bytes, content_type: str, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_json(self, status: int, data, headers: dict | None = None) -> None:
        self._send_bytes(status, json.dumps(data).encode(), "application/json; charset=utf-8", headers)

    def _send_error(self, error: HubError) -> None:
        one_line = " ".join(error.message.split())
        headers = {"X-Error-Message": one_line.encode("ascii", "replace").decode()}
        if error.code:
            headers["X-Error-Code"] = error.code
        if error.commit:
            headers["X-Repo-Commit"] = error.commit
        if self._body_remaining:
            self.close_connection = True
        self._send_json(error.status, {"error": error.message}, headers)

    def _not_found(self) -> None:
        raise HubError(404, f"Not found: {self.command} {urlsplit(self.path).path}")

    def _paginated(self, items: list, base_path: str) -> None:
        """Cursor pagination with a `Link: <...>; rel="next"` header, as the Hub does."""
        cursor = self._query.get("cursor", ["0"])[0]
        start = int(cursor) if cursor.isdigit() else 0
        page = items[start:start + PAGE_SIZE]
        headers = {}
        if start + PAGE_SIZE < len(items):
            query = {key: values[-1] for key, values in self._query.items()}
            query["cursor"] = str(start + PAGE_SIZE)
            headers["Link"] = f'<{self._base_url()}{base_path}?{urlencode(query)}>; rel="next"'
        self._send_json(200, page, headers)

    # -- account and organizations --------------------------------------------------------------

    def _whoami(self) -> None:
        self._require_token()
        self._send_json(200, {
            "type": "user",
            "id": USER_NAME,
            "name": USER_NAME,
            "fullname": "tpu-kernels local hub user",
            "isPro": False,
            "orgs": [{"type": "org", "name": org, "fullname": org} for org in sorted(self._organizations())],
            "auth": {"type": "access_token", "accessToken": {"displayName": "tpu-kernels hub token", "role": "write"}},
        })

    def _agent_harnesses(self) -> None:
        # huggingface_hub's once-a-day telemetry lookup; an empty registry detects no agent.
        self._send_json(200, {"standardEnvVars": [], "harnesses": {}})

    def _organizations(self) -> set[str]:
        return (self.server.storage.namespaces() | self.server.trusted_orgs) - {USER_NAME}

    def _organization(self, org: str) -> None:
        if org not in self._organizations():
            raise HubError(404, f"Organization {org} not found")
        counts = self.server.storage.count_repos(org)
        self._send_json(200, {
            "name": org,
            "fullname": org,
            "avatarUrl": "",
            "type": "org",
            "isVerified": False,
            "numModels": counts["model"],
            "numKernels": counts["kernel"],
            "numDatasets": 0,
            "numSpaces": 0,
            "trustedKernelPublisher": org in self.server.trusted_orgs,
        })

    # -- repos ----------------------------------------------------------------------------------

    def _create_repo(self) -> None:
        self._require_token()
        payload = self._read_json()
        repo_type = validate_repo_type(payload.get("type") or "model")
        namespace = payload.get("organization") or USER_NAME
        repo_id = f"{namespace}/{payload.get('name', '')}"
        validate_repo_id(repo_id)
        url = self._repo_url(repo_type, repo_id)
        try:
            self.server.storage.create_repo(repo_type, repo_id, author=USER_NAME)
        except HubError as error:
            if error.status == 409:
                self._send_json(409, {"error": error.message, "url": url})
                return
            raise
        self._send_json(200, {"url": url, "name": repo_id, "id": repo_id})

    def _validate_yaml(self) -> None:
        content = self._read_json().get("content") or ""
        match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", content, re.DOTALL)
        if match:
            try:
                metadata = yaml.safe_load(match.group(1))
            except yaml.YAMLError as error:
                self._send_json(400, {"errors": [{"message": f"Invalid YAML front matter: {error}"}], "warnings": []})
                return
            if metadata is not None and not isinstance(metadata, dict):
                self._send_json(400, {"errors": [{"message": "YAML front matter must be a mapping"}], "warnings": []})
                return
        self._send_json(200, {"errors": [], "warnings": []})

    def _info(self, repo_type: str, repo_id: str, revision: str) -> None:
        storage = self.server.storage
        commit = storage.resolve_revision(repo_type, repo_id, revision)
        self._send_json(200, {
            "id": repo_id,
            "author": repo_id.split("/")[0],
            "sha": commit.id,
            "lastModified": commit.date,
            "createdAt": storage.repo_created_at(repo_type, repo_id),
            "private": False,
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

    @staticmethod
    def _tree_item(files, path: str, entry: FileEntry | None) -> dict:
        if entry is None:
            return {"type": "directory", "oid": folder_oid(files, path), "size": 0, "path": path}
        return {"type": "file", "oid": entry.git_oid, "size": entry.size, "path": path}

    def _tree(self, repo_type: str, repo_id: str, revision: str, folder: str) -> None:
        commit = self.server.storage.resolve_revision(repo_type, repo_id, revision)
        folder = folder.strip("/")
        if folder:
            validate_path(folder)
        recursive = self._query.get("recursive", ["false"])[-1].lower() in ("1", "true")
        items = [self._tree_item(commit.files, path, entry) for path, entry in
                 tree_entries(commit.files, folder, recursive)]
        base = f"/api/{repo_type}s/{quote(repo_id)}/tree/{quote(revision, safe='')}"
        self._paginated(items, base + (f"/{quote(folder, safe='')}" if folder else ""))

    def _paths_info(self, repo_type: str, repo_id: str, revision: str) -> None:
        form = parse_qs(self._read_body(MAX_JSON_BYTES).decode())
        commit = self.server.storage.resolve_revision(repo_type, repo_id, revision)
        items = []
        for path in form.get("paths", []):
            path = path.strip("/")
            if path in commit.files:
                items.append(self._tree_item(commit.files, path, commit.files[path]))
            elif any(name.startswith(path + "/") for name in commit.files):
                items.append(self._tree_item(commit.files, path, None))
        self._send_json(200, items)

    def _refs(self, repo_type: str, repo_id: str) -> None:
        refs = self.server.storage.refs(repo_type, repo_id)

        def listed(names, kind):
            return [{"name": name, "ref": f"refs/{kind}/{name}", "targetCommit": target}
                    for name, target in sorted(names.items())]

        self._send_json(200, {
            "branches": listed(refs.branches, "heads"),
            "tags": listed(refs.tags, "tags"),
            "converts": [],
            "pullRequests": [],
        })

    def _commits(self, repo_type: str, repo_id: str, revision: str) -> None:
        items = [
            {
                "id": commit.id,
                "title": commit.title,
                "message": commit.message,
                "date": commit.date,
                "authors": [{"user": commit.author}],
            }
            for commit in self.server.storage.history(repo_type, repo_id, revision)
        ]
        self._paginated(items, f"/api/{repo_type}s/{quote(repo_id)}/commits/{quote(revision, safe='')}")

    # -- writes ---------------------------------------------------------------------------------

    def _refuse_pull_requests(self) -> None:
        if self._query.get("create_pr", ["0"])[-1] not in ("0", "false", ""):
            raise HubError(400, "This server does not support pull requests: commit to a branch")

    def _preupload(self, repo_type: str, repo_id: str, revision: str) -> None:
        self._require_token()
        self._refuse_pull_requests()
        payload = self._read_json()
        commit = self.server.storage.resolve_revision(repo_type, repo_id, revision)
        files = payload.get("files")
        if not isinstance(files, list):
            raise HubError(400, "Expected 'files': a list")
        answers = []
        for item in files:
            path = validate_path(item.get("path") if isinstance(item, dict) else None)
            existing = commit.files.get(path)
            answers.append({
                "path": path,
                "uploadMode": "regular",
                "shouldIgnore": False,
                "oid": existing.git_oid if existing else None,
            })
        self._send_json(200, {"files": answers, "commitOid": commit.id})

    def _commit(self, repo_type: str, repo_id: str, branch: str) -> None:
        self._require_token()
        self._refuse_pull_requests()
        storage = self.server.storage
        storage.existing_repo_dir(repo_type, repo_id)
        header: dict | None = None
        additions: list[StagedFile] = []
        deletions: list[Deletion] = []
        try:
            for line in self._body_lines(MAX_COMMIT_BYTES):
                try:
                    item = json.loads(line)
                    key, value = item["key"], item["value"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise HubError(400, "Invalid commit payload: expected NDJSON lines {key, value}") from None
                if key == "header":
                    header = value
                elif key == "file":
                    path = validate_path(value.get("path"))
                    if value.get("encoding", "base64") != "base64":
                        raise HubError(400, f"Unsupported encoding for {path!r}: only base64")
                    additions.append(storage.stage_base64(path, value.get("content", "")))
                elif key in ("deletedFile", "deletedFolder"):
                    deletions.append(Deletion(validate_path(value.get("path", "").rstrip("/")), key == "deletedFolder"))
                elif key == "lfsFile":
                    raise HubError(400, "This server does not store LFS files: preupload never asks for LFS")
                else:
                    raise HubError(400, f"Unknown commit operation {key!r}")
            if not isinstance(header, dict) or not header.get("summary"):
                raise HubError(400, "Invalid commit payload: a header with a non-empty summary comes first")
            parent_commit = header.get("parentCommit")
            if parent_commit is not None and not _PARENT_COMMIT.fullmatch(str(parent_commit)):
                raise HubError(400, f"Invalid parentCommit {parent_commit!r}")
        except BaseException:
            storage.discard(additions)
            raise
        commit = storage.commit_operations(
            repo_type,
            repo_id,
            branch,
            additions=additions,
            deletions=deletions,
            title=str(header["summary"]),
            message=str(header.get("description") or ""),
            author=USER_NAME,
            parent_commit=parent_commit,
        )
        self._send_json(200, {
            "success": True,
            "commitOid": commit.id,
            "commitUrl": f"{self._repo_url(repo_type, repo_id)}/commit/{commit.id}",
            "hookOutput": "",
        })

    def _create_branch(self, repo_type: str, repo_id: str, branch: str) -> None:
        self._require_token()
        starting_point = self._read_json().get("startingPoint") or MAIN_BRANCH
        self.server.storage.create_branch(repo_type, repo_id, branch, starting_point)
        self._send_json(200, {})

    def _delete_branch(self, repo_type: str, repo_id: str, branch: str) -> None:
        self._require_token()
        self.server.storage.delete_ref(repo_type, repo_id, "branches", branch)
        self._send_json(200, {})

    def _create_tag(self, repo_type: str, repo_id: str, revision: str) -> None:
        self._require_token()
        tag = self._read_json().get("tag")
        if not isinstance(tag, str):
            raise HubError(400, "Expected 'tag': a string")
        self.server.storage.create_tag(repo_type, repo_id, tag, revision)
        self._send_json(200, {})

    def _delete_tag(self, repo_type: str, repo_id: str, tag: str) -> None:
        self._require_token()
        self.server.storage.delete_ref(repo_type, repo_id, "tags", tag)
        self._send_json(200, {})

    # -- downloads ------------------------------------------------------------------------------

    def _resolve(self, repo_type: str, repo_id: str, revision: str, path: str, method: str) -> None:
        storage = self.server.storage
        commit: Commit = storage.resolve_revision(repo_type, repo_id, revision)
        validate_path(path)
        entry = commit.files.get(path)
        if entry is None:
            raise HubError(404, f"Entry not found: {path}", code="EntryNotFound", commit=commit.id)
        headers = {
            "X-Repo-Commit": commit.id,
            "ETag": f'"{entry.git_oid}"',
            "Accept-Ranges": "bytes",
            "Content-Disposition": f"inline; filename*=UTF-8''{quote(path.rsplit('/', 1)[-1])}",
        }
        start, end = 0, entry.size - 1
        status = 200
        range_header = self.headers.get("Range")
        if range_header:
            start, end = _parse_range(range_header, entry.size)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{entry.size}"
        length = max(end - start + 1, 0)
        with open(storage.blob_path(entry), "rb") as blob:
            if os.fstat(blob.fileno()).st_size != entry.size:
                raise HubError(500, f"The stored content of {path} does not have its recorded size")
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(length))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            if method == "HEAD":
                return
            blob.seek(start)
            remaining = length
            while remaining:
                chunk = blob.read(min(remaining, 1 << 20))
                self.wfile.write(chunk)
                remaining -= len(chunk)


def _parse_range(header: str, size: int) -> tuple[int, int]:
    """One `bytes=` range (first-last, first-, -suffix); 416 if it cannot be served."""
    match = _RANGE.fullmatch(header.strip())
    if match is None or (not match.group(1) and not match.group(2)):
        raise HubError(416, f"Unsupported Range header {header!r}: one 'bytes=first-last' range only")
    first, last = match.group(1), match.group(2)
    if first:
        start = int(first)
        end = min(int(last), size - 1) if last else size - 1
    else:
        start, end = max(size - int(last), 0), size - 1
    if start >= size or start > end:
        raise HubError(416, f"Range {header!r} not satisfiable for a {size}-byte file")
    return start, end


class RunningHub:
    """A hub server running in a background thread of this process."""

    def __init__(self, server: HubHTTPServer):
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="tpu-kernels-hub", daemon=True
        )
        self._thread.start()
        host, port = server.server_address[:2]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    @property
    def storage(self) -> Storage:
        return self._server.storage

    @property
    def request_count(self) -> int:
        return self._server.stats.snapshot()["requests"]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self._server.storage.close()

    def __enter__(self) -> RunningHub:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_hub(
    root: str | Path,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    trusted_orgs=(),
    log_requests: bool = False,
) -> RunningHub:
    """Serve `root` in a background thread; `port=0` picks a free port. Use as a context manager or call stop()."""
    storage = Storage(Path(root))
    try:
        server = HubHTTPServer((host, port), storage, token, trusted_orgs, log_requests)
    except BaseException:
        storage.close()
        raise
    return RunningHub(server)


def describe(hub_url: str, root: Path, token: str | None, trusted_orgs) -> str:
    lines = [f"tpu-kernels hub serving {root} at {hub_url}"]
    lines.append("writes need the token (clients: HF_TOKEN)" if token else "read-only: no --token given")
    if trusted_orgs:
        lines.append(f"trusted kernel publishers: {', '.join(sorted(trusted_orgs))}")
    lines.append(f"clients: export HF_ENDPOINT={hub_url}")
    return "\n".join(lines)


def warn_if_exposed(host: str) -> None:
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"warning: serving plain HTTP on {host}: the token travels unencrypted; "
            "put the server behind TLS or keep it on a trusted network",
            file=sys.stderr,
        )


def serve_main(argv: list[str] | None = None) -> int:
    """`tpu-kernels serve`: run the hub in the foreground until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(
        prog="tpu-kernels serve",
        description="Serve a local Hub that huggingface_hub and kernels talk to (set HF_ENDPOINT to its URL).",
    )
    parser.add_argument("--root", required=True, type=Path, help="folder holding the repos (created if missing)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT}; 0 picks one)")
    parser.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV),
        help=f"token that writes must present (default: ${TOKEN_ENV}); without it the server is read-only",
    )
    parser.add_argument(
        "--trusted-org", dest="trusted_orgs", action="extend", nargs="+", default=[], metavar="ORG",
        help="organizations whose kernels load without trust_remote_code",
    )
    parser.add_argument("--quiet", action="store_true", help="do not log requests")
    args = parser.parse_args(argv)
    warn_if_exposed(args.host)
    hub = start_hub(args.root, args.host, args.port, args.token, args.trusted_orgs, log_requests=not args.quiet)
    stopped = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopped.set())
    print(describe(hub.url, hub.storage.root, args.token, args.trusted_orgs), flush=True)
    stopped.wait()
    hub.stop()
    return 0
