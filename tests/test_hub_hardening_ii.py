"""The local Hub against slow clients, huge listings, `.git` paths, orphans, big headers, smuggling, cards and names:
each class refused or bounded, with variants.

A real server on loopback, raw sockets for what no client would send; memory is measured
on a server process. tests/test_hub_fuzz.py runs the bounded fuzz of the commit reader.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
import unicodedata
from pathlib import Path
from urllib.parse import quote

import pytest
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

from tpu_kernels.distribution.hub import Limits, card, start_hub
from tpu_kernels.distribution.hub import commits as hub_commits
from tpu_kernels.distribution.hub.app import _error_response
from tpu_kernels.distribution.hub.blobs import StagedFile
from tpu_kernels.distribution.hub.errors import HubError
from tpu_kernels.distribution.hub.storage import Storage

from .hub_support import module_hub
from .test_hub_hardening import (  # noqa: F401 - api and repo are fixtures: they take this module's hub
    HEADER,
    TOKEN,
    _peak_rss_kib,
    address,
    api,
    file_line,
    http,
    ndjson,
    repo,
    status_of,
    stored_state,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
LIMITS = Limits(header_timeout=0.5, idle_timeout=0.5, body_timeout=0.5, send_timeout=1.0, min_rate=64 << 10,
                max_connections=64)

pytestmark = pytest.mark.usefixtures("local_agent_registry")


hub = module_hub(TOKEN, LIMITS)


@pytest.fixture
def errors_logged(caplog):
    """The server's log records at ERROR and above (a traceback is one)."""
    caplog.set_level(logging.WARNING)
    return lambda: [record for record in caplog.records if record.levelno >= logging.ERROR]


def add(path: str, content: bytes) -> CommitOperationAdd:
    return CommitOperationAdd(path_in_repo=path, path_or_fileobj=content)


def connect(url: str, receive_buffer: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(10)
    sock.connect(address(url))
    return sock


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


def commit_body(hub, repo_id: str, body: bytes) -> tuple[int, bytes]:
    return http("POST", f"{hub.url}/api/kernels/{repo_id}/commit/main", body, token=TOKEN,
                headers={"Content-Type": "application/x-ndjson"})[::2]


def orphan_blobs(root: Path) -> list[str]:
    """Blobs in the store that no commit object references."""
    referenced = {entry["sha256"] for commit_file in root.glob("repos/*/*/*/commits/*.json")
                  for entry in json.loads(commit_file.read_bytes())["files"].values()}
    return [blob.name for blob in root.glob("blobs/*/*") if blob.name not in referenced]


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
    status, seconds = _drip_until_answered(hub.url, head, interval=0.2, give_up=LIMITS.body_timeout + 5)
    assert status == 408, f"answered {status} after {seconds:.1f} s"
    assert seconds < LIMITS.body_timeout + 1
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


@pytest.mark.multiprocess
@pytest.mark.slow
def test_256_connections_with_4_mib_bodies_add_under_100_mib(tmp_path):
    """Bodies past 64 KiB wait on disk; what is parsed at once is bounded (Limits.max_large_bodies)."""
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
        baseline = _peak_rss_kib(process.pid)
        for _ in range(256):
            sock = connect(url)
            sock.settimeout(60)
            sock.sendall(b"POST /api/kernels/org/k/paths-info/main HTTP/1.1\r\nHost: localhost\r\n"
                         b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: %d\r\n\r\n" % size
                         + body[:-1])
            held.append(sock)
        for sock in held:
            sock.sendall(body[-1:])
        answered = collections.Counter(status_of(answers(sock, timeout=120)[0]) for sock in held)
        growth_mib = (_peak_rss_kib(process.pid) - baseline) / 1024
    finally:
        for sock in held:
            sock.close()
        process.terminate()
        process.wait(timeout=30)
    assert answered == {200: 256}
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
    assert time.monotonic() - start < LIMITS.body_timeout  # not read: no wait for the rest of the body


# -- 7. tree listing: linear, ids once per commit --------------------------------------------------


@pytest.mark.multiprocess
def test_folder_ids_are_the_git_tree_ids(hub, api, tmp_path):
    files = {"a/b/c.txt": b"c", "a/b/d.py": b"d", "a/e": b"e", "a-b/f": b"f", "a.b/g": b"g", "a/b-c/h": b"h",
             "x/y/z/w.bin": os.urandom(300), "top.md": b"top"}
    api.create_repo("org/git-ids", repo_type="kernel")
    api.create_commit("org/git-ids", repo_type="kernel", commit_message="tree",
                      operations=[add(path, content) for path, content in files.items()])
    listed = {item.path: item.tree_id for item in api.list_repo_tree("org/git-ids", repo_type="kernel", recursive=True)
              if hasattr(item, "tree_id")}
    work = tmp_path / "git"
    for path, content in files.items():
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).write_bytes(content)
    git = ["git", "-C", str(work), "-c", "core.autocrlf=false"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    tree = subprocess.run([*git, "write-tree"], check=True, capture_output=True, text=True).stdout.strip()
    expected = dict(line.split("\t")[::-1] for line in subprocess.run(
        [*git, "ls-tree", "-r", "-d", "--format=%(objectname)\t%(path)", tree],
        check=True, capture_output=True, text=True).stdout.splitlines())
    assert listed == expected


@pytest.mark.slow
def test_25000_one_file_folders_list_in_pages_from_one_index(hub, api, monkeypatch):
    count = 25_000
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # 25,000 staged files: durability is not the point here
    api.create_repo("org/many-folders", repo_type="kernel")
    body = ndjson(HEADER, *(file_line(f"d{index:05d}/f.txt", b"%d" % (index % 7)) for index in range(count)))
    status, answer = commit_body(hub, "org/many-folders", body)
    assert status == 200, answer
    built = []
    index_folders = hub_commits.Tree.__init__

    def counted(tree, files):
        built.append(1)
        index_folders(tree, files)

    monkeypatch.setattr(hub_commits.Tree, "__init__", counted)
    start = time.monotonic()
    root = api.list_repo_tree("org/many-folders", repo_type="kernel")
    assert sum(1 for _ in root) == count
    walk = [item.path for item in api.list_repo_tree("org/many-folders", repo_type="kernel", recursive=True)]
    # 75 pages; quadratic, as before, took minutes for one of them.
    assert time.monotonic() - start < 60
    assert len(walk) == 2 * count and walk == sorted(walk) and len(set(walk)) == len(walk)
    assert built == [1]


# -- 8. .git in any spelling -----------------------------------------------------------------------

DOT_GIT_ALIASES = [".GIT/config", "a/.gIt/config", ".git./config", ".git /config", ".git. . /hooks/x",
                   "GIT~1/config", "git~2/config", ".git::$INDEX_ALLOCATION/config", ".git:x/config",
                   "a/b/.Git/hooks/post-checkout", ".g\u0131t/config"]
LOOKALIKES = [".github/workflows/ci.yml", ".gitignore", ".gitattributes", "git/x", "a.git/x", ".git-blame-ignore-revs",
              "GIT~1x/y", "x/.gitkeep"]


@pytest.mark.parametrize("path", DOT_GIT_ALIASES)
def test_a_path_that_some_file_system_reads_as_dot_git_is_refused_everywhere(hub, repo, path):
    before = stored_state(hub, repo)
    status, answer = commit_body(hub, repo, ndjson(HEADER, file_line(path, b"[core]\n\tfsmonitor = touch /tmp/x\n")))
    assert status == 400 and ".git" in json.loads(answer)["error"], answer
    status, answer = commit_body(hub, repo, ndjson(HEADER, {"key": "deletedFile", "value": {"path": path}}))
    assert status == 400
    status, _, answer = http("POST", f"{hub.url}/api/kernels/{repo}/preupload/main", token=TOKEN,
                             body=json.dumps({"files": [{"path": path, "size": 1, "sample": ""}]}).encode())
    assert status == 400
    assert http("GET", f"{hub.url}/kernels/{repo}/resolve/main/{quote(path)}")[0] == 400
    assert stored_state(hub, repo) == before


def test_names_that_only_look_like_dot_git_are_fine(api, repo):
    api.create_commit(repo, repo_type="kernel", commit_message="lookalikes",
                      operations=[add(path, b"ok\n") for path in LOOKALIKES])
    assert set(LOOKALIKES) <= set(api.list_repo_files(repo, repo_type="kernel"))


# -- 9. bad input leaves nothing behind ------------------------------------------------------------

SURROGATES = {
    "summary, escaped": ndjson(b'{"key": "header", "value": {"summary": "s \\ud800"}}', file_line("s.bin", b"s")),
    "description, escaped": ndjson(b'{"key": "header", "value": {"summary": "s", "description": "\\udfff"}}',
                                   file_line("s.bin", b"s")),
    "path, escaped": ndjson(HEADER, b'{"key": "file", "value": {"path": "p\\udc00.bin", "content": "cA=="}}'),
    "path, UTF-8-encoded": ndjson(HEADER, b'{"key": "file", "value": {"path": "p\xed\xa0\x80.bin", "content": "cA=="}}'),
    "key": ndjson(HEADER, b'{"key": "file\\ud800", "value": {"path": "p.bin", "content": "cA=="}}'),
    "after a file": ndjson(HEADER, file_line("ok.bin", b"fine"),
                           b'{"key": "file", "value": {"path": "\\ud83d.bin", "content": "cA=="}}'),
}


@pytest.mark.parametrize("case", SURROGATES)
def test_a_lone_surrogate_in_a_commit_is_400_and_leaves_no_blob(hub, repo, case, errors_logged):
    before = stored_state(hub, repo)
    status, answer = commit_body(hub, repo, SURROGATES[case])
    assert status == 400 and "Unicode" in json.loads(answer)["error"], answer
    assert stored_state(hub, repo) == before and errors_logged() == []


@pytest.mark.parametrize("path, payload", [
    ("/api/repos/create", {"name": "k\ud800", "organization": "org", "type": "kernel"}),
    ("/api/kernels/{repo}/branch/b", {"startingPoint": "\ud800"}),
    ("/api/kernels/{repo}/tag/main", {"tag": "\udfff"}),
    ("/api/kernels/{repo}/preupload/main", {"files": [{"path": "a\ud800", "size": 1}]}),
    ("/api/validate-yaml", {"content": "---\na: \ud800\n---\n"}),
])
def test_a_lone_surrogate_in_a_json_body_is_400(hub, repo, path, payload, errors_logged):
    body = json.dumps(payload).encode()  # ASCII JSON: the surrogate travels as \ud800
    status, _, answer = http("POST", hub.url + path.format(repo=repo), body, token=TOKEN)
    assert status == 400 and errors_logged() == [], answer
    status, _, _ = http("POST", f"{hub.url}/api/kernels/{repo}/paths-info/main", b"paths=%ED%A0%80")
    assert status == 400


@pytest.mark.parametrize("lines", [
    [file_line("twice.bin", b"first"), file_line("twice.bin", b"second")],
    [file_line("twice.bin", b"same"), file_line("twice.bin", b"same")],
    [file_line("c/d.txt", b"new"), file_line("x", b"x"), file_line("c/d.txt", b"newer")],
], ids=["different-contents", "same-content", "existing-path"])
def test_a_path_added_twice_in_one_commit_is_400_and_leaves_no_blob(hub, repo, lines):
    before = stored_state(hub, repo)
    status, answer = commit_body(hub, repo, ndjson(HEADER, *lines))
    assert status == 400 and "added twice" in json.loads(answer)["error"]
    assert stored_state(hub, repo) == before


def test_orphan_blobs_are_collected_when_the_server_starts(tmp_path):
    root = tmp_path / "hub"
    with start_hub(root, token=TOKEN) as hub:
        api = HfApi(endpoint=hub.url, token=TOKEN)
        for repo_id, content in (("org/kept", b"kept"), ("org/deleted", b"only in the deleted repo")):
            api.create_repo(repo_id, repo_type="kernel")
            api.create_commit(repo_id, repo_type="kernel", commit_message="c",
                              operations=[add("f.bin", content), add("shared.bin", b"shared")])
        api.delete_repo("org/deleted", repo_type="kernel")
    planted = root / "blobs" / "ab" / ("ab" + "1" * 62)
    planted.parent.mkdir(exist_ok=True)
    planted.write_bytes(b"planted")
    assert len(orphan_blobs(root)) == 2
    with start_hub(root, token=TOKEN) as hub:
        assert orphan_blobs(root) == [] and not planted.exists()
        api = HfApi(endpoint=hub.url, token=TOKEN)
        for path, content in (("f.bin", b"kept"), ("shared.bin", b"shared")):
            assert http("GET", f"{hub.url}/kernels/org/kept/resolve/main/{path}")[2] == content


def _staged(storage: Storage, path: str, content: bytes) -> StagedFile:
    writer = storage.blob_store.start_staging()
    writer.write(content)
    writer.finish()
    return writer.staged_as(path)


def _commit(storage: Storage, repo_id: str, path: str, content: bytes):
    return storage.commit_operations("kernel", repo_id, "main", additions=[_staged(storage, path, content)],
                                     deletions=[], title="t", message="", author="a", parent_commit=None)


@pytest.fixture
def storage(tmp_path):
    opened = Storage(tmp_path / "hub")
    for repo_id in ("org/a", "org/b"):
        opened.create_repo("kernel", repo_id, author="a")
    yield opened
    opened.close()


def _failing_refs(storage: Storage, monkeypatch, failing_repo: str, before_failing=lambda: None):
    """Make refs.json writes of `failing_repo` fail (a full disk, say), after `before_failing()` returns."""
    write_refs = storage._write_refs

    def write(folder, refs):
        if folder.name == failing_repo.split("/")[1]:
            before_failing()
            raise OSError(28, "No space left on device")
        write_refs(folder, refs)

    monkeypatch.setattr(storage, "_write_refs", write)


def test_a_commit_failing_after_its_blobs_are_installed_removes_them(storage, monkeypatch):
    _failing_refs(storage, monkeypatch, "org/a")
    head = storage.refs("kernel", "org/a").branches["main"]
    with pytest.raises(OSError):
        _commit(storage, "org/a", "f.bin", b"doomed")
    assert list(storage.blobs.glob("*/*")) == []
    assert storage.refs("kernel", "org/a").branches["main"] == head
    assert [path.stem for path in (storage.repo_dir("kernel", "org/a") / "commits").iterdir()] == [head]


@pytest.mark.parametrize("order", ["other-stored-before-the-failure", "other-in-flight-at-the-failure"])
def test_a_failed_commit_keeps_a_blob_another_commit_relies_on(storage, monkeypatch, order):
    """org/a installs a blob, then fails to move its branch; org/b commits the same content meanwhile."""
    a_waits, other_relies, a_failed = threading.Event(), threading.Event(), threading.Event()

    def before_failing():
        a_waits.set()
        other_relies.wait(10)

    _failing_refs(storage, monkeypatch, "org/a", before_failing)
    if order == "other-in-flight-at-the-failure":
        install = storage.blob_store.install

        def install_then_wait_for_the_failure(staged):
            install(staged)
            if threading.current_thread().name == "b":
                other_relies.set()
                a_failed.wait(10)

        monkeypatch.setattr(storage.blob_store, "install", install_then_wait_for_the_failure)
    outcome = {}

    def commit_a():
        try:
            _commit(storage, "org/a", "f.bin", b"shared content")
        except OSError as error:
            outcome["a"] = error
        a_failed.set()

    def commit_b():
        outcome["b"] = _commit(storage, "org/b", "f.bin", b"shared content")
        other_relies.set()

    threads = [threading.Thread(target=commit_a, name="a"), threading.Thread(target=commit_b, name="b")]
    threads[0].start()
    assert a_waits.wait(10)
    threads[1].start()
    for thread in threads:
        thread.join(10)
    assert isinstance(outcome.get("a"), OSError) and "b" in outcome
    assert storage.blob_store.path(outcome["b"].files["f.bin"]).read_bytes() == b"shared content"
    assert orphan_blobs(storage.root) == []


def test_commits_of_one_content_that_all_fail_leave_no_blob(storage, monkeypatch):
    for repo_id in ("org/a", "org/b"):
        _failing_refs(storage, monkeypatch, repo_id)
    failures = []

    def commit(repo_id):
        try:
            _commit(storage, repo_id, "f.bin", b"same")
        except OSError as error:
            failures.append(error)

    threads = [threading.Thread(target=commit, args=(repo_id,)) for repo_id in ("org/a", "org/b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(failures) == 2 and list(storage.blobs.glob("*/*")) == []


# -- 10. the header cap, however the bytes arrive --------------------------------------------------


@pytest.mark.parametrize("headers", [
    "X-Pad: " + "a" * (40 << 10) + "\r\n",
    "".join(f"X-Pad-{index}: {'a' * 30}\r\n" for index in range(1100)),
    "Cookie: " + "; ".join(f"c{index}=v" for index in range(6000)) + "\r\n",
], ids=["one-header", "many-headers", "long-cookie"])
def test_headers_past_the_cap_sent_in_one_write_are_431(hub, headers):
    request = f"GET /api/agent-harnesses HTTP/1.1\r\nHost: localhost\r\n{headers}\r\n".encode()
    assert len(request) > LIMITS.max_header_bytes
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


# -- 12. cards: rendered once per content, not for HEAD --------------------------------------------


@pytest.fixture
def renders(monkeypatch):
    """One item per card markdown-it parses."""
    counted = []
    parse = card._MARKDOWN.parse

    def counting(*args, **kwargs):
        counted.append(1)
        return parse(*args, **kwargs)

    monkeypatch.setattr(card._MARKDOWN, "parse", counting)
    return counted


def test_a_card_is_rendered_once_per_content_and_its_links_follow_each_commit(hub, api, repo, renders):
    api.create_commit(repo, repo_type="kernel", commit_message="card",
                      operations=[add("README.md", b"# A card\n\n![plot](plot.png) " + os.urandom(8).hex().encode())])
    first = api.list_repo_commits(repo, repo_type="kernel")[0].commit_id
    for _ in range(3):
        status, _, page = http("GET", f"{hub.url}/kernels/{repo}")
        assert status == 200 and f"/resolve/{first}/plot.png".encode() in page
    api.create_commit(repo, repo_type="kernel", commit_message="no card change", operations=[add("x.txt", b"x")])
    second = api.list_repo_commits(repo, repo_type="kernel")[0].commit_id
    status, _, page = http("GET", f"{hub.url}/kernels/{repo}/tree/{second}")
    assert status == 200 and f"/resolve/{second}/plot.png".encode() in page
    assert f"/resolve/{first}/".encode() not in page.split(b'class="card"')[1].split(b"</article>")[0]
    assert renders == [1]


def test_concurrent_views_of_a_new_card_render_it_once(hub, api, repo, renders):
    api.create_commit(repo, repo_type="kernel", commit_message="card",
                      operations=[add("README.md", b"![" * (64 << 10))])
    results = []
    threads = [threading.Thread(target=lambda: results.append(http("GET", f"{hub.url}/kernels/{repo}")[0]))
               for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == [200] * 8 and renders == [1]


@pytest.mark.parametrize("path, expected", [
    ("/", 200), ("/kernels/{repo}", 200), ("/kernels/{repo}/tree/main", 200), ("/kernels/{repo}/tree/nope", 404),
    ("/kernels/{repo}/commit/{commit}", 200), ("/kernels/{repo}/commit/" + "0" * 40, 404),
    ("/kernels/org/missing-repo", 404),
])
def test_head_of_a_page_answers_as_its_get_would_without_rendering(hub, api, repo, renders, path, expected):
    commit = api.list_repo_commits(repo, repo_type="kernel")[0].commit_id
    url = hub.url + path.format(repo=repo, commit=commit)
    status, headers, body = http("HEAD", url)
    assert status == expected and body == b"" and headers["content-type"].startswith("text/html")
    assert renders == []
    assert http("GET", url)[0] == expected


# -- 13. Host names, invisible characters and name twins, HEAD on every GET route ------------------


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


INVISIBLE = ["\u202e", "\u202d", "\u2066", "\u200b", "\u200c", "\u200d", "\u200e", "\ufeff", "\u00ad", "\x7f",
             "\x85", "\x1b", "\x00", "\u2028", "\u2029", "\U000e0001"]


@pytest.mark.parametrize("char", INVISIBLE, ids=[f"U+{ord(char):04X}" for char in INVISIBLE])
def test_control_bidi_and_invisible_characters_in_a_name_are_refused(hub, repo, char):
    before = stored_state(hub, repo)
    status, answer = commit_body(hub, repo, ndjson(HEADER, file_line(f"doc{char}txt.py", b"x")))
    assert status == 400 and f"U+{ord(char):04X}" in json.loads(answer)["error"]
    assert stored_state(hub, repo) == before


TWINS = {
    "case": ["Model.py", "model.py"],
    "nfc-nfd": [unicodedata.normalize("NFC", "café.py"), unicodedata.normalize("NFD", "café.py")],
    "trailing-dot": ["notes", "notes."],
    "trailing-space": ["notes", "notes "],
    "folders": ["Src/a.py", "src/b.py"],
    "file-and-folder": ["Lib", "lib/x.py"],
    "dotless-i": ["config.py", "conf\u0131g.py"],
    "existing-file": ["readme.md"],
    "existing-folder": ["C/e.txt"],
}


@pytest.mark.parametrize("case", TWINS)
def test_names_one_file_on_macos_or_windows_are_refused(hub, repo, case):
    before = stored_state(hub, repo)
    status, answer = commit_body(hub, repo, ndjson(HEADER, *(file_line(path, b"%d" % index)
                                                        for index, path in enumerate(TWINS[case]))))
    assert status == 400 and "differ only in case" in json.loads(answer)["error"], answer
    assert stored_state(hub, repo) == before


def test_distinct_unicode_names_and_a_rename_by_case_are_fine(api, repo):
    names = ["café.py", "模型.py", "naïve/ü.txt", "a.py", "b.py", "emoji-\U0001f600.md"]
    api.create_commit(repo, repo_type="kernel", commit_message="names", operations=[add(n, b"x") for n in names])
    api.create_commit(repo, repo_type="kernel", commit_message="rename by case",
                      operations=[CommitOperationDelete("README.md"), add("readme.md", b"# card\n")])
    files = set(api.list_repo_files(repo, repo_type="kernel"))
    assert set(names) | {"readme.md"} <= files and "README.md" not in files


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


def test_a_card_placeholder_cannot_be_forged_by_a_card(hub, api, repo):
    api.create_commit(repo, repo_type="kernel", commit_message="nul",
                      operations=[add("README.md", b"a\0b [x](y.md) `\0`")])
    status, _, page = http("GET", f"{hub.url}/kernels/{repo}")
    article = page.split(b'class="card"')[1].split(b"</article>")[0]
    assert status == 200 and b"\0" not in article and article.count(b"/resolve/") == 1


def test_an_error_quoting_a_lone_surrogate_still_encodes():
    response = _error_response(HubError(404, "Invalid rev id: \ud800"))
    assert json.loads(response.body)["error"] == "Invalid rev id: \\ud800"
