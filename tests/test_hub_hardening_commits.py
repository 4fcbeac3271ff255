"""What the local Hub lets into a repo: an empty token serves read-only; malformed commit lines, JSON
fields, cursors and forms are 400s that name the field and change nothing; a file/folder clash or a
non-canonical ref name is refused; a private repo is invisible without the token; concurrent commits
all land, and the commit reader reads a body however it is split.

A real server on loopback with small timeouts (hub_support.FAST); huggingface_hub checks that what
a client sees stays right.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

from tpu_kernels.distribution.hub import Limits, start_hub
from tpu_kernels.distribution.hub.commit_payload import MAX_LINE_BYTES

from .hub_support import (FAST, HEADER, REPO, REPO_ROOT, TOKEN, add, connect, file_line, http, module_hub, ndjson,
                          read_until_closed, run_concurrently, status_of, stored_state)

pytestmark = pytest.mark.usefixtures("local_agent_registry")


hub = module_hub(TOKEN, FAST)


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
