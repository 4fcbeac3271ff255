"""v5p's megacore: which kernel grids split over the device's two TensorCores, from the compiled program.

libtpu's LLO dump of each kernel shows the split: a grid the two cores share
starts with a megacore barrier and indexes its blocks by the core id; a grid
left to one core runs inside a `PrimaryCoreRegion`. The performance model
charges a call for two cores only when it predicts the split
(`perf.grid_replay`: the first "parallel" grid dimension with more than one
index); here each prediction is held against the compiler's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import perf
from tpu_kernels.distribution.loader import get_local_kernel

from .megacore_cases import GENERATION, cases

pytestmark = [pytest.mark.aot, pytest.mark.multiprocess]

ROOT = Path(__file__).resolve().parents[1]
SHARED_MARKER = "BarrierMegacore"
ONE_CORE_MARKER = "PrimaryCoreRegion"


@pytest.fixture(scope="module")
def compiled_splits(kernel_builds, tmp_path_factory) -> dict[str, bool]:
    """{case: whether its kernel's compiled program runs on both cores}, from libtpu's LLO dump."""
    dump = tmp_path_factory.mktemp("llo_dump")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               LIBTPU_INIT_ARGS=f"--xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true")
    folders = {name: str(folder) for name, folder in kernel_builds.items()}
    run = subprocess.run([sys.executable, "-m", "tests.megacore_cases", json.dumps(folders), str(dump)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    added = json.loads(run.stdout.strip().splitlines()[-1])
    names = {case: name for case, (_, _, name) in cases(_loaded(kernel_builds)).items()}
    splits = {}
    for case, files in added.items():
        # The kernel's program as the LLO pipeline first sees it, named after its pallas_call.
        programs = [f for f in files if f.split("-", 1)[1].startswith(f"{names[case]}.")
                    and f.endswith("-02-original.txt")]
        assert len(programs) == 1, (case, files)
        text = (dump / programs[0]).read_text()
        shared, one_core = SHARED_MARKER in text, ONE_CORE_MARKER in text
        assert shared != one_core, f"{case}: the dump shows neither or both ways of running the grid"
        splits[case] = shared
    return splits


def _loaded(kernel_builds) -> dict:
    return {name: get_local_kernel(folder, backend="cpu") for name, folder in kernel_builds.items()}


def test_the_compiler_splits_what_the_model_charges_two_cores_for(compiled_splits, kernel_builds):
    assert compiled_splits == {
        "ragged_dot, four N tiles": True,
        "ragged_dot, one N tile": False,
        "ragged_dot gated, two N tiles": True,
        "tgmm, two N tiles": True,
        "tgmm, one N tile, two K tiles": True,
        "fused experts (decode)": True,
        "fused experts, one expert shared": True,
        "combine picks, two token tiles": True,
        "rms_norm": True,
        "flash attention forward": True,
    }
    for case, (fn, args, name) in cases(_loaded(kernel_builds)).items():
        calls = [call for call in perf.model_pallas_traffic(fn, *args) if call.name == name]
        assert len(calls) == 1, case
        assert (len(calls[0].core_steps(GENERATION)) == 2) == compiled_splits[case], case


def test_a_split_grid_is_priced_on_the_busier_core(kernel_builds):
    """Four N tiles, two per core: the call takes about half of what the same grid takes on one core."""
    fn, args, _ = cases(_loaded(kernel_builds))["ragged_dot, four N tiles"]
    (call,) = perf.model_pallas_traffic(fn, *args)
    one_core = dataclasses.replace(call, megacore_core=None)
    assert 0.4 < call.pipelined_seconds(GENERATION) / one_core.pipelined_seconds(GENERATION) < 0.6
