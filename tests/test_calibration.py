"""`python -m benchmarks calibrate`: reading tokamax's timing files, and the model's error on a few real-chip entries
per kind.

The entries below are tokamax 0.0.12's own measurements (tokamax/data/autotuning), rebuilt and modelled
as `python -m benchmarks calibrate` does; a model change that moves them outside the issue's bands fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import perf
from benchmarks.perf import calibration, tokamax_calls

tokamax = pytest.importorskip("tokamax")
AUTOTUNING = Path(tokamax.__file__).parent / "data" / "autotuning"

# (chip folder, file, call label, the largest |predicted / measured - 1| accepted): the accepted bands
# (Pallas ragged dot: worst 20 %; XLA ragged dot: within 2x; flash attention: 30 %).
PINNED = [
    ("tpu_v5_lite", "pallas_mosaic_tpu_ragged_dot.json", "fwd bf16[4096,4096] x bf16[8,4096,4096] G=8", 0.20),
    ("tpu_v5_lite", "pallas_mosaic_tpu_ragged_dot.json",
     "drhs bf16[131072,2048] x bf16[131072,768] G=128", 0.20),
    ("tpu_v5_lite", "pallas_mosaic_tpu_ragged_dot.json",
     "fwd bf16[8192,4096] x bf16[8,4096,14336] G=8 +residuals", 0.20),
    ("tpu_v5_lite", "ragged_dot.json", "fwd bf16[8,4096] x bf16[8,4096,4096] G=8", 1.0),
    ("tpu_v5_lite", "ragged_dot.json", "fwd bf16[131072,2048] x bf16[128,2048,768] G=128", 1.0),
    ("tpu_v5_lite", "ragged_dot.json", "drhs bf16[131072,2048] x bf16[131072,768] G=128", 1.0),
    ("tpu7x", "pallas_mosaic_tpu_ragged_dot.json", "fwd bf16[131072,7168] x bf16[256,7168,512] G=256", 0.20),
    ("tpu7x", "ragged_dot.json", "fwd bf16[131072,2048] x bf16[128,2048,768] G=128", 1.0),
    ("tpu7x", "pallas_mosaic_tpu_flash_attention.json",
     "q bf16[16,1024,16,128] k bf16[16,1024,16,128] v bf16[16,1024,16,128] is_causal", 0.30),
    ("tpu7x", "pallas_mosaic_tpu_flash_attention_vjp.json",
     "q bf16[16,1024,16,128] k bf16[16,1024,16,128] v bf16[16,1024,16,128] is_causal", 0.30),
]


def _measurement(folder: str, file: str, label: str) -> calibration.Measurement:
    measurements, _ = calibration.read_measurements([AUTOTUNING / folder / file])
    found = [m for m in measurements if m.label == label]
    assert found, f"{label} is not in {folder}/{file}"
    return found[0]


@pytest.mark.aot
@pytest.mark.parametrize("folder, file, label, band", PINNED, ids=[p[2] for p in PINNED])
def test_pinned_entries_stay_inside_the_calibrated_bands(folder, file, label, band, tmp_path):
    measurement = _measurement(folder, file, label)
    [analysed] = calibration.analyse_measurements([measurement], calibration.AnalysisCache(tmp_path), jobs=1)
    assert analysed.program is not None, analysed.reason
    ratio = analysed.price().pipelined_time_s * 1e6 / measurement.measured_us
    if band >= 1.0:  # "within 2x"
        assert 0.5 <= ratio <= 2.0, ratio
    else:
        assert abs(ratio - 1) <= band, ratio


def test_calibration_fit_writes_the_constant_files_the_model_reads():
    from benchmarks.studies import calibration_fit

    # Relative to the checkout (pytest runs from its root): `--write-constants` refuses a path that is no file.
    assert calibration_fit.CONSTANTS.resolve() == (Path(perf.__file__).parent / "model_constants.json").resolve()
    assert calibration_fit.HBM_FRACTIONS.resolve() == (Path(perf.__file__).parent / "hbm_fractions.json").resolve()


@pytest.mark.aot
def test_constants_priced_with_are_passed_in_and_leave_the_fitted_pricing_alone(tmp_path):
    [(folder, file, label, _)] = [p for p in PINNED if p[1] == "pallas_mosaic_tpu_flash_attention.json"]
    measurement = _measurement(folder, file, label)
    [analysed] = calibration.analyse_measurements([measurement], calibration.AnalysisCache(tmp_path), jobs=1)
    assert calibration.ModelConstants().rates == perf.FITTED_RATES
    fitted = analysed.price().pipelined_time_s
    # Flash attention on TPU7x is vector-bound: slower vector units make it slower.
    slower = calibration.ModelConstants(vector_elements_per_cycle=perf.FITTED_RATES.vector_elements_per_cycle / 4)
    assert analysed.price(slower).pipelined_time_s > fitted
    assert analysed.price().pipelined_time_s == fitted


def test_group_sizes_given_as_a_count_expand_as_tokamax_expands_them():
    from tokamax._src.ops.ragged_dot.base import generate_group_sizes

    call = {"group_sizes": {"num_groups": 8, "total_size": 100}}
    sizes = tokamax_calls.group_sizes_of(call)
    assert sizes.tolist() == list(generate_group_sizes(m=100, num_groups=8)) and sizes.sum() == 100


def test_reading_repairs_tokamax_unescaped_group_sizes_and_refuses_other_damage(tmp_path):
    key = ('{\\"lhs\\":\\"bf16[16,128]\\",\\"group_sizes\\":{"num_groups":2,"total_size":16},'
           '\\"return_residuals\\":false}')
    damaged = tmp_path / "tpu_v5_lite" / "ragged_dot.json"
    damaged.parent.mkdir()
    damaged.write_text('{"%s": {"{}": {"evaluation_times_ms": [1.0, 2.0]}}}' % key)
    [(parsed, configs)] = tokamax_calls.read_timing_file(damaged).items()
    assert json.loads(parsed)["group_sizes"] == {"num_groups": 2, "total_size": 16}
    assert configs == {"{}": {"evaluation_times_ms": [1.0, 2.0]}}

    (tmp_path / "empty.json").write_text("")
    assert tokamax_calls.read_timing_file(tmp_path / "empty.json") == {}
    (tmp_path / "broken.json").write_text('{"a": ')
    with pytest.raises(calibration.CalibrationInputError, match="not a tokamax autotuning file"):
        tokamax_calls.read_timing_file(tmp_path / "broken.json")


def test_the_chip_comes_from_the_folder_and_unknown_ops_or_untimed_entries_are_listed(tmp_path):
    folder = tmp_path / "tpu7x"
    folder.mkdir()
    timed = '{"lhs":"bf16[8,128]","rhs":"bf16[2,128,128]","group_sizes":[4,4],' \
            '"ragged_dot_dimension_numbers":{"dot_dimension_numbers":[[[1],[1]],[[],[]]],' \
            '"lhs_ragged_dimensions":[0],"rhs_group_dimensions":[0]},"precision":["DEFAULT","DEFAULT"],' \
            '"preferred_element_type":null,"return_residuals":false,"activation":null}'
    (folder / "ragged_dot.json").write_text(json.dumps({timed: {"{}": {"evaluation_times_ms": [0.5, 0.4]}},
                                                         timed.replace("[4,4]", "[8,0]"): {}}))
    (folder / "normalization.json").write_text(json.dumps({"x": {}}))
    measurements, skipped = calibration.read_measurements([folder])
    assert [(m.chip, m.kind, m.measured_us) for m in measurements] == [("tpu7x", "xla_ragged_dot", 400.0)]
    reasons = sorted(entry["reason"] for entry in skipped)
    assert "no rebuild of tokamax op 'normalization'" in reasons[0] and reasons[1] == "no timing recorded"

    elsewhere = tmp_path / "mystery"
    elsewhere.mkdir()
    (elsewhere / "ragged_dot.json").write_text(json.dumps({timed: {"{}": {"evaluation_times_ms": [1.0]}}}))
    measurements, skipped = calibration.read_measurements([elsewhere])
    assert not measurements and "chip unknown" in skipped[0]["reason"]
    measurements, _ = calibration.read_measurements([elsewhere], chip="v5e")
    assert measurements[0].chip == "v5e"


@pytest.mark.slow
def test_cli_writes_the_report_and_fails_only_on_a_file_it_cannot_read(tmp_path, capsys):
    from benchmarks.cli import main

    source = tmp_path / "tpu_v5_lite"
    source.mkdir()
    entries = json.loads((AUTOTUNING / "tpu_v5_lite" / "ragged_dot.json").read_text())
    decode = {key: value for key, value in entries.items() if '"lhs":"bf16[8,4096]"' in key}
    (source / "ragged_dot.json").write_text(json.dumps(decode))
    out = tmp_path / "calibration.json"
    # The command through cli.main in this process: a process of its own would start torch and jax again.
    command = ["calibrate", str(source), "--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--jobs", "1"]
    assert main(command) == 0, capsys.readouterr().err[-2000:]
    report = json.loads(out.read_text())
    assert {e["kind"] for e in report["entries"]} == {"xla_ragged_dot"} and len(report["entries"]) == 2
    assert report["summary"]["v5e"]["xla_ragged_dot"]["all"]["count"] == 2
    assert all(0.5 <= e["ratio"] <= 2 for e in report["entries"])

    (source / "ragged_dot.json").write_text("not json")
    capsys.readouterr()
    assert main(command) == 2 and "not a tokamax autotuning file" in capsys.readouterr().err


def test_a_timing_faster_than_the_peak_allows_for_its_recorded_inputs_is_left_out(tmp_path):
    # tokamax records these group sizes as a count; at its expansion (random sizes, seed 0) the kernel's
    # tiles hold more matmul work than TPU7x's bf16 peak does in the measured time.
    measurement = _measurement("tpu7x", "pallas_mosaic_tpu_ragged_dot.json", "fwd bf16[4096,4096] x bf16[8,4096,4096] G=8")
    [analysed] = calibration.analyse_measurements([measurement], calibration.AnalysisCache(tmp_path), jobs=1)
    assert "inconsistent inputs" in calibration.inconsistent_with_peak(analysed)
    fine = _measurement("tpu_v5_lite", "pallas_mosaic_tpu_ragged_dot.json", "fwd bf16[4096,4096] x bf16[8,4096,4096] G=8")
    [analysed] = calibration.analyse_measurements([fine], calibration.AnalysisCache(tmp_path), jobs=1)
    assert calibration.inconsistent_with_peak(analysed) is None


def test_a_compile_the_compiler_refuses_is_kept_until_what_decides_it_changes(tmp_path, monkeypatch):
    """The compiler's refusal (here: over the scoped VMEM limit) is cached like a compiled program, so the next run
    does not compile it again; other libtpu flags or library versions compile it again; a failure of this host
    (a full disk) is not kept."""
    import jax

    measurement = _measurement("tpu_v5_lite", "ragged_dot.json", "fwd bf16[8,4096] x bf16[8,4096,4096] G=8")
    compiles = []

    def refuse(lowered):
        compiles.append(lowered)
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:\nmore lines")

    def reason_and_compiles() -> tuple[str, int]:
        [analysed] = calibration.analyse_measurements([measurement], calibration.AnalysisCache(tmp_path), jobs=1)
        return analysed.reason, len(compiles)

    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    monkeypatch.setattr(calibration, "compile_text", refuse)
    refused = "compile failed: RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:"
    assert reason_and_compiles() == (refused, 1)
    assert reason_and_compiles() == (refused, 1)
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_scoped_vmem_limit_kib=65536")
    assert reason_and_compiles() == (refused, 2)
    assert reason_and_compiles() == (refused, 2)
    monkeypatch.setattr(calibration, "library_versions", lambda: "jax=0.10.3;jaxlib=0.10.3;libtpu=0.0.53")
    assert reason_and_compiles() == (refused, 3)

    def disk_full(lowered):
        compiles.append(lowered)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(calibration, "compile_text", disk_full)
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_scoped_vmem_limit_kib=32768")
    assert reason_and_compiles() == ("compile failed: [Errno 28] No space left on device", 4)
    assert reason_and_compiles() == ("compile failed: [Errno 28] No space left on device", 5)
