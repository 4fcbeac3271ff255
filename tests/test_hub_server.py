"""The local Hub server, driven through the unmodified huggingface_hub client (and raw HTTP where
the client would refuse to send what we test)."""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
from huggingface_hub.errors import (
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from tpu_kernels.distribution.hub import repo_reads
from tpu_kernels.distribution.hub import server as hub_server
from tpu_kernels.distribution.hub import start_hub

from .hub_support import run_concurrently

TOKEN = "test-token-" + os.urandom(4).hex()
REPO = "org/kernel-a"
REPO_ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("local_agent_registry")


@pytest.fixture
def hub(tmp_path):
    with start_hub(tmp_path / "hub", token=TOKEN, trusted_orgs=["trusted-org"]) as running:
        yield running


@pytest.fixture
def api(hub):
    return HfApi(endpoint=hub.url, token=TOKEN)


@dataclass
class Response:
    status_code: int
    headers: http.client.HTTPMessage
    content: bytes

    def json(self):
        return json.loads(self.content)


def request(method: str, url: str, *, headers: dict | None = None, body: bytes | None = None) -> Response:
    """Raw HTTP, for what huggingface_hub would refuse to send or hides from us."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        connection.request(method, parts.path + (f"?{parts.query}" if parts.query else ""), body=body,
                           headers=headers or {})
        response = connection.getresponse()
        return Response(response.status, response.headers, response.read())
    finally:
        connection.close()


def random_bytes(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def add(path: str, content: bytes) -> CommitOperationAdd:
    return CommitOperationAdd(path_in_repo=path, path_or_fileobj=content)


def commit_ndjson(url: str, lines: list[dict], token: str | None = TOKEN) -> Response:
    headers = {"Content-Type": "application/x-ndjson"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    return request("POST", url, headers=headers, body=body)


def file_line(path: str, content: bytes) -> dict:
    return {"key": "file", "value": {"path": path, "content": base64.b64encode(content).decode(), "encoding": "base64"}}


def stored_files(root: Path) -> set[Path]:
    return {path for path in root.rglob("*") if path.is_file() and path.name != "server.lock"}


def test_commits_branches_tags_tree_and_resolve(api, hub):
    api.create_repo(REPO, repo_type="kernel")
    readme, module, weights = b"# card\n", b"def answer():\n    return 41\n", random_bytes(300_000, seed=1)
    first = api.create_commit(
        REPO, repo_type="kernel", commit_message="first",
        operations=[add("README.md", readme), add("build/torch-cpu/__init__.py", module), add("data/w.bin", weights)],
    )
    api.create_branch(REPO, repo_type="kernel", branch="v1")
    api.create_tag(REPO, repo_type="kernel", tag="release-1", revision="v1")
    second = api.create_commit(
        REPO, repo_type="kernel", commit_message="second", revision="v1",
        operations=[add("build/torch-cpu/__init__.py", b"def answer():\n    return 42\n"),
                    CommitOperationDelete("data/w.bin")],
    )

    refs = api.list_repo_refs(REPO, repo_type="kernel")
    assert {b.name: b.target_commit for b in refs.branches} == {"main": first.oid, "v1": second.oid}
    assert {t.name: t.target_commit for t in refs.tags} == {"release-1": first.oid}
    assert api.repo_info(REPO, repo_type="kernel", revision="v1").sha == second.oid
    assert [c.title for c in api.list_repo_commits(REPO, repo_type="kernel", revision="v1")] == [
        "second", "first", "initial commit"]

    top = {item.path: type(item).__name__ for item in api.list_repo_tree(REPO, repo_type="kernel")}
    assert top == {"README.md": "RepoFile", "build": "RepoFolder", "data": "RepoFolder"}
    everything = {item.path for item in api.list_repo_tree(REPO, repo_type="kernel", revision="v1", recursive=True)}
    assert everything == {"README.md", "build", "build/torch-cpu", "build/torch-cpu/__init__.py"}
    assert [f.path for f in api.list_repo_tree(REPO, "build", repo_type="kernel", revision="v1")] == ["build/torch-cpu"]

    url = f"{hub.url}/kernels/{REPO}/resolve/main/data/w.bin"
    head = request("HEAD", url)
    git_oid = hashlib.sha1(b"blob %d\0" % len(weights) + weights).hexdigest()
    assert head.status_code == 200
    assert head.headers["X-Repo-Commit"] == first.oid
    assert head.headers["ETag"] == f'"{git_oid}"'
    assert int(head.headers["Content-Length"]) == len(weights)
    assert request("GET", url).content == weights
    by_sha = request("GET", f"{hub.url}/kernels/{REPO}/resolve/{first.oid}/data/w.bin")
    assert by_sha.content == weights and by_sha.headers["X-Repo-Commit"] == first.oid
    ranged = request("GET", url, headers={"Range": "bytes=100-199"})
    assert ranged.status_code == 206 and ranged.content == weights[100:200]
    assert ranged.headers["Content-Range"] == f"bytes 100-199/{len(weights)}"
    assert request("GET", url, headers={"Range": "bytes=-10"}).content == weights[-10:]
    assert request("GET", url, headers={"Range": f"bytes={len(weights)}-"}).status_code == 416

    with pytest.raises(RemoteEntryNotFoundError):
        api.hf_hub_download(REPO, "data/w.bin", repo_type="kernel", revision="v1", cache_dir=hub.storage.root / "c")
    with pytest.raises(RevisionNotFoundError):
        api.repo_info(REPO, repo_type="kernel", revision="v9")
    with pytest.raises(RepositoryNotFoundError):
        api.list_repo_refs("org/missing", repo_type="kernel")


def test_model_repos_are_served_too(api, hub):
    api.create_repo("org/tiny-model")
    config = json.dumps({"hidden_size": random.Random(3).randint(8, 64)}).encode()
    api.create_commit("org/tiny-model", commit_message="config", operations=[add("config.json", config)])
    path = api.hf_hub_download("org/tiny-model", "config.json", cache_dir=hub.storage.root.parent / "model-cache")
    assert Path(path).read_bytes() == config
    assert api.model_info("org/tiny-model").siblings[0].rfilename == "config.json"


def test_a_kernel_repo_is_read_as_a_model_repo_where_no_model_repo_has_its_id(api, hub, tmp_path):
    # kernels 0.19's `kernels benchmark` downloads the kernel repo it benchmarks without a repo_type.
    script = f"ROUNDS = {random.Random(5).randint(2, 9)}\n".encode()
    api.create_repo("org/benchmarked", repo_type="kernel")
    api.create_commit("org/benchmarked", repo_type="kernel", commit_message="bench",
                      operations=[add("benchmarks/benchmark.py", script)])
    folder = Path(api.snapshot_download("org/benchmarked", cache_dir=tmp_path / "as-model"))
    assert (folder / "benchmarks" / "benchmark.py").read_bytes() == script

    api.create_repo("org/benchmarked")  # a model repo of that id is the one read
    api.create_commit("org/benchmarked", commit_message="model", operations=[add("config.json", b"{}")])
    assert [s.rfilename for s in api.model_info("org/benchmarked").siblings] == ["config.json"]
    api.create_repo("org/hidden", repo_type="kernel", private=True)
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.url, token=False).model_info("org/hidden")
    with pytest.raises(RepositoryNotFoundError):  # writes never alias
        api.create_commit("org/hidden", commit_message="x", operations=[add("a.txt", b"a")])


def test_writes_without_the_token_are_401_and_change_nothing(api, hub):
    api.create_repo(REPO, repo_type="kernel")
    before = stored_files(hub.storage.root)
    for token in (None, "wrong-token"):
        anonymous = HfApi(endpoint=hub.url, token=token or False)
        for write in (
            lambda: anonymous.create_repo("org/other", repo_type="kernel"),
            lambda: anonymous.create_commit(REPO, repo_type="kernel", commit_message="x", operations=[add("a", b"x")]),
            lambda: anonymous.create_branch(REPO, repo_type="kernel", branch="v1"),
        ):
            with pytest.raises(HfHubHTTPError) as error:
                write()
            assert error.value.response.status_code == 401
        raw = commit_ndjson(f"{hub.url}/api/kernels/{REPO}/commit/main",
                            [{"key": "header", "value": {"summary": "x"}}, file_line("a.py", b"x")], token=token)
        assert raw.status_code == 401
    assert stored_files(hub.storage.root) == before
    with pytest.raises(HfHubHTTPError) as error:
        HfApi(endpoint=hub.url, token="wrong-token").whoami()
    assert error.value.response.status_code == 401
    assert api.whoami()["name"] == hub_server.USER_NAME


@pytest.mark.parametrize("path", ["../escape.py", "build/../../escape.py", "/etc/passwd", "a\0b.py",
                                  "build/./x.py", "build//x.py", ".git/config", "build\\x.py"])
def test_commit_path_escaping_the_repo_is_400_and_writes_nothing(api, hub, path):
    api.create_repo(REPO, repo_type="kernel")
    before = stored_files(hub.storage.root)
    head = api.repo_info(REPO, repo_type="kernel").sha
    response = commit_ndjson(
        f"{hub.url}/api/kernels/{REPO}/commit/main",
        [{"key": "header", "value": {"summary": "sneaky"}}, file_line("ok.py", b"fine"), file_line(path, b"evil")],
    )
    assert response.status_code == 400, response.text
    assert stored_files(hub.storage.root) == before
    assert api.repo_info(REPO, repo_type="kernel").sha == head


@pytest.mark.parametrize("repo_id", ["org/bad--name", "org/..", "org/-lead", "kernels/name", "org/a/b", "org/" + "x" * 97])
def test_bad_repo_ids_are_400(hub, repo_id):
    namespace, _, name = repo_id.partition("/")
    created = request("POST", f"{hub.url}/api/repos/create", headers={"Authorization": f"Bearer {TOKEN}"},
                      body=json.dumps({"name": name, "organization": namespace, "type": "kernel"}).encode())
    assert created.status_code == 400, created.text
    assert request("GET", f"{hub.url}/api/kernels/{repo_id}/refs").status_code in (400, 404)
    assert not (hub.storage.root / "repos" / "kernel" / namespace).exists()


def test_concurrent_commits_to_one_branch_all_land(api, hub):
    api.create_repo(REPO, repo_type="kernel")
    start = threading.Barrier(4)
    results = {}

    def upload(index: int) -> None:
        client = HfApi(endpoint=hub.url, token=TOKEN)
        start.wait()
        results[index] = client.create_commit(
            REPO, repo_type="kernel", commit_message=f"upload {index}",
            operations=[add(f"uploads/{index}.bin", random_bytes(50_000, seed=index)),
                        add("shared/last-writer.txt", f"{index}".encode())],
        )

    assert run_concurrently(upload, 4) == []
    titles = [c.title for c in api.list_repo_commits(REPO, repo_type="kernel")]
    assert sorted(titles[:4]) == [f"upload {index}" for index in range(4)] and titles[4:] == ["initial commit"]
    files = set(api.list_repo_files(REPO, repo_type="kernel"))
    assert {f"uploads/{index}.bin" for index in range(4)} <= files
    for index in range(4):
        content = request("GET", f"{hub.url}/kernels/{REPO}/resolve/main/uploads/{index}.bin").content
        assert content == random_bytes(50_000, seed=index)


def test_stale_parent_commit_is_refused_with_412(api):
    api.create_repo(REPO, repo_type="kernel")
    base = api.repo_info(REPO, repo_type="kernel").sha
    api.create_commit(REPO, repo_type="kernel", commit_message="moves main", operations=[add("a.txt", b"a")])
    with pytest.raises(HfHubHTTPError) as error:
        api.create_commit(REPO, repo_type="kernel", commit_message="stale", operations=[add("b.txt", b"b")],
                          parent_commit=base)
    assert error.value.response.status_code == 412
    assert "b.txt" not in api.list_repo_files(REPO, repo_type="kernel")


def test_listings_paginate(api, hub, monkeypatch):
    monkeypatch.setattr(repo_reads, "PAGE_SIZE", 3)
    api.create_repo(REPO, repo_type="kernel")
    for index in range(4):
        api.create_commit(REPO, repo_type="kernel", commit_message=f"c{index}",
                          operations=[add(f"f{index}/x.txt", bytes([index]))])
    assert len(list(api.list_repo_tree(REPO, repo_type="kernel", recursive=True))) == 8
    assert len(api.list_repo_commits(REPO, repo_type="kernel")) == 5


def test_invalid_readme_metadata_is_rejected(api):
    api.create_repo(REPO, repo_type="kernel")
    with pytest.raises(ValueError, match="Invalid metadata in README.md"):
        api.create_commit(REPO, repo_type="kernel", commit_message="card",
                          operations=[add("README.md", b"---\nlicense: [unclosed\n---\n# card\n")])


def test_organization_overview_reports_trusted_publishers(api):
    api.create_repo("plain-org/k", repo_type="kernel")
    assert getattr(api.get_organization_overview("trusted-org"), "trustedKernelPublisher") is True
    assert getattr(api.get_organization_overview("plain-org"), "trustedKernelPublisher") is False
    with pytest.raises(HfHubHTTPError):
        api.get_organization_overview("no-such-org")


@pytest.mark.multiprocess
def test_hf_cli_downloads_a_kernel_revision(api, hub, tmp_path):
    api.create_repo(REPO, repo_type="kernel")
    api.create_branch(REPO, repo_type="kernel", branch="v1")
    files = {"README.md": b"# card\n", "build/torch-cpu/__init__.py": b"X = 1\n",
             "build/torch-cpu/data.bin": random_bytes(200_000, seed=7)}
    api.create_commit(REPO, repo_type="kernel", revision="v1", commit_message="v1",
                      operations=[add(path, content) for path, content in files.items()])
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_UPDATE_CHECK="1")
    env.pop("HF_TOKEN", None)
    result = subprocess.run(
        [str(Path(sys.executable).with_name("hf")), "download", "--repo-type", "kernel", REPO,
         "--revision", "v1", "--local-dir", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    for path, content in files.items():
        assert (tmp_path / "out" / path).read_bytes() == content


@pytest.fixture
def server_processes():
    """Hub servers run as `python -m tpu_kernels.distribution.hub`; any still alive at the end is killed."""
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def _start_server_process(root: Path, started: list[subprocess.Popen], *flags: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "tpu_kernels.distribution.hub", "--root", str(root), "--port", "0", "--quiet", *flags],
        env=dict(os.environ, TPU_KERNELS_HUB_TOKEN=TOKEN), cwd=REPO_ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    started.append(process)
    first_line = process.stdout.readline()
    assert " at http://" in first_line, first_line
    return process, first_line.split(" at ")[1].split()[0]


def _wait_for_staged_files(staging: Path, count: int, timeout: float = 60) -> None:
    """Until the server has written `count` files of a commit to its staging folder."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if staging.is_dir() and len(list(staging.iterdir())) >= count:
            return
        time.sleep(0.001)
    raise AssertionError("the upload never reached the commit endpoint")


@pytest.mark.multiprocess
def test_sigkill_during_an_upload_leaves_the_branch_at_a_complete_commit(tmp_path, server_processes):
    """Also runs the server as its command line does, with --token from the environment and --trusted-org."""
    root = tmp_path / "hub"
    process, url = _start_server_process(root, server_processes)
    api = HfApi(endpoint=url, token=TOKEN)
    api.create_repo(REPO, repo_type="kernel")
    complete = api.create_commit(REPO, repo_type="kernel", commit_message="complete",
                                 operations=[add("keep.txt", b"kept")])
    big = {f"big/{index}.bin": random_bytes(1 << 20, seed=index) for index in range(24)}
    upload_error: list[BaseException] = []

    def upload() -> None:
        try:
            HfApi(endpoint=url, token=TOKEN).create_commit(
                REPO, repo_type="kernel", commit_message="interrupted",
                operations=[add(path, content) for path, content in big.items()])
        except BaseException as error:  # expected: the server dies mid-request
            upload_error.append(error)

    uploader = threading.Thread(target=upload)
    uploader.start()
    _wait_for_staged_files(root / "tmp", count=len(big) // 2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    uploader.join()
    assert any((root / "tmp").iterdir()), "the kill should land while the commit is being received"
    assert upload_error, "the client should see the connection die"

    process, url = _start_server_process(root, server_processes, "--trusted-org", "org")
    api = HfApi(endpoint=url, token=TOKEN)
    assert getattr(api.get_organization_overview("org"), "trustedKernelPublisher") is True
    head = api.repo_info(REPO, repo_type="kernel").sha
    files = set(api.list_repo_files(REPO, repo_type="kernel"))
    assert head == complete.oid or files == {"keep.txt", *big}
    for path in files:
        expected = b"kept" if path == "keep.txt" else big[path]
        assert request("GET", f"{url}/kernels/{REPO}/resolve/{head}/{path}").content == expected
    assert not any((root / "tmp").iterdir())
    after = api.create_commit(REPO, repo_type="kernel", commit_message="after restart",
                              operations=[add("after.txt", b"ok")])
    assert api.list_repo_commits(REPO, repo_type="kernel")[1].commit_id == head
    assert api.repo_info(REPO, repo_type="kernel").sha == after.oid
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0


def test_a_second_server_on_the_same_root_is_refused(hub):
    with pytest.raises(RuntimeError, match="already using"):
        start_hub(hub.storage.root)
