"""On TPU7x the experts kernels' fp8 weights reach the MXU as fp8, with fp8 activations, on both paths (the fused
kernel, GPT-OSS's interleaved gate/up layout too, and the grouped matmuls); on v6e (no fp8 MXU) they are dequantized
first. Read from libtpu's LLO dump of the compiled kernels (tests/fp8_mxu_case.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.perf.megacore_dump import original_llo_dump_args

pytestmark = [pytest.mark.aot, pytest.mark.multiprocess]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def matmuls(kernel_builds, tmp_path_factory):
    """{path: {generation: {matmul instruction: count}}} of the fp8 layer's kernels."""
    dump = tmp_path_factory.mktemp("llo")
    env = dict(os.environ, JAX_PLATFORMS="cpu", LIBTPU_INIT_ARGS=original_llo_dump_args(dump))
    run = subprocess.run([sys.executable, "-m", "tests.fp8_mxu_case", str(kernel_builds["ragged-dot-tpu"]),
                          str(dump)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("path", ["fused", "grouped", "fused-interleaved"])
def test_fp8_weights_take_the_fp8_mxu_on_tpu7x_only(matmuls, path):
    found = matmuls[path]
    fp8 = {generation: sum(count for name, count in kinds.items() if "f8e4m3fn" in name)
           for generation, kinds in found.items()}
    bf16 = {generation: sum(count for name, count in kinds.items() if ".bf16." in name)
            for generation, kinds in found.items()}
    # TPU7x: the expert matmuls in fp8 (the fused kernel's one-hot gather and scatter of the rows stay bf16).
    assert fp8["tpu7x"] > 0, found
    # v6e: no fp8 operand reaches the MXU; the dequantized weights go in as bf16.
    assert fp8["v6e"] == 0 and bf16["v6e"] > bf16["tpu7x"], found
