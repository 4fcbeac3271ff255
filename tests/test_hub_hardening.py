"""The local Hub under hostile input and faults: a real server on loopback, with small timeouts.

Raw sockets send what no well-behaved client would; huggingface_hub checks that what a
client sees stays right. Memory is measured on a server process (its peak RSS), not assumed.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import os
import random
import re
import selectors
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote, urlsplit

import pytest
from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

from tpu_kernels.distribution.hub import Limits, start_hub
from tpu_kernels.distribution.hub.commit_payload import MAX_LINE_BYTES

from .hub_support import module_hub, run_concurrently

TOKEN = "hardening-" + os.urandom(4).hex()
REPO = "org/kernel-h"
REPO_ROOT = Path(__file__).resolve().parents[1]
FAST = Limits(header_timeout=0.5, idle_timeout=0.5, body_timeout=0.5, max_connections=64)


pytestmark = pytest.mark.usefixtures("local_agent_registry")


hub = module_hub(TOKEN, FAST)


@pytest.fixture
def api(hub):
    return HfApi(endpoint=hub.url, token=TOKEN)


_repo_names = itertools.count()


@pytest.fixture
def repo(api) -> str:
    """A new kernel repo whose main holds README.md and c/d.txt; its id."""
    repo_id = f"org/kernel-{next(_repo_names)}"
    api.create_repo(repo_id, repo_type="kernel")
    api.create_commit(repo_id, repo_type="kernel", commit_message="seed",
                      operations=[add("README.md", b"# card\n"), add("c/d.txt", b"d")])
    return repo_id


def add(path: str, content: bytes) -> CommitOperationAdd:
    return CommitOperationAdd(path_in_repo=path, path_or_fileobj=content)


# -- raw HTTP ------------------------------------------------------------------------------------


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname, parts.port


def connect(url: str) -> socket.socket:
    return socket.create_connection(address(url), timeout=10)


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


def _readable(sock: socket.socket, timeout: float) -> bool:
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_READ)
        return bool(selector.select(timeout))


def exchange(url: str, raw_request: bytes) -> bytes:
    """Send raw bytes, read the whole answer (the server closes, or the read times out)."""
    with connect(url) as sock:
        sock.sendall(raw_request)
        return read_until_closed(sock)[0]


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


HEADER = {"key": "header", "value": {"summary": "hostile"}}


def file_line(path: str, content: bytes) -> dict:
    return {"key": "file", "value": {"content": base64.b64encode(content).decode(), "path": path, "encoding": "base64"}}


def stored_state(hub, repo_id: str) -> tuple:
    """Everything a failed request must leave as it was: refs, commits, blobs, and an empty staging area."""
    root = hub.storage.root
    files = sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())
    return files, (root / "repos" / "kernel" / repo_id / "refs.json").read_bytes()


# -- 1. token semantics --------------------------------------------------------------------------


@pytest.mark.parametrize("token", ["", "   ", "\t\n"])
def test_an_empty_or_blank_token_is_no_token(tmp_path, token):
    with start_hub(tmp_path / "hub", token=token, limits=FAST) as hub:
        assert hub.token is None
        for given in (None, "", token.strip() or "x"):
            headers = {"Authorization": f"Bearer {given}"} if given is not None else {}
            status, _, body = http("POST", f"{hub.url}/api/repos/create", json.dumps(
                {"name": "k", "organization": "org", "type": "kernel"}).encode(), headers)
            assert status == 401 and b"read-only" in body
        assert not (hub.storage.root / "repos" / "kernel" / "org").exists()


@pytest.mark.multiprocess
def test_serve_with_an_empty_token_variable_says_read_only_and_is(tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-m", "tpu_kernels.distribution.hub", "--root", str(tmp_path / "hub"), "--port", "0", "--quiet",
         "--trusted-org", "org"],
        env=dict(os.environ, TPU_KERNELS_HUB_TOKEN=""), cwd=REPO_ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        banner = [process.stdout.readline() for _ in range(2)]
        url = banner[0].split(" at ")[1].strip()
        assert banner[1].startswith("read-only"), banner
        status, _, _ = http("POST", f"{url}/api/repos/create",
                            json.dumps({"name": "k", "organization": "org", "type": "kernel"}).encode(), token="")
        assert status == 401
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    assert "the token is empty: serving read-only" in stderr


# -- 3a. timeouts and connections ----------------------------------------------------------------


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(hub):
    with connect(hub.url) as sock:
        received, elapsed = read_until_closed(sock)
    assert received == b"" and FAST.header_timeout * 0.8 <= elapsed < FAST.header_timeout + 2


def test_half_sent_and_trickled_headers_are_cut_off_with_408(hub):
    with connect(hub.url) as sock:
        sock.sendall(b"GET /api/kernels/org/x/refs HTTP/1.1\r\nHost: localhost\r\n")
        received, elapsed = read_until_closed(sock)
    assert status_of(received) == 408 and elapsed < FAST.header_timeout + 2

    with connect(hub.url) as sock:
        start = time.monotonic()
        for byte in b"GET /api/kernels/org/x/refs HTTP/1.1\r\nX-Slow: " + b"a" * 200:
            sock.sendall(bytes([byte]))
            if _readable(sock, 0.05):
                break
        received, _ = read_until_closed(sock)
    assert status_of(received) == 408 and time.monotonic() - start < FAST.header_timeout + 2


def test_a_kept_alive_connection_idle_after_a_response_is_closed(hub):
    with connect(hub.url) as sock:
        sock.sendall(b"GET /api/agent-harnesses HTTP/1.1\r\nHost: localhost\r\n\r\n")
        received, elapsed = read_until_closed(sock)
    assert status_of(received) == 200 and elapsed < FAST.idle_timeout + 2


def test_a_body_shorter_than_its_content_length_is_a_408_not_a_hang(hub, repo):
    before = stored_state(hub, repo)
    body = ndjson(HEADER)
    with connect(hub.url) as sock:
        sock.sendall(b"POST /api/kernels/" + repo.encode() + b"/commit/main HTTP/1.1\r\nHost: localhost\r\n"
                     b"Authorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: %d\r\n\r\n" % (len(body) + 100)
                     + body)
        received, elapsed = read_until_closed(sock)
    assert status_of(received) == 408 and b"stalled" in received and elapsed < FAST.body_timeout + 2
    assert stored_state(hub, repo) == before


def test_hundreds_of_idle_and_half_sent_connections_are_all_closed_and_the_server_keeps_serving(tmp_path):
    with start_hub(tmp_path / "hub", token=TOKEN, limits=Limits(header_timeout=1, max_connections=1000)) as hub:
        sockets = [connect(hub.url) for _ in range(300)]
        for sock in sockets[::2]:
            sock.sendall(b"POST /api/repos/create HTTP/1.1\r\nHost: localhost\r\n")
        status, _, _ = http("GET", f"{hub.url}/api/agent-harnesses")
        assert status == 200
        selector = selectors.DefaultSelector()
        for sock in sockets:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        open_ = set(sockets)
        deadline = time.monotonic() + 10
        while open_ and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.5):
                try:
                    chunk = key.fileobj.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                if not chunk:
                    selector.unregister(key.fileobj)
                    open_.discard(key.fileobj)
        for sock in sockets:
            sock.close()
        assert not open_, f"{len(open_)} of 300 connections still open 10 s after a 1 s header timeout"


def test_connections_beyond_the_cap_get_503_and_service_resumes(tmp_path):
    with start_hub(tmp_path / "hub", token=TOKEN, limits=Limits(max_connections=8)) as hub:
        held = [connect(hub.url) for _ in range(8)]
        time.sleep(0.2)
        with connect(hub.url) as extra:
            received, _ = read_until_closed(extra)
        assert status_of(received) == 503
        for sock in held:
            sock.close()
        time.sleep(0.2)
        assert http("GET", f"{hub.url}/api/agent-harnesses")[0] == 200


# -- 3b. strict request parsing ------------------------------------------------------------------


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    """`python -m tpu_kernels.distribution.hub` as deployed; yields (url, its stderr so far)."""
    folder = tmp_path_factory.mktemp("served")
    stderr = open(folder / "stderr.txt", "w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "tpu_kernels.distribution.hub", "--root", str(folder / "hub"), "--port", "0", "--quiet"],
        env=dict(os.environ, TPU_KERNELS_HUB_TOKEN=TOKEN), cwd=REPO_ROOT,
        stdout=subprocess.PIPE, stderr=stderr, text=True,
    )
    try:
        yield process.stdout.readline().split(" at ")[1].strip(), lambda: (folder / "stderr.txt").read_text()
    finally:
        process.terminate()
        process.wait(timeout=30)
        stderr.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("content_length", [
    b"Content-Length: \xc2\xb2", b"Content-Length: " + b"9" * 5000, b"Content-Length: -1", b"Content-Length: 1e3",
    b"Content-Length: 2\r\nContent-Length: 3", b"Content-Length: 2, 3",
    b"Content-Length: 2\r\nTransfer-Encoding: gzip",
])
def test_malformed_or_conflicting_content_length_is_400_without_a_traceback(server_process, content_length):
    url, stderr = server_process
    response = exchange(url, b"POST /api/repos/create HTTP/1.1\r\nHost: localhost\r\n" + content_length + b"\r\n\r\n{}")
    assert status_of(response) in (400, 501)
    assert http("GET", f"{url}/api/agent-harnesses")[0] == 200
    assert "Traceback" not in stderr()


def test_oversized_bodies_are_refused_before_they_are_read(hub):
    response = exchange(hub.url, b"POST /api/repos/create HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer "
                        + TOKEN.encode() + b"\r\nContent-Length: %d\r\n\r\n{" % (FAST.max_json_bytes + 1))
    assert status_of(response) == 413 and b"connection: close" in response.lower()


# -- 3c. unauthenticated endpoints are bounded ---------------------------------------------------


def test_validate_yaml_needs_the_token_and_bounds_the_front_matter(hub, api):
    big = "---\n" + "".join(f"key{i}: [a, b, {{c: d}}]\n" for i in range(20_000)) + "---\n# card\n"
    assert len(big) > 400_000
    status, _, _ = http("POST", f"{hub.url}/api/validate-yaml", json.dumps({"content": big}).encode())
    assert status == 401
    status, _, body = http("POST", f"{hub.url}/api/validate-yaml", json.dumps({"content": big}).encode(), token=TOKEN)
    assert status == 400 and b"front matter larger than" in body
    status, _, _ = http("POST", f"{hub.url}/api/validate-yaml", json.dumps({"content": 3}).encode(), token=TOKEN)
    assert status == 400
    # The client's own check still works.
    api.create_repo("org/with-card", repo_type="kernel")
    api.create_commit("org/with-card", repo_type="kernel", commit_message="card",
                      operations=[add("README.md", b"---\nlicense: apache-2.0\n---\n# card\n")])


# -- 3d. commit bodies stream to disk ------------------------------------------------------------


def _peak_rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1))


def _stream_commit(url: str, path: str, size: int, seed: int) -> tuple[int, dict, str]:
    """POST a one-file commit whose base64 content is generated while it is sent; returns the file's sha256."""
    import http.client

    prefix = json.dumps(HEADER).encode() + b'\n{"key": "file", "value": {"path": "' + path.encode() + b'", "content": "'
    suffix = b'", "encoding": "base64"}}\n'
    block = 3 << 20  # a multiple of 3: each block's base64 stands alone
    digest = hashlib.sha256()
    generator = random.Random(seed)

    def body():
        yield prefix
        remaining = size
        while remaining:
            piece = generator.randbytes(min(block, remaining))
            digest.update(piece)
            remaining -= len(piece)
            yield base64.b64encode(piece)
        yield suffix

    length = len(prefix) + 4 * ((size + 2) // 3) + len(suffix)
    host, port = address(url)
    connection = http.client.HTTPConnection(host, port, timeout=300)
    try:
        connection.request("POST", f"/api/kernels/{REPO}/commit/main", body=body(), headers={
            "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/x-ndjson", "Content-Length": str(length)})
        response = connection.getresponse()
        return response.status, json.loads(response.read()), digest.hexdigest()
    finally:
        connection.close()


@pytest.mark.multiprocess
def test_a_256_mib_commit_raises_the_server_peak_memory_by_a_few_mib(tmp_path):
    root = tmp_path / "hub"
    process = subprocess.Popen(
        [sys.executable, "-m", "tpu_kernels.distribution.hub", "--root", str(root), "--port", "0", "--quiet"],
        env=dict(os.environ, TPU_KERNELS_HUB_TOKEN=TOKEN), cwd=REPO_ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        url = process.stdout.readline().split(" at ")[1].strip()
        HfApi(endpoint=url, token=TOKEN).create_repo(REPO, repo_type="kernel")
        # Warm up every code path with an 8 MiB file, then measure what a 32x larger one adds.
        assert _stream_commit(url, "warm-up.bin", 8 << 20, seed=1)[0] == 200
        baseline = _peak_rss_kib(process.pid)
        status, answer, sha256 = _stream_commit(url, "big.bin", 256 << 20, seed=2)
        growth_mib = (_peak_rss_kib(process.pid) - baseline) / 1024
        assert status == 200, answer
        commit = json.loads(next((root / "repos/kernel/org/kernel-h/commits").glob(f"{answer['commitOid']}.json"))
                            .read_text())
        assert commit["files"]["big.bin"]["sha256"] == sha256 and commit["files"]["big.bin"]["size"] == 256 << 20
        blob = root / "blobs" / sha256[:2] / sha256
        assert blob.stat().st_size == 256 << 20
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert growth_mib < 8, f"peak RSS grew by {growth_mib:.1f} MiB for a 256 MiB file"


# -- 3e. malformed commit lines are 400s naming the field ----------------------------------------


MALFORMED_COMMITS = {
    "value not an object": (ndjson(HEADER, {"key": "file", "value": "c"}), "value"),
    "integer content": (ndjson(HEADER, {"key": "file", "value": {"path": "a", "content": 5}}), "value.content"),
    "missing content": (ndjson(HEADER, {"key": "file", "value": {"path": "a"}}), "value.content"),
    "integer path": (ndjson(HEADER, {"key": "file", "value": {"path": 5, "content": ""}}), "value.path"),
    "invalid UTF-8 path": (ndjson(HEADER, b'{"key": "file", "value": {"path": "a\xff", "content": ""}}'), "value.path"),
    "invalid UTF-8 key": (ndjson(HEADER, b'{"key": "\xc3", "value": {}}'), "key"),
    "bad base64": (ndjson(HEADER, {"key": "file", "value": {"path": "a", "content": "ab!d"}}), "value.content"),
    "unpadded base64": (ndjson(HEADER, {"key": "file", "value": {"path": "a", "content": "YWJj" * 9 + "YQ"}}),
                        "value.content"),
    "data after padding": (ndjson(HEADER, {"key": "file", "value": {"path": "a", "content": "YQ==YWJj"}}),
                           "value.content"),
    "escaped non-base64": (ndjson(HEADER, b'{"key": "file", "value": {"path": "a", "content": "YW\\nJj"}}'),
                           "value.content"),
    "content on a deletion": (ndjson(HEADER, {"key": "deletedFile", "value": {"path": "c/d.txt", "content": "YQ=="}}),
                              "value.content"),
    "unknown operation": (ndjson(HEADER, {"key": "rename", "value": {"path": "a"}}), "key"),
    "lfs file": (ndjson(HEADER, {"key": "lfsFile", "value": {"path": "a", "oid": "0" * 64, "size": 1}}), "key"),
    "not an object": (ndjson(HEADER, [1, 2]), "line 2"),
    "header missing": (ndjson(file_line("a", b"x")), "header"),
    "header twice": (ndjson(HEADER, HEADER), "header"),
    "integer summary": (ndjson({"key": "header", "value": {"summary": 3}}), "value.summary"),
    "empty summary": (ndjson({"key": "header", "value": {"summary": " "}}), "value.summary"),
    "bad parentCommit": (ndjson({"key": "header", "value": {"summary": "s", "parentCommit": "xyz"}}),
                         "value.parentCommit"),
    "duplicate field": (ndjson(HEADER, b'{"key": "file", "key": "file", "value": {}}'), "key"),
    "two values on a line": (ndjson(HEADER, b'{"key": "deletedFile", "value": {"path": "c/d.txt"}} {}'), "line 2"),
    "truncated line": (ndjson(HEADER) + b'{"key": "file", "value": {"path": "a", "content": "YWJj', "value.content"),
    "unterminated object": (ndjson(HEADER, b'{"key": "file", "value": {"path": "a"'), "value"),
    "deep nesting": (ndjson(HEADER, b'{"key": "file", "value": {"x": ' + b"[" * 40 + b"]" * 40 + b"}}"), "nested"),
    "huge number": (ndjson(HEADER, b'{"key": "file", "value": {"x": ' + b"9" * 5000 + b"}}"), "value.x"),
    "huge string": (ndjson({"key": "header", "value": {"summary": "s" * (MAX_LINE_BYTES + 1)}}), "value.summary"),
    "escaping path": (ndjson(HEADER, file_line("ok.py", b"fine"), file_line("../x.py", b"evil")), "value.path"),
}


@pytest.mark.parametrize("case", MALFORMED_COMMITS, ids=list(MALFORMED_COMMITS))
def test_malformed_commit_lines_are_400_naming_the_field_and_change_nothing(hub, repo, case):
    body, field = MALFORMED_COMMITS[case]
    before = stored_state(hub, repo)
    status, headers, answer = http("POST", f"{hub.url}/api/kernels/{repo}/commit/main", body, token=TOKEN,
                                   headers={"Content-Type": "application/x-ndjson"})
    assert status == 400, answer
    message = json.loads(answer)["error"]
    assert field in message and "Invalid commit payload" in message, message
    assert headers["X-Error-Message"]
    assert stored_state(hub, repo) == before


@pytest.mark.parametrize("cursor", ["9" * 5000, "\u00b2", "-1", "1.5", "x"])
def test_an_invalid_pagination_cursor_is_400(hub, repo, cursor):
    status, _, body = http("GET", f"{hub.url}/api/kernels/{repo}/commits/main?cursor={quote(cursor)}")
    assert status == 400 and b"cursor" in body


@pytest.mark.parametrize("path, payload, field", [
    ("/api/repos/create", {"name": 5, "type": "kernel"}, "name"),
    ("/api/repos/create", {"name": "k", "organization": ["org"]}, "organization"),
    ("/api/repos/create", {"name": "k", "private": "yes"}, "private"),
    ("/api/repos/create", {"name": "k", "visibility": "protected"}, "visibility"),
    ("/api/kernels/{repo}/preupload/main", {"files": {"path": "a"}}, "files"),
    ("/api/kernels/{repo}/preupload/main", {"files": [{"path": 3}]}, "files[0].path"),
    ("/api/kernels/{repo}/preupload/main", {"files": ["a"]}, "files[0]"),
    ("/api/kernels/{repo}/branch/v2", {"startingPoint": 7}, "startingPoint"),
    ("/api/kernels/{repo}/tag/main", {"tag": None}, "tag"),
])
def test_malformed_json_fields_are_400_naming_the_field(hub, repo, path, payload, field):
    before = stored_state(hub, repo)
    status, _, body = http("POST", hub.url + path.format(repo=repo), json.dumps(payload).encode(), token=TOKEN)
    assert status == 400 and field in json.loads(body)["error"], body
    assert stored_state(hub, repo) == before


def test_non_utf8_deeply_nested_or_non_object_json_and_bad_forms_are_400(hub, repo):
    for body in (b'{"name": "\xff"}', b"[" * 200_000 + b"]" * 200_000, b'{"name": ' + b"9" * 5000 + b"}", b"[1]"):
        assert http("POST", f"{hub.url}/api/repos/create", body, token=TOKEN)[0] == 400
    assert http("POST", f"{hub.url}/api/kernels/{repo}/paths-info/main", b"paths=%ff")[0] == 400


def test_escaped_base64_and_split_network_chunks_decode_exactly(hub, api, repo):
    content = random.Random(5).randbytes(100_000)
    encoded = base64.b64encode(content).decode().replace("/", "\\/")
    body = ndjson(HEADER, ('{"key": "file", "value": {"path": "e.bin", "content": "%s"}}' % encoded).encode())
    with connect(hub.url) as sock:
        sock.sendall(b"POST /api/kernels/" + repo.encode() + b"/commit/main HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer "
                     + TOKEN.encode() + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
        for start in range(0, len(body), 997):  # odd pieces split escapes and base64 quads
            sock.sendall(body[start:start + 997])
        assert status_of(read_until_closed(sock)[0]) == 200
    status, _, downloaded = http("GET", f"{hub.url}/kernels/{repo}/resolve/main/e.bin")
    assert status == 200 and downloaded == content


def _wait_for_staging(hub, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not any((hub.storage.root / "tmp").iterdir()):
        assert time.monotonic() < deadline, "the commit never started staging"
        time.sleep(0.01)


def test_a_client_that_disconnects_mid_commit_leaves_nothing_staged(hub, repo):
    before = stored_state(hub, repo)
    body = ndjson(HEADER, file_line("big.bin", random.Random(2).randbytes(2 << 20)))
    with connect(hub.url) as sock:
        sock.sendall(b"POST /api/kernels/" + repo.encode() + b"/commit/main HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer "
                     + TOKEN.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:len(body) // 2])
        _wait_for_staging(hub)
    deadline = time.monotonic() + 10
    while stored_state(hub, repo) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stored_state(hub, repo) == before


# -- 3f. file/folder clashes and ref names -------------------------------------------------------


@pytest.mark.parametrize("operations", [
    [("c2", b"file"), ("c2/d", b"file below it")],
    [("c2/d", b"file below"), ("c2", b"file above")],
    [("c", b"a file where the folder c/ is")],
    [("c/d.txt/e", b"below an existing file")],
], ids=["file-and-folder-in-one-commit", "folder-then-file", "file-over-a-folder", "folder-under-a-file"])
def test_file_folder_clashes_are_400_and_the_branch_stays_downloadable(hub, api, repo, tmp_path, operations):
    before = stored_state(hub, repo)
    with pytest.raises(HfHubHTTPError) as error:
        api.create_commit(repo, repo_type="kernel", commit_message="clash",
                          operations=[add(path, content) for path, content in operations])
    assert error.value.response.status_code == 400 and "both a file and a folder" in str(error.value)
    assert stored_state(hub, repo) == before
    snapshot = Path(api.snapshot_download(repo, repo_type="kernel", cache_dir=tmp_path / "cache"))
    assert (snapshot / "c" / "d.txt").read_bytes() == b"d"


def test_replacing_a_folder_by_a_file_in_one_commit_is_fine(api, repo):
    from huggingface_hub import CommitOperationDelete

    api.create_commit(repo, repo_type="kernel", commit_message="folder to file",
                      operations=[CommitOperationDelete("c/"), add("c", b"now a file")])
    assert set(api.list_repo_files(repo, repo_type="kernel")) == {"README.md", "c"}


BAD_REF_NAMES = ["a/./b", "a/.hidden", ".hidden", "a/b.lock", "x.lock", "a..b", "a//b", "a/", "/a", "a.", "-a",
                 "HEAD", "refs/heads/x", "0123456789abcdef0123456789abcdef01234567", "a b", "a~1", "a^", "a:b",
                 "a?", "a*", "a[1]", "a\\b", "a@{1}", "@", "x" * 256, "é"]


@pytest.mark.parametrize("name", BAD_REF_NAMES)
def test_non_canonical_ref_names_are_400_and_refs_stay_unchanged(hub, repo, name):
    before = stored_state(hub, repo)
    for path in (f"/api/kernels/{repo}/branch/{quote(name, safe='')}", f"/api/kernels/{repo}/tag/main"):
        status, _, body = http("POST", hub.url + path, json.dumps({"tag": name}).encode(), token=TOKEN)
        assert status == 400 and b"Invalid branch or tag name" in body, (path, body)
    assert stored_state(hub, repo) == before


def test_canonical_ref_names_work_and_git_refuses_a_ref_below_another(api, repo):
    for name in ("v1", "release/1.0", "feature-x_y.z"):
        api.create_branch(repo, repo_type="kernel", branch=name)
    api.create_tag(repo, repo_type="kernel", tag="r/1")
    for branch in ("v1/x", "release"):
        with pytest.raises(HfHubHTTPError) as error:
            api.create_branch(repo, repo_type="kernel", branch=branch)
        assert error.value.response.status_code == 409
    refs = api.list_repo_refs(repo, repo_type="kernel")
    assert {b.name for b in refs.branches} == {"main", "v1", "release/1.0", "feature-x_y.z"}


# -- 3g. private repos ---------------------------------------------------------------------------


def test_a_private_repo_is_invisible_without_the_token(hub, api, tmp_path):
    api.create_repo("secret-org/k", repo_type="kernel", private=True)
    api.create_commit("secret-org/k", repo_type="kernel", commit_message="c", operations=[add("a.txt", b"secret")])
    assert api.repo_info("secret-org/k", repo_type="kernel").private is True
    assert {"type": "org", "name": "secret-org", "fullname": "secret-org"} in api.whoami()["orgs"]
    path = api.hf_hub_download("secret-org/k", "a.txt", repo_type="kernel", cache_dir=tmp_path / "c1")
    assert Path(path).read_bytes() == b"secret"

    for token in (False, "wrong-token"):
        anonymous = HfApi(endpoint=hub.url, token=token)
        for read in (
            lambda: anonymous.repo_info("secret-org/k", repo_type="kernel"),
            lambda: anonymous.list_repo_files("secret-org/k", repo_type="kernel"),
            lambda: anonymous.list_repo_refs("secret-org/k", repo_type="kernel"),
            lambda: anonymous.hf_hub_download("secret-org/k", "a.txt", repo_type="kernel", cache_dir=tmp_path / "c2"),
        ):
            with pytest.raises(RepositoryNotFoundError):
                read()
    for url in (f"{hub.url}/kernels/secret-org/k/resolve/main/a.txt", f"{hub.url}/api/organizations/secret-org/overview"):
        assert http("GET", url)[0] == 404
    assert http("GET", f"{hub.url}/api/organizations/secret-org/overview", token=TOKEN)[0] == 200


def test_public_repos_say_so_and_the_legacy_private_field_works(hub, api):
    api.create_repo("org/public", repo_type="kernel")
    api.create_repo("org/public-too", repo_type="kernel", private=False)
    assert api.repo_info("org/public", repo_type="kernel").private is False
    assert HfApi(endpoint=hub.url, token=False).repo_info("org/public-too", repo_type="kernel").private is False
    status, _, _ = http("POST", f"{hub.url}/api/repos/create", token=TOKEN,
                        body=json.dumps({"name": "legacy", "organization": "org", "type": "kernel", "private": True}).encode())
    assert status == 200 and api.repo_info("org/legacy", repo_type="kernel").private is True
    assert http("GET", f"{hub.url}/api/kernels/org/legacy")[0] == 404


# -- durability under the new stack --------------------------------------------------------------


def test_concurrent_commits_beyond_the_upload_slots_all_land(tmp_path):
    with start_hub(tmp_path / "hub", token=TOKEN, limits=Limits(max_concurrent_commits=1)) as hub:
        api = HfApi(endpoint=hub.url, token=TOKEN)
        api.create_repo(REPO, repo_type="kernel")

        def upload(index: int) -> None:
            HfApi(endpoint=hub.url, token=TOKEN).create_commit(
                REPO, repo_type="kernel", commit_message=f"u{index}",
                operations=[add(f"u/{index}.bin", random.Random(index).randbytes(300_000))])

        assert run_concurrently(upload, 5) == []
        assert {f"u/{index}.bin" for index in range(5)} <= set(api.list_repo_files(REPO, repo_type="kernel"))
        assert not any((hub.storage.root / "tmp").iterdir())


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 64, 4096])
def test_the_commit_reader_gives_what_json_loads_gives_however_the_body_is_split(tmp_path, piece):
    from tpu_kernels.distribution.hub.commit_payload import read_commit_payload
    from tpu_kernels.distribution.hub.storage import Storage

    content = random.Random(piece).randbytes(3000)
    encoded = base64.b64encode(content).decode()
    lines = [
        b'{"value": {"summary": "say \\"hi\\"\\n\\u00e9\\ud83d\\ude00", "description": null, "extra": [1, -2.5e3, true,'
        b' {"k": []}]}, "key": "header"}',
        b'  {"key":"file","value":{"content":"' + encoded.replace("/", "\\/").encode() + b'","path":"d\\u00e9/\\u0041.bin"}}\t',
        b"",
        b'{"key": "deletedFolder", "value": {"path": "old/"}}',
    ]
    body = b"\r\n".join(lines) + b"\n"
    storage = Storage(tmp_path / "hub")
    try:
        pieces = iter([body[start:start + piece] for start in range(0, len(body), piece)])
        payload = read_commit_payload(lambda: next(pieces, b""), storage.blob_store)
        assert payload.summary == 'say "hi"\né\U0001f600' and payload.description == ""
        [added] = payload.additions
        assert added.path == "dé/A.bin" and added.staged_at.read_bytes() == content
        assert added.entry.sha256 == hashlib.sha256(content).hexdigest() and added.entry.size == len(content)
        assert added.entry.git_oid == hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
        assert [(d.path, d.is_folder) for d in payload.deletions] == [("old", True)]
    finally:
        storage.close()
