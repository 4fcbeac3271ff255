"""A hostile Hub for the loader's tests: it forwards every request to a real (local) Hub and changes its
answers in one chosen way, as a compromised mirror or a man in the middle of plain HTTP would.

Standard library only (`http.server` and `http.client`), on a free loopback port. A lie is a function
that edits an `Exchange` (the request, and the answer the real Hub gave) before it is sent back.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import quote, unquote, urlsplit

# Hop-by-hop or recomputed: never copied from the real Hub's answer as they are.
_DROPPED_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"}


@dataclass
class Exchange:
    method: str
    path: str  # decoded, without the query
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self):
        return json.loads(self.body)

    def set_json(self, value) -> None:
        self.body = json.dumps(value).encode()
        self.headers["content-type"] = "application/json"


Lie = Callable[[Exchange], None]


@dataclass
class HostileHub:
    url: str
    upstream: str
    lie: Lie | None = None
    # A fake id -> the real one it stands for in requests: the server answers for its fake ids.
    aliases: dict[str, str] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)

    def upstream_path(self, path: str) -> str:
        """`path` (as sent, quoted) with each segment that is a fake id replaced by the real one."""
        route, _, query = path.partition("?")
        segments = [quote(self.aliases[unquote(segment)], safe="") if unquote(segment) in self.aliases else segment
                    for segment in route.split("/")]
        return "/".join(segments) + (f"?{query}" if query else "")


def _handler(hub: HostileHub) -> type[BaseHTTPRequestHandler]:
    upstream = urlsplit(hub.upstream)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # The headers and the body go out in two writes: with Nagle's algorithm on, the body waits for the
        # client's delayed ACK of the headers (40 ms per answer on Linux), as the real Hub avoids (TCP_NODELAY).
        disable_nagle_algorithm = True

        def log_message(self, *args):
            pass

        def forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            headers = {name: value for name, value in self.headers.items()
                       if name.lower() not in ("host", "accept-encoding", "connection")}
            connection = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=30)
            try:
                connection.request(self.command, hub.upstream_path(self.path), body=body, headers=headers)
                response = connection.getresponse()
                payload = response.read()
                answer = {name.lower(): value for name, value in response.getheaders()}
            finally:
                connection.close()
            exchange = Exchange(self.command, unquote(urlsplit(self.path).path), response.status, answer, payload)
            hub.requests.append((exchange.method, exchange.path))
            if hub.lie is not None:
                hub.lie(exchange)
            if "location" in exchange.headers:
                exchange.headers["location"] = exchange.headers["location"].replace(hub.upstream, hub.url)
            self.send_response(exchange.status)
            for name, value in exchange.headers.items():
                if name not in _DROPPED_HEADERS:
                    self.send_header(name, value)
            # A HEAD answer states the length of what a GET would send.
            length = answer.get("content-length", "0") if self.command == "HEAD" else str(len(exchange.body))
            self.send_header("Content-Length", length)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(exchange.body)

        do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = forward

    return Handler


@contextmanager
def hostile_hub(upstream: str) -> Iterator[HostileHub]:
    """A hostile Hub in front of the Hub at `upstream`; it tells the truth until `.lie` is set."""
    hub = HostileHub(url="", upstream=upstream.rstrip("/"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


# -- the lies ---------------------------------------------------------------------------------------


def revision_sha(value: str) -> Lie:
    """Answer revision lookups (`repo_info(revision=...)`) with `value` as the commit."""

    def lie(exchange: Exchange) -> None:
        if "/revision/" in exchange.path and exchange.status == 200:
            exchange.set_json({**exchange.json(), "sha": value})

    return lie


def branch_target(value: str) -> Lie:
    """List every branch (the `v<N>` ones included) as pointing at `value`."""

    def lie(exchange: Exchange) -> None:
        if exchange.path.endswith("/refs") and exchange.status == 200:
            refs = exchange.json()
            refs["branches"] = [{**branch, "targetCommit": value} for branch in refs.get("branches", [])]
            exchange.set_json(refs)

    return lie


def extra_branches(*branches: dict) -> Lie:
    """List more branches than the repo has."""

    def lie(exchange: Exchange) -> None:
        if exchange.path.endswith("/refs") and exchange.status == 200:
            refs = exchange.json()
            refs["branches"] = [*refs.get("branches", []), *branches]
            exchange.set_json(refs)

    return lie


def file_header(name: str, value: str, *, status: int | None = None) -> Lie:
    """Send header `name` (ETag, X-Repo-Commit, ...) as `value` with every file (`/resolve/`), optionally with
    another status."""

    def lie(exchange: Exchange) -> None:
        if "/resolve/" in exchange.path:
            exchange.headers[name.lower()] = value
            if status is not None:
                exchange.status = status
                exchange.headers["x-error-code"] = "EntryNotFound"
                exchange.body = b'{"error": "Entry not found"}'

    return lie


def tree_files(edit: Callable[[dict], None]) -> Lie:
    """Edit each file entry of the tree listings (`list_repo_tree`) under `build/`."""

    def lie(exchange: Exchange) -> None:
        if "/tree/" in exchange.path and exchange.status == 200:
            entries = exchange.json()
            for entry in entries:
                if entry.get("type") == "file" and entry.get("path", "").startswith("build/"):
                    edit(entry)
            exchange.set_json(entries)

    return lie


def file_body(edit: Callable[[bytes], bytes]) -> Lie:
    """Send each file (`/resolve/`) with its body edited, headers untouched (the real ETag)."""

    def lie(exchange: Exchange) -> None:
        if "/resolve/" in exchange.path and exchange.method == "GET" and exchange.status == 200:
            exchange.body = edit(exchange.body)

    return lie
