"""The `attacks` group's cases: slow clients, huge listings, `.git` paths, orphaned blobs, oversized headers,
smuggling, costly cards, spoofed hosts and names (the package docstring lists them)."""

from __future__ import annotations

import base64
import collections
import contextlib
import http.client
import json
import re
import select
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

from .client import (HEADER, REPO, Server, answer, commit, connect, create_repo, file_line, known_flags, raw, request,
                     server, stream_commit)


def _drip(srv: Server, path: str, cap: float) -> tuple[str, float]:
    """An anonymous POST announcing 100 body bytes, sent 1 byte per 1.5 s: (outcome, seconds held)."""
    with connect(srv) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\n"
                     "Content-Length: 100\r\n\r\n".encode())
        start = time.monotonic()
        while time.monotonic() - start < cap:
            try:
                sock.sendall(b"a")
            except (BrokenPipeError, ConnectionResetError):
                return "closed, no answer", time.monotonic() - start
            if select.select([sock], [], [], 1.5)[0]:
                outcome, _ = answer(sock, 5)
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
    flags = ("--max-connections", "8", "--body-timeout", "2") + known_flags(code, "--send-timeout", "2")
    results = {"flags": " ".join(flags)}
    with server(code, work, "slots", flags=flags) as srv:
        create_repo(srv)
        stream_commit(srv, "big.bin", 40 << 20, seed=4)
        readers = []
        for _ in range(8):
            sock = connect(srv)
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
            sock = connect(srv)
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
            sock = connect(srv, timeout=60)
            sock.sendall(f"POST /api/kernels/{REPO}/paths-info/main HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         f"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {size}\r\n\r\n".encode()
                         + body[:-1])
            held.append(sock)
        time.sleep(2)
        held_growth = (srv.status("VmRSS") - baseline) / 1024
        for sock in held:
            sock.sendall(body[-1:])
        statuses = collections.Counter(answer(sock, 60)[0] for sock in held)
        for sock in held:
            sock.close()
        return {"connections": 256, "body_mib": 4, "rss_growth_while_held_mib": round(held_growth, 1),
                "peak_rss_growth_mib": round((srv.status("VmHWM") - baseline) / 1024, 1), "answers": dict(statuses)}


def rss_with_unread_clients(srv, path: str, count: int) -> int:
    """The server's RSS (KiB) while `count` clients with small receive buffers have asked for `path` and read
    nothing of the answer (the server holds what it could not send)."""
    clients = []
    for _ in range(count):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((srv.host, srv.port))
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        clients.append(sock)
    time.sleep(3)
    rss = srv.status("VmRSS")
    for sock in clients:
        sock.close()
    return rss


def response_memory(code: Path, work: Path) -> dict:
    with server(code, work, "response-memory") as srv:
        create_repo(srv)
        stream_commit(srv, "big.bin", 40 << 20, seed=5)
        request(srv, "GET", f"/kernels/{REPO}/resolve/main/big.bin")
        baseline = srv.status("VmRSS")
        growth = (rss_with_unread_clients(srv, f"/kernels/{REPO}/resolve/main/big.bin", 250) - baseline) / 1024
        return {"clients": 250, "rss_growth_mib": round(growth, 1)}


def get_body(code: Path, work: Path) -> dict:
    with server(code, work, "get-body", flags=("--body-timeout", "2")) as srv:
        create_repo(srv)
        with connect(srv) as sock:
            start = time.monotonic()
            sock.sendall(f"GET /api/kernels/{REPO}/refs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {4 << 20}\r\n\r\n"
                         .encode() + b"x" * 1024)
            outcome, closed = answer(sock, 30)
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
        with connect(srv) as sock:
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


# A card defining one reference link with a 50 KiB URL and using it 4,000 times: markdown-it copies the URL
# into every use, so the card's HTML is thousands of times the card.
AMPLIFIED_CARD = (b"---\nlicense: mit\n---\n# Amplified\n\n[r]: https://example.com/" + b"x" * (50 << 10) + b"\n\n"
                  + b"[a][r] " * 4000 + b"\n")


def card_page(code: Path, work: Path) -> dict:
    """The page of a card whose reference links expand: its bytes, and the server's RSS after one view and
    after 8 more clients that ask for it and never read."""
    with server(code, work, "card-page") as srv:
        create_repo(srv)
        commit(srv, [HEADER, file_line("README.md", AMPLIFIED_CARD)])
        status, page = request(srv, "GET", f"/kernels/{REPO}", token=None)
        after_one_view = srv.status("VmRSS") / 1024
        after_clients = rss_with_unread_clients(srv, f"/kernels/{REPO}", 8) / 1024
        return {"card_kb": round(len(AMPLIFIED_CARD) / 1e3), "status": status, "page_mb": round(len(page) / 1e6, 2),
                "rss_after_one_view_mib": round(after_one_view, 1),
                "rss_with_8_unread_views_mib": round(after_clients, 1)}


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
