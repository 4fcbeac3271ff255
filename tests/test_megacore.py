"""v5p's megacore: which kernel grids split over the device's two TensorCores, from the compiled program
(`benchmarks.perf.megacore_dump` reads libtpu's LLO dump), held against the performance model's prediction: it
charges a call for two cores only when it predicts the split. The cases (megacore_cases.py) reach the kernels
through their faces, and ragged-dot-tpu's kernels past its face too: all compile in one process.
"""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks import perf
from benchmarks.perf import megacore_dump

pytestmark = [pytest.mark.aot, pytest.mark.multiprocess]

CASES = "tests.megacore_cases"


@pytest.fixture(scope="module")
def compiled_splits(kernel_builds, tmp_path_factory) -> dict[str, bool]:
    return megacore_dump.compiled_splits(CASES, kernel_builds, tmp_path_factory.mktemp("llo_dump"))


def test_the_compiler_splits_what_the_model_charges_two_cores_for(compiled_splits, kernel_builds):
    assert compiled_splits == {
        "ragged_dot, four N tiles": True,
        "ragged_dot, one N tile": False,
        "fused experts (decode)": True,
        "rms_norm": True,
        "flash attention forward": True,
        "ragged_dot gated, two N tiles": True,
        "tgmm, two N tiles": True,
        "tgmm, one N tile, two K tiles": True,
        "fused experts, one expert shared": True,
        "combine picks, two token tiles": True,
    }
    assert megacore_dump.modelled_splits(CASES, kernel_builds) == compiled_splits


def test_a_split_grid_is_priced_on_the_busier_core(kernel_builds):
    """Four N tiles, two per core: the call takes about half of what the same grid takes on one core."""
    cases = megacore_dump.load_cases(CASES).cases(megacore_dump.loaded_kernels(kernel_builds))
    fn, args, _ = cases["ragged_dot, four N tiles"]
    (call,) = perf.model_pallas_traffic(fn, *args)
    one_core = dataclasses.replace(call, megacore_core=None)
    generation = megacore_dump.GENERATION
    assert 0.4 < call.pipelined_seconds(generation) / one_core.pipelined_seconds(generation) < 0.6
