"""The main job: `tpu-kernels demo` end to end (build, local Hub, publish, get_kernel, kernelize, generate)."""

import os
import shutil
import subprocess
import sys

import pytest

from tpu_kernels.distribution.builder import build_kernel_repo

from .conftest import REPO_ROOT

KINDS_AND_REPOS = {"experts": "ragged-dot-tpu", "rmsnorm": "rmsnorm-tpu", "attention": "attention-tpu"}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_demo_replaces_every_kind_and_exits_zero_with_identical_tokens():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-m", "tpu_kernels.cli", "demo", "--new-tokens", "4"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for kind, repo in KINDS_AND_REPOS.items():
        assert f"published tpu-kernels/{repo}@1 to the local Hub at http://127.0.0.1:" in result.stdout
        assert f"{kind:<9} replaced by tpu-kernels/{repo}@1" in result.stdout, result.stdout[-3000:]
    assert "greedy tokens identical" in result.stdout and "NO" not in result.stdout.split("identical")[-1]
    assert "ms per token" in result.stdout
    _assert_quiet(result)


def _assert_quiet(result):
    """Only the demo's own lines: no Python warnings, no log lines of libraries, no progress bars."""
    assert result.stderr == "", result.stderr[-3000:]
    assert "Warning" not in result.stdout and "No kernel mapping found" not in result.stdout, result.stdout[-3000:]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_demo_exits_non_zero_when_a_kind_is_not_replaced(tmp_path):
    """Attention from a build without a torch-cpu variant: kernelize falls back, the demo must fail."""
    builds = {kind: build_kernel_repo(REPO_ROOT / "kernel_repos" / repo, tmp_path) for kind, repo in KINDS_AND_REPOS.items()}
    shutil.rmtree(builds["attention"] / "build" / "torch-cpu")
    command = [sys.executable, "-m", "tpu_kernels.cli", "demo", "--model-part", "--new-tokens", "2"]
    for kind, build in builds.items():
        command += ["--repo", f"{kind}={build}"]
    result = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                            timeout=600)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "attention kept original: the kernel has no build for this system" in result.stdout
    assert "experts   replaced" in result.stdout and "rmsnorm   replaced" in result.stdout
    assert "FAILED: not replaced: attention" in result.stdout
    _assert_quiet(result)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_demo_with_int8_experts_prints_their_error_and_the_bytes_saved():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-m", "tpu_kernels.cli", "demo", "--new-tokens", "4",
                             "--quantize-experts", "int8"], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "quantized 2 experts module(s) to int8" in result.stdout
    assert "logits max abs error" in result.stdout and "greedy tokens equal" in result.stdout
    assert "MB saved (" in result.stdout
    _assert_quiet(result)
