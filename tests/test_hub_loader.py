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
import subprocess
import sys
import textwrap
import uuid
from importlib import _bootstrap_external
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi

import tpu_kernels
from tpu_kernels.distribution.loader import KernelIntegrityError, get_kernel, loaded_commit, verify_variant
from tpu_kernels.distribution.publish import upload_main

from .loader_support import (
    FAST_SUBPROCESS_ENV,
    REPO,
    REPO_ROOT,
    TOKEN,
    cached_variant,
    make_build,
    publish,
    run_python,
    subprocess_env,
)

pytestmark = pytest.mark.usefixtures("local_agent_registry")


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


def test_a_loaded_kernel_names_the_commit_it_was_verified_at_even_after_its_branch_moves(
    hub, client, tmp_path, monkeypatch
):
    first = publish(hub, make_build(tmp_path, answer=1))
    kernel = get_kernel(REPO, version=1)
    second = publish(hub, make_build(tmp_path, answer=2))
    assert second.build_commit.oid != first.build_commit.oid
    assert loaded_commit(kernel) == first.build_commit.oid
    assert loaded_commit(get_kernel(REPO, version=1)) == second.build_commit.oid
    assert get_kernel(REPO, revision=loaded_commit(kernel)).answer() == 1
    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO}={make_build(tmp_path, answer=3)}")
    assert loaded_commit(get_kernel(REPO, version=1)) is None


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


def test_a_tampered_cache_is_refused_naming_the_file_and_dropped_so_the_next_load_repairs_it(hub, client, tmp_path):
    publication = publish(hub, make_build(tmp_path, answer=5))
    assert get_kernel(REPO, version=1).answer() == 5
    variant = cached_variant(client, publication.build_oid)
    value_file = variant / "_value.py"
    original = value_file.read_bytes()
    blob = value_file.resolve()

    tampered = bytearray(original)
    tampered[-2] ^= 1  # "5" -> "4", written through the cache's link into its blob
    value_file.write_bytes(bytes(tampered))
    with pytest.raises(KernelIntegrityError, match="_value.py") as refused:
        get_kernel(REPO, version=1)
    assert refused.value.files == [value_file]
    assert "dropped from the cache" in str(refused.value)
    assert not variant.exists() and not blob.exists()  # the refused bytes are gone: nothing refuses them again
    assert get_kernel(REPO, version=1).answer() == 5
    assert value_file.read_bytes() == original

    value_file.unlink()  # replaced by a plain file, as `sed -i` would do
    value_file.write_text("VALUE = 666\n")
    (variant / "extra.py").write_text("import os\n")
    with pytest.raises(KernelIntegrityError) as refused:
        get_kernel(REPO, version=1)
    assert refused.value.files == [variant / "_value.py", variant / "extra.py"]
    assert get_kernel(REPO, version=1, force_download=True).answer() == 5
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
