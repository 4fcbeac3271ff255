"""`import tpu_kernels` stays light: the Hub server and the CLI start without the heavy frameworks."""

import json
import subprocess
import sys

import pytest

from .conftest import REPO_ROOT

HEAVY = ("jax", "torch", "torch_tpu", "kernels", "huggingface_hub", "transformers")


@pytest.mark.multiprocess
def test_importing_the_package_loads_no_framework():
    code = (
        "import json, sys, tpu_kernels; "
        "tpu_kernels.integration.kernelize; tpu_kernels.KernelIntegrityError; "
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
