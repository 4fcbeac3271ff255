"""The local Hub against slow clients and hostile framing: a body dripped to dodge the stall limit, or a
client that does not read its responses, loses its connection and slot, while one that keeps up the
minimum rate is served; large bodies wait on disk; a route that takes no body answers without reading
one; the header cap holds however the bytes arrive; Content-Length with Transfer-Encoding is refused;
a Host name the server does not answer to is a 400; every GET route answers HEAD; and huggingface_hub's
own traffic meets none of the default bounds.

A real server on loopback with small timeouts and pace limits (hub_support.PACED), raw sockets for
what no client would send; memory is measured on a server process.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest
from huggingface_hub import HfApi

from tpu_kernels.distribution.hub import Limits, start_hub

from .hub_support import PACED, REPO_ROOT, TOKEN, add, connect, http, module_hub, peak_rss_kib, status_of, stored_state

pytestmark = pytest.mark.usefixtures("local_agent_registry")


hub = module_hub(TOKEN, PACED)


def answers(sock: socket.socket, timeout: float = 5) -> tuple[bytes, bool]:
    """What the server sends within `timeout`, and whether it closed the connection by then."""
    sock.settimeout(timeout)
    received = b""
    try:
        while chunk := sock.recv(1 << 20):
            received += chunk
    except TimeoutError:
        return received, False
    except ConnectionResetError:
        pass
    return received, True


def statuses(received: bytes) -> list[int]:
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", received)]


# -- 6. slow clients hold no slot ------------------------------------------------------------------


def _drip_until_answered(url: str, head: bytes, interval: float, give_up: float) -> tuple[int | None, float]:
    """Send `head`, then one body byte per `interval`: (the status answered, seconds it took); None if no
    answer within `give_up` seconds."""
    with connect(url) as sock:
        sock.sendall(head)
        start = time.monotonic()
        while time.monotonic() - start < give_up:
            try:
                sock.sendall(b"a")
            except (BrokenPipeError, ConnectionResetError):
                break
            sock.settimeout(interval)
            try:
                first = sock.recv(65536)
            except TimeoutError:
                continue
            received, _ = answers(sock)
            return (status_of(first + received) if first else None), time.monotonic() - start
        return None, time.monotonic() - start


@pytest.mark.parametrize("route, authorized, start", [
    ("/api/kernels/{repo}/paths-info/main", False, b"paths="),
    ("/api/repos/create", True, b'{"name": "'),
    ("/api/kernels/{repo}/commit/main", True, b'{"key": "header", "value": {"summary": "'),
], ids=["anonymous-form", "json", "streamed-commit"])
def test_a_body_dripped_to_dodge_the_stall_limit_is_cut_within_a_second_of_its_deadline(hub, repo, route,
                                                                                         authorized, start):
    before = stored_state(hub, repo)
    head = (f"POST {route.format(repo=repo)} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5000\r\n"
            + (f"Authorization: Bearer {TOKEN}\r\n" if authorized else "") + "\r\n").encode() + start
    # One byte every 0.2 s: the body never stalls for the 0.5 s body_timeout, but averages 5 bytes/s.
    status, seconds = _drip_until_answered(hub.url, head, interval=0.2, give_up=PACED.body_timeout + 5)
    assert status == 408, f"answered {status} after {seconds:.1f} s"
    assert seconds < PACED.body_timeout + 1
    assert stored_state(hub, repo) == before


def test_a_body_that_keeps_up_the_minimum_rate_is_not_cut(tmp_path):
    limits = Limits(body_timeout=0.5, min_rate=4 << 10)
    with start_hub(tmp_path / "hub", token=TOKEN, limits=limits) as hub:
        HfApi(endpoint=hub.url, token=TOKEN).create_repo("org/k", repo_type="kernel")
        body = ("paths=" + "&paths=".join(f"f{index:04d}" for index in range(2700))).encode()[:16 << 10]
        with connect(hub.url) as sock:
            sock.sendall(b"POST /api/kernels/org/k/paths-info/main HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
                         b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: %d\r\n\r\n" % len(body))
            start = time.monotonic()
            for offset in range(0, len(body), 1024):  # 8 KiB/s, twice the minimum, for 2 s: 4x the grace
                sock.sendall(body[offset:offset + 1024])
                time.sleep(0.125)
            received, _ = answers(sock, timeout=5)
        assert status_of(received) == 200 and time.monotonic() - start > 1.5


def _download_request(repo_id: str, path: str) -> bytes:
    return f"GET /kernels/{repo_id}/resolve/main/{path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode()


@pytest.mark.slow
@pytest.mark.parametrize("reader", ["never-reads-a-download", "never-reads-pipelined-responses", "trickles"])
def test_a_client_that_does_not_read_its_responses_loses_its_connection_and_slot(tmp_path, reader):
    limits = Limits(header_timeout=0.5, idle_timeout=0.5, send_timeout=0.5, min_rate=4 << 20, max_connections=4)
    size = 16 << 20
    with start_hub(tmp_path / "hub", token=TOKEN, limits=limits) as hub:
        api = HfApi(endpoint=hub.url, token=TOKEN)
        api.create_repo("org/k", repo_type="kernel")
        api.create_commit("org/k", repo_type="kernel", commit_message="big",
                          operations=[add("big.bin", os.urandom(size)), add("part.bin", os.urandom(256 << 10))])
        request = (_download_request("org/k", "part.bin") * 64 if reader == "never-reads-pipelined-responses"
                   else _download_request("org/k", "big.bin"))
        clients = [connect(hub.url, receive_buffer=4096) for _ in range(limits.max_connections)]
        for sock in clients:
            sock.sendall(request)
        start = time.monotonic()
        while time.monotonic() - start < limits.send_timeout + 2:
            if reader == "trickles":  # 1 KiB per 0.1 s: 10 KiB/s, far below the minimum rate
                for sock in clients:
                    sock.settimeout(0.01)
                    with contextlib.suppress(TimeoutError, ConnectionResetError):
                        sock.recv(1024)
            time.sleep(0.1)
        # Every slot is free again: a new client is served.
        assert http("GET", f"{hub.url}/api/agent-harnesses")[0] == 200
        for sock in clients:
            received, closed = answers(sock, timeout=2)
            assert closed and len(received) < size
            sock.close()


@pytest.mark.slow
def test_a_response_read_at_the_minimum_rate_completes(tmp_path):
    limits = Limits(send_timeout=0.5, min_rate=256 << 10)
    content = os.urandom(2 << 20)
    with start_hub(tmp_path / "hub", token=TOKEN, limits=limits) as hub:
        api = HfApi(endpoint=hub.url, token=TOKEN)
        api.create_repo("org/k", repo_type="kernel")
        api.create_commit("org/k", repo_type="kernel", commit_message="big", operations=[add("big.bin", content)])
        with connect(hub.url, receive_buffer=4096) as sock:
            sock.sendall(_download_request("org/k", "big.bin"))
            received = bytearray()
            while not received.endswith(content[-1000:]):  # 64 KiB per 0.1 s: 640 KiB/s, 2.5x the minimum
                sock.settimeout(5)
                chunk = sock.recv(64 << 10)
                assert chunk, f"cut after {len(received)} bytes"
                received += chunk
                time.sleep(0.1 * len(chunk) / (64 << 10))
        assert received.split(b"\r\n\r\n", 1)[1] == content


CONNECTIONS = 64


@pytest.mark.multiprocess
@pytest.mark.slow
def test_64_connections_with_4_mib_bodies_add_under_100_mib(tmp_path):
    """Bodies past 64 KiB wait on disk; what is parsed at once is bounded (Limits.max_large_bodies). The 256 MiB
    the connections hold would be past the bound in memory, before any parsing."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tpu_kernels.distribution.hub", "--root", str(tmp_path / "hub"), "--port", "0", "--quiet"],
        env=dict(os.environ, TPU_KERNELS_HUB_TOKEN=TOKEN), cwd=REPO_ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    size = 4 << 20
    item = b"paths=" + b"d/" * 500 + b"f.txt&"
    body = (item * (size // len(item) + 1))[:size]
    held = []
    try:
        url = process.stdout.readline().split(" at ")[1].strip()
        created = json.dumps({"name": "k", "organization": "org", "type": "kernel"}).encode()
        assert http("POST", f"{url}/api/repos/create", created, token=TOKEN)[0] == 200
        assert http("POST", f"{url}/api/kernels/org/k/paths-info/main", b"paths=a")[0] == 200
        baseline = peak_rss_kib(process.pid)
        for _ in range(CONNECTIONS):
            sock = connect(url)
            sock.settimeout(60)
            sock.sendall(b"POST /api/kernels/org/k/paths-info/main HTTP/1.1\r\nHost: localhost\r\n"
                         b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: %d\r\n\r\n" % size
                         + body[:-1])
            held.append(sock)
        for sock in held:
            sock.sendall(body[-1:])
        answered = collections.Counter(status_of(answers(sock, timeout=120)[0]) for sock in held)
        growth_mib = (peak_rss_kib(process.pid) - baseline) / 1024
    finally:
        for sock in held:
            sock.close()
        process.terminate()
        process.wait(timeout=30)
    assert answered == {200: CONNECTIONS}
    assert growth_mib < 100, f"peak RSS grew by {growth_mib:.0f} MiB"


def test_bodies_past_the_memory_part_read_back_exactly(hub, api, repo):
    paths = [f"c/{'x' * 200}-{index}" for index in range(1000)] + ["c/d.txt", "c"]
    body = "&".join(f"paths={quote(path)}" for path in paths).encode()
    assert len(body) > 200 << 10
    status, _, answer = http("POST", f"{hub.url}/api/kernels/{repo}/paths-info/main", body,
                             headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 200 and [item["path"] for item in json.loads(answer)] == ["c/d.txt", "c"]
    description = "é" * (100 << 10)
    api.create_branch(repo, repo_type="kernel", branch="padded")
    status, _, _ = http("POST", f"{hub.url}/api/kernels/{repo}/tag/padded", token=TOKEN,
                        body=json.dumps({"tag": "t-padded", "padding": description}).encode())
    assert status == 200 and "t-padded" in {tag.name for tag in api.list_repo_refs(repo, repo_type="kernel").tags}
    assert not any((hub.storage.root / "tmp").iterdir())


@pytest.mark.parametrize("method, path, authorized, expected", [
    ("GET", "/api/kernels/{repo}/refs", False, 200),
    ("HEAD", "/kernels/{repo}/resolve/main/c/d.txt", False, 200),
    ("GET", "/kernels/{repo}", False, 200),
    ("GET", "/api/whoami-v2", True, 200),
    ("DELETE", "/api/kernels/{repo}/branch/nope", True, 404),
    ("POST", "/api/kernels/{repo}/discussions", False, 400),
    ("PATCH", "/api/nothing-here", False, 400),
], ids=lambda value: value if isinstance(value, str) else None)
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_route_that_takes_no_body_answers_at_once_without_reading_it_and_closes(hub, repo, method, path,
                                                                                 authorized, expected, framing):
    length = f"Content-Length: {4 << 20}" if framing == "content-length" else "Transfer-Encoding: chunked"
    head = (f"{method} {path.format(repo=repo)} HTTP/1.1\r\nHost: localhost\r\n{length}\r\n"
            + (f"Authorization: Bearer {TOKEN}\r\n" if authorized else "") + "\r\n").encode()
    with connect(hub.url) as sock:
        sock.sendall(head + (b"x" * 1024 if framing == "content-length" else b"400000\r\n" + b"x" * 1024))
        start = time.monotonic()
        received, closed = answers(sock, timeout=5)
    assert statuses(received) == [expected] and closed
    assert time.monotonic() - start < PACED.body_timeout  # not read: no wait for the rest of the body


# -- 10. the header cap, however the bytes arrive --------------------------------------------------


@pytest.mark.parametrize("headers", [
    "X-Pad: " + "a" * (40 << 10) + "\r\n",
    "".join(f"X-Pad-{index}: {'a' * 30}\r\n" for index in range(1100)),
    "Cookie: " + "; ".join(f"c{index}=v" for index in range(6000)) + "\r\n",
], ids=["one-header", "many-headers", "long-cookie"])
def test_headers_past_the_cap_sent_in_one_write_are_431(hub, headers):
    request = f"GET /api/agent-harnesses HTTP/1.1\r\nHost: localhost\r\n{headers}\r\n".encode()
    assert len(request) > PACED.max_header_bytes
    with connect(hub.url) as sock:
        sock.sendall(request)
        received, closed = answers(sock)
    assert statuses(received) in ([400], [431]) and closed


def test_a_long_target_sent_in_one_write_is_431_and_one_under_the_cap_is_fine(hub):
    for length, expected in ((40 << 10, ([400], [431])), (30 << 10, ([200],))):
        request = f"GET /api/agent-harnesses?x={'a' * length} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode()
        with connect(hub.url) as sock:
            sock.sendall(request)
            received, _ = answers(sock, timeout=2)
        assert statuses(received) in expected


def test_a_pipelined_request_past_the_cap_is_431_after_the_one_before_it(hub):
    good = b"GET /api/agent-harnesses HTTP/1.1\r\nHost: localhost\r\n\r\n"
    big = b"GET /api/agent-harnesses HTTP/1.1\r\nHost: localhost\r\nX-Pad: " + b"a" * (40 << 10) + b"\r\n\r\n"
    with connect(hub.url) as sock:
        sock.sendall(good + big + good)
        received, closed = answers(sock)
    assert statuses(received) in ([200, 400], [200, 431]) and closed


# -- 11. Content-Length with Transfer-Encoding -----------------------------------------------------


@pytest.mark.parametrize("framing", [
    "Content-Length: 11\r\nTransfer-Encoding: chunked",
    "Transfer-Encoding: chunked\r\nContent-Length: 11",
    "content-length: 0\r\nTRANSFER-ENCODING: chunked",
    "Content-Length: 11\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked",
])
@pytest.mark.parametrize("method, path, authorized", [
    ("POST", "/api/kernels/{repo}/paths-info/main", False),
    ("POST", "/api/kernels/{repo}/commit/main", True),
    ("GET", "/api/kernels/{repo}/refs", False),
], ids=["anonymous-post", "commit", "get"])
def test_content_length_with_transfer_encoding_is_400_and_the_connection_closes(hub, repo, framing, method, path,
                                                                               authorized):
    smuggled = b"GET /api/agent-harnesses HTTP/1.1\r\nHost: localhost\r\n\r\n"
    request = (f"{method} {path.format(repo=repo)} HTTP/1.1\r\nHost: localhost\r\n{framing}\r\n"
               + (f"Authorization: Bearer {TOKEN}\r\n" if authorized else "") + "\r\n").encode()
    with connect(hub.url) as sock:
        sock.sendall(request + b"7\r\npaths=a\r\n0\r\n\r\n" + smuggled)
        received, closed = answers(sock)
    assert statuses(received) in ([400], [501]) and closed, received[:300]


# -- 13. Host names, HEAD on every GET route -------------------------------------------------------


@pytest.mark.parametrize("host", ["evil.example", "evil.example:80", "localhost.evil.example", "127.0.0.1.nip.io",
                                  "", "a@127.0.0.1", "[::1", "localhost:http", "127.0.0.1/x"])
@pytest.mark.parametrize("path", ["/", "/kernels/{repo}", "/api/kernels/{repo}/refs", "/kernels/{repo}/resolve/main/c/d.txt"])
def test_a_host_this_server_does_not_answer_to_is_400(hub, repo, host, path):
    status, _, body = http("GET", hub.url + path.format(repo=repo), headers={"Host": host})
    assert status == 400 and b"Host" in body


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:1234", "127.0.0.1", "127.0.0.1:80", "[::1]:8765",
                                  "10.1.2.3", "[fe80::1]"])
def test_ip_addresses_and_loopback_names_are_served(hub, repo, host):
    assert http("GET", f"{hub.url}/api/kernels/{repo}/refs", headers={"Host": host})[0] == 200


def test_allowed_host_names_are_configurable(tmp_path):
    with start_hub(tmp_path / "a", allowed_hosts=["hub.internal"]) as hub:
        assert http("GET", f"{hub.url}/", headers={"Host": "hub.internal:8765"})[0] == 200
        assert http("GET", f"{hub.url}/", headers={"Host": "other.internal"})[0] == 400
    with start_hub(tmp_path / "b", allowed_hosts=["*"]) as hub:
        assert http("GET", f"{hub.url}/", headers={"Host": "anything.example"})[0] == 200


@pytest.mark.multiprocess
def test_serve_takes_the_new_limits_and_host_names_from_its_command_line(tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-m", "tpu_kernels.distribution.hub", "--root", str(tmp_path / "hub"), "--port", "0", "--quiet",
         "--allowed-host", "hub.internal", "--send-timeout", "5", "--min-rate", "1000"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        url = process.stdout.readline().split(" at ")[1].strip()
        assert http("GET", f"{url}/", headers={"Host": "hub.internal"})[0] == 200
        assert http("GET", f"{url}/", headers={"Host": "evil.example"})[0] == 400
    finally:
        process.terminate()
        process.wait(timeout=30)
    bad = subprocess.run([sys.executable, "-m", "tpu_kernels.distribution.hub", "--root", str(tmp_path / "hub"), "--min-rate", "0"],
                         cwd=REPO_ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "min_rate must be positive" in bad.stderr


@pytest.mark.parametrize("path, authorized", [
    ("/api/whoami-v2", True), ("/api/whoami-v2", False), ("/api/agent-harnesses", False),
    ("/api/organizations/org/overview", False), ("/api/kernels/{repo}/auth-check", False),
    ("/api/kernels/{repo}/auth-check/write", True), ("/api/kernels/{repo}", False), ("/api/kernels/{repo}/refs", False),
    ("/api/kernels/{repo}/tree/main", False), ("/api/kernels/{repo}/commits/main", False), ("/api/kernels", False),
    ("/kernels/{repo}/resolve/main/c/d.txt", False), ("/api/tpu-kernels/stats", False),
])
def test_every_get_route_answers_head_as_its_get_does(hub, repo, path, authorized):
    url = hub.url + path.format(repo=repo)
    token = TOKEN if authorized else None
    got, _, _ = http("GET", url, token=token)
    status, _, body = http("HEAD", url, token=token)
    assert status == got and status in (200, 401) and body == b""


def test_existing_hf_clients_still_work_with_the_default_bounds(tmp_path):
    """What huggingface_hub does in one session (keep-alive, 8 download threads, hundreds of requests)
    meets none of the default limits. Not on this module's hub: its half-second timeouts are shorter
    than a download thread can wait for the GIL on a loaded 2-core machine, and huggingface_hub does
    not retry a download whose connection the server closed."""
    with start_hub(tmp_path / "hub", token=TOKEN) as hub:
        api = HfApi(endpoint=hub.url, token=TOKEN)
        repo = api.create_repo("org/many", repo_type="kernel").repo_id
        api.upload_folder(repo_id=repo, repo_type="kernel", folder_path=_folder(tmp_path / "up", 300),
                          path_in_repo="many")
        snapshot = Path(api.snapshot_download(repo, repo_type="kernel", cache_dir=tmp_path / "cache"))
    assert len(list((snapshot / "many").rglob("*.txt"))) == 300
    assert (snapshot / "many" / "f0" / "0.txt").read_bytes() == b"0" * 1000


def _folder(folder: Path, count: int) -> Path:
    for index in range(count):
        path = folder / f"f{index % 30}" / f"{index}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(str(index).encode() * 1000)
    return folder
