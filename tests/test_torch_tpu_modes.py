"""Our op in torch_tpu's modes, with torch_tpu's own runtime and no chip (tests/torch_tpu_modes_probe.py).

What only a chip can show (strict eager's per-op compile, the MLIR build and compile of a graph, results) is
listed in docs/binding.md; `tpu-kernels doctor` runs it on a TPU host.
"""

import json
import os
import subprocess
import sys

import pytest

from .conftest import REPO_ROOT
from .torch_tpu_modes_probe import CHIPLESS_ENVIRONMENT


@pytest.fixture(scope="module")
def probed() -> dict:
    environment = {**os.environ, **CHIPLESS_ENVIRONMENT, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "torch_tpu_modes_probe.py")], env=environment,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["DEFER_AND_FUSE", "_INTERNAL_COMPILE_FX_GRAPH"])
def test_our_op_hands_the_launcher_what_jax_op_hands_it(probed, mode):
    """Both ops, called with and without the optional tensor and again: the same launches (fingerprint, inputs,
    output placeholders, no donation, no mesh), seen by the runtime in the mode set, and the same outputs."""
    calls = probed["modes"][mode]
    assert calls["ours"] == calls["jax_op"]
    launches = calls["ours"]["launches"]
    assert [launch["mode"] for launch in launches] == [mode] * 3
    assert launches[0]["fingerprint"] == launches[2]["fingerprint"] != launches[1]["fingerprint"]
    assert [len(launch["inputs"]) for launch in launches] == [2, 1, 2]
    assert all(launch["donate"] == launch["devices"] == [] for launch in launches)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_only_a_signatures_first_call_goes_through_jax_callable(probed):
    """Six calls of two signatures in two modes: JaxCallable ran twice, the runtime's kernels were launched
    directly otherwise (the registered kernel does not depend on the mode)."""
    assert probed["direct"] and probed["ours_through_jax_callable"] == 2


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_tpu_backend_traces_our_op_into_its_graph(probed):
    """torch.compile(backend="tpu", fullgraph=True, dynamic=False): Dynamo and AOT autograd keep our op as one node;
    the backend's interpretation runs it on placeholders in its tracing mode, which launches our kernels into the
    graph being built; the MLIR build after that needs a chip."""
    compiled = probed["compiled"]
    assert compiled["stopped_at_mlir_build"], compiled.get("error")
    assert compiled["targets"] == ["aten.add.Tensor", "aten.mul.Tensor", "tk_modes.add.default"]
    assert [launch["mode"] for launch in compiled["launches"]] == ["_INTERNAL_COMPILE_FX_GRAPH"] * 2
    assert compiled["outputs"] == [[[8, 128], "tpu:0"]]
