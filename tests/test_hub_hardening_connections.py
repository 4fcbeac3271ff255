"""The local Hub's connections under hostile clients: idle, half-sent and stalled requests cut by the
timeouts, connections past the cap turned away, malformed Content-Length and oversized bodies refused,
anonymous endpoints bounded, and commit bodies streamed to disk.

A real server on loopback with small timeouts (hub_support.FAST); raw sockets send what no
well-behaved client would. Memory is measured on a server process (its peak RSS), not assumed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import selectors
import socket
import subprocess
import sys
import time

import pytest
from huggingface_hub import HfApi

from tpu_kernels.distribution.hub import Limits, start_hub

from .hub_support import (FAST, HEADER, REPO, REPO_ROOT, TOKEN, add, address, connect, http, module_hub, ndjson,
                          peak_rss_kib, read_until_closed, status_of, stored_state)

pytestmark = pytest.mark.usefixtures("local_agent_registry")


hub = module_hub(TOKEN, FAST)


def _readable(sock: socket.socket, timeout: float) -> bool:
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_READ)
        return bool(selector.select(timeout))


def exchange(url: str, raw_request: bytes) -> bytes:
    """Send raw bytes, read the whole answer (the server closes, or the read times out)."""
    with connect(url) as sock:
        sock.sendall(raw_request)
        return read_until_closed(sock)[0]


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
        baseline = peak_rss_kib(process.pid)
        status, answer, sha256 = _stream_commit(url, "big.bin", 256 << 20, seed=2)
        growth_mib = (peak_rss_kib(process.pid) - baseline) / 1024
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
