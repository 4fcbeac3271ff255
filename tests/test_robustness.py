"""The robustness table: its verdicts follow from its numbers, and a claim flips where the constant crosses its
threshold."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from benchmarks.studies import robustness

RESULTS = Path("benchmarks/results")


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads((RESULTS / "robustness.json").read_text())


def holds(claim: dict, value: float) -> bool:
    return value <= claim["threshold"] if claim["holds_if"] == "at_most" else value >= claim["threshold"]


def test_each_verdict_follows_from_its_numbers(report):
    for claim in report["claims"]:
        checks = [holds(claim, claim["fitted"]), holds(claim, claim["worst_point"]["value"])]
        for entry in claim["by_constant"].values():
            ends = [holds(claim, entry["at_low"]), holds(claim, entry["at_high"])]
            assert entry["holds"] == all(ends), claim["claim"]
            assert (entry["flips_at"] is not None) == (holds(claim, claim["fitted"]) and not all(ends))
            checks += ends
        assert claim["verdict"] == ("robust" if all(checks) else "fragile"), claim["claim"]


def test_the_tracked_table_is_what_the_study_computes(report):
    assert robustness.study(RESULTS)["claims"] == report["claims"]


def test_a_claim_flips_where_its_constant_crosses_the_threshold():
    moe = json.loads((RESULTS / "moe_layer.json").read_text())
    claim, name, entry = next((c, name, entry) for c in robustness.moe_claims(moe)
                              for name, entry in robustness.evaluate(c)["by_constant"].items()
                              if name != robustness.COPY_COST and entry["flips_at"] is not None)
    away = 1 if entry["flips_at"] > entry["fitted"] else -1  # the side of the flip away from the fitted value
    assert claim.holds(claim.value({name: entry["flips_at"] - away * 1e-3}))
    assert not claim.holds(claim.value({name: entry["flips_at"] + away * 1e-3}))
    paged = json.loads((RESULTS / "paged_attention.json").read_text())
    page = next(c for c in robustness.paged_claims(paged) if c.generation == "v6e")
    flip = robustness.evaluate(page)["by_constant"][robustness.COPY_COST]["flips_at"]
    assert page.holds(page.value({robustness.COPY_COST: flip * 0.99}))
    assert not page.holds(page.value({robustness.COPY_COST: flip * 1.01}))


def test_a_claim_robust_over_a_range_is_fragile_once_the_range_reaches_its_threshold():
    claim = robustness.Claim("test", "time at most 10", "v6e", 10.0, True,
                             {robustness.GRID_STEP: (0.34, 0.02, 0.34)},
                             lambda point: 6.0 + 10.0 * point.get(robustness.GRID_STEP, 0.34))
    assert robustness.evaluate(claim)["verdict"] == "robust"
    wider = robustness.Claim(claim.family, claim.claim, claim.generation, claim.threshold, True,
                             {robustness.GRID_STEP: (0.34, 0.02, 0.5)}, claim.value)
    found = robustness.evaluate(wider)
    assert found["verdict"] == "fragile"
    assert found["by_constant"][robustness.GRID_STEP]["flips_at"] == pytest.approx(0.4, abs=1e-6)


def _priced_point(priced: robustness.Priced, generation: str) -> dict:
    """The constants a study priced `generation` at, as a point robustness re-prices at."""
    point = {robustness.HBM_SHARE: priced.hbm_fraction[generation]}
    return point | ({robustness.GRID_STEP: priced.grid_step_us["v6e"]} if generation == "v6e" else {})


def test_re_pricing_at_the_constants_a_study_priced_at_gives_its_recorded_figures():
    moe = json.loads((RESULTS / "moe_layer.json").read_text())
    priced = robustness.Priced.of(moe)
    for shape in moe["shapes"][:8]:
        if shape.get("best_rival"):
            line = next(v for v in moe["variants"] if (v["label"], v["generation"], v["variant"])
                        == (shape["label"], shape["generation"], "ours"))
            point = _priced_point(priced, shape["generation"])
            assert robustness.moe_variant_us(line, shape["generation"], point, priced) == pytest.approx(line["us"])
            assert robustness.moe_variant_us(line, shape["generation"], point | {robustness.HBM_SHARE: 0.85},
                                             priced) == pytest.approx(line["hbm85_us"])
    paged = json.loads((RESULTS / "paged_attention.json").read_text())
    priced = robustness.Priced.of(paged)
    for row in paged["results"][:4]:
        for generation, figures in row["ours"].items():
            assert robustness.paged_pct(figures, robustness.paged_copies(row, figures), generation,
                                        _priced_point(priced, generation), priced) == pytest.approx(
                figures["pct_of_hbm_roofline_fitted"])


def test_the_step_and_share_rules_are_the_models_own():
    """A figure re-priced at another v6e step cost, or (a kernel bound by its copies at every step) at another HBM
    share, from its recorded terms equals the model's price there."""
    from benchmarks import perf

    from .perf_kernels import MATMUL, X, Y

    [call] = perf.model_pallas_traffic(MATMUL, X, Y)

    def priced(step_us: float, share: float) -> perf.ModelledTime:
        return perf.roofline(call, "v6e", step_overhead_s=step_us * 1e-6, hbm_fraction=share)

    fitted_us = perf.grid_step_s("v6e") * 1e6
    line = {"us": priced(fitted_us, 1.0).pipelined_time_s * 1e6,
            "hbm85_us": priced(fitted_us, robustness.MOE_SECOND_SHARE).pipelined_time_s * 1e6,
            "step_cost_us": priced(fitted_us, 1.0).overhead_s * 1e6}
    at = robustness.Priced(hbm_fraction={"v6e": 1.0}, grid_step_us={"v6e": fitted_us})
    for step_us in robustness.V6E_STEP_RANGE_US:
        assert robustness.moe_variant_us(line, "v6e", {robustness.GRID_STEP: step_us, robustness.HBM_SHARE: 1.0},
                                         at) == pytest.approx(priced(step_us, 1.0).pipelined_time_s * 1e6)
    for share in (*robustness.SHARE_RANGE, 0.9):
        assert robustness.moe_variant_us(line, "v6e", {robustness.HBM_SHARE: share}, at) == pytest.approx(
            priced(fitted_us, share).pipelined_time_s * 1e6)


def _tokamax_fit(share_entry: dict) -> dict:
    """calibration_fit_v6e.json's shape: the share fit, the Pallas fit and its step-against-share profile."""
    profile = [{"grid_step_us": step, "best_hbm_fraction": share, "fit_median_log_error": error}
               for step, share, error in ((0.0, 0.7, 0.06), (0.02, 0.71, 0.05), (0.34, 0.8, 0.055), (1.0, 1.0, 0.07))]
    return {"hbm_fraction_sources": ["tokamax-abc1234/tpu_v6_lite/ragged_dot.json"],
            "hbm_fraction": {"v6e": share_entry}, "fits": {"v6e": {"constants": {"grid_step_s": 0.9e-6}}}, "step_share_profile": {"v6e": profile}}


def test_v6e_claims_are_priced_at_the_constants_v6e_borrowed_before_and_only_v6e_claims():
    from benchmarks.studies.tables import robustness as tables

    fitted = robustness.v6e_tokamax_data(_tokamax_fit({"hbm_fraction": 0.9, "entries": [{}, {}]}))
    assert fitted["hbm_share"] == 0.9 and fitted["hbm_share_timings"] == 2
    # Only the priced step range (0.02-0.34 us) says whether the step is identified.
    assert fitted["best_share_across_step_range"] == [0.71, 0.8]
    assert fitted["fit_error_across_step_range"] == [0.05, 0.055]
    borrowed = robustness.v6e_tokamax_data(_tokamax_fit({"hbm_fraction": 1.0, "borrowed_from": "v5e", "entries": []}))
    assert borrowed["hbm_share"] is None
    # Fitted at a share of 0.9, where 9.5 / 0.9 fails: at the share borrowed before (1.0) it held.
    claim = robustness.Claim("anchor", "time at most 10", "v6e", 10.0, True, {robustness.HBM_SHARE: (0.9, 0.78, 1.0)},
                             lambda p: 9.5 / p.get(robustness.HBM_SHARE, 0.9))
    found = robustness.evaluate(claim)
    assert found["at_borrowed"] == {"constants": {robustness.HBM_SHARE: 1.0}, "value": 9.5, "holds": True}
    assert not found["holds_at_fitted"]
    other = robustness.Claim(*dataclasses.astuple(claim)[:2], "v5e", *dataclasses.astuple(claim)[3:6], claim.value)
    assert "at_borrowed" not in robustness.evaluate(other)
    table = tables.flipped({"claims": [found]})
    assert "(hbm_share 1)" in table
    assert "| anchor | 0 | 1 | time at most 10, 9.5 -> 10.5556 |" in table


def test_the_tracked_report_prices_every_v6e_claim_at_the_borrowed_constants_too(report):
    fit = json.loads((RESULTS / "calibration_fit_v6e.json").read_text())
    assert report["v6e_tokamax_data"]["hbm_share"] == fit["hbm_fraction"]["v6e"]["hbm_fraction"]
    assert all(("at_borrowed" in c) == (c["generation"] == "v6e") for c in report["claims"])


def _backward_kernel(us: float, hbm85_us: float, steps: int) -> dict:
    return {"modelled_time_us": us, "pipelined_hbm85_us": hbm85_us,
            "step_cost_us": steps * robustness.chip.grid_step_s("v6e") * 1e6}


def _backward_fixture() -> dict:
    """moe_backward.json's shape, one projection, priced at the fitted constants (g, v6e's step). v6e d_lhs: ours
    100 us in 10 steps, megablox 101 us in 5 (tokamax slower): at a step cost g + 0.2 us both take
    100 + 10 (s - g) = 101 + 5 (s - g), so ours stops winning there. v5e d_rhs: megablox beats ours. v6e's layer: our
    backward 200 (220 at a share of 0.85) over our forward 95 (100), 2.2 exactly at 0.85; v5e's layer misses the
    target (220 / 95) and makes no claim."""
    ours = {"v5e": _backward_kernel(100, 110, 10), "v6e": _backward_kernel(100, 110, 10)}
    kernels = {
        "d_lhs": {"ours": ours, "megablox": {g: _backward_kernel(101, 111, 5) for g in ours},
                  "tokamax": {g: _backward_kernel(130, 140, 200) for g in ours}},
        "d_rhs": {"ours": {"v5e": _backward_kernel(120, 130, 10), "v6e": _backward_kernel(100, 110, 10)},
                  "megablox": {g: _backward_kernel(110, 120, 100) for g in ours},
                  "tokamax": {g: _backward_kernel(130, 140, 100) for g in ours}},
        "forward": {"ours": {g: _backward_kernel(95, 100, 10) for g in ours}},
    }
    return {"priced_at": robustness.chip.priced_at(),
            "entries": [{"setting": "layer", "projection": "gate_up", "kernels": kernels}],
            "layer_ratios": [{"setting": "layer", "generation": "v5e", "ours_backward_over_our_forward": 220 / 95},
                             {"setting": "layer", "generation": "v6e", "ours_backward_over_our_forward": 200 / 95}],
            "targets": {"backward_forward_ratio_target": 2.2}}


def test_backward_claims_flip_where_the_hand_computation_says():
    found = {(c["claim"], c["generation"]): c for c in map(robustness.evaluate, robustness.backward_ranking_claims(
        _backward_fixture()))}
    assert len(found) == 4
    d_lhs = found[("layer gate_up d_lhs: ours at most the better of megablox and tokamax", "v6e")]
    assert d_lhs["verdict"] == "fragile" and d_lhs["by_constant"][robustness.HBM_SHARE]["holds"]
    fitted_step = robustness.chip.grid_step_s("v6e") * 1e6
    assert d_lhs["by_constant"][robustness.GRID_STEP]["flips_at"] == pytest.approx(fitted_step + 0.2, abs=1e-4)
    assert found[("layer gate_up d_lhs: ours at most the better of megablox and tokamax", "v5e")]["verdict"] == (
        "robust")
    beaten = found[("layer gate_up d_rhs: megablox beats ours", "v5e")]
    assert beaten["holds_if"] == "at_least" and beaten["verdict"] == "robust"
    assert robustness.GRID_STEP not in beaten["by_constant"]
    [ratio] = map(robustness.evaluate, robustness.backward_ratio_claims(_backward_fixture()))
    assert (ratio["generation"], ratio["fitted"]) == ("v6e", round(200 / 95, 4))
    assert ratio["verdict"] == "fragile"
    assert ratio["by_constant"][robustness.HBM_SHARE]["flips_at"] == pytest.approx(0.85, abs=1e-4)
    assert ratio["by_constant"][robustness.GRID_STEP]["holds"]


def test_moe_backward_records_what_robustness_re_prices_with():
    """Each figure carries its price at a share of 0.85 and its grid-step cost, as the model gives them."""
    import numpy as np

    from benchmarks import perf
    from benchmarks.studies import moe_backward

    from .perf_kernels import MATMUL, X, Y

    figures = moe_backward._model(lambda x, y, sizes: MATMUL(x, y), (X, Y), np.array([256, 256]), 10**6, 10**9)
    [call] = perf.model_pallas_traffic(MATMUL, X, Y)
    for generation, found in figures.items():
        at_85 = perf.roofline(call, generation, min_bytes=10**6, min_flops=10**9, hbm_fraction=0.85)
        assert found["pipelined_hbm85_us"] == pytest.approx(at_85.pipelined_time_s * 1e6)
        assert found["step_cost_us"] == pytest.approx(at_85.overhead_s * 1e6) and found["step_cost_us"] > 0
    tracked = json.loads((RESULTS / "moe_backward.json").read_text())
    for entry in tracked["entries"]:
        for kernels in entry["kernels"].values():
            for by_generation in kernels.values():
                assert all({"pipelined_hbm85_us", "step_cost_us"} <= set(f) for f in by_generation.values())


def test_readme_verdicts_take_one_line_per_study():
    from benchmarks.studies.tables import robustness as tables

    claims = [{"family": family, "verdict": verdict} for family, verdict in (
        ("moe_layer ranking", "robust"), ("anchor", "fragile"), ("paged decode", "robust"), ("decode step", "robust"),
        ("moe_backward ranking", "robust"), ("moe_backward ranking", "fragile"), ("backward/forward ratio", "robust"))]
    assert tables.verdicts({"claims": claims, "decode_step_rests_on": {}}).splitlines() == [
        "- moe_layer ranking: 1 of 1 claims robust; anchor: 0 of 1 claims robust, fragile: 1 "
        "(each in robustness.json's claims)",
        "- paged decode: 1 of 1 claims robust",
        "- decode step: 1 of 1 claims robust",
        "- moe_backward ranking: 1 of 2 claims robust, fragile: 1; backward/forward ratio: 1 of 1 claims robust "
        "(each in robustness.json's claims)"]
