"""Hostile input to pages, builder and caches, each refused or bounded: cards that expand, the card cache, symlinks
in a kernel source, the on-disk caches, NTFS aliases, control characters in a revision, hostile
calibration input, the cache root, and the server's folder modes.

A real server on loopback where a client would see the difference; in this process where memory is
measured (tracemalloc) or an internal bound is the point.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tracemalloc
from pathlib import Path
from urllib.parse import unquote

import anyio
import pytest
from huggingface_hub import HfApi

from tpu_kernels.distribution.hub import card as hub_card
from tpu_kernels.distribution.hub import start_hub

from .hub_support import FAST, HEADER, REPO_ROOT, TOKEN, add, assert_refused_everywhere, http, module_hub, ndjson

pytestmark = pytest.mark.usefixtures("local_agent_registry")

hub = module_hub(TOKEN, FAST)


def amplified_card(url_bytes: int, uses: int) -> bytes:
    """A card defining one reference link whose URL is `url_bytes` long and using it `uses` times:
    markdown-it copies the URL into every use."""
    return b"---\nlicense: mit\n---\n# Amplified\n\n[r]: https://example.com/" + b"x" * url_bytes + b"\n\n" + \
        b"[a][r] " * uses + b"\n"


# -- 1. a card whose references expand is cut, and says so; a view holds no whole page ---------------


def test_a_card_whose_reference_links_expand_is_cut_on_its_page_and_says_so(hub, api, repo):
    # 8 KiB x 1,000 uses: 8 MB of HTML from an 8 KB card before.
    api.create_commit(repo, repo_type="kernel", commit_message="card",
                      operations=[add("README.md", amplified_card(8 << 10, 1000))])
    status, _, page = http("GET", f"{hub.url}/kernels/{repo}")
    assert status == 200
    card_html = page.split(b'<article class="card">')[1].split(b"</article>")[0]
    assert len(card_html) <= hub_card.MAX_CARD_HTML_CHARS
    assert len(page) < hub_card.MAX_CARD_HTML_CHARS + (64 << 10)
    assert b"The card is cut here" in card_html and b"/README.md\">README.md</a>" in card_html
    assert b"license: mit" in card_html and card_html.count(b"<a ") > 10  # what fits is shown


def test_front_matter_aliases_cannot_repeat_a_tag_without_bound(hub, api, repo):
    tag = "t" * 10_000
    front = f"---\nlicense: mit\nx: &big {tag}\ntags: [{', '.join(['*big'] * 8_000)}]\n---\n# aliases\n"
    assert len(front) < hub_card.MAX_FRONT_MATTER_CHARS + 20
    api.create_commit(repo, repo_type="kernel", commit_message="card", operations=[add("README.md", front.encode())])
    status, _, page = http("GET", f"{hub.url}/kernels/{repo}")
    assert status == 200 and b"aliases</h1>" in page
    assert len(page) < 256 << 10  # 80 MB before


def _drain(response) -> int:
    """Reads a page's whole body a chunk at a time, keeping none; its largest chunk."""
    async def read() -> int:
        largest = 0
        async for chunk in response.body_iterator:
            largest = max(largest, len(chunk))
        return largest

    if hasattr(response, "body_iterator"):
        return anyio.run(read)
    return len(response.body)


def test_a_view_of_a_cached_card_holds_a_bounded_piece_of_the_page_not_the_page(hub, api, repo):
    api.create_commit(repo, repo_type="kernel", commit_message="card",
                      operations=[add("README.md", amplified_card(8 << 10, 1000))])
    pages = hub._app.pages
    _drain(pages.repo("kernel", repo, hub.url))  # renders the card into the cache
    tracemalloc.start()
    try:
        largest = _drain(pages.repo("kernel", repo, hub.url))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Before: the page was built whole (8 MB, three copies of it at the peak).
    assert largest <= 2 * (64 << 10) and peak < 1 << 20, (largest, peak)


# -- 2. the card cache: bounded per card, so one card cannot evict the others -------------------------


def test_a_huge_card_does_not_evict_the_other_cached_cards(hub, api, renders):
    small = []
    for index in range(3):
        repo_id = f"org/small-card-{index}"
        api.create_repo(repo_id, repo_type="kernel")
        api.create_commit(repo_id, repo_type="kernel", commit_message="card",
                          operations=[add("README.md", f"# small {index}\n\n![plot](plot.png)\n".encode())])
        small.append(repo_id)
    api.create_repo("org/huge-card", repo_type="kernel")
    # 48 KiB x 700 uses: 34 MB of HTML before, more than the whole cache (32 MiB).
    api.create_commit("org/huge-card", repo_type="kernel", commit_message="card",
                      operations=[add("README.md", amplified_card(48 << 10, 700))])
    for repo_id in small:
        assert http("GET", f"{hub.url}/kernels/{repo_id}")[0] == 200
    assert len(renders) == 3
    assert http("GET", f"{hub.url}/kernels/org/huge-card")[0] == 200
    assert len(renders) == 4
    for repo_id in small:
        status, _, page = http("GET", f"{hub.url}/kernels/{repo_id}")
        assert status == 200 and b"/plot.png" in page
    assert len(renders) == 4  # each small card still cached: not rendered again


def test_the_card_cache_bounds_each_card_to_a_share_of_the_whole():
    cache = hub_card.CardCache(max_chars=1 << 20)
    assert cache.max_entry_chars <= (1 << 20) // 8
    for index in range(6):
        cache.card(f"small-{index}", lambda index=index: f"# card {index}\n".encode())
    huge = cache.card("huge", lambda: amplified_card(8 << 10, 1000))
    assert huge.cut and len(huge.html) <= cache.max_entry_chars
    rendered = []
    for index in range(6):
        cache.card(f"small-{index}", lambda: rendered.append(1) or b"")
    assert rendered == []


# -- 5. NTFS aliases: streams and 8.3 short names of a file ------------------------------------------

NTFS_ALIASES = ["README.md::$DATA", "README.md:$DATA", "config.json:evil", "CONFIG~1.JSO", "config~1.jso",
                "c/D~1.TXT", "c/d.txt:Zone.Identifier", "CO1A2B~1.JSO", "README~1.MD.", "c:x/y"]
NOT_ALIASES = ["notes~draft.md", "x~1.tar.gz", "ABCDEFG~1", "v~1a.json", "c/~x", "config.json.bak"]


@pytest.mark.parametrize("path", NTFS_ALIASES)
def test_ntfs_streams_and_short_names_of_a_file_are_refused_everywhere(hub, api, repo, path):
    api.create_commit(repo, repo_type="kernel", commit_message="config", operations=[add("config.json", b"{}")])
    error = assert_refused_everywhere(hub, repo, path, b"overwrites the file it aliases on NTFS")
    assert "':'" in error or "8.3 short name" in error


def test_names_that_only_look_like_short_names_are_fine(api, repo):
    api.create_commit(repo, repo_type="kernel", commit_message="lookalikes",
                      operations=[add(path, b"ok\n") for path in NOT_ALIASES])
    assert set(NOT_ALIASES) <= set(api.list_repo_files(repo, repo_type="kernel"))


# -- 6. a control character in a revision: a clean 4xx, nothing in the log --------------------------


REVISION_ROUTES = [
    ("GET", "/kernels/{repo}/resolve/{rev}/c/d.txt"), ("HEAD", "/kernels/{repo}/resolve/{rev}/c/d.txt"),
    ("GET", "/api/kernels/{repo}/revision/{rev}"), ("GET", "/api/kernels/{repo}/tree/{rev}"),
    ("GET", "/api/kernels/{repo}/tree/{rev}/c"), ("GET", "/api/kernels/{repo}/commits/{rev}"),
    ("POST", "/api/kernels/{repo}/paths-info/{rev}"), ("GET", "/kernels/{repo}/tree/{rev}"),
    ("POST", "/api/kernels/{repo}/commit/{rev}"), ("DELETE", "/api/kernels/{repo}/branch/{rev}"),
    ("DELETE", "/api/kernels/{repo}/tag/{rev}"), ("POST", "/api/kernels/{repo}/tag/{rev}"),
    ("POST", "/api/kernels/{repo}/branch/x"),
]


@pytest.mark.parametrize("revision", ["main%00", "main%00x", "%00", "ma%0D%0Ain", "main%01", "v1%7F"])
@pytest.mark.parametrize("method, route", REVISION_ROUTES)
def test_a_control_character_in_a_revision_is_a_clean_4xx(hub, repo, errors_logged, method, route, revision):
    url = hub.url + route.format(repo=repo, rev=revision)
    body = {"commit/": ndjson(HEADER), "paths-info/": b"paths=c", "/tag/": json.dumps({"tag": "t"}).encode(),
            "/branch/x": json.dumps({"startingPoint": unquote(revision)}).encode()}
    payload = next((value for key, value in body.items() if key in route and method == "POST"), b"")
    headers = {"Content-Type": "application/x-ndjson" if "commit/" in route else
               "application/x-www-form-urlencoded" if "paths-info" in route else "application/json"}
    status, answer_headers, answer = http(method, url, payload, token=TOKEN, headers=headers)
    assert 400 <= status < 500, (status, answer[:300])
    assert all(" " <= char <= "~" for value in answer_headers.values() for char in value)
    assert errors_logged() == []


# -- 11. the server's folders are 0700, its files 0600 ----------------------------------------------


def test_the_servers_folders_are_0700_and_its_files_0600(tmp_path):
    root = tmp_path / "new-root"
    with start_hub(root, token=TOKEN) as running:
        api = HfApi(endpoint=running.url, token=TOKEN)
        api.create_repo("secret-org/private-kernel", repo_type="kernel", private=True)
        api.create_commit("secret-org/private-kernel", repo_type="kernel", commit_message="x",
                          operations=[add("build/torch-cpu/x.py", b"x = 1\n")])
        paths = [root, *root.rglob("*")]
        modes = {path.relative_to(tmp_path).as_posix(): stat.S_IMODE(path.stat().st_mode) for path in paths}
    folders = {path: mode for path, mode in modes.items() if (tmp_path / path).is_dir()}
    files = {path: mode for path, mode in modes.items() if not (tmp_path / path).is_dir()}
    assert any("secret-org" in path for path in folders) and any("commits" in path for path in folders)
    assert set(folders.values()) == {0o700}, folders
    assert set(files.values()) == {0o600}, files


def test_a_root_an_earlier_server_left_open_is_closed_at_start(tmp_path):
    root = tmp_path / "old-root"
    for folder in ("blobs", "repos/kernel/org/k", "tmp"):
        (root / folder).mkdir(parents=True)
    for folder in ("blobs", "repos", "tmp"):
        os.chmod(root / folder, 0o755)
    with start_hub(root, token=TOKEN):
        pass
    assert {stat.S_IMODE((root / folder).stat().st_mode) for folder in ("blobs", "repos", "tmp")} == {0o700}


# -- 3. a symbolic link in a kernel source or a build is refused, never followed out -----------------

PRIVATE_KEY = b"-----BEGIN OPENSSH PRIVATE KEY-----\nnot a real key, but private\n-----END OPENSSH PRIVATE KEY-----\n"


@pytest.fixture
def private_key(tmp_path) -> Path:
    secrets = tmp_path / "home" / ".ssh"
    secrets.mkdir(parents=True)
    (secrets / "id_ed25519").write_bytes(PRIVATE_KEY)
    return secrets / "id_ed25519"


@pytest.fixture
def kernel_source(tmp_path) -> Path:
    source = tmp_path / "rmsnorm-tpu"
    shutil.copytree(REPO_ROOT / "kernel_repos" / "rmsnorm-tpu", source,
                    ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    return source


def _plant(source: Path, where: str, target: Path) -> Path:
    """A link at `where` (relative to `source`) to `target`: a file, or for `benchmarks/data` its folder."""
    link = source / where
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.exists():
        link.unlink()
    link.symlink_to(target.parent if where.endswith("data") else target)
    return link


def _files_holding(folder: Path, content: bytes) -> list[Path]:
    return [path for path in folder.rglob("*") if path.is_file() and content in path.read_bytes()]


@pytest.mark.parametrize("where", ["torch-ext/rmsnorm_tpu/keys.py", "benchmarks/data", "CARD.md",
                                   "torch-ext/rmsnorm_tpu/sub/deeper/k.txt"])
def test_build_refuses_a_symbolic_link_out_of_the_kernel_repo_and_names_it(tmp_path, kernel_source, private_key,
                                                                           where, capsys):
    from tpu_kernels import cli

    link = _plant(kernel_source, where, private_key)
    out = tmp_path / "build"
    assert cli.main(["build", str(kernel_source), "--out", str(out)]) == 1
    error = capsys.readouterr().err
    assert str(link) in error and "symbolic link" in error and "Traceback" not in error
    assert not out.exists() or _files_holding(out, b"PRIVATE KEY") == []


def test_build_copies_a_link_to_a_file_inside_the_kernel_repo_as_that_file(tmp_path, kernel_source):
    from tpu_kernels.distribution.builder import build_kernel_repo

    (kernel_source / "benchmarks").mkdir(exist_ok=True)
    (kernel_source / "benchmarks" / "notes.md").symlink_to(kernel_source / "CARD.md")
    built = build_kernel_repo(kernel_source, tmp_path / "build")
    copied = built / "benchmarks" / "notes.md"
    assert not copied.is_symlink() and copied.read_bytes() == (kernel_source / "CARD.md").read_bytes()


@pytest.mark.parametrize("where", ["README.md", "benchmarks/data", "build/torch-cpu/extra/key.txt"])
def test_upload_refuses_a_symbolic_link_out_of_the_build_and_publishes_nothing(hub, tmp_path, kernel_source,
                                                                              private_key, where):
    from tpu_kernels.distribution.builder import build_kernel_repo
    from tpu_kernels.distribution.publish import upload_kernel

    built = build_kernel_repo(kernel_source, tmp_path / "build")
    link = _plant(built, where, private_key)
    repo_id = f"org/linked-{where.replace('/', '-').replace('.', '-')}"
    with pytest.raises(ValueError) as refused:  # `tpu-kernels upload` prints it and exits 1
        upload_kernel(built, repo_id, endpoint=hub.url, token=TOKEN)
    assert refused.value.link == link and str(link) in str(refused.value)
    assert not (hub.storage.root / "repos" / "kernel" / repo_id).exists()
    assert _files_holding(hub.storage.root / "blobs", b"PRIVATE KEY") == []


# -- 4. the on-disk caches: nothing read runs code unless this user wrote it; private folders only ----


class _Planted:
    """Unpickled, it makes the folder `marker`: proof that reading the cache ran code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


@pytest.fixture
def cache_home(tmp_path, monkeypatch) -> Path:
    """XDG_CACHE_HOME (and HOME) in the test's folder: the HMAC key and default caches go there."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    (tmp_path / "home").mkdir(mode=0o700)
    return tmp_path / "xdg"


def _cache_classes():
    from benchmarks.studies.moe_layer.cache import Cache
    from benchmarks.perf.calibration import AnalysisCache
    from tpu_kernels.disk_cache import DiskCache

    return {"DiskCache (check's aot cache)": DiskCache, "calibration.AnalysisCache": AnalysisCache,
            "moe_layer Cache": Cache}


@pytest.mark.parametrize("kind", ["DiskCache (check's aot cache)", "calibration.AnalysisCache", "moe_layer Cache"])
def test_a_pickle_planted_in_a_cache_is_a_miss_and_never_runs(tmp_path, cache_home, kind):
    import pickle

    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    marker = tmp_path / "code-ran"
    (folder / "compile-planted.pkl").write_bytes(pickle.dumps(_Planted(marker)))
    cache = _cache_classes()[kind](folder)
    assert cache.get("compile-planted") is None and not marker.exists()
    # An entry of this format under another key (copied or renamed), or with its bytes changed, is a miss too.
    cache.put("compile-mine", {"flops": 1.0})
    entry = (folder / "compile-mine.pkl").read_bytes()
    (folder / "compile-copied.pkl").write_bytes(entry)
    assert cache.get("compile-copied") is None
    (folder / "compile-mine.pkl").write_bytes(entry[:-len(pickle.dumps({"flops": 1.0}))] +
                                             pickle.dumps(_Planted(marker)))
    assert cache.get("compile-mine") is None and not marker.exists()
    assert cache.put("compile-new", [1, 2]) == [1, 2] and cache.get("compile-new") == [1, 2]
    assert (cache.hits, cache.misses) == (1, 3)


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_cache_folder_others_can_write_is_refused(tmp_path, cache_home, mode):
    from tpu_kernels.disk_cache import DiskCache

    folder = tmp_path / "shared-cache"
    folder.mkdir()
    os.chmod(folder, mode)
    with pytest.raises(RuntimeError, match="Refusing the cache folder .*other users can change it"):
        DiskCache(folder)
    below = tmp_path / "open-parent"
    below.mkdir()
    os.chmod(below, 0o777)
    with pytest.raises(RuntimeError, match="above it can be changed by other users"):
        DiskCache(below / "cache")
    os.chmod(below, 0o1777)  # sticky: others cannot rename or replace what is ours
    DiskCache(below / "cache-2")


def test_calibrate_on_a_cache_folder_others_can_write_exits_2_with_a_message(tmp_path, cache_home, capsys):
    from benchmarks import cli

    folder = tmp_path / "shared-cache"
    folder.mkdir()
    os.chmod(folder, 0o777)
    (tmp_path / "timings").mkdir()
    assert cli.main(["calibrate", str(tmp_path / "timings"), "--out", str(tmp_path / "out.json"),
                     "--cache-dir", str(folder)]) == 2
    error = capsys.readouterr().err
    assert "Refusing the cache folder" in error and "Traceback" not in error


def test_the_hmac_key_is_made_0600_and_one_others_can_read_is_refused(tmp_path, cache_home):
    from tpu_kernels import disk_cache

    disk_cache.DiskCache(tmp_path / "cache").put("k", 1)
    key = cache_home / "tpu-kernels" / disk_cache.HMAC_KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32
    assert stat.S_IMODE((cache_home / "tpu-kernels").stat().st_mode) == 0o700
    os.chmod(key, 0o644)
    disk_cache._keys.clear()
    with pytest.raises(disk_cache.UnsafeCacheError, match="only this user can read"):
        disk_cache.DiskCache(tmp_path / "cache")


# -- 8. one cache root, and it honours XDG_CACHE_HOME -------------------------------------------------


def test_calibrate_keeps_its_cache_below_xdg_cache_home(tmp_path, cache_home):
    from benchmarks import cli

    (tmp_path / "timings").mkdir()
    assert cli.main(["calibrate", str(tmp_path / "timings"), "--out", str(tmp_path / "out.json")]) == 0
    assert (cache_home / "tpu-kernels" / "calibration").is_dir()
    assert not (tmp_path / "home" / ".cache").exists()


def test_every_cache_root_comes_from_one_function():
    import ast

    readers = []
    for path in sorted((REPO_ROOT / "tpu_kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in ("XDG_CACHE_HOME", ".cache"):
                readers.append(path.relative_to(REPO_ROOT).as_posix())
    assert sorted(set(readers)) == ["tpu_kernels/disk_cache.py"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_default_cache_folders_are_below_xdg_cache_home(tmp_path):
    # The defaults are read when the modules are imported: in a new process.
    code = ("from tpu_kernels import aot; from benchmarks.studies.moe_layer import run, vllm_kernels; "
            "from benchmarks.perf import calibration; "
            "print([str(p) for p in (aot.DEFAULT_CACHE, calibration.DEFAULT_CACHE, run.DEFAULT_CACHE, "
            "vllm_kernels.DEFAULT_FOLDER)])")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "xdg"), JAX_PLATFORMS="cpu")
    printed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert json.loads(printed.strip().replace("'", '"')) == [
        str(tmp_path / "xdg" / "tpu-kernels" / name) for name in ("aot", "calibration", "moe_layer", "wheels")]


# -- 7. calibrate on hostile JSON: exit 2 with a message, never a traceback ----------------------------

RAGGED_CALL = {"lhs": "bf16[8,128]", "rhs": "bf16[2,128,128]", "group_sizes": [4, 4],
               "ragged_dot_dimension_numbers": {"dot_dimension_numbers": [[[1], [1]], [[], []]],
                                                "lhs_ragged_dimensions": [0], "rhs_group_dimensions": [0]},
               "precision": ["DEFAULT", "DEFAULT"], "preferred_element_type": None, "return_residuals": False,
               "activation": None}
RAGGED_KEY = json.dumps(RAGGED_CALL)
TIMED = {"evaluation_times_ms": [0.5, 0.4]}
HOSTILE_TIMINGS = {
    "a key that is not JSON": ("ragged_dot.json", json.dumps({"not json": {"{}": TIMED}})),
    "configs as a list": ("ragged_dot.json", json.dumps({RAGGED_KEY: [1, 2]})),
    "an int result": ("ragged_dot.json", json.dumps({RAGGED_KEY: {"{}": 3}})),
    "string times": ("ragged_dot.json", json.dumps({RAGGED_KEY: {"{}": {"evaluation_times_ms": ["a", "b"]}}})),
    "200k-deep nesting": ("ragged_dot.json", '{"a":' * 200_000 + "1" + "}" * 200_000),
    "200k-deep nesting in a key": ("ragged_dot.json", json.dumps({"[" * 200_000 + "]" * 200_000: {"{}": TIMED}})),
    "a negative tile": ("pallas_mosaic_tpu_ragged_dot.json",
                        json.dumps({RAGGED_KEY: {json.dumps({"tile_m": -128, "tile_k": 128, "tile_n": 128}): TIMED}})),
    "a huge group count": ("ragged_dot.json", json.dumps(
        {json.dumps({**RAGGED_CALL, "group_sizes": {"num_groups": 10**12, "total_size": 10**12}}): {"{}": TIMED}})),
    "a key without the call's fields": ("ragged_dot.json", json.dumps({json.dumps({"lhs": 3}): {"{}": TIMED}})),
    "zero times": ("ragged_dot.json", json.dumps({RAGGED_KEY: {"{}": {"evaluation_times_ms": [0.0]}}})),
    "not UTF-8": ("ragged_dot.json", b'{"\xff": 1}'),
    "a 5,000-digit number": ("ragged_dot.json", '{"a": ' + "9" * 5000 + "}"),
    "a 5,000-digit dimension": ("ragged_dot.json", json.dumps(
        {json.dumps({**RAGGED_CALL, "lhs": f"bf16[{'9' * 5000},128]"}): {"{}": TIMED}})),
}


@pytest.mark.parametrize("case", HOSTILE_TIMINGS)
def test_calibrate_on_hostile_timings_exits_2_with_a_message(tmp_path, cache_home, capsys, case):
    from benchmarks import cli

    name, content = HOSTILE_TIMINGS[case]
    folder = tmp_path / "tpu_v5_lite"
    folder.mkdir()
    (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    status = cli.main(["calibrate", str(folder), "--out", str(tmp_path / "out.json"), "--jobs", "1"])
    error = capsys.readouterr().err
    assert status == 2 and "python -m benchmarks calibrate:" in error and str(folder / name) in error
    assert "Traceback" not in error and not (tmp_path / "out.json").exists()


ATTENTION_CALL = {"q": "bf16[2,256,4,128]", "k": "bf16[2,256,4,128]", "v": "bf16[2,256,4,128]",
                  "logits_dtype": "float32", "logits_scale": 0.088, "mask": {"is_causal": True},
                  "normalize_output": True, "return_residuals": False}


@pytest.mark.parametrize("precision, expected", [
    (["BF16_BF16_F32", "BF16_BF16_F32"], ("BF16_BF16_F32", "BF16_BF16_F32")),
    ([["DEFAULT", "DEFAULT"], ["DEFAULT", "DEFAULT"]], ("BF16_BF16_F32", "BF16_BF16_F32")),  # newer tokamax files
    ([["HIGHEST", "HIGHEST"], "BF16_BF16_F32_X3"], ("BF16_BF16_F32", "BF16_BF16_F32_X3")),  # bf16: as tokamax on TPU
])
def test_attention_precision_is_read_in_both_of_tokamaxs_forms(precision, expected):
    pytest.importorskip("tokamax")
    from jax import lax

    from benchmarks.perf import tokamax_calls

    arguments = tokamax_calls._attention_arguments({**ATTENTION_CALL, "precision": precision})
    assert arguments["precision"] == tuple(lax.DotAlgorithmPreset[name] for name in expected)


@pytest.mark.parametrize("kind, precision", [
    ("flash_attention", [["DEFAULT", "HIGH"], ["DEFAULT", "DEFAULT"]]), ("flash_attention", [["NOPE", "NOPE"], "X"]),
    ("flash_attention", "DEFAULT"), ("xla_ragged_dot", [["DEFAULT", "DEFAULT"], ["DEFAULT", "DEFAULT"]]),
    ("xla_ragged_dot", ["FAST", "SLOW"]),
])
def test_an_entry_whose_precision_cannot_be_read_is_skipped_with_the_reason(tmp_path, cache_home, kind, precision):
    pytest.importorskip("tokamax")
    from benchmarks.perf import calibration

    call = {**(ATTENTION_CALL if kind == "flash_attention" else RAGGED_CALL), "precision": precision}
    config = {"block_q": 128, "block_kv": 128, "block_kv_compute": 128} if kind == "flash_attention" else {}
    measurement = calibration.Measurement("v5e", kind, "f.json", call, config, (0.5,))
    [analysed] = calibration.analyse_measurements([measurement], calibration.AnalysisCache(None), jobs=1)
    assert analysed.program is None and analysed.reason.startswith("not rebuilt: precision"), analysed.reason
