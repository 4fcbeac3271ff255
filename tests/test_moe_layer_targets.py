"""The benchmark's v5e prefill entry: the ceilings the kernels' MXU passes and grid steps put over the layer."""

import pytest

from benchmarks.studies.moe_layer.targets import check_targets
from tpu_kernels.runtime.hardware import tpu_generation

USEFUL_FLOPS = 7.0e11


def _prefill_row(mxu_us: float, step_cost_us: float, xla_us: float) -> dict:
    useful_us = USEFUL_FLOPS / tpu_generation("v5e").bf16_flops_per_s * 1e6
    headline = mxu_us + step_cost_us + 40.0 + xla_us
    return {
        "label": "qwen3-30b-a3b T=8192", "setting": "qwen3-30b-a3b", "tokens": 8192, "phase": "prefill",
        "generation": "v5e", "roofline_bound": "compute", "useful_flops": USEFUL_FLOPS, "roofline_us": useful_us,
        "variants": {"ours": {
            "compiled": True, "headline_us": headline, "mxu_utilisation_pct": 100.0 * useful_us / headline,
            "kernels": {"mxu_flops": 8.0e11, "mxu_us": mxu_us, "step_cost_us": step_cost_us, "hbm_us": 1.0,
                        "us": mxu_us + step_cost_us + 40.0, "grid_steps": 400},
            "xla_ops": {"us": xla_us, "relayout_us": 0.0, "vmem_prefetch_us": 0.0},
        }},
    }


@pytest.mark.parametrize("over_useful", [1.1, 1.6])
def test_prefill_entry_reports_the_ceiling_of_mxu_passes_and_steps_and_no_retired_target(over_useful):
    useful_us = USEFUL_FLOPS / tpu_generation("v5e").bf16_flops_per_s * 1e6
    mxu_us, step_cost_us = 0.9 * over_useful * useful_us, 0.1 * over_useful * useful_us
    targets = check_targets([_prefill_row(mxu_us, step_cost_us, xla_us=10.0)])
    (entry,) = targets["prefill"]
    assert entry["passes_and_steps_ceiling_pct"] == pytest.approx(100.0 / over_useful, abs=0.05)
    # The layer's share never exceeds the ceiling its own passes and steps set.
    assert entry["mxu_utilisation_pct"] < entry["passes_and_steps_ceiling_pct"]
    assert "meets" not in entry and "85 %" in targets["retired"]
    assert not any("max_over_roofline" in figures for figures in targets["per_generation_anchor"].values())
