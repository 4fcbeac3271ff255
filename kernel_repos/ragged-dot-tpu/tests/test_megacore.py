"""v5p's megacore for this repo's kernels past its face (the gated grouped matmul, tgmm, the fused kernel sharing
one expert, the combine kernel): which grids split over the device's two TensorCores, from the compiled program
(`benchmarks.perf.megacore_dump` reads libtpu's LLO dump), held against the performance model's prediction.
tests/test_megacore.py holds the cases the face reaches."""

from pathlib import Path

import pytest

from benchmarks.perf import megacore_dump

pytestmark = [pytest.mark.aot, pytest.mark.multiprocess]

CASES = Path(__file__).with_name("megacore_cases.py")


def test_the_compiler_splits_what_the_model_charges_two_cores_for(kernel, tmp_path):
    # The build folder the kernel was loaded from: build/<name>/build/torch-cpu/__init__.py.
    builds = {"ragged-dot-tpu": Path(kernel.__file__).parents[2]}
    compiled = megacore_dump.compiled_splits(CASES, builds, tmp_path / "llo_dump")
    assert compiled == {
        "ragged_dot gated, two N tiles": True,
        "tgmm, two N tiles": True,
        "tgmm, one N tile, two K tiles": True,
        "fused experts, one expert shared": True,
        "combine picks, two token tiles": True,
    }
    assert megacore_dump.modelled_splits(CASES, builds) == compiled
