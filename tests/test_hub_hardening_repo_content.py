"""What a local Hub repo may hold, and how it is kept: tree listings in pages, with git's folder ids;
`.git` in any spelling, invisible characters and names that are one file on macOS or Windows refused;
bad input (a lone surrogate, a path added twice, a commit failing half-way) leaves no blob behind, and
orphan blobs are collected at start; a card is rendered once per content, never for HEAD, and no card
can forge its placeholders.

A real server on loopback with small timeouts and pace limits (hub_support.PACED).
tests/test_hub_fuzz.py runs the bounded fuzz of the commit reader.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import unicodedata
from pathlib import Path

import pytest
from huggingface_hub import CommitOperationDelete, HfApi

from tpu_kernels.distribution.hub import commits as hub_commits
from tpu_kernels.distribution.hub import start_hub
from tpu_kernels.distribution.hub.app import _error_response
from tpu_kernels.distribution.hub.blobs import StagedFile
from tpu_kernels.distribution.hub.errors import HubError
from tpu_kernels.distribution.hub.storage import Storage

from .hub_support import (HEADER, PACED, TOKEN, add, assert_refused_everywhere, commit_body, file_line, http,
                          module_hub, ndjson, stored_state)

pytestmark = pytest.mark.usefixtures("local_agent_registry")


hub = module_hub(TOKEN, PACED)


def orphan_blobs(root: Path) -> list[str]:
    """Blobs in the store that no commit object references."""
    referenced = {entry["sha256"] for commit_file in root.glob("repos/*/*/*/commits/*.json")
                  for entry in json.loads(commit_file.read_bytes())["files"].values()}
    return [blob.name for blob in root.glob("blobs/*/*") if blob.name not in referenced]


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
    error = assert_refused_everywhere(hub, repo, path, b"[core]\n\tfsmonitor = touch /tmp/x\n")
    assert ".git" in error, error


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


# -- 12. cards: rendered once per content, not for HEAD --------------------------------------------


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


# -- 13. invisible characters and name twins -------------------------------------------------------


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


def test_a_card_placeholder_cannot_be_forged_by_a_card(hub, api, repo):
    api.create_commit(repo, repo_type="kernel", commit_message="nul",
                      operations=[add("README.md", b"a\0b [x](y.md) `\0`")])
    status, _, page = http("GET", f"{hub.url}/kernels/{repo}")
    article = page.split(b'class="card"')[1].split(b"</article>")[0]
    assert status == 200 and b"\0" not in article and article.count(b"/resolve/") == 1


def test_an_error_quoting_a_lone_surrogate_still_encodes():
    response = _error_response(HubError(404, "Invalid rev id: \ud800"))
    assert json.loads(response.body)["error"] == "Invalid rev id: \\ud800"
