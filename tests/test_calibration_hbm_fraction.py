"""The share of the peak HBM bandwidth per generation: fitted on timings bound by weight streaming, borrowed
where a generation has none, and carried in the model's rates so that prices use it."""

from __future__ import annotations

import dataclasses
import json
import types
from importlib import resources

import numpy as np
import pytest

from benchmarks import perf
from benchmarks.studies import hbm_fraction_fit
from benchmarks.perf import calibration, program_time
from tpu_kernels.runtime.hardware import tpu_generation

from .perf_kernels import MATMUL, X, Y

CALL = {"lhs": "bf16[8,4096]", "rhs": "bf16[8,4096,4096]", "group_sizes": [1] * 8,
        "ragged_dot_dimension_numbers": {"dot_dimension_numbers": [[[1], [1]], [[], []]],
                                         "lhs_ragged_dimensions": [0], "rhs_group_dimensions": [0]},
        "precision": ["DEFAULT", "DEFAULT"], "return_residuals": False}


@dataclasses.dataclass(frozen=True)
class Synthetic:
    """An analysed entry whose price is its copies at the priced share plus fixed matmul and step times."""

    measurement: calibration.Measurement
    hbm_bytes: float
    mxu_s: float = 1e-6
    steps: int = 0

    def price(self, constants=calibration.ModelConstants()):
        generation = tpu_generation(self.measurement.chip)
        share = constants.hbm_fraction
        share = constants.rates.hbm_fraction(generation) if share is None else share
        copies = self.hbm_bytes / (generation.device_hbm_bytes_per_s * share)
        step_s = program_time.XLA_RAGGED_DOT_STEP_S[generation.name]
        return program_time.ProgramTime(
            generation=generation.name, step_overhead_s=0.0, hbm_fraction=share, kernels=None, xla_s=0.0,
            ragged_dot_s=max(copies, self.mxu_s) + self.steps * step_s, xla_flops=0.0, xla_hbm_bytes=0,
            xla_vmem_bytes=0, xla_ops=0, xla_estimated_cycles=0, xla_ops_without_estimate=0,
            ragged_dot_hbm_bytes=int(self.hbm_bytes), ragged_dot_mxu_s=self.mxu_s, ragged_dot_steps=self.steps)


def synthetic(chip: str, share: float, hbm_bytes: float, *, call=CALL, **terms) -> Synthetic:
    """An entry measured as if the chip's copies ran at `share` of its peak bandwidth."""
    measured_s = hbm_bytes / (tpu_generation(chip).device_hbm_bytes_per_s * share)
    config = {"bytes": int(hbm_bytes), **terms, "counted": isinstance(call["group_sizes"], dict)}  # distinct entries
    measurement = calibration.Measurement(chip, "xla_ragged_dot", f"/data/{chip}/ragged_dot.json", call, config,
                                          (1e3 * max(measured_s, terms.get("mxu_s", 1e-6)),))
    return Synthetic(measurement, hbm_bytes, **terms)


@pytest.fixture(scope="module")
def matmul_traffic():
    [call] = perf.model_pallas_traffic(MATMUL, X, Y)
    return call


def test_a_fit_on_entries_bound_by_weight_streaming_recovers_the_share_they_were_measured_at():
    entries = [synthetic("v5e", 0.83, size) for size in (2.7e8, 2.8e8, 3.0e8)]  # the weights: 268 MB
    compute_bound = synthetic("v5e", 0.5, 2.7e8, mxu_s=1.0)  # its copies hide behind its matmuls: not used
    step_bound = synthetic("v5e", 0.5, 2.7e8, steps=200_000)  # mostly fixed step costs: not used
    not_weights = synthetic("v5e", 0.5, 1e9)  # most of its copies are not the weights: not used
    counted = synthetic("v5e", 0.5, 2.7e8, call={**CALL, "group_sizes": {"num_groups": 8, "total_size": 8}})
    results = hbm_fraction_fit.fit_hbm_fractions([*entries, compute_bound, step_bound, not_weights, counted])
    v5e = results["v5e"]
    assert v5e["hbm_fraction"] == 0.83 and len(v5e["entries"]) == 3
    assert all(e["implied_hbm_fraction"] == pytest.approx(0.83, abs=1e-3) for e in v5e["entries"])
    assert v5e["spread"]["min"] == pytest.approx(0.83, abs=1e-3) and "median of 3" in v5e["derived"]
    why = {json.dumps(e["config"]): e["left_out"] for e in v5e["left_out"]}
    assert json.dumps(compute_bound.measurement.config) not in why  # its copies are not the longer term
    assert "fixed step costs" in why[json.dumps(step_bound.measurement.config)]
    assert json.dumps(not_weights.measurement.config) not in why  # most of its copies are not the weights
    # The count expands (tokamax's seed) with empty groups: which sizes were timed is not known.
    assert "groups empty" in why[json.dumps(counted.measurement.config)]


def test_a_generation_without_such_timings_borrows_the_named_generations_share_and_says_so():
    results = hbm_fraction_fit.fit_hbm_fractions([synthetic("v5e", 0.9, 2.7e8), synthetic("tpu7x", 0.78, 2.7e8)])
    assert results["v6e"]["hbm_fraction"] == 0.9 and results["v6e"]["borrowed_from"] == "v5e"
    assert results["v6e"]["derived"].startswith("borrowed from v5e: ") and results["v6e"]["entries"] == []
    assert results["tpu7x"]["hbm_fraction"] == 0.78 and "borrowed_from" not in results["tpu7x"]
    assert hbm_fraction_fit.fractions(results) == {"tpu7x": 0.78, "v5e": 0.9, "v5p": 0.9, "v6e": 0.9}


def test_an_entry_the_model_prices_slower_than_measured_at_the_peak_counts_as_the_peak():
    fast = synthetic("v5e", 1.25, 2.7e8)
    results = hbm_fraction_fit.fit_hbm_fractions([fast, synthetic("v5e", 0.9, 2.7e8), synthetic("v5e", 0.95, 2.7e8)])
    assert results["v5e"]["hbm_fraction"] == 0.95
    [record] = [e for e in results["v5e"]["entries"] if e["implied_hbm_fraction"] == 1.0]
    assert record["ratio_at_peak"] == pytest.approx(1.25, abs=1e-3)
    assert "v6e" in results and hbm_fraction_fit.fit_hbm_fractions([]) == {}


def test_prices_use_the_generations_share_carried_in_the_rates(matmul_traffic):
    assert calibration.ModelConstants().rates == perf.FITTED_RATES
    halved = dataclasses.replace(perf.FITTED_RATES, hbm_fractions=(("v5e", 0.5), ("v6e", 0.25)))
    assert halved.hbm_fraction("v6e") == 0.25 and halved.hbm_fraction(tpu_generation("v5e")) == 0.5
    assert halved.hbm_fraction("tpu7x") == 1.0  # not named: the peak
    at_quarter = perf.roofline(matmul_traffic, "v6e", hbm_fraction=0.25)
    assert perf.roofline(matmul_traffic, "v6e", rates=halved).pipelined_time_s == at_quarter.pipelined_time_s
    fitted = perf.FITTED_RATES.hbm_fraction("v6e")
    assert perf.roofline(matmul_traffic, "v6e").hbm_bound_s == pytest.approx(
        perf.roofline(matmul_traffic, "v6e", hbm_fraction=1.0).hbm_bound_s / fitted)
    # The calibration's constants carry the shares per generation into its prices.
    constants = calibration.ModelConstants(hbm_fractions=(("v5e", 0.5),))
    entry = synthetic("v5e", 0.5, 2.7e8)
    assert entry.price(constants).pipelined_time_s == pytest.approx(entry.measurement.measured_us * 1e-6)


def test_the_fitted_shares_are_the_data_the_model_reads():
    shares = dict(perf.FITTED_RATES.hbm_fractions)
    assert set(shares) == {"v5e", "v5p", "v6e", "tpu7x"}
    assert all(0.5 <= share <= 1.0 for share in shares.values())
    # v6e's own (its weight-streaming timings); v5p and TPU7x borrow v5e's, and their notes say so.
    assert shares["v6e"] < shares["v5e"]
    assert shares["v5p"] == shares["tpu7x"] == shares["v5e"]
    notes = json.loads(resources.files("benchmarks.perf").joinpath("hbm_fractions.json").read_text())["hbm_fraction_note"]
    assert all(notes[chip].startswith("borrowed from v5e") for chip in ("v5p", "tpu7x"))
    assert "v6e's own" in notes["v6e"]


@dataclasses.dataclass(frozen=True)
class StepsAndCopies:
    """An analysed Pallas entry priced as its copies at the priced share plus its grid steps at the priced cost."""

    measurement: calibration.Measurement
    hbm_bytes: float
    steps: int

    def price(self, constants):
        bandwidth = tpu_generation("v6e").device_hbm_bytes_per_s * constants.hbm_fraction
        return types.SimpleNamespace(pipelined_time_s=self.hbm_bytes / bandwidth + self.steps * constants.grid_step_s)


def steps_and_copies(sizes: list[tuple[float, int]], share: float, step_s: float) -> list[StepsAndCopies]:
    """Entries measured as if the chip's copies ran at `share` of the peak and a grid step cost `step_s`."""
    bandwidth = tpu_generation("v6e").device_hbm_bytes_per_s * share
    return [StepsAndCopies(calibration.Measurement(
        "v6e", "pallas_ragged_dot", "/data/tpu_v6_lite/pallas_mosaic_tpu_ragged_dot.json", CALL,
        {"bytes": int(hbm_bytes), "steps": steps}, (1e3 * (hbm_bytes / bandwidth + steps * step_s),)),
        hbm_bytes, steps) for hbm_bytes, steps in sizes]


def test_the_step_share_profile_tells_an_identified_step_from_one_traded_against_the_share():
    from benchmarks.studies import calibration_fit

    varied = [(2.0e8 * (1 + i % 3), 500 * (1 + 2 * (i % 5))) for i in range(16)]
    [identified] = calibration_fit.step_share_profile(steps_and_copies(varied, 0.9, 0.2e-6)).values()
    best = min(identified, key=lambda row: row["fit_median_log_error"])
    assert (best["grid_step_us"], best["best_hbm_fraction"]) == (0.2, 0.9) and best["holdout"]["median_abs_error"] < 1e-3
    assert max(row["fit_median_log_error"] for row in identified) > 0.05
    # Steps in proportion to bytes: every step cost up to 0.34 us has a share that prices the entries as well, a
    # dearer step a higher share.
    proportional = [(2.0e8 * (1 + i % 7), 80 * (1 + i % 7)) for i in range(16)]
    [traded] = calibration_fit.step_share_profile(steps_and_copies(proportional, 0.9, 0.2e-6)).values()
    within = [row for row in traded if row["grid_step_us"] <= 0.34]
    assert len(within) == 7 and all(row["fit_median_log_error"] < 0.01 for row in within)
    shares = [row["best_hbm_fraction"] for row in within]
    assert shares == sorted(shares) and shares[0] < 0.85 < 0.95 < shares[-1]
