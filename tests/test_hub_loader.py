"""Publish and load kernels through the local Hub: `tpu_kernels.upload_kernel` and `tpu_kernels.get_kernel`.

Clients run two ways. In this process, the `client` fixture points huggingface_hub and
kernels at the test hub by setting the module globals they derive from HF_ENDPOINT,
KERNELS_CACHE and HF_HUB_OFFLINE when imported. In subprocesses, those environment
variables are set for real: that is how the offline, multi-process and unmodified-
`kernels` checks run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import uuid
from importlib import _bootstrap_external
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi, constants
from kernels import resolver as kernels_resolver
from kernels._rust import Digest, DigestAlgorithm

import tpu_kernels
from tpu_kernels.distribution.hub import start_hub
from tpu_kernels.distribution.loader import KernelIntegrityError, get_kernel, verify_variant
from tpu_kernels.distribution.publish import upload_kernel, upload_main

TOKEN = "test-token-" + os.urandom(4).hex()
TRUSTED = "trusted-org"
REPO = f"{TRUSTED}/answer"
REPO_ROOT = Path(__file__).resolve().parents[1]
# Synthetic kernels need no TPU runtime; skipping torch_tpu's autoload halves a
# subprocess's start-up and does not change the backend `kernels` picks here (cpu).
FAST_SUBPROCESS_ENV = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}

pytestmark = pytest.mark.usefixtures("local_agent_registry")


def make_build(
    root: Path, answer: int, *, version: int = 1, backends=("cpu", "tpu"), name="answer", extra: str | None = None,
    digest: bool = True,
) -> Path:
    """A built kernel in the layout of `tpu-kernels build`: `answer()` returns `answer`.

    `extra` adds a module of that name to each variant (builds with different file sets);
    `digest=False` leaves the digest out of metadata.json.
    """
    build = root / f"{name}-{answer}-{uuid.uuid4().hex[:6]}" / name
    (build / "benchmarks").mkdir(parents=True)
    (build / "README.md").write_text(f"---\nlicense: apache-2.0\ntags: [kernels]\n---\n# {name} answering {answer}\n")
    (build / "benchmarks" / "benchmark_answer.py").write_text("ROUNDS = 3\n")
    for backend in backends:
        variant = build / "build" / f"torch-{backend}"
        variant.mkdir(parents=True)
        (variant / "_value.py").write_text(f"VALUE = {answer}\n")
        (variant / "__init__.py").write_text("from ._value import VALUE\n\n\ndef answer():\n    return VALUE\n")
        if extra is not None:
            (variant / f"_{extra}.py").write_text(f"NAME = {extra!r}\n")
        metadata = {
            "name": name,
            "id": f"_{name}_{backend}_{uuid.uuid4().hex[:10]}",
            "version": version,
            "license": "apache-2.0",
            "python-depends": [],
            "backend": {"type": backend},
        }
        if digest:
            metadata["digest"] = {"algorithm": "sha256", "files": Digest.hash_variant(DigestAlgorithm.SHA256, variant).files}
        (variant / "metadata.json").write_text(json.dumps(metadata))
    return build


@pytest.fixture
def hub(tmp_path):
    with start_hub(tmp_path / "hub", token=TOKEN, trusted_orgs=[TRUSTED]) as running:
        yield running


@pytest.fixture
def client(monkeypatch, tmp_path, hub) -> Path:
    """huggingface_hub and kernels in this process, as if HF_ENDPOINT and KERNELS_CACHE had been set."""
    cache = tmp_path / "kernels-cache"
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(kernels_resolver, "CACHE_DIR", str(cache))
    monkeypatch.setenv("KERNELS_CACHE", str(cache))
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    return cache


def publish(hub, build: Path, repo_id: str = REPO, version: int | None = None):
    return upload_kernel(build, repo_id, version=version, endpoint=hub.url, token=TOKEN)


def subprocess_env(hub, cache: Path, tmp_path: Path, **extra: str) -> dict:
    env = {key: value for key, value in os.environ.items()
           if key not in ("HF_TOKEN", "LOCAL_KERNELS", "HF_HUB_OFFLINE", "KERNELS_CACHE")}
    env.update(HF_ENDPOINT=hub.url, KERNELS_CACHE=str(cache), HF_HOME=str(tmp_path / "hf-home"), **extra)
    return env


def run_python(code: str, env: dict, timeout: float = 300) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON line last."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-5000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def cached_variant(cache: Path, commit: str, repo_id: str = REPO, variant: str = "torch-cpu") -> Path:
    """Where huggingface_hub keeps a downloaded variant; loaded kernels run from a private copy of it."""
    return cache / f"kernels--{repo_id.replace('/', '--')}" / "snapshots" / commit / "build" / variant


def test_upload_publishes_the_card_on_main_and_the_build_on_its_version_branch(
    hub, client, tmp_path, capsys, monkeypatch
):
    build = make_build(tmp_path, answer=41)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert upload_main([str(build), "--repo-id", REPO, "--endpoint", hub.url]) == 0
    printed = capsys.readouterr().out
    api = HfApi(endpoint=hub.url)
    build_head = api.repo_info(REPO, repo_type="kernel", revision="v1").sha
    assert f"/kernels/{REPO}/commit/{build_head}" in printed
    assert api.list_repo_files(REPO, repo_type="kernel") == ["README.md"]
    v1_files = set(api.list_repo_files(REPO, repo_type="kernel", revision="v1"))
    assert {"README.md", "benchmarks/benchmark_answer.py", "build/torch-cpu/__init__.py",
            "build/torch-tpu/metadata.json"} <= v1_files
    assert get_kernel(REPO, version=1).answer() == 41

    # A re-upload without the tpu variant: one new commit on v1 that also deletes the stale files.
    commits_before = len(api.list_repo_commits(REPO, repo_type="kernel", revision="v1"))
    smaller = make_build(tmp_path, answer=43, backends=("cpu",))
    publication = publish(hub, smaller)
    assert len(api.list_repo_commits(REPO, repo_type="kernel", revision="v1")) == commits_before + 1
    assert "torch-tpu" in publication.build_commit.commit_description
    assert not any("torch-tpu" in path for path in api.list_repo_files(REPO, repo_type="kernel", revision="v1"))


def test_versions_load_side_by_side_and_by_revision(hub, client, tmp_path):
    publish(hub, make_build(tmp_path, answer=1, version=1))
    v2 = publish(hub, make_build(tmp_path, answer=2, version=2))
    first, second = get_kernel(REPO, version=1), get_kernel(REPO, version=2)
    assert (first.answer(), second.answer()) == (1, 2)
    assert first is not second and first.answer() == 1
    assert get_kernel(REPO, revision="v1").answer() == 1
    assert get_kernel(REPO, revision=v2.build_commit.oid).answer() == 2
    with pytest.raises(ValueError, match="Version 3 not found, available versions: 1, 2"):
        get_kernel(REPO, version=3)
    with pytest.raises(ValueError, match="Only one of"):
        get_kernel(REPO, version=1, revision="v1")


def test_only_trusted_publishers_load_without_trust_remote_code(hub, client, tmp_path):
    untrusted = "someone/answer"
    publish(hub, make_build(tmp_path, answer=7), repo_id=untrusted)
    publish(hub, make_build(tmp_path, answer=8), repo_id=REPO)
    with pytest.raises(ValueError, match="not from a trusted publisher"):
        get_kernel(untrusted, version=1)
    with pytest.raises(ValueError, match="not from a trusted publisher"):
        get_kernel(untrusted, version=1, trust_remote_code=["someone/other"])
    assert get_kernel(untrusted, version=1, trust_remote_code=[untrusted]).answer() == 7
    assert get_kernel(untrusted, version=1, trust_remote_code=True).answer() == 7
    assert get_kernel(REPO, version=1).answer() == 8


def test_a_tampered_cache_is_refused_naming_the_file_and_a_forced_download_repairs_it(hub, client, tmp_path):
    publication = publish(hub, make_build(tmp_path, answer=5))
    assert get_kernel(REPO, version=1).answer() == 5
    variant = cached_variant(client, publication.build_oid)
    value_file = variant / "_value.py"
    original = value_file.read_bytes()

    tampered = bytearray(original)
    tampered[-2] ^= 1  # "5" -> "4", written through the cache's link into its blob
    value_file.write_bytes(bytes(tampered))
    with pytest.raises(KernelIntegrityError, match="_value.py") as refused:
        get_kernel(REPO, version=1)
    assert refused.value.files == [value_file]
    assert "force_download=True" in str(refused.value)
    assert get_kernel(REPO, version=1, force_download=True).answer() == 5
    assert value_file.read_bytes() == original

    value_file.unlink()  # replaced by a plain file, as `sed -i` would do
    value_file.write_text("VALUE = 666\n")
    (variant / "extra.py").write_text("import os\n")
    with pytest.raises(KernelIntegrityError) as refused:
        get_kernel(REPO, version=1)
    assert refused.value.files == [variant / "_value.py", variant / "extra.py"]
    get_kernel(REPO, version=1, force_download=True)
    assert value_file.read_bytes() == original and not (variant / "extra.py").exists()
    verify_variant(variant)


def test_forged_bytecode_does_not_replace_the_verified_source(hub, client, tmp_path):
    publication = publish(hub, make_build(tmp_path, answer=5))
    snapshot = Path(HfApi(endpoint=hub.url).snapshot_download(
        REPO, repo_type="kernel", revision=publication.build_commit.oid, cache_dir=client))
    value_file = snapshot / "build" / "torch-cpu" / "_value.py"
    # Bytecode that Python accepts for _value.py (its header matches the source's
    # mtime and size) but says 666: `hash_variant` does not look at __pycache__.
    stat = value_file.stat()
    forged = _bootstrap_external._code_to_timestamp_pyc(
        compile("VALUE = 666\n", str(value_file), "exec"), stat.st_mtime, stat.st_size)
    pyc = Path(importlib.util.cache_from_source(str(value_file)))
    pyc.parent.mkdir()
    pyc.write_bytes(forged)
    spec = importlib.util.spec_from_file_location(f"forged_{uuid.uuid4().hex}", value_file)
    plain_import = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plain_import)
    assert plain_import.VALUE == 666  # the forgery works on a plain import

    assert get_kernel(REPO, revision=publication.build_commit.oid).answer() == 5
    assert pyc.exists()  # left in the cache: the import reads a private copy, which has no bytecode


def test_local_kernels_overrides_are_verified_too(hub, client, tmp_path, monkeypatch):
    build = make_build(tmp_path, answer=9)
    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO}={build}")
    requests_before = hub.request_count
    assert get_kernel(REPO, version=1).answer() == 9
    assert hub.request_count == requests_before
    (build / "build" / "torch-cpu" / "_value.py").write_text("VALUE = 10\n")
    with pytest.raises(KernelIntegrityError, match="Rebuild it"):
        get_kernel(REPO, version=1)


@pytest.mark.multiprocess
def test_offline_loads_from_the_cache_with_zero_requests(hub, client, tmp_path):
    publication = publish(hub, make_build(tmp_path, answer=3))
    assert get_kernel(REPO, version=1).answer() == 3
    requests_before = hub.request_count
    loaded = run_python(f"""
        import json
        from tpu_kernels.distribution.loader import get_kernel
        by_version = get_kernel({REPO!r}, version=1).answer()
        by_sha = get_kernel({REPO!r}, revision={publication.build_commit.oid!r}).answer()
        print(json.dumps([by_version, by_sha]))
    """, subprocess_env(hub, client, tmp_path, HF_HUB_OFFLINE="1", **FAST_SUBPROCESS_ENV))
    assert loaded == [3, 3]
    assert hub.request_count == requests_before


@pytest.mark.multiprocess
@pytest.mark.slow
def test_eight_processes_share_one_consistent_cache(hub, tmp_path):
    publish(hub, make_build(tmp_path, answer=11))
    cache = tmp_path / "shared-cache"
    code = f"""
        import json
        from tpu_kernels.distribution.loader import get_kernel
        module = get_kernel({REPO!r}, version=1)
        print(json.dumps([module.answer(), module.__file__]))
    """
    env = subprocess_env(hub, cache, tmp_path, HF_HUB_DISABLE_PROGRESS_BARS="1", **FAST_SUBPROCESS_ENV)
    processes = [
        subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO_ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(8)
    ]
    outputs = [process.communicate(timeout=300) for process in processes]
    for process, (_, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr[-5000:]
    results = [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in outputs]
    assert {answer for answer, _ in results} == {11}
    assert len({path for _, path in results}) == 8  # each process imports its own private copy
    repo_cache = cache / "kernels--trusted-org--answer"
    (snapshot,) = (repo_cache / "snapshots").iterdir()
    verify_variant(snapshot / "build" / "torch-cpu")
    assert not list(repo_cache.rglob("*.incomplete"))


@pytest.fixture(scope="module")
def ragged_dot_build(tmp_path_factory) -> Path:
    from tpu_kernels.distribution.builder import build_kernel_repo

    return build_kernel_repo(REPO_ROOT / "kernel_repos" / "ragged-dot-tpu", tmp_path_factory.mktemp("build"))


RAGGED_DOT_CHECK = """
    generator = torch.Generator().manual_seed(0)
    lhs = torch.randn(64, 128, generator=generator)
    rhs = torch.randn(4, 128, 128, generator=generator)
    group_sizes = torch.tensor([16, 0, 30, 10], dtype=torch.int32)
    out = kernel.ragged_dot(lhs, rhs, group_sizes)
    expected = kernel.reference.ragged_dot_reference(lhs, rhs, group_sizes)
    error = (out - expected).abs().max().item()
"""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ragged_dot_round_trip_through_the_hub(hub, client, tmp_path, ragged_dot_build):
    repo = "tpu-kernels-test/ragged-dot-tpu"
    publish(hub, ragged_dot_build, repo_id=repo)
    kernel = tpu_kernels.get_kernel(repo, version=1, trust_remote_code=[repo])
    scope = {"kernel": kernel, "torch": torch}
    exec(textwrap.dedent(RAGGED_DOT_CHECK), scope)
    assert scope["error"] < 1e-3

    unmodified = run_python(f"""
        import json, torch, kernels
        kernel = kernels.get_kernel({repo!r}, version=1, trust_remote_code=True)
        {textwrap.indent(textwrap.dedent(RAGGED_DOT_CHECK), "        ").strip()}
        print(json.dumps([error, kernel.__file__]))
    """, subprocess_env(hub, tmp_path / "unmodified-cache", tmp_path, JAX_PLATFORMS="cpu"))
    assert unmodified[0] < 1e-3
    assert "unmodified-cache" in unmodified[1]
