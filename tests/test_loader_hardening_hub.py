"""What an attacker gets through the Hub the loader talks to: ids a lying Hub gives (a revision's commit,
a branch's target, tree entries, file headers) never name a path outside the cache, nor does a tree
listing planted in the cache; the trust check comes before anything the Hub says; the ids, fuzzed; and
the errors users see when telemetry is off or the Hub is out of reach.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import pytest
from huggingface_hub import constants
from huggingface_hub.errors import HfHubHTTPError
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tpu_kernels.distribution.digest import KernelIntegrityError, blob_name_matches
from tpu_kernels.distribution.loader import HubUnreachableError, UnsafeIdError, get_kernel, ids

from .hostile_hub import branch_target, extra_branches, file_body, file_header, hostile_hub, revision_sha, tree_files
from .loader_support import (FAST_SUBPROCESS_ENV, REPO, forget_loaded_kernels, make_build, point_clients_at, publish,
                             run_python, subprocess_env)

pytestmark = pytest.mark.usefixtures("local_agent_registry")

UNTRUSTED = "someone/answer"


def files_outside(root: Path, *inside: Path) -> dict[str, bytes | None]:
    """Every path under `root` but those under `inside`, with file contents (None for folders and links)."""
    found = {}
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if Path(folder) / name not in inside]
        for name in subfolders + files:
            path = Path(folder) / name
            regular = path.is_file() and not path.is_symlink()
            found[str(path.relative_to(root))] = path.read_bytes() if regular else None
    return found


# -- found 3: ids from the server ----------------------------------------------------------------------


@pytest.fixture
def hostile(hub, monkeypatch, tmp_path):
    """A hostile Hub in front of `hub`, with this process's clients pointed at it; and a folder to lose."""
    with hostile_hub(hub.url) as server:
        point_clients_at(monkeypatch, server.url, tmp_path / "cache")
        victim = tmp_path / "victim"
        victim.mkdir()
        (victim / "precious.txt").write_text("keep me\n")
        yield server


# Relative to any folder of a repo's cache (snapshots/, blobs/, refs/, trees/, .no_exist/), this is
# tmp_path/victim: outside the cache.
OUT = "../../../victim"


def lie_about_commits(make_lie, fake: str, commit: str):
    """The lie, told consistently: the server also answers for `fake` as if it were `commit`."""
    return make_lie(fake), {fake: commit}


def _set(field: str, value):
    def edit(entry: dict) -> None:
        entry[field] = value
    return edit


def _altered(body: bytes) -> bytes:
    """Same length, other code: what a man in the middle would send under the real ETag."""
    return body.replace(b"5", b"6") if b"VALUE = 5" in body else body


HOSTILE_CASES = {
    "revision sha with ../": (lambda commit: lie_about_commits(revision_sha, OUT, commit),
                              {"revision": "v1"}, UnsafeIdError, "revision 'v1'"),
    "revision sha with ../, force_download": (lambda commit: lie_about_commits(revision_sha, OUT, commit),
                                              {"revision": "v1", "force_download": True}, UnsafeIdError, "revision 'v1'"),
    "targetCommit with ../": (lambda commit: lie_about_commits(branch_target, OUT, commit),
                              {"version": 1}, UnsafeIdError, "branch v1"),
    "targetCommit with ../, force_download": (lambda commit: lie_about_commits(branch_target, OUT, commit),
                                              {"version": 1, "force_download": True}, UnsafeIdError, "branch v1"),
    "targetCommit in capitals": (lambda commit: lie_about_commits(branch_target, commit.upper(), commit),
                                 {"version": 1}, UnsafeIdError, "branch v1"),
    "tree oid with ../": (lambda commit: (tree_files(_set("oid", f"{OUT}/planted")), {}),
                          {"version": 1}, UnsafeIdError, "blob id '../../../victim/planted'"),
    "tree LFS oid with ../": (lambda commit: (tree_files(_set("lfs", {"oid": f"{OUT}/planted", "size": 10, "pointerSize": 130})), {}),
                              {"version": 1}, UnsafeIdError, "blob id '../../../victim/planted'"),
    "tree path with ../": (lambda commit: (tree_files(lambda entry: entry.update(path="build/torch-cpu/../" + OUT)), {}),
                           {"version": 1}, UnsafeIdError, "not a plain relative path"),
    "tree oid of other bytes": (lambda commit: (tree_files(_set("oid", "0" * 40)), {}),
                                {"version": 1}, KernelIntegrityError, "are not blob 0000"),
    "file bytes altered under the real ETag": (lambda commit: (file_body(_altered), {}),
                                               {"version": 1}, KernelIntegrityError, "are not blob"),
    "X-Repo-Commit with ../ on a 404": (lambda commit: (file_header("X-Repo-Commit", OUT, status=404), {}),
                                        {"version": 1}, HfHubHTTPError, "404"),
}


@pytest.mark.parametrize("case", HOSTILE_CASES)
def test_ids_from_a_lying_hub_never_name_a_path(hub, hostile, tmp_path, case):
    make_lie, load, error, message = HOSTILE_CASES[case]
    publication = publish(hub, make_build(tmp_path, answer=5))
    cache = tmp_path / "cache"
    outside = files_outside(tmp_path, cache, tmp_path / "hub")
    hostile.lie, hostile.aliases = make_lie(publication.build_oid)
    with pytest.raises(error, match=message):
        get_kernel(REPO, **load)
    assert files_outside(tmp_path, cache, tmp_path / "hub") == outside
    blobs = cache / "kernels--trusted-org--answer" / "blobs"
    assert all(blob_name_matches(blob.name, blob.read_bytes()) for blob in blobs.glob("*"))  # no lie stays cached
    hostile.lie, hostile.aliases = None, {}
    forget_loaded_kernels()
    assert get_kernel(REPO, **load).answer() == 5  # told the truth, the same call loads


# Headers huggingface_hub would name cache files after; our downloads name them after checked ids only.
IGNORED_HEADER_LIES = {
    "ETag with ../": file_header("ETag", f'"{OUT}/planted"'),
    "weak ETag with ../": file_header("ETag", f'W/"{OUT}/planted"'),
    "X-Linked-Etag with ../": file_header("X-Linked-Etag", f"{OUT}/planted"),
    "X-Repo-Commit with ../": file_header("X-Repo-Commit", OUT),
    "X-Repo-Commit of another commit": file_header("X-Repo-Commit", "0" * 40),
}


@pytest.mark.parametrize("case", IGNORED_HEADER_LIES)
def test_file_headers_name_nothing(hub, hostile, tmp_path, case):
    publish(hub, make_build(tmp_path, answer=5))
    cache = tmp_path / "cache"
    outside = files_outside(tmp_path, cache, tmp_path / "hub")
    hostile.lie = IGNORED_HEADER_LIES[case]
    assert get_kernel(REPO, version=1).answer() == 5
    assert files_outside(tmp_path, cache, tmp_path / "hub") == outside
    names = {path.name for path in cache.rglob("*")}
    assert not any("victim" in name or name == "0" * 40 for name in names)


def test_a_tree_listing_planted_in_the_cache_is_never_read(hub, client, tmp_path):
    """huggingface_hub takes ETags from a tree listing it cached (trees/<commit>.json, written from what a server
    said); our downloads never read it."""
    publication = publish(hub, make_build(tmp_path, answer=5))
    trees = client / "kernels--trusted-org--answer" / "trees"
    trees.mkdir(parents=True)
    listing = {"format_version": 1, "files": {"build/torch-cpu/metadata.json": {
        "size": 10, "blob_id": "0" * 40, "lfs_sha256": f"{OUT}/planted", "lfs_size": 10, "xet_hash": "a" * 64}}}
    (trees / f"{publication.build_oid}.json").write_text(json.dumps(listing))
    outside = files_outside(tmp_path, client, tmp_path / "hub")
    assert get_kernel(REPO, version=1).answer() == 5
    assert files_outside(tmp_path, client, tmp_path / "hub") == outside


def test_the_trust_check_comes_before_anything_a_lying_hub_says(hub, hostile, tmp_path):
    publication = publish(hub, make_build(tmp_path, answer=5), repo_id=UNTRUSTED)
    outside = files_outside(tmp_path, tmp_path / "cache", tmp_path / "hub")
    hostile.lie, hostile.aliases = lie_about_commits(revision_sha, OUT, publication.build_oid)
    with pytest.raises(ValueError, match="not from a trusted publisher"):
        get_kernel(UNTRUSTED, revision="v1", force_download=True)
    assert files_outside(tmp_path, tmp_path / "cache", tmp_path / "hub") == outside
    assert (tmp_path / "victim" / "precious.txt").exists()


def test_branches_that_are_not_versions_are_ignored(hub, hostile, tmp_path):
    publish(hub, make_build(tmp_path, answer=5))
    hostile.lie = extra_branches(*({"name": name, "ref": f"refs/heads/{name}", "targetCommit": OUT}
                                   for name in ("v1/../../victim", "v01", "v+2", "v2 ", "v٢")))
    assert get_kernel(REPO, version=1).answer() == 5
    with pytest.raises(ValueError, match="Version 2 not found, available versions: 1$"):
        get_kernel(REPO, version=2)


def test_refs_in_the_cache_are_checked_offline(hub, client, tmp_path, monkeypatch):
    publication = publish(hub, make_build(tmp_path, answer=5))
    assert get_kernel(REPO, version=1).answer() == 5
    refs = client / "kernels--trusted-org--answer" / "refs"
    assert (refs / "v1").read_text() == publication.build_oid
    (refs / "v1").write_text(OUT)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UnsafeIdError, match="refs/v1 gives .*ref v1 the commit id '../../../victim'"):
        get_kernel(REPO, version=1)
    with pytest.raises(UnsafeIdError, match="refs/v1 gives .* the commit id '../../../victim'"):
        get_kernel(REPO, revision="v1")
    with pytest.raises(UnsafeIdError, match="is not a branch or tag name"):
        get_kernel(REPO, revision=OUT)


# -- found 4 and 5: telemetry off, and a Hub out of reach ----------------------------------------------


def test_loads_and_trust_checks_work_with_telemetry_off(hub, client, tmp_path):
    publish(hub, make_build(tmp_path, answer=5))
    publish(hub, make_build(tmp_path, answer=7), repo_id=UNTRUSTED)
    trusted, untrusted = run_python(f"""
        import json
        from tpu_kernels.distribution.loader import get_kernel
        trusted = get_kernel({REPO!r}, version=1).answer()
        try:
            get_kernel({UNTRUSTED!r}, version=1)
        except ValueError as error:
            untrusted = str(error)
        print(json.dumps([trusted, untrusted]))
    """, subprocess_env(hub, tmp_path / "telemetry-off-cache", tmp_path, HF_HUB_DISABLE_TELEMETRY="1",
                        **FAST_SUBPROCESS_ENV))
    assert trusted == 5
    assert "not from a trusted publisher" in untrusted


def closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def test_an_unreachable_hub_is_named_with_the_failure_and_no_advice_to_trust(tmp_path, monkeypatch):
    from .test_kernelize import _tiny_model

    from tpu_kernels import kernelize

    url = closed_port_url()
    point_clients_at(monkeypatch, url, tmp_path / "cache")
    calls = {
        "get_kernel": lambda: get_kernel(REPO, version=1),
        "get_kernel, trust_remote_code": lambda: get_kernel(REPO, version=1, trust_remote_code=True),
        "kernelize, a repo": lambda: kernelize(_tiny_model("qwen3_moe"),
                                               repos={"experts": f"{REPO}@1", "rmsnorm": None, "attention": None}),
        "kernelize, the default repos": lambda: kernelize(_tiny_model("qwen3_moe")),
    }
    for name, call in calls.items():
        with pytest.raises(HubUnreachableError) as raised:
            call()
        message = str(raised.value)
        assert f"Cannot reach the Hub at {url}: ConnectError" in message, (name, message)
        assert "refused" in message and "trust_remote_code" not in message, (name, message)
        if name.startswith("kernelize"):
            assert raised.value.__notes__[-1].startswith("kernelize: while loading the experts kernel "), name


# -- the ids, fuzzed (bounded: about 20 s) -------------------------------------------------------------

HEX = "0123456789abcdef"
# Values near the valid ones (hex of other lengths and cases, with a traversal) and arbitrary ones.
# Header values are kept to what HTTP can carry.
header_ids = st.one_of(
    st.text(alphabet=HEX + "ABCDEF", min_size=38, max_size=66),
    st.builds(lambda a, b: a + b, st.sampled_from(["../", "../../", "/", "..\\", "./", ""]),
              st.text(alphabet=HEX + "/.", max_size=70)),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=80),
)
json_ids = st.one_of(header_ids, st.text(max_size=80))
LIES = {
    "sha": (lambda value: revision_sha(value), {"revision": "v1"}),
    "targetCommit": (lambda value: branch_target(value), {"version": 1}),
    "tree oid": (lambda value: tree_files(_set("oid", value)), {"version": 1}),
    "tree path": (lambda value: tree_files(lambda entry: entry.update(path="build/torch-cpu/" + value)), {"version": 1}),
    "ETag": (lambda value: file_header("ETag", f'"{value}"'), {"version": 1}),
    "X-Repo-Commit": (lambda value: file_header("X-Repo-Commit", value), {"version": 1}),
}
# Headers name nothing in our downloads: a load through them may succeed, with the true bytes.
HARMLESS_LIES = {"ETag", "X-Repo-Commit"}
# The hostile Hub answers for a lie's fake revision id by rewriting path segments equal to it: a fake id equal
# to a segment of the loader's own requests (`/api/kernels/<org>/<name>/revision/v1`, ...) would rewrite the
# request itself, not test the loader with the lie.
ALIASED_LIES = {"sha", "targetCommit"}
REQUEST_SEGMENTS = {"", "api", "kernels", *REPO.split("/"), "revision", "v1", "refs", "tree", "resolve", "main"}


@pytest.mark.slow
def test_ids_from_the_server_fuzzed(hub, hostile, tmp_path, monkeypatch):
    publication = publish(hub, make_build(tmp_path, answer=5))
    commit = publication.build_oid
    outside = files_outside(tmp_path, tmp_path / "hub", tmp_path / "caches")
    started = time.monotonic()
    examples = []

    @settings(max_examples=100, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(lie=st.sampled_from(sorted(LIES)), data=st.data())
    def load_through_a_lie(lie, data):
        value = data.draw(header_ids if lie in HARMLESS_LIES else json_ids)
        assume(lie not in ALIASED_LIES or value not in REQUEST_SEGMENTS)
        make_lie, load = LIES[lie]
        cache = Path(tempfile.mkdtemp(dir=tmp_path / "caches"))
        monkeypatch.setenv("KERNELS_CACHE", str(cache))
        hostile.lie, hostile.aliases = make_lie(value), {value: commit} if lie in ALIASED_LIES else {}
        forget_loaded_kernels()
        try:
            answer = get_kernel(REPO, **load).answer()
        except (UnsafeIdError, KernelIntegrityError) as error:  # a blob id, but not this file's: integrity
            outcome = type(error).__name__
        else:
            outcome = f"loaded {answer}"
        examples.append((lie, value, outcome))
        assert files_outside(tmp_path, tmp_path / "hub", tmp_path / "caches") == outside
        for folder, _, files in os.walk(cache):  # inside the cache, only names from checked ids
            for name in files:
                assert ".." not in Path(folder, name).relative_to(cache).parts
        blobs = cache / "kernels--trusted-org--answer" / "blobs"
        assert all(blob_name_matches(blob.name, blob.read_bytes()) for blob in blobs.glob("*"))

    (tmp_path / "caches").mkdir()
    load_through_a_lie()
    elapsed = time.monotonic() - started
    outcomes = collections.Counter((lie, outcome) for lie, _, outcome in examples)
    print(f"{len(examples)} lies in {elapsed:.1f} s: {dict(sorted(outcomes.items()))}")
    loaded = [example for example in examples if example[2].startswith("loaded")]
    assert all(lie in HARMLESS_LIES and outcome == "loaded 5" for lie, _, outcome in loaded)  # no lie that counts loads
    assert elapsed < 40, elapsed


@settings(max_examples=2000, deadline=None, database=None)
@given(name=st.one_of(st.text(), st.text(alphabet="./\\abv019-_ ", max_size=30)))
def test_ref_names_the_loader_writes_stay_in_refs(name):
    refs = Path("/cache/kernels--o--n/refs")
    if ids.is_ref_name(name):
        assert Path(os.path.normpath(refs / name)).is_relative_to(refs) and (refs / name) != refs
    try:
        commit = ids.checked_commit(name, "test", "a fuzzed id")
    except UnsafeIdError:
        assert not ids.REGEX_COMMIT_HASH.fullmatch(name)
    else:
        assert commit == name and len(name) == 40 and set(name) <= set(HEX)
