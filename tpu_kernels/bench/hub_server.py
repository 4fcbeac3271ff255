"""The local Hub server under hostile input and faults: the figures of issues 11 and 21, measured.

Each case runs against `python -m tpu_kernels.distribution.hub` in its own process on loopback,
with the server's default limits as deployed, unless the case names a flag.

Issue 11 (`--issue 11`):

    empty_token      TPU_KERNELS_HUB_TOKEN= : the banner's access line; an anonymous repo creation
    connections      620 connections (half idle, half with half-sent headers): open after 15 s,
                     server threads; a GET meanwhile (503 beyond the connection cap) and after
    short_body       Content-Length 100 with a 10-byte body: seconds until answered (40 s cap)
    parsing          malformed and conflicting Content-Length: status, or "dropped"; tracebacks logged
    validate_yaml    anonymous 0.4 MB README: status, server CPU seconds, peak RSS growth
    commit_memory    one-file commits of 64 and 256 MiB: server peak RSS (VmHWM) growth over an
                     8 MiB warm-up commit, upload rate
    malformed        malformed commit lines and a huge cursor: statuses
    clash            one commit adding `c` and `c/d`: status; does a snapshot hold every file of the branch
    ref_names        branches `a/./b`, `a/.hidden`: statuses
    private          create_repo(private=True), then an anonymous repo_info: status
    latency          1000 GETs of /refs on one kept-alive connection: median and p99 ms;
                     a 64 MiB download: MiB/s

Issue 21 (`--issue 21`; found item numbers in brackets):

    slow_body        [6] an anonymous body dripped at 1 byte per 1.5 s, --body-timeout 2: seconds
                     until the server cuts it (30 s cap)
    slots            [6] --max-connections 8: 8 clients that never read a 40 MiB download, then 8
                     that drip bodies; seconds until a new client is served again (30 s cap each)
    body_memory      [6] 256 connections each sending a 4 MiB anonymous body (all but its last byte,
                     then the rest): server RSS growth while held, peak growth after
    response_memory  [6] 250 clients that never read a 40 MiB download: server RSS growth after 3 s
    get_body         [6] a GET announcing a 4 MiB body and sending 1 KiB, --body-timeout 2: status,
                     seconds until answered
    tree_listing     [7] 8,000 and 25,000 one-file folders: seconds for the first page of the
                     listing and of the recursive listing, and for the whole recursive walk (as
                     snapshot_download does; stopped after 120 s)
    dot_git          [8] commits of paths that are `.git` on some file system: statuses
    orphans          [9] lone surrogates, a path given twice: statuses, blobs no commit references;
                     the same after a restart with one more planted orphan
    headers          [10] a 40 KiB and a 200 KiB header block, each in one write: status
    smuggling        [11] Content-Length with Transfer-Encoding, a request pipelined behind:
                     answers, connection closed or not
    card             [12] a 512 KiB card of `![`: server CPU seconds for two GETs of the page, a HEAD
    smaller          [13] Host: evil.example (DNS rebinding); RTL-override, control-character, NFC/NFD
                     and case-twin names; HEAD on whoami: statuses
    latency          as above: what the new bounds cost a well-behaved client

`--code DIR --label before` runs a group against the package in DIR (e.g. an export of
another commit: `git archive <commit> tpu_kernels | tar -x -C DIR`; by default the folder
holding the tpu_kernels package this runs from); results merge into
benchmarks/results/hub_server.json (relative to the current directory; `--out`) under the
issue and the label.

Usage:
    tpu-kernels bench hub_server --issue 21 [--code DIR --label before]
    (or python -m tpu_kernels.bench.hub_server ...)
"""

from __future__ import annotations

import argparse
import base64
import collections
import contextlib
import http.client
import json
import os
import platform
import random
import re
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import tpu_kernels
from tpu_kernels.bench import result_path

# The folder holding the tpu_kernels package this runs from (a checkout or site-packages): the default --code.
PACKAGE_PARENT = Path(tpu_kernels.__file__).resolve().parents[1]
DEFAULT_OUT = result_path("hub_server.json")
TOKEN = "bench-token"
REPO = "org/k"


# -- a server process ----------------------------------------------------------------------------


class Server:
    def __init__(self, code: Path, root: Path, token: str | None = TOKEN, flags: tuple[str, ...] = ()):
        env = {key: value for key, value in os.environ.items() if key != "TPU_KERNELS_HUB_TOKEN"}
        env["PYTHONPATH"] = str(code)
        if token is not None:
            env["TPU_KERNELS_HUB_TOKEN"] = token
        self.stderr_path = root.parent / f"{root.name}.stderr"
        self._stderr = open(self.stderr_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tpu_kernels.distribution.hub", "--root", str(root), "--port", "0", "--quiet", *flags],
            env=env, cwd=code, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
        )
        self.banner = [self.process.stdout.readline().strip(), self.process.stdout.readline().strip()]
        self.url = self.banner[0].split(" at ")[1]
        self.host, self.port = urlsplit(self.url).hostname, urlsplit(self.url).port

    def status(self, field: str) -> int:
        return int(re.search(rf"{field}:\s+(\d+)", Path(f"/proc/{self.process.pid}/status").read_text()).group(1))

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def tracebacks(self) -> int:
        return self.stderr_path.read_text().count("Traceback")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._stderr.close()


@contextmanager
def server(code: Path, work: Path, name: str, token: str | None = TOKEN, flags: tuple[str, ...] = ()):
    running = Server(code, work / name, token, flags)
    try:
        yield running
    finally:
        running.stop()


def request(srv: Server, method: str, path: str, body=b"", headers=None, token: str | None = TOKEN, timeout=300):
    connection = http.client.HTTPConnection(srv.host, srv.port, timeout=timeout)
    try:
        sent = dict(headers or {})
        if token:
            sent["Authorization"] = f"Bearer {token}"
        connection.request(method, path, body=body, headers=sent)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def raw(srv: Server, data: bytes, timeout: float = 10) -> str:
    """The status line of the answer to raw bytes, or what happened instead."""
    with socket.create_connection((srv.host, srv.port), timeout=timeout) as sock:
        sock.sendall(data)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            return f"no answer in {timeout} s" if not received else received.split(b"\r\n")[0].decode()
        except ConnectionResetError:
            pass
    return received.split(b"\r\n")[0].decode() if received else "dropped (no answer)"


def create_repo(srv: Server, private: bool = False) -> int:
    payload = {"name": REPO.split("/")[1], "organization": REPO.split("/")[0], "type": "kernel"}
    if private:
        payload["visibility"] = "private"
    return request(srv, "POST", "/api/repos/create", json.dumps(payload).encode())[0]


def commit(srv: Server, lines: list[bytes], token: str | None = TOKEN) -> tuple[int, bytes]:
    return request(srv, "POST", f"/api/kernels/{REPO}/commit/main", b"".join(line + b"\n" for line in lines),
                   {"Content-Type": "application/x-ndjson"}, token)


HEADER = json.dumps({"key": "header", "value": {"summary": "bench"}}).encode()


def file_line(path: str, content: bytes) -> bytes:
    return json.dumps({"key": "file", "value": {"content": base64.b64encode(content).decode(), "path": path,
                                                "encoding": "base64"}}).encode()


# -- cases ---------------------------------------------------------------------------------------


def empty_token(code: Path, work: Path) -> dict:
    with server(code, work, "empty-token", token="") as srv:
        return {"banner_access_line": srv.banner[1], "anonymous_create_repo_status": create_repo(srv)}


def connections(code: Path, work: Path) -> dict:
    with server(code, work, "connections") as srv:
        create_repo(srv)
        threads_before = srv.status("Threads")
        held = []
        for index in range(620):
            sock = socket.create_connection((srv.host, srv.port), timeout=10)
            if index % 2:
                sock.sendall(b"POST /api/repos/create HTTP/1.1\r\nHost: localhost\r\n")
            held.append(sock)
        time.sleep(1)
        threads_held = srv.status("Threads")
        start = time.perf_counter()
        status, _ = request(srv, "GET", f"/api/kernels/{REPO}/refs", timeout=30)
        latency_ms = (time.perf_counter() - start) * 1000
        time.sleep(14)
        still_open = sum(_is_open(sock) for sock in held)
        for sock in held:
            sock.close()
        status_after, _ = request(srv, "GET", f"/api/kernels/{REPO}/refs", timeout=30)
        return {"connections": 620, "still_open_after_15_s": still_open, "server_threads_before": threads_before,
                "server_threads_while_held": threads_held, "get_status_while_held": status,
                "get_ms_while_held": round(latency_ms, 1), "get_status_after_15_s": status_after}


def _is_open(sock: socket.socket) -> bool:
    """Whether the server still holds the connection (whatever it sent before is drained)."""
    sock.setblocking(False)
    try:
        while sock.recv(65536):
            pass
        return False
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False


def short_body(code: Path, work: Path) -> dict:
    with server(code, work, "short-body") as srv:
        create_repo(srv)
        start = time.perf_counter()
        outcome = raw(srv, b"POST /api/kernels/org/k/commit/main HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer "
                      + TOKEN.encode() + b"\r\nContent-Length: 100\r\n\r\n" + HEADER[:10], timeout=40)
        return {"outcome": outcome, "seconds": round(time.perf_counter() - start, 1)}


def parsing(code: Path, work: Path) -> dict:
    cases = {
        "superscript_two": b"Content-Length: \xc2\xb2",
        "5000_digits": b"Content-Length: " + b"9" * 5000,
        "conflicting_duplicates": b"Content-Length: 2\r\nContent-Length: 3",
    }
    results = {}
    with server(code, work, "parsing") as srv:
        for name, header in cases.items():
            results[name] = raw(srv, b"POST /api/repos/create HTTP/1.1\r\nHost: localhost\r\n" + header + b"\r\n\r\n{}")
        time.sleep(0.5)
        results["tracebacks_logged"] = srv.tracebacks()
    return results


def validate_yaml(code: Path, work: Path) -> dict:
    readme = "---\n" + "".join(f"key{i}: [a, b, {{c: d}}]\n" for i in range(20_000)) + "---\n# card\n"
    body = json.dumps({"content": readme}).encode()
    with server(code, work, "validate-yaml") as srv:
        request(srv, "POST", "/api/validate-yaml", b'{"content": "---\\na: 1\\n---\\n"}', token=None)
        rss, cpu, start = srv.status("VmHWM"), srv.cpu_seconds(), time.perf_counter()
        status, _ = request(srv, "POST", "/api/validate-yaml", body, token=None)
        return {"body_bytes": len(body), "anonymous_status": status,
                "wall_seconds": round(time.perf_counter() - start, 3),
                "server_cpu_seconds": round(srv.cpu_seconds() - cpu, 2),
                "server_peak_rss_growth_mib": round((srv.status("VmHWM") - rss) / 1024, 1)}


def _stream_commit(srv: Server, path: str, size: int, seed: int) -> tuple[int, float]:
    prefix = HEADER + b'\n{"key": "file", "value": {"path": "' + path.encode() + b'", "content": "'
    suffix = b'", "encoding": "base64"}}\n'
    generator = random.Random(seed)

    def body():
        yield prefix
        remaining = size
        while remaining:
            piece = generator.randbytes(min(3 << 20, remaining))
            remaining -= len(piece)
            yield base64.b64encode(piece)
        yield suffix

    length = len(prefix) + 4 * ((size + 2) // 3) + len(suffix)
    start = time.perf_counter()
    status, _ = request(srv, "POST", f"/api/kernels/{REPO}/commit/main", body(),
                        {"Content-Type": "application/x-ndjson", "Content-Length": str(length)})
    return status, time.perf_counter() - start


def commit_memory(code: Path, work: Path) -> dict:
    results = {}
    for mib in (64, 256):
        with server(code, work, f"commit-{mib}") as srv:
            create_repo(srv)
            _stream_commit(srv, "warm-up.bin", 8 << 20, seed=1)
            baseline = srv.status("VmHWM")
            status, seconds = _stream_commit(srv, "big.bin", mib << 20, seed=2)
            results[f"{mib}_mib"] = {"status": status,
                                     "server_peak_rss_growth_mib": round((srv.status("VmHWM") - baseline) / 1024, 1),
                                     "upload_mib_per_s": round(mib / seconds, 1)}
    return results


def malformed(code: Path, work: Path) -> dict:
    lines = {
        "value_not_an_object": b'{"key": "file", "value": "c"}',
        "integer_content": b'{"key": "file", "value": {"path": "a", "content": 5}}',
        "invalid_utf8_path": b'{"key": "file", "value": {"path": "a\xff", "content": ""}}',
    }
    with server(code, work, "malformed") as srv:
        create_repo(srv)
        results = {name: commit(srv, [HEADER, line])[0] for name, line in lines.items()}
        results["huge_cursor"] = request(srv, "GET", f"/api/kernels/{REPO}/commits/main?cursor={'9' * 5000}")[0]
    return results


def clash(code: Path, work: Path) -> dict:
    from huggingface_hub import HfApi, snapshot_download

    with server(code, work, "clash") as srv:
        create_repo(srv)
        status, _ = commit(srv, [HEADER, file_line("c", b"file"), file_line("c/d", b"below")])
        branch_files = HfApi(endpoint=srv.url, token=False).list_repo_files(REPO, repo_type="kernel")
        try:
            snapshot = Path(snapshot_download(REPO, repo_type="kernel", endpoint=srv.url,
                                              cache_dir=work / "clash-cache", token=False))
            missing = [path for path in branch_files if not (snapshot / path).is_file()]
            download = f"files missing: {missing}" if missing else "complete"
        except Exception as error:  # the figure: what a client gets
            download = type(error).__name__
    return {"commit_status": status, "branch_files": sorted(branch_files), "snapshot_download": download}


def ref_names(code: Path, work: Path) -> dict:
    with server(code, work, "refs") as srv:
        create_repo(srv)
        return {name: request(srv, "POST", f"/api/kernels/{REPO}/branch/{name.replace('/', '%2F')}", b"{}")[0]
                for name in ("a/./b", "a/.hidden")}


def private(code: Path, work: Path) -> dict:
    with server(code, work, "private") as srv:
        created = create_repo(srv, private=True)
        return {"create_status": created, "anonymous_repo_info_status":
                request(srv, "GET", f"/api/kernels/{REPO}", token=None)[0]}


def latency(code: Path, work: Path) -> dict:
    with server(code, work, "latency") as srv:
        create_repo(srv)
        commit(srv, [HEADER, file_line("w.bin", random.Random(3).randbytes(64 << 20))])
        connection = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
        times = []
        for _ in range(1000):
            start = time.perf_counter()
            connection.request("GET", f"/api/kernels/{REPO}/refs")
            connection.getresponse().read()
            times.append((time.perf_counter() - start) * 1000)
        start = time.perf_counter()
        connection.request("GET", f"/kernels/{REPO}/resolve/main/w.bin")
        size = len(connection.getresponse().read())
        download_seconds = time.perf_counter() - start
        connection.close()
    times.sort()
    return {"refs_get_median_ms": round(statistics.median(times), 3), "refs_get_p99_ms": round(times[989], 3),
            "download_64_mib_mib_per_s": round(size / (1 << 20) / download_seconds, 1)}


# -- issue 21 ------------------------------------------------------------------------------------


def _flags(code: Path, *wanted: str) -> tuple[str, ...]:
    """The `--flag value` pairs of `wanted` that this code's `serve` knows (an older one lacks some)."""
    known = subprocess.run([sys.executable, "-m", "tpu_kernels.distribution.hub", "--help"], env=dict(os.environ, PYTHONPATH=str(code)),
                           cwd=code, capture_output=True, text=True).stdout
    pairs = zip(wanted[::2], wanted[1::2])
    return tuple(part for flag, value in pairs if flag in known for part in (flag, value))


def _connect(srv: Server, timeout: float = 10) -> socket.socket:
    return socket.create_connection((srv.host, srv.port), timeout=timeout)


def _answer(sock: socket.socket, timeout: float) -> tuple[str, bool]:
    """(the first status line received, whether the server closed the connection) within `timeout`."""
    sock.settimeout(timeout)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        return (received.split(b"\r\n")[0].decode() if received else "no answer"), False
    except ConnectionResetError:
        pass
    return (received.split(b"\r\n")[0].decode() if received else "closed, no answer"), True


def _drip(srv: Server, path: str, cap: float) -> tuple[str, float]:
    """An anonymous POST announcing 100 body bytes, sent 1 byte per 1.5 s: (outcome, seconds held)."""
    with _connect(srv) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\n"
                     "Content-Length: 100\r\n\r\n".encode())
        start = time.monotonic()
        while time.monotonic() - start < cap:
            try:
                sock.sendall(b"a")
            except (BrokenPipeError, ConnectionResetError):
                return "closed, no answer", time.monotonic() - start
            if select.select([sock], [], [], 1.5)[0]:
                outcome, _ = _answer(sock, 5)
                return outcome, time.monotonic() - start
        return f"still open at {cap:g} s", time.monotonic() - start


def slow_body(code: Path, work: Path) -> dict:
    with server(code, work, "slow-body", flags=("--body-timeout", "2")) as srv:
        create_repo(srv)
        outcome, held = _drip(srv, f"/api/kernels/{REPO}/paths-info/main", cap=30)
        return {"body_timeout_s": 2, "outcome": outcome, "held_s": round(held, 1)}


def _seconds_until_served(srv: Server, cap: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < cap:
        try:
            if request(srv, "GET", "/api/agent-harnesses", token=None, timeout=2)[0] == 200:
                return round(time.monotonic() - start, 1)
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(0.25)
    return None


def slots(code: Path, work: Path) -> dict:
    flags = ("--max-connections", "8", "--body-timeout", "2") + _flags(code, "--send-timeout", "2")
    results = {"flags": " ".join(flags)}
    with server(code, work, "slots", flags=flags) as srv:
        create_repo(srv)
        _stream_commit(srv, "big.bin", 40 << 20, seed=4)
        readers = []
        for _ in range(8):
            sock = _connect(srv)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(f"GET /kernels/{REPO}/resolve/main/big.bin HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            readers.append(sock)
        time.sleep(0.5)
        results["unread_downloads_free_their_slots_after_s"] = _seconds_until_served(srv, cap=30)
        for sock in readers:
            sock.close()
        time.sleep(0.5)
        drips = []
        for _ in range(8):
            sock = _connect(srv)
            sock.sendall(f"POST /api/kernels/{REPO}/paths-info/main HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         "Content-Length: 100\r\n\r\n".encode())
            drips.append(sock)
        start, served = time.monotonic(), None
        while served is None and time.monotonic() - start < 30:
            for sock in drips:
                with contextlib.suppress(OSError):
                    sock.send(b"a")
            served = _seconds_until_served(srv, cap=1.5)
        results["dripped_bodies_free_their_slots_after_s"] = round(time.monotonic() - start, 1) if served else None
        for sock in drips:
            sock.close()
        results["tracebacks_logged"] = srv.tracebacks()
    return results


def body_memory(code: Path, work: Path) -> dict:
    size = 4 << 20
    item = b"paths=" + b"d/" * 500 + b"f.txt&"
    body = (item * (size // len(item) + 1))[:size]
    with server(code, work, "body-memory") as srv:
        create_repo(srv)
        request(srv, "POST", f"/api/kernels/{REPO}/paths-info/main", b"paths=a", token=None)
        baseline = srv.status("VmRSS")
        held = []
        for _ in range(256):
            sock = _connect(srv, timeout=60)
            sock.sendall(f"POST /api/kernels/{REPO}/paths-info/main HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         f"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {size}\r\n\r\n".encode()
                         + body[:-1])
            held.append(sock)
        time.sleep(2)
        held_growth = (srv.status("VmRSS") - baseline) / 1024
        for sock in held:
            sock.sendall(body[-1:])
        statuses = collections.Counter(_answer(sock, 60)[0] for sock in held)
        for sock in held:
            sock.close()
        return {"connections": 256, "body_mib": 4, "rss_growth_while_held_mib": round(held_growth, 1),
                "peak_rss_growth_mib": round((srv.status("VmHWM") - baseline) / 1024, 1), "answers": dict(statuses)}


def response_memory(code: Path, work: Path) -> dict:
    with server(code, work, "response-memory") as srv:
        create_repo(srv)
        _stream_commit(srv, "big.bin", 40 << 20, seed=5)
        request(srv, "GET", f"/kernels/{REPO}/resolve/main/big.bin")
        baseline = srv.status("VmRSS")
        clients = []
        for _ in range(250):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((srv.host, srv.port))
            sock.sendall(f"GET /kernels/{REPO}/resolve/main/big.bin HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            clients.append(sock)
        time.sleep(3)
        growth = (srv.status("VmRSS") - baseline) / 1024
        for sock in clients:
            sock.close()
        return {"clients": 250, "rss_growth_mib": round(growth, 1)}


def get_body(code: Path, work: Path) -> dict:
    with server(code, work, "get-body", flags=("--body-timeout", "2")) as srv:
        create_repo(srv)
        with _connect(srv) as sock:
            start = time.monotonic()
            sock.sendall(f"GET /api/kernels/{REPO}/refs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {4 << 20}\r\n\r\n"
                         .encode() + b"x" * 1024)
            outcome, closed = _answer(sock, 30)
        return {"outcome": outcome, "seconds": round(time.monotonic() - start, 1), "closed": closed}


def _tree_pages(srv: Server, path: str, cap: float) -> dict:
    """Follow the listing's Link headers: pages, seconds for the first and for all (None past `cap`)."""
    start, pages, first = time.perf_counter(), 0, None
    url = path
    while url:
        connection = http.client.HTTPConnection(srv.host, srv.port, timeout=600)
        connection.request("GET", url)
        response = connection.getresponse()
        response.read()
        link = response.getheader("Link")
        connection.close()
        pages += 1
        if first is None:
            first = time.perf_counter() - start
        if time.perf_counter() - start > cap:
            return {"first_page_s": round(first, 2), "walk_s": None, "pages_in_cap": pages}
        url = urlsplit(link.split(">")[0][1:])._replace(scheme="", netloc="").geturl() if link else None
    return {"first_page_s": round(first, 2), "walk_s": round(time.perf_counter() - start, 2), "pages": pages}


def tree_listing(code: Path, work: Path) -> dict:
    results = {}
    for folders in (8000, 25_000):
        with server(code, work, f"tree-{folders}") as srv:
            create_repo(srv)
            lines = [HEADER] + [file_line(f"d{index:05d}/f.txt", b"%d" % index) for index in range(folders)]
            status, _ = commit(srv, lines)
            assert status == 200, status
            root = _tree_pages(srv, f"/api/kernels/{REPO}/tree/main", cap=0)
            walk = _tree_pages(srv, f"/api/kernels/{REPO}/tree/main?recursive=true", cap=120)
            results[f"{folders}_folders"] = {"page_s": root["first_page_s"], "recursive_page_s": walk["first_page_s"],
                                             "recursive_walk_s": walk["walk_s"],
                                             **({"walk_pages_in_120_s": walk["pages_in_cap"]} if walk["walk_s"] is None
                                                else {"walk_pages": walk["pages"]})}
    return results


def _orphan_blobs(root: Path) -> int:
    referenced = {entry["sha256"] for commit_file in root.glob("repos/*/*/*/commits/*.json")
                  for entry in json.loads(commit_file.read_bytes())["files"].values()}
    return sum(1 for blob in root.glob("blobs/*/*") if blob.name not in referenced)


DOT_GIT_PATHS = {
    ".GIT/config": ".GIT/config", "a/.gIt/config": "a/.gIt/config", ".git./config": ".git./config",
    ".git_space/config": ".git /config", ".git..._/config": ".git.. /config", "GIT~1/config": "GIT~1/config",
    "git~1/hooks/x": "git~1/hooks/x", ".g_zwnj_it/config": ".g\u200cit/config", ".git::$INDEX_ALLOCATION/config":
    ".git::$INDEX_ALLOCATION/config",
}


def dot_git(code: Path, work: Path) -> dict:
    with server(code, work, "dot-git") as srv:
        create_repo(srv)
        return {name: commit(srv, [HEADER, file_line(path, b"[core]\n\tfsmonitor = touch /tmp/pwned\n")])[0]
                for name, path in DOT_GIT_PATHS.items()}


def orphans(code: Path, work: Path) -> dict:
    cases = {
        "lone_surrogate_in_summary": [b'{"key": "header", "value": {"summary": "\\ud800"}}', file_line("s.bin", b"s1")],
        "lone_surrogate_in_path": [HEADER, b'{"key": "file", "value": {"path": "p\\udc00.bin", "content": "'
                                   + base64.b64encode(b"p2") + b'"}}'],
        "same_path_twice": [HEADER, file_line("twice.bin", b"first"), file_line("twice.bin", b"second")],
    }
    results = {}
    with server(code, work, "orphans") as srv:
        create_repo(srv)
        root = srv.process.args[srv.process.args.index("--root") + 1]
        for name, lines in cases.items():
            status, _ = commit(srv, lines)
            results[name] = {"status": status, "orphan_blobs": _orphan_blobs(Path(root))}
        results["tracebacks_logged"] = srv.tracebacks()
    planted = Path(root) / "blobs" / "ab" / ("ab" + "0" * 62)
    planted.parent.mkdir(exist_ok=True)
    planted.write_bytes(b"planted")
    before = _orphan_blobs(Path(root))
    with server(code, work, "orphans"):
        pass
    results["restart"] = {"orphan_blobs_before": before, "orphan_blobs_after": _orphan_blobs(Path(root))}
    return results


def headers(code: Path, work: Path) -> dict:
    with server(code, work, "headers") as srv:
        return {f"{size >> 10}_kib_in_one_write": raw(srv, b"GET /api/agent-harnesses HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                                          b"X-Pad: " + b"a" * size + b"\r\n\r\n")
                for size in (40 << 10, 200 << 10)}


def smuggling(code: Path, work: Path) -> dict:
    with server(code, work, "smuggling") as srv:
        create_repo(srv)
        with _connect(srv) as sock:
            sock.sendall(f"POST /api/kernels/{REPO}/paths-info/main HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         "Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 7\r\n"
                         "Transfer-Encoding: chunked\r\n\r\n7\r\npaths=a\r\n0\r\n\r\n"
                         "GET /api/agent-harnesses HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            sock.settimeout(3)
            received = b""
            closed = False
            try:
                while chunk := sock.recv(65536):
                    received += chunk
                closed = True
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed = True
        statuses = re.findall(rb"HTTP/1\.1 (\d{3})", received)
        return {"statuses": [int(status) for status in statuses], "closed": closed}


def card(code: Path, work: Path) -> dict:
    with server(code, work, "card") as srv:
        create_repo(srv)
        commit(srv, [HEADER, file_line("README.md", b"![" * (256 << 10))])
        results = {}
        for name, method in (("first_get", "GET"), ("second_get", "GET"), ("head", "HEAD")):
            cpu = srv.cpu_seconds()
            status, _ = request(srv, method, f"/kernels/{REPO}", token=None)
            results[f"{name}_cpu_s"] = round(srv.cpu_seconds() - cpu, 2)
            results[f"{name}_status"] = status
        return results


def smaller(code: Path, work: Path) -> dict:
    with server(code, work, "smaller") as srv:
        create_repo(srv)
        results = {
            "host_evil_example": request(srv, "GET", "/", headers={"Host": f"evil.example:{srv.port}"}, token=None)[0],
            "host_127_0_0_1": request(srv, "GET", "/", headers={"Host": f"127.0.0.1:{srv.port}"}, token=None)[0],
            "host_localhost": request(srv, "GET", "/", headers={"Host": f"localhost:{srv.port}"}, token=None)[0],
            "head_whoami": request(srv, "HEAD", "/api/whoami-v2")[0],
        }
        names = {"rtl_override": ["doc\u202etxt.py"], "control_char": ["a\x7fb.py"], "c1_control": ["a\x85b.py"],
                 "nfc_nfd_twins": ["caf\u00e9.py", "cafe\u0301.py"], "case_twins": ["Model.py", "model.py"]}
        for name, paths in names.items():
            results[name] = commit(srv, [HEADER, *(file_line(path, b"x = %d\n" % index)
                                                   for index, path in enumerate(paths))])[0]
        return results


GROUPS = {
    "11": [empty_token, connections, short_body, parsing, validate_yaml, commit_memory, malformed, clash, ref_names,
           private, latency],
    "21": [slow_body, slots, body_memory, response_memory, get_body, tree_listing, dot_git, orphans, headers, smuggling, card, smaller,
           latency],
}


# Issue 21's before/after table: (finding, what is measured, case, fields of its result).
TABLE_21 = [
    ("6", "body dripped at 1 B / 1.5 s, --body-timeout 2: seconds held", "slow_body", ["held_s", "outcome"]),
    ("6", "8 unread 40 MiB downloads on 8 slots: seconds until a new client is served (30 s cap)", "slots",
     ["unread_downloads_free_their_slots_after_s"]),
    ("6", "8 dripped bodies on 8 slots: seconds until a new client is served (30 s cap)", "slots",
     ["dripped_bodies_free_their_slots_after_s"]),
    ("6", "256 connections x 4 MiB bodies: RSS growth held / peak, MiB", "body_memory",
     ["rss_growth_while_held_mib", "peak_rss_growth_mib"]),
    ("6", "250 clients not reading a 40 MiB download: RSS growth after 3 s, MiB", "response_memory",
     ["rss_growth_mib"]),
    ("6", "GET announcing a 4 MiB body, 1 KiB sent: answer / seconds", "get_body", ["outcome", "seconds"]),
    ("7", "8,000 one-file folders: first page / whole recursive walk, s", "tree_listing",
     ["8000_folders.page_s", "8000_folders.recursive_walk_s"]),
    ("7", "25,000 one-file folders: first page / whole recursive walk, s (walk stopped at 120 s)", "tree_listing",
     ["25000_folders.page_s", "25000_folders.recursive_walk_s"]),
    ("8", "commits of 9 spellings of .git (.GIT, a/.gIt, .git., '.git ', '.git.. ', GIT~1, git~1, .g<ZWNJ>it, "
          ".git::$INDEX_ALLOCATION): statuses", "dot_git", list(DOT_GIT_PATHS)),
    ("9", "lone surrogate in the summary: status / orphan blobs", "orphans",
     ["lone_surrogate_in_summary.status", "lone_surrogate_in_summary.orphan_blobs"]),
    ("9", "lone surrogate in a path: status / orphan blobs", "orphans",
     ["lone_surrogate_in_path.status", "lone_surrogate_in_path.orphan_blobs"]),
    ("9", "a path twice in one commit: status / orphan blobs", "orphans",
     ["same_path_twice.status", "same_path_twice.orphan_blobs"]),
    ("9", "orphan blobs before / after a restart", "orphans",
     ["restart.orphan_blobs_before", "restart.orphan_blobs_after"]),
    ("9", "tracebacks logged", "orphans", ["tracebacks_logged"]),
    ("10", "40 KiB / 200 KiB header block in one write", "headers", ["40_kib_in_one_write", "200_kib_in_one_write"]),
    ("11", "Content-Length + Transfer-Encoding, a GET pipelined behind: statuses / closed", "smuggling",
     ["statuses", "closed"]),
    ("12", "512 KiB card of `![`: server CPU s, first GET / second GET / HEAD", "card",
     ["first_get_cpu_s", "second_get_cpu_s", "head_cpu_s"]),
    ("13", "Host: evil.example / 127.0.0.1 / localhost", "smaller",
     ["host_evil_example", "host_127_0_0_1", "host_localhost"]),
    ("13", "names with an RTL override / DEL / NEL; NFC+NFD twins; case twins: statuses", "smaller",
     ["rtl_override", "control_char", "c1_control", "nfc_nfd_twins", "case_twins"]),
    ("13", "HEAD on whoami", "smaller", ["head_whoami"]),
    ("-", "1000 GETs of /refs kept alive: median / p99 ms; 64 MiB download MiB/s", "latency",
     ["refs_get_median_ms", "refs_get_p99_ms", "download_64_mib_mib_per_s"]),
]


def _field(result: dict, dotted: str) -> str:
    """result["a"]["b"] for "a.b" (a key holding dots is tried whole first); "capped" for a measure
    stopped at its cap (None)."""
    if dotted in result:
        result = result[dotted]
    else:
        for key in dotted.split("."):
            result = result.get(key) if isinstance(result, dict) else None
    return "capped" if result is None else str(result)


def table_21(issue: dict) -> list[list[str]]:
    """[finding, measure, before, after] rows from the two runs' results."""
    rows = []
    for finding, measure, case, fields in TABLE_21:
        values = [" / ".join(_field(issue[label].get(case, {}), field) for field in fields)
                  for label in ("before", "after")]
        rows.append([finding, measure, *values])
    return rows


def run_group(code: Path, cases) -> dict:
    results = {}
    with tempfile.TemporaryDirectory(prefix="hub-bench-") as folder:
        for case in cases:
            print(f"{code.name}: {case.__name__} ...", flush=True)
            results[case.__name__] = case(code, Path(folder))
            print(f"  {json.dumps(results[case.__name__])}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--issue", choices=sorted(GROUPS), default="21", help="which issue's cases to run")
    parser.add_argument("--case", action="append", help="run only these cases (by name)")
    parser.add_argument("--code", type=Path, default=PACKAGE_PARENT,
                        help="folder holding the tpu_kernels package to measure (default: this one's)")
    parser.add_argument("--label", default="after", help="where the results go: before or after")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    cases = [case for case in GROUPS[args.issue] if not args.case or case.__name__ in args.case]
    report = json.loads(args.out.read_text()) if args.out.is_file() else {"what": __doc__.split("\n")[0]}
    issue = report.setdefault(f"issue_{args.issue}", {})
    issue.setdefault(args.label, {}).update(run_group(args.code.resolve(), cases))
    issue.setdefault("machine", {})[args.label] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                                                   "load_average_at_start": [round(x, 1) for x in os.getloadavg()]}
    if args.issue == "21" and {"before", "after"} <= set(issue):
        issue["table"] = table_21(issue)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
