"""A Hub server process of the code under test, and the raw and HTTP clients the cases speak to it with."""

from __future__ import annotations

import base64
import http.client
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

TOKEN = "bench-token"
REPO = "org/k"


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


def _first_status_line(sock: socket.socket) -> tuple[str | None, bool]:
    """(the first status line the server sent, None if nothing; whether it closed the connection before the
    socket's timeout)."""
    received = b""
    closed = True
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        closed = False
    except ConnectionResetError:
        pass
    return (received.split(b"\r\n")[0].decode() if received else None), closed


def raw(srv: Server, data: bytes, timeout: float = 10) -> str:
    """The status line of the answer to raw bytes, or what happened instead."""
    with connect(srv, timeout) as sock:
        sock.sendall(data)
        line, closed = _first_status_line(sock)
    return line or ("dropped (no answer)" if closed else f"no answer in {timeout} s")


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


def known_flags(code: Path, *wanted: str) -> tuple[str, ...]:
    """The `--flag value` pairs of `wanted` that this code's `serve` knows (an older one lacks some)."""
    known = subprocess.run([sys.executable, "-m", "tpu_kernels.distribution.hub", "--help"], env=dict(os.environ, PYTHONPATH=str(code)),
                           cwd=code, capture_output=True, text=True).stdout
    pairs = zip(wanted[::2], wanted[1::2])
    return tuple(part for flag, value in pairs if flag in known for part in (flag, value))


def connect(srv: Server, timeout: float = 10) -> socket.socket:
    return socket.create_connection((srv.host, srv.port), timeout=timeout)


def answer(sock: socket.socket, timeout: float) -> tuple[str, bool]:
    """(the first status line received, whether the server closed the connection) within `timeout`."""
    sock.settimeout(timeout)
    line, closed = _first_status_line(sock)
    return line or ("closed, no answer" if closed else "no answer"), closed


def stream_commit(srv: Server, path: str, size: int, seed: int) -> tuple[int, float]:
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
