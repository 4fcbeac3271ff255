"""`kernels benchmark` on our three published repos, and `python -m benchmarks calibrate --from-benchmark` on its JSON.

The chain runs here end to end: the real `kernels benchmark` CLI against our local Hub (interpret mode on this
CPU: every case checked against its reference), then `calibrate --from-benchmark` on its JSON. The fit is
checked on a recorded TPU run: tests/tokamax_v5e_kernels_benchmark.json holds, in kernels benchmark's form,
three of tokamax 0.0.12's own v5e timings of its Pallas ragged dot (tokamax/data/autotuning/tpu_v5_lite: each
entry's `evaluation_times_ms` as the timings, named by `benchmark_cases.tokamax_workload`), so the model's
figures and the constants the data moves are known: the model's are `calibrate`'s for the same entries, and
timings made from the model at other constants must move exactly those.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .hub_support import BIN, CLI_TIMEOUT, KERNEL_NAMES, TOKEN, TRUSTED, cli_env, published_fixture, run_cli

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKAMAX_FIXTURE = Path(__file__).with_name("tokamax_v5e_kernels_benchmark.json")

published = published_fixture("kernels-benchmark")


def interpret_workloads(build: Path) -> set[str]:
    """The workloads the build's benchmark suites run without a TPU."""
    from benchmarks.studies import benchmark_cases
    from tpu_kernels.distribution.loader import get_local_kernel

    suites = benchmark_cases.benchmark_suites(get_local_kernel(build, backend="cpu"))
    return {f"{class_name}.{workload}" for _, _, table in suites.SUITES for class_name, cases in table.items()
            for workload in cases}


@pytest.fixture(scope="module")
def benchmark_runs(published, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """`kernels benchmark tpu-kernels/<name> --version 1` of each repo, as a user runs it: its JSON and its
    printed output. One warm-up-free timing per case: the times here mean nothing."""
    home = tmp_path_factory.mktemp("benchmark-user")
    env = cli_env(published.url, home)
    runs = {}
    for name in KERNEL_NAMES:
        out = home / f"{name}.json"
        done = run_cli("kernels", "benchmark", f"{TRUSTED}/{name}", "--version", "1", "--warmup", "0",
                       "--iterations", "1", "--output", str(out), env=env)
        runs[name] = (out, done.stdout + done.stderr)
    return runs


@pytest.mark.multiprocess
@pytest.mark.slow
def test_kernels_benchmark_runs_each_published_repo_and_every_check_passes(published, benchmark_runs):
    for name, (out, printed) in benchmark_runs.items():
        results = json.loads(out.read_text())["results"]
        assert {r["workload"] for r in results} == interpret_workloads(published.builds[name])
        assert all(r["verified"] is True for r in results), name
        assert "mean nothing about a TPU" in printed


PROBE = """import os, pathlib
from kernels import Benchmark
pathlib.Path(os.environ["BENCHMARK_RAN"]).write_text("ran")


class Probe(Benchmark):
    def benchmark_probe(self):
        pass
"""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_kernels_benchmark_runs_a_repos_code_before_refusing_its_untrusted_publisher(published, tmp_path):
    """A fact of kernels 0.19.1 (docs/security.md): the benchmark scripts run before get_kernel's trust check."""
    import shutil

    from tpu_kernels.distribution.publish import upload_kernel

    build = tmp_path / "rmsnorm-tpu"
    shutil.copytree(published.builds["rmsnorm-tpu"], build)
    (build / "benchmarks" / "benchmark.py").write_text(PROBE)
    upload_kernel(build, "someone/rmsnorm-tpu", endpoint=published.url, token=TOKEN)
    ran = tmp_path / "ran"
    env = dict(cli_env(published.url, tmp_path), BENCHMARK_RAN=str(ran))
    done = subprocess.run([str(BIN / "kernels"), "benchmark", "someone/rmsnorm-tpu",
                           "--version", "1", "--warmup", "0", "--iterations", "1"], env=env, capture_output=True,
                          text=True, timeout=CLI_TIMEOUT, stdin=subprocess.DEVNULL)
    assert done.returncode == 1 and "is not from a trusted publisher" in done.stderr
    assert ran.read_text() == "ran"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_calibrate_prices_every_benchmarked_case_and_fits_nothing_from_interpret_mode(benchmark_runs, tmp_path,
                                                                                         capsys):
    from benchmarks.cli import main

    paths = [str(out) for out, _ in benchmark_runs.values()]
    unknown = tmp_path / "unknown.json"
    payload = json.loads(Path(paths[0]).read_text())
    payload["results"] = [dict(payload["results"][0], workload="Elsewhere.kernel")]
    unknown.write_text(json.dumps(payload))
    report_path = tmp_path / "report.json"
    # In this process: the command's own start-up (torch, jax) would cost more than what it does here.
    returncode = main(["calibrate", "--from-benchmark", *paths, str(unknown), "--chip", "v6e", "--out",
                       str(report_path), "--cache-dir", str(tmp_path / "cache")])
    printed = capsys.readouterr()
    assert returncode == 0, printed.err[-3000:]
    report = json.loads(report_path.read_text())
    measured = {r["workload"]: r for path in paths for r in json.loads(Path(path).read_text())["results"]}
    constants = {p["workload"]: p for p in report["model_constant_points"]}
    assert {e["workload"] for e in report["entries"]} | set(constants) == set(measured)
    assert {p["term"] for p in constants.values()} == {"grid_step", "kernel_dma", "hbm_stream", "expert_gather"}
    assert all(p["interpret_mode"] and p["seconds"] > 0 for p in constants.values())
    for entry in report["entries"]:
        assert entry["interpret_mode"] and entry["chip"] == "v6e" and entry["predicted_us"] > 0
        assert entry["measured_us"] == pytest.approx(1e3 * measured[entry["workload"]]["timingResults"]["min_ms"],
                                                     abs=0.01)
        assert entry["terms_us"]["kernel_steps"] > 0
    assert report["skipped"] == [{"workload": "Elsewhere.kernel", "reason": "no kernel repo's benchmark defines it"}]
    assert report["moves"] == {} and report["summary"] == {} and report["model_constant_fits"] == {}
    assert "interpret mode: the time means nothing" in printed.out and "no constant moves" in printed.out


def test_calibrate_takes_tokamax_files_or_benchmark_json_and_asks_for_the_chip(tmp_path, capsys):
    from benchmarks.cli import main

    results = tmp_path / "results.json"
    results.write_text(json.dumps({"results": [{"workload": "InterpretModeRMSNorm.rms_norm_h256_r16",
                                                "timingResults": {"min_ms": 1.0, "mean_ms": 1.0, "iterations": 1},
                                                "verified": True}]}))
    not_json = tmp_path / "not.json"
    not_json.write_text("timings: none")
    for args, said in (((), "give one of"), ((str(tmp_path), "--from-benchmark", str(results)), "give one of"),
                       (("--from-benchmark", str(results)), "name the chip"),
                       (("--from-benchmark", str(results), "--chip", "v9"), "--chip v9"),
                       (("--from-benchmark", str(not_json)), "not the JSON")):
        assert main(["calibrate", *args]) == 2
        assert said in capsys.readouterr().err, args


@pytest.fixture(scope="module")
def tokamax_analysis(tmp_path_factory):
    from benchmarks.studies import from_benchmark

    cache = tmp_path_factory.mktemp("calibration-cache")
    return from_benchmark.analyse([TOKAMAX_FIXTURE], None, cache_dir=cache), cache


def _with_times(analysis, constants, folder: Path) -> Path:
    """The fixture with each workload's timing replaced by the model's figure at `constants`."""
    priced = {analysis.workloads[a.measurement.identity][0]: a.price(constants).pipelined_time_s * 1e3
              for a in analysis.analysed}
    payload = json.loads(TOKAMAX_FIXTURE.read_text())
    for result in payload["results"]:
        result["timingResults"].update(min_ms=priced[result["workload"]], mean_ms=priced[result["workload"]])
    path = folder / "priced.json"
    path.write_text(json.dumps(payload))
    return path


@pytest.mark.aot
@pytest.mark.slow
def test_a_recorded_tpu_run_is_priced_as_calibrate_prices_the_same_timings(tokamax_analysis, tmp_path):
    from benchmarks.perf import calibration
    from benchmarks.studies import benchmark_cases, calibration_fit, from_benchmark

    analysis, cache = tokamax_analysis
    assert len(analysis.analysed) == 3 and analysis.skipped == []
    tokamax = benchmark_cases.tokamax_measurements(calibration_fit.installed_paths())
    report = from_benchmark.make_report(analysis, [TOKAMAX_FIXTURE])
    recorded = [tokamax[entry["workload"]] for entry in report["entries"]]
    direct = calibration.analyse_measurements(recorded, calibration.AnalysisCache(cache), jobs=1)
    for entry, measurement, same in zip(report["entries"], recorded, direct):
        assert entry["measured_us"] == pytest.approx(measurement.measured_us)
        assert entry["predicted_us"] == pytest.approx(same.price().pipelined_time_s * 1e6, abs=0.01)
    assert report["summary"]["v5e"]["pallas_ragged_dot"]["all"]["count"] == 3
    assert set(report["moves"]["v5e"]["constants"]) == set(from_benchmark.SCANS)


@pytest.mark.aot
@pytest.mark.slow
@pytest.mark.parametrize("name, value", [("grid_step_s", 0.6e-6), ("hbm_fraction", 0.8)])
def test_timings_made_at_other_constants_move_exactly_those(tokamax_analysis, tmp_path, name, value):
    from benchmarks.perf import calibration
    from benchmarks.studies import from_benchmark

    analysis, cache = tokamax_analysis
    current = from_benchmark.current_values("v5e", calibration.ModelConstants())
    pinned = {key: current[key] for key in ("grid_step_s", "ragged_dot_step_s", "hbm_fraction")}
    at_current = _with_times(analysis, calibration.ModelConstants(**pinned), tmp_path)
    found = from_benchmark.moves(from_benchmark.analyse([at_current], None, cache_dir=cache).analysed)["v5e"]
    assert not any(constant["moves"] for constant in found["constants"].values())

    moved = _with_times(analysis, calibration.ModelConstants(**dict(pinned, **{name: value})), tmp_path)
    found = from_benchmark.moves(from_benchmark.analyse([moved], None, cache_dir=cache).analysed)["v5e"]
    assert found["constants"][name]["fitted"] == pytest.approx(value)
    assert found["constants"][name]["moves"] and found["constants"][name]["median_abs_error_fitted"] == 0


# Lines a TPU run of the microbenchmarks could have measured (per call): fixed cost + x / rate.
KNOWN_LINES = {"grid_step": (4e-6, 0.5e-6), "kernel_dma": (1.5e-6, 0.6), "hbm_stream": (10e-6, 0.8),
               "expert_gather": (20e-6, 0.7)}


def test_microbenchmark_timings_fit_their_terms_directly(tmp_path, ragged_dot_kernel):
    import importlib

    from benchmarks.studies import from_benchmark, model_constant_fits
    from tpu_kernels.runtime.hardware import tpu_generation

    module = importlib.import_module(f"{ragged_dot_kernel.__name__}.model_constant_suites")
    peak = tpu_generation("v6e").device_hbm_bytes_per_s
    results = []
    for class_name, cases in module.TPU_CASES.items():
        for workload, case in cases.items():
            term, x, _ = model_constant_fits.point(case, 1.0)
            fixed, rate = KNOWN_LINES[term]
            per_x = rate if term == "grid_step" else 1 / (rate * peak)
            seconds = fixed + per_x * x
            per_call = seconds * case.get("copies", 1) if term == "kernel_dma" else seconds
            timing_ms = 1e3 * per_call * module.harness.TPU_CALLS_PER_TIMING
            results.append({"workload": f"{class_name}.{workload}", "verified": True,
                            "timingResults": {"min_ms": timing_ms, "mean_ms": timing_ms, "iterations": 5}})
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({"results": results}))

    report = from_benchmark.make_report(from_benchmark.analyse([measured], "v6e"), [measured])
    fits = report["model_constant_fits"]["v6e"]
    assert report["entries"] == [] and len(report["model_constant_points"]) == len(results)
    assert fits["grid_step"]["fitted"] == pytest.approx(0.5e-6) and fits["grid_step"]["moves"]
    assert fits["grid_step"]["intercept_s"] == pytest.approx(4e-6)
    assert fits["kernel_dma"]["fixed_cost_per_copy_s"] == pytest.approx(1.5e-6)
    for term in ("kernel_dma", "hbm_stream", "expert_gather"):
        assert fits[term]["share_of_peak_hbm"] == pytest.approx(KNOWN_LINES[term][1]), term
        assert fits[term]["constant"] == "hbm_fraction" and fits[term]["moves"], term


def test_a_term_with_one_size_is_not_fitted():
    from benchmarks.studies import model_constant_fits

    found = model_constant_fits.term_fit("v5e", "grid_step", [(100.0, 1e-4), (100.0, 1.1e-4)])
    assert found["fit"] is None and "two distinct" in found["why"]


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_every_tpu_case_resolves_against_the_kernels_compile_targets(name, kernel_builds):
    """The TPU tables name shapes of compile_targets (checked here, where no TPU runs them)."""
    from benchmarks.studies import benchmark_cases
    from tpu_kernels.distribution.loader import get_local_kernel

    kernel = get_local_kernel(kernel_builds[name], backend="cpu")
    module = benchmark_cases.benchmark_suites(kernel)
    for case_class, tpu_table, _ in module.SUITES:
        instance = case_class()
        targets = instance.targets(kernel)
        for cases in tpu_table.values():
            for case in cases.values():
                instance.spec(case, targets)  # a name or shape compile_targets no longer has raises
    if name == "rmsnorm-tpu":
        with pytest.raises(ValueError, match="not among compile_targets' shapes"):
            module.modelled("rms_norm", 3, 4096)(targets)
    if name == "attention-tpu":  # DeepSeek-V3's latent decode under TP8, at a cache length no target has
        off_target = {"Latent": {"tp8_cache8192": lambda t: dict(t.flash.LATENT_HEADS["deepseek-v3 tp8"], batch=64,
                                                                 q_len=1, kv_len=8192, lengths=True)}}
        checked = module.declared(off_target, lambda spec: module.latent_shapes(spec).values())
        with pytest.raises(ValueError, match="tp8_cache8192: .* not among compile_targets' shapes"):
            checked["Latent"]["tp8_cache8192"](targets)
