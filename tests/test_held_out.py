"""The held-out checks: each priced as the model prices that chip's copies, and the tracked table is what the study
computes."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.studies import held_out
from benchmarks.studies.tables import held_out as tables
from tpu_kernels.runtime.hardware import tpu_generation

RESULTS = Path("benchmarks/results")


def test_a_streaming_check_is_its_bytes_at_the_priced_share_of_the_peak():
    check = {"source": "u", "chip": "v6e", "kernel": "k", "experts": 2, "k": 128, "n": 256, "dtype": "bf16",
             "touched": 2, "rows": 3, "weight_bytes": 10**9, "measured_us": 1000.0}
    found = held_out.streaming_check(check)
    bandwidth = tpu_generation("v6e").device_hbm_bytes_per_s * found["hbm_share"]
    moved = 10**9 + 16 * (128 + 256) * 2  # 6 rows padded to 16
    assert found["bytes"] == moved
    assert abs(found["modelled_us"] - 1e6 * moved / bandwidth) < 0.01
    assert found["ratio"] == round(found["modelled_us"] / 1000.0, 4)
    assert "| u | v6e | k: E=2, 128x256 bf16, 2 groups x 3 rows | 1000.0 µs |" in tables.checks({"checks": [found]})


def test_the_tracked_checks_are_what_the_study_computes():
    tracked = json.loads((RESULTS / "held_out.json").read_text())
    computed = held_out.study([])["checks"]
    assert [c for c in tracked["checks"] if c["kind"] != "calibrate"] == json.loads(json.dumps(computed))
