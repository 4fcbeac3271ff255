"""The `faults` group's cases: tokens, connection caps, malformed and conflicting requests, big commits, names,
privacy and latency (the package docstring lists them)."""

from __future__ import annotations

import http.client
import json
import random
import socket
import statistics
import time
from pathlib import Path

from .client import HEADER, REPO, TOKEN, commit, create_repo, file_line, raw, request, server, stream_commit


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


def commit_memory(code: Path, work: Path) -> dict:
    results = {}
    for mib in (64, 256):
        with server(code, work, f"commit-{mib}") as srv:
            create_repo(srv)
            stream_commit(srv, "warm-up.bin", 8 << 20, seed=1)
            baseline = srv.status("VmHWM")
            status, seconds = stream_commit(srv, "big.bin", mib << 20, seed=2)
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
