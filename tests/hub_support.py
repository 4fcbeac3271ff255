"""Shared by the local-Hub tests: a Hub holding the three built kernel repos, and the real CLIs run
against it in subprocesses (client, page and browser tests); raw HTTP and commit bodies (hardening tests)."""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import quote, urlsplit

import pytest
from huggingface_hub import CommitOperationAdd, HfApi, constants

from tpu_kernels.distribution.builder import build_kernel_repo
from tpu_kernels.distribution.hub import Limits, RunningHub, start_hub
from tpu_kernels.distribution.publish import upload_kernel

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKEN = "test-token-" + os.urandom(4).hex()
TRUSTED = "tpu-kernels"
KERNEL_NAMES = ("ragged-dot-tpu", "rmsnorm-tpu", "attention-tpu")
CLI_TIMEOUT = 180
BIN = Path(sys.executable).parent


@dataclass
class PublishedHub:
    url: str
    builds: dict[str, Path]  # kernel name -> its build folder
    commits: dict[str, str]  # repo id -> the commit its v1 holds
    hub: RunningHub | None = None  # when it runs in this process


@contextmanager
def loopback_only(folder: Path) -> Iterator[None]:
    """The first time huggingface_hub builds request headers in a process, it fetches an agent registry
    from HF_ENDPOINT (huggingface.co in this process) unless a copy is cached: give it one."""
    registry = folder / "agent-harnesses.json"
    registry.write_text(json.dumps({"standardEnvVars": [], "harnesses": {}}))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(constants, "AGENT_HARNESSES_PATH", str(registry))
        yield


def publish_kernels(url: str, root: Path) -> PublishedHub:
    """Build the three kernel repos under `root` and publish each as tpu-kernels/<name> v1 to the Hub at `url`."""
    builds, commits = {}, {}
    for name in KERNEL_NAMES:
        builds[name] = build_kernel_repo(REPO_ROOT / "kernel_repos" / name, root / "build")
        commits[f"{TRUSTED}/{name}"] = upload_kernel(builds[name], f"{TRUSTED}/{name}", endpoint=url,
                                                     token=TOKEN).build_oid
    return PublishedHub(url, builds, commits)


@contextmanager
def published_hub(root: Path) -> Iterator[PublishedHub]:
    """A Hub in this process, under `root`, where tpu-kernels (a trusted publisher) has published v1 of the
    three kernels."""
    with loopback_only(root), start_hub(root / "hub", token=TOKEN, trusted_orgs=[TRUSTED]) as hub:
        published = publish_kernels(hub.url, root)
        published.hub = hub
        yield published


def module_hub(token: str, limits: Limits):
    """A `hub` fixture for a test module: one server for all its tests, each working in repos of its own
    (starting one per test costs more)."""

    @pytest.fixture(scope="module")
    def hub(tmp_path_factory):
        with start_hub(tmp_path_factory.mktemp("shared") / "hub", token=token, limits=limits) as running:
            yield running

    return hub


def published_fixture(folder: str, publish_more: Callable[[HfApi], None] = lambda api: None):
    """A `published` fixture for a test module: `published_hub` in a folder of its own, then
    `publish_more(api)` for what the module's tests need beyond the three kernels."""

    @pytest.fixture(scope="module")
    def published(tmp_path_factory):
        with published_hub(tmp_path_factory.mktemp(folder)) as hub:
            publish_more(HfApi(endpoint=hub.url, token=TOKEN))
            yield hub

    return published


def run_concurrently(work: Callable[[int], object], count: int) -> list[Exception]:
    """`work(index)` for each index in range(count), in threads started together; what they raised."""
    errors = []

    def run(index: int) -> None:
        try:
            work(index)
        except Exception as error:  # the caller asserts on the list
            errors.append(error)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def cli_env(hub_url: str, home: Path, token: str | None = TOKEN) -> dict[str, str]:
    """The environment of a user of this Hub: HF_ENDPOINT, their own caches, and the token."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("HF_", "KERNELS_", "LOCAL_KERNELS"))}
    env.update(
        HF_ENDPOINT=hub_url,
        HF_HOME=str(home / "hf-home"),
        KERNELS_CACHE=str(home / "kernels-cache"),
        HF_HUB_DISABLE_UPDATE_CHECK="1",
        # Our kernels need no TPU runtime here: skipping torch_tpu's autoload halves each start-up.
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",
        NO_COLOR="1",
        COLUMNS="250",
    )
    if token is not None:
        env["HF_TOKEN"] = token
    return env


def run_cli(program: str, *args: str, env: dict[str, str], returncode: int = 0) -> subprocess.CompletedProcess:
    """Run `kernels ...` or `hf ...`; check its exit code, and that it printed no traceback."""
    result = subprocess.run([str(BIN / program), *args], env=env, capture_output=True, text=True,
                            timeout=CLI_TIMEOUT, stdin=subprocess.DEVNULL)
    output = result.stdout + result.stderr
    assert result.returncode == returncode, f"{program} {' '.join(args)} -> {result.returncode}\n{output[-4000:]}"
    assert "Traceback" not in output, output[-4000:]
    return result


# -- raw HTTP and commit bodies, for the hardening tests ------------------------------------------------

# Small timeouts: a hardening test of an idle or stalled connection ends within a second or two.
FAST = Limits(header_timeout=0.5, idle_timeout=0.5, body_timeout=0.5, max_connections=64)
# FAST with pace limits: a body or a response slower than 64 KiB/s on average is cut after a second.
PACED = Limits(header_timeout=0.5, idle_timeout=0.5, body_timeout=0.5, send_timeout=1.0, min_rate=64 << 10,
               max_connections=64)
# The repo of a hardening test that starts a Hub of its own.
REPO = "org/kernel-h"
HEADER = {"key": "header", "value": {"summary": "hostile"}}


def add(path: str, content: bytes) -> CommitOperationAdd:
    return CommitOperationAdd(path_in_repo=path, path_or_fileobj=content)


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname, parts.port


def connect(url: str, receive_buffer: int | None = None) -> socket.socket:
    """A socket connected to the Hub at `url`, with a 10 s timeout; `receive_buffer`: its SO_RCVBUF, set before
    connecting (a small one makes a client that reads slowly)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(10)
    sock.connect(address(url))
    return sock


def read_until_closed(sock: socket.socket, limit: float = 10) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    start, received = time.monotonic(), b""
    sock.settimeout(limit)
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            raise AssertionError(f"the server kept the connection open for {limit} s; got {received[:200]!r}")
        except ConnectionResetError:
            break
        if not chunk:
            break
        received += chunk
    return received, time.monotonic() - start


def status_of(response: bytes) -> int:
    match = re.match(rb"HTTP/1\.1 (\d{3}) ", response)
    assert match, response[:200]
    return int(match.group(1))


def http(method: str, url: str, body: bytes = b"", headers: dict | None = None, token: str | None = None):
    """One request on a fresh connection: (status, headers, body)."""
    import http.client

    host, port = address(url)
    connection = http.client.HTTPConnection(host, port, timeout=30)
    try:
        sent = dict(headers or {})
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        connection.request(method, urlsplit(url).path + (f"?{urlsplit(url).query}" if urlsplit(url).query else ""),
                           body=body, headers=sent)
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def ndjson(*lines) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


def file_line(path: str, content: bytes) -> dict:
    return {"key": "file", "value": {"content": base64.b64encode(content).decode(), "path": path, "encoding": "base64"}}


def commit_body(hub: RunningHub, repo_id: str, body: bytes) -> tuple[int, bytes]:
    """POST `body` (NDJSON commit lines) as a commit to `repo_id`'s main: (status, answer)."""
    return http("POST", f"{hub.url}/api/kernels/{repo_id}/commit/main", body, token=hub.token,
                headers={"Content-Type": "application/x-ndjson"})[::2]


def stored_state(hub: RunningHub, repo_id: str) -> tuple:
    """Everything a failed request must leave as it was: refs, commits, blobs, and an empty staging area."""
    root = hub.storage.root
    files = sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())
    return files, (root / "repos" / "kernel" / repo_id / "refs.json").read_bytes()


def assert_refused_everywhere(hub: RunningHub, repo_id: str, path: str, content: bytes) -> str:
    """Assert that every way a client can name `path` in `repo_id` is a 400 that leaves the repo as it was: a
    commit adding it (as `content`) or deleting it, a preupload, a download. Returns the adding commit's error,
    for the caller to check the reason."""
    before = stored_state(hub, repo_id)
    status, answer = commit_body(hub, repo_id, ndjson(HEADER, file_line(path, content)))
    assert status == 400, answer
    status, _ = commit_body(hub, repo_id, ndjson(HEADER, {"key": "deletedFile", "value": {"path": path}}))
    assert status == 400
    status, _, _ = http("POST", f"{hub.url}/api/kernels/{repo_id}/preupload/main", token=hub.token,
                        body=json.dumps({"files": [{"path": path, "size": 1, "sample": ""}]}).encode())
    assert status == 400
    assert http("GET", f"{hub.url}/kernels/{repo_id}/resolve/main/{quote(path)}")[0] == 400
    assert stored_state(hub, repo_id) == before
    return json.loads(answer)["error"]


def peak_rss_kib(pid: int) -> int:
    """The peak resident memory of process `pid` so far (Linux's VmHWM)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1))


# -- hostile and private content, for the pages --------------------------------------------------------

PRIVATE_REPO = f"{TRUSTED}/secret-kernel"


@dataclass(frozen=True)
class HostileRepo:
    """A repo whose every field a page shows holds markup that must stay inert."""

    repo: str
    card: str
    title: str
    message: str
    path: str
    backend: str


HOSTILE = HostileRepo(
    repo="mallory/kernel",
    card="""---
license: "<script>alert('license')</script>"
tags: ["<img src=x onerror=alert('tag')>"]
---
# Card <script>alert('card')</script>

<img src=x onerror="alert('img')">

<script>document.title = 'pwned'</script>

[click me](javascript:alert('link')) and [the notes](build/torch-cpu/notes.md)

![the plot](plot.png)
""",
    title="<b>bold</b><script>alert('title')</script>",
    message="<img src=x onerror=alert('message')>\n<a href=\"javascript:alert('message')\">x</a>",
    path="build/torch-cpu/<img src=x onerror=alert('path')>.py",
    backend="<svg onload=alert('backend')>",
)


def png(width: int = 24, height: int = 12) -> bytes:
    """A small opaque RGB picture (a red-to-blue gradient), made with the standard library."""
    rows = b"".join(b"\0" + b"".join(bytes((255 * x // width, 64, 255 - 255 * x // width)) for x in range(width))
                    for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def publish_hostile_and_private_repos(api: HfApi) -> None:
    """A kernel repo whose card, commit message, file name and metadata try to inject markup, and a
    private kernel repo of the trusted publisher."""
    api.create_repo(HOSTILE.repo, repo_type="kernel")
    api.create_branch(HOSTILE.repo, repo_type="kernel", branch="v1")
    metadata = json.dumps({"name": "kernel", "version": 1, "backend": {"type": HOSTILE.backend}}).encode()
    api.create_commit(HOSTILE.repo, repo_type="kernel", revision="v1", commit_message=HOSTILE.title,
                      commit_description=HOSTILE.message, operations=[
                          CommitOperationAdd("README.md", HOSTILE.card.encode()),
                          CommitOperationAdd("plot.png", png()),
                          CommitOperationAdd("build/torch-cpu/metadata.json", metadata),
                          CommitOperationAdd("build/torch-cpu/notes.md", b"notes\n"),
                          CommitOperationAdd(HOSTILE.path, b"VALUE = 1\n")])
    api.create_tag(HOSTILE.repo, repo_type="kernel", tag="release-1", revision="v1")
    api.create_repo(PRIVATE_REPO, repo_type="kernel", private=True)
    api.upload_file(path_or_fileobj=b"# secret\n", path_in_repo="README.md", repo_id=PRIVATE_REPO, repo_type="kernel")


_HIDDEN = {"head", "style", "script", "title"}
# Elements whose edges separate words in what a reader sees (as innerText does).
_BLOCKS = {"p", "div", "li", "ul", "ol", "tr", "td", "th", "table", "pre", "br", "h1", "h2", "h3", "h4", "h5", "h6",
           "header", "main", "article", "blockquote", "hr"}


class _Document(HTMLParser):
    """Elements, attributes and visible text of an HTML document."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self._hidden = 0
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))
        self._hidden += tag in _HIDDEN
        if tag in _BLOCKS:
            self.text.append(" ")

    def handle_endtag(self, tag):
        self._hidden -= tag in _HIDDEN
        if tag in _BLOCKS:
            self.text.append(" ")

    def handle_data(self, data):
        if not self._hidden:
            self.text.append(data)


def visible_text(html: str) -> str:
    """The page's text as a reader sees it, whitespace collapsed."""
    return " ".join("".join(_Document(html).text).split())


def active_content(html: str) -> list[str]:
    """Everything in a page that could run code: script-like elements, event handler attributes,
    javascript:/vbscript:/data: links."""
    found = []
    for tag, attrs in _Document(html).elements:
        if tag in ("script", "iframe", "object", "embed", "base", "form", "meta") and not (
                tag == "meta" and set(attrs) <= {"charset", "name", "content"}):
            found.append(f"<{tag}>")
        for name, value in attrs.items():
            if name.startswith("on"):
                found.append(f"<{tag} {name}=...>")
            if name in ("href", "src", "action", "formaction") and (value or "").strip().lower().startswith(
                    ("javascript:", "vbscript:", "data:text")):
                found.append(f"<{tag} {name}={value}>")
    return found
