"""The local Hub server under hostile input and faults: the figures of issue 11, measured.

Each case runs against `python -m tpu_kernels.hub` in its own process on loopback,
with the server's default limits, as deployed:

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

`--baseline DIR` also runs every case against the package in DIR (e.g. an export of
the previous commit: `git archive <commit> tpu_kernels | tar -x -C DIR`).
Results go to benchmarks/results/hub_server.json.

Usage:
    .venv/bin/python benchmarks/hub_server.py [--baseline DIR] [--out benchmarks/results/hub_server.json]
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import platform
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "hub_server.json"
TOKEN = "bench-token"
REPO = "org/k"


# -- a server process ----------------------------------------------------------------------------


class Server:
    def __init__(self, code: Path, root: Path, token: str | None = TOKEN):
        env = {key: value for key, value in os.environ.items() if key != "TPU_KERNELS_HUB_TOKEN"}
        env["PYTHONPATH"] = str(code)
        if token is not None:
            env["TPU_KERNELS_HUB_TOKEN"] = token
        self.stderr_path = root.parent / f"{root.name}.stderr"
        self._stderr = open(self.stderr_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tpu_kernels.hub", "--root", str(root), "--port", "0", "--quiet"],
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
def server(code: Path, work: Path, name: str, token: str | None = TOKEN):
    running = Server(code, work / name, token)
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
                sock.sendall(b"POST /api/repos/create HTTP/1.1\r\nHost: a\r\n")
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
        outcome = raw(srv, b"POST /api/kernels/org/k/commit/main HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer "
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
            results[name] = raw(srv, b"POST /api/repos/create HTTP/1.1\r\nHost: a\r\n" + header + b"\r\n\r\n{}")
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


CASES = [empty_token, connections, short_body, parsing, validate_yaml, commit_memory, malformed, clash, ref_names,
         private, latency]


def run_all(code: Path) -> dict:
    results = {}
    with tempfile.TemporaryDirectory(prefix="hub-bench-") as folder:
        for case in CASES:
            print(f"{code.name}: {case.__name__} ...", flush=True)
            results[case.__name__] = case(code, Path(folder))
            print(f"  {json.dumps(results[case.__name__])}", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, help="folder holding an earlier tpu_kernels package to compare")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    report = {
        "what": "hub server under hostile input and faults (see the module docstring)",
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "load_average_at_start": os.getloadavg()},
        "after": run_all(ROOT),
    }
    if args.baseline:
        report["before"] = run_all(args.baseline.resolve())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
