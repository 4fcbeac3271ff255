"""The calibrated error band a benchmark figure carries: taken in the figure's regime, or none where that regime has
no timing."""

import pytest

from benchmarks.studies import calibration_bands
from benchmarks.studies.tables import calibration as calibration_tables
from benchmarks.perf import calibration, modelled_time


def stats(count: int, median: float, p90: float) -> dict:
    # The model faster than the chip: a signed bias below zero, its mean pulled further by the tail.
    return {"count": count, "median_abs_error": median, "p90_abs_error": p90, "worst": {"ratio": 1 + p90},
            "median_signed_error": -median, "mean_signed_error": -(median + p90) / 2}


# v5e timed Pallas ragged dots in both regimes, XLA's only streaming; TPU7x timed flash attention only.
SUMMARY = {
    "v5e": {"pallas_ragged_dot": {"all": stats(16, 0.02, 0.06),
                                  "regimes": {"streaming": stats(2, 0.1, 0.2), "compute_bound": stats(14, 0.01, 0.05)}},
            "xla_ragged_dot": {"all": stats(5, 0.1, 0.3), "regimes": {"streaming": stats(5, 0.1, 0.3)}}},
    "tpu7x": {"flash_attention": {"all": stats(3, 0.1, 0.2), "regimes": {"compute_bound": stats(3, 0.1, 0.2)}}},
}


@pytest.fixture
def summary(monkeypatch):
    monkeypatch.setattr(calibration_bands, "_summary", lambda: SUMMARY)


def test_regime_is_the_longer_of_copies_and_matmuls():
    assert modelled_time.regime(2.0, 1.0) == "streaming"
    assert modelled_time.regime(1.0, 2.0) == "compute_bound"
    assert set(modelled_time.REGIMES) == {"streaming", "compute_bound"}


def test_band_takes_the_error_of_the_figures_regime(summary):
    streaming = calibration_bands.band({"pallas_ragged_dot": 100e-6}, "v6e", "streaming")
    compute = calibration_bands.band({"pallas_ragged_dot": 100e-6}, "v6e", "compute_bound")
    assert streaming["p90_us"] == [80.0, 120.0] and streaming["regime"] == "streaming"
    assert compute["p90_us"] == [95.0, 105.0] and compute["median_us"] == [99.0, 101.0]
    # A band says how many timings it rests on, per kind.
    assert streaming["points"] == {"pallas_ragged_dot": 2} and compute["points"] == {"pallas_ragged_dot": 14}


def test_describe_gives_the_signed_bias_and_the_number_of_timings(summary):
    line = calibration_bands.describe("pallas_ragged_dot", "v5e", "streaming")
    assert line == ("pallas_ragged_dot, streaming, on v5e (2 entries): median 10.0 %, p90 20.0 %, signed bias "
                    "-10.0 % (mean -15.0 %), worst ratio 1.20")
    older = {"v5e": {"pallas_ragged_dot": {"regimes": {"streaming": {
        k: v for k, v in stats(2, 0.1, 0.2).items() if "signed" not in k}}}}}
    found = calibration_bands.error("pallas_ragged_dot", "v5e", "streaming", older)
    assert found["median_signed"] is None and found["mean_signed"] is None
    assert "bias not summarised" in calibration_tables.bands({"summary": older})


def test_a_regime_without_timings_gives_no_band_and_says_why(summary):
    found = calibration_bands.band({"pallas_ragged_dot": 50e-6, "xla_ragged_dot": 50e-6}, "v5e", "compute_bound",
                                   uncalibrated_s=10e-6)
    assert found["p90_us"] is None and found["median_us"] is None and found["uncalibrated_us"] == 10.0
    assert "xla_ragged_dot" in found["no_band"] and "compute_bound" in found["no_band"]
    assert "pallas_ragged_dot" not in found["no_band"]
    assert calibration_bands.p90_fields(found)["no_band"] == found["no_band"]
    assert calibration_bands.span(found["p90_us"]) == "no band"
    # A term of zero seconds asks for no error.
    assert calibration_bands.band({"pallas_ragged_dot": 50e-6, "xla_ragged_dot": 0.0}, "v5e",
                                  "compute_bound")["p90_us"] == [47.5, 52.5]


def test_a_kind_no_standing_chip_timed_takes_another_chips_in_the_same_regime(summary):
    found = calibration_bands.error("flash_attention", "v6e", "compute_bound")
    assert found["measured_on"] == "tpu7x" and not found["own_measurements"] and found["count"] == 3
    assert calibration_bands.error("flash_attention", "v6e", "streaming") is None
    assert "no band" in calibration_bands.describe("flash_attention", "v6e")


def test_unknown_kind_or_regime_is_refused(summary):
    with pytest.raises(ValueError, match="regime"):
        calibration_bands.error("pallas_ragged_dot", "v5e", "decode")
    with pytest.raises(ValueError, match="kind"):
        calibration_bands.error("matmul", "v5e", "streaming")


def test_calibration_summary_splits_each_chip_and_kind_by_regime():
    def record(ratio: float, regime: str, split: str = "fit") -> dict:
        return {"chip": "v5e", "kind": "pallas_ragged_dot", "call": f"c{ratio}", "config": {}, "ratio": ratio,
                "regime": regime, "split": split}

    summary = calibration.summarize([record(1.1, "streaming"), record(1.3, "streaming", "holdout"),
                                     record(0.99, "compute_bound")])
    block = summary["v5e"]["pallas_ragged_dot"]
    assert block["all"]["count"] == 3
    assert block["regimes"]["streaming"]["count"] == 2
    assert block["regimes"]["streaming"]["median_abs_error"] == pytest.approx(0.2)
    assert block["regimes"]["compute_bound"]["count"] == 1
    # Signed: the bias keeps the direction the absolute error loses.
    assert block["all"]["median_signed_error"] == pytest.approx(0.1)
    assert block["all"]["mean_signed_error"] == pytest.approx((0.1 + 0.3 - 0.01) / 3, abs=1e-4)
    assert block["regimes"]["compute_bound"]["median_signed_error"] == pytest.approx(-0.01)


def test_resummarize_rewrites_the_summary_from_the_reports_entries(tmp_path):
    def record(ratio: float, split: str) -> dict:
        return {"chip": "v5p", "kind": "pallas_ragged_dot", "call": f"c{ratio}", "config": {}, "ratio": ratio,
                "regime": "compute_bound", "split": split}

    entries = [record(0.8, "holdout"), record(0.9, "holdout"), record(1.05, "fit")]
    path = tmp_path / "calibration.json"
    calibration.write_report({"what": "w", "summary": {"stale": {}}, "entries": entries, "skipped": []}, path)
    calibration.write_report(calibration.resummarize(path), path)
    summary = calibration.json.loads(path.read_text())["summary"]
    assert list(summary) == ["v5p"]
    held_out = summary["v5p"]["pallas_ragged_dot"]["holdout"]
    assert held_out["count"] == 2 and held_out["median_signed_error"] == pytest.approx(-0.15)
    assert held_out["median_abs_error"] == pytest.approx(0.15)


def test_bands_table_names_the_chip_and_count_or_no_band():
    table = calibration_tables.bands({"summary": SUMMARY}).splitlines()
    assert table[0] == ("| generation | kind | streaming p90, signed bias median / mean (timings, chip) "
                        "| compute_bound p90, signed bias median / mean (timings, chip) |")
    assert "| v6e | pallas_ragged_dot | 20.0 %, -10.0 / -15.0 % (2, v5e) | 5.0 %, -1.0 / -3.0 % (14, v5e) |" in table
    assert "| v5e | xla_ragged_dot | 30.0 %, -10.0 / -20.0 % (5, v5e) | no band |" in table
    assert "| tpu7x | flash_attention | no band | 20.0 %, -10.0 / -15.0 % (3, tpu7x) |" in table


def test_cli_resummarizes_without_compiling_and_refuses_no_input(tmp_path, capsys):
    from benchmarks import cli

    entries = [{"chip": "v5p", "kind": "pallas_ragged_dot", "call": "c", "config": {}, "ratio": 1.07,
                "regime": "streaming", "split": "holdout"}]
    path = tmp_path / "calibration_v5p.json"
    calibration.write_report({"summary": {}, "entries": entries, "skipped": []}, path)
    assert cli.main(["calibrate", "--resummarize", str(path)]) == 0
    stats = calibration.json.loads(path.read_text())["summary"]["v5p"]["pallas_ragged_dot"]["all"]
    assert stats["median_signed_error"] == pytest.approx(0.07)
    assert cli.main(["calibrate"]) == 2
    assert "--resummarize" in capsys.readouterr().err


def _pallas_entry(chip: str, call: str, ratio: float, split: str, xla_us: float = 0.0) -> dict:
    measured = 1000.0
    return {"chip": chip, "kind": "pallas_ragged_dot", "call": call, "config": {"tile_m": 512, "tile_k": 2944,
            "tile_n": 768}, "measured_us": measured, "predicted_us": measured * ratio, "ratio": ratio,
            "regime": "compute_bound", "split": split,
            "terms_us": {"kernels": measured * ratio - xla_us, "kernels_hbm": 100.0, "kernels_mxu": 400.0,
                         "kernel_steps": 12, "xla_ops": xla_us + 5.0, "xla_transposes": xla_us}}


def test_calibration_tables_add_a_checking_chips_report_and_explain_each_held_out_outlier():
    stats = {"count": 2, "median_abs_error": 0.1, "p90_abs_error": 0.3, "worst": {"ratio": 0.7},
             "median_signed_error": -0.1, "mean_signed_error": -0.2}
    odd = "bf16[320,2880] x bf16[8,2880,2880] G=8"
    report = {"summary": {"tpu7x": {"pallas_ragged_dot": {"all": stats}}}, "skipped": [],
              "entries": [_pallas_entry("tpu7x", f"dlhs {odd}", 0.69, "holdout", xla_us=200.0),
                          _pallas_entry("tpu7x", f"drhs {odd}", 0.7, "fit", xla_us=200.0),
                          _pallas_entry("tpu7x", "fwd bf16[512,512] x bf16[8,512,512] G=8", 1.02, "holdout")]}
    v5p = {"summary": {"v5p": {"pallas_ragged_dot": {"all": {**stats, "count": 1}}}}, "skipped": [],
           "entries": [_pallas_entry("v5p", "fwd bf16[64,512] x bf16[8,512,512] G=8", 1.25, "holdout")]}
    tables = calibration_tables.render_markdown(report, {"what": "x"}, {"hbm_fraction": {}, "hbm_fraction_note": {}},
                                                (v5p,))
    assert [row.split(" | ")[0] for row in tables["error"].splitlines()[2:]] == ["| tpu7x", "| v5p"]
    # The bands stay the standing report's: v5p's timings check the model, they do not make its bands.
    assert "(1, v5p)" not in tables["bands"]
    rows = tables["outliers"].splitlines()[4:]
    assert len(rows) == 2 and rows[0].startswith("| tpu7x | dlhs ") and rows[1].startswith("| v5p | fwd ")
    assert f"transposes around the kernel are {100 * 200 / 690:.0f} % of its predicted time" in rows[0]
    assert f"{(1000 - 690 + 200) / 200:.1f}x their price" in rows[0]
    assert "0.70 (drhs, fit): the miss follows the problem" in rows[0]
    assert "not identified" in rows[1]
    with pytest.raises(ValueError, match="overlap on tpu7x"):
        calibration_tables.render_markdown(report, {"what": "x"}, {"hbm_fraction": {}, "hbm_fraction_note": {}},
                                           (report,))


def test_an_outlier_whose_row_tile_is_biased_apart_says_so():
    def entry(tile_m: int, ratio: float, split: str = "fit") -> dict:
        found = _pallas_entry("v5p", f"fwd bf16[{tile_m},512] x bf16[8,512,512] G=8", ratio, split)
        return {**found, "config": {**found["config"], "tile_m": tile_m}}

    entries = [entry(128, 1.08), entry(128, 1.1), entry(128, 1.22, "holdout"), entry(256, 0.99), entry(512, 1.01)]
    [reason] = calibration_tables.row_tile_reason(entries[2], entries)
    assert "the 3 entries of v5p with its row tile (128) are priced at a median signed error of +10.0 %" in reason
    assert "the 2 with other row tiles at +0.0 %" in reason
    # A row tile priced like the others explains nothing.
    assert calibration_tables.row_tile_reason(entries[3], entries[:2] + entries[3:]) == []


def test_a_generation_whose_timings_only_check_says_so_for_the_kinds_they_cover(summary):
    checked = calibration_bands.describe("pallas_ragged_dot", "v5p", "streaming")
    assert checked.endswith("v5p's figures take v5e's constants and error; v5p's own timings of pallas_ragged_dot "
                            "check them (benchmarks/results/calibration_v5p.json)")
    assert calibration_bands.describe("flash_attention", "v5p", "compute_bound").endswith(
        "v5p has no timing of flash_attention: tpu7x's constants and error")
    assert calibration_bands.describe("pallas_ragged_dot", "v6e", "streaming").endswith(
        "v6e's figures take v5e's constants and error; v6e's own timings of pallas_ragged_dot, xla_ragged_dot, "
        "flash_attention check them (benchmarks/results/calibration_v6e.json)")
    assert (calibration_bands.borrowed("v6e", "tpu7x", "flash_attention_vjp")
            == "v6e has no timing of flash_attention_vjp: tpu7x's constants and error")


def test_an_outlier_its_problem_does_not_explain_says_so_and_names_the_pass_biased_apart():
    problem = "bf16[1024,512] x bf16[1024,512] G=8"
    entries = [_pallas_entry("v6e", f"drhs {problem}", 1.23, "holdout"),
               _pallas_entry("v6e", "drhs bf16[2048,512] x bf16[2048,512] G=8", 1.05, "fit"),
               _pallas_entry("v6e", f"fwd {problem}", 0.84, "fit"), _pallas_entry("v6e", f"dlhs {problem}", 0.85, "fit"),
               _pallas_entry("v6e", "fwd bf16[64,512] x bf16[8,512,512] G=8", 0.88, "fit")]
    reason = calibration_tables.outlier_reason(entries[0], entries)
    assert "0.84 (fwd, fit), 0.85 (dlhs, fit): the miss is not the problem's" in reason
    assert ("the 2 drhs entries of v6e are priced at a median signed error of +14.0 %, the 3 of the other passes at "
            "-15.0 %: the miss follows the pass") in reason
    # Passes priced alike explain nothing.
    assert calibration_tables.pass_reason(entries[2], entries[2:]) == []
