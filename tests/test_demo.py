"""The main job: `tpu-kernels demo` end to end (build, local Hub, publish, get_kernel, kernelize, generate)."""

import os
import subprocess
import sys


def test_demo_exits_zero_with_identical_tokens():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-m", "tpu_kernels.cli", "demo", "--new-tokens", "8"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "experts   replaced by tpu-kernels/ragged-dot-tpu@1" in result.stdout
    assert "greedy tokens identical" in result.stdout and "NO" not in result.stdout.split("identical")[-1]
