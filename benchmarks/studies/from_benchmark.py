"""`python -m benchmarks calibrate --from-benchmark RESULTS.json ... [--chip CHIP]`: a TPU run of `kernels
benchmark` against the performance model.

`kernels benchmark ORG/REPO --version N --output RESULTS.json` on a TPU VM times each workload of a kernel's
benchmark suites (its package's `benchmark_suites`, through the repo's `benchmarks/benchmark.py`); its JSON holds
per workload the timings' mean, spread and fastest, but not the chip (kernels names no TPU), hence `--chip`. For
each workload this

- finds the program it timed (`benchmark_cases`: one of our repos' cases, rebuilt from the same inputs, or a
  call tokamax timed), compiles it for the chip and prices it with the model, as `calibrate` prices tokamax's
  timings; measured = the fastest timing divided by the calls it made (`_benchmark_harness.TPU_CALLS_PER_TIMING`
  on a TPU), a host's wall time per call, which approaches the device time when the chip stays busy;
- prints measured against modelled and writes the entries in `calibrate`'s report form (`calibration.report`:
  each entry's ratio = predicted / measured, regime and terms), so that `calibration_fit` and the bands read
  them like tokamax's;
- per chip, scans each of the model's fitted constants on its own (the grids `calibration_fit` scans), the
  others held at their values, over these entries, and says which the new data would move: the value that
  minimizes the median |log(predicted / measured)|, against the current one, and the error at each.

Workloads timed in interpret mode (a host without a TPU: the benchmark's interpret-mode tables) are priced and
listed, so the whole chain runs anywhere, but never move a constant: their times measure the interpreter.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

from benchmarks.perf import calibration, chip as chip_constants
from benchmarks.perf.tokamax_calls import escaped
from benchmarks.studies import benchmark_cases, calibration_fit, model_constant_fits

DEFAULT_OUT = Path("benchmarks/results/calibration_from_benchmark.json")
CHIPS = ("v5e", "v5p", "v6e", "tpu7x")
# The share of the peak HBM bandwidth: 0.5 to 1 in hundredths.
HBM_FRACTIONS = [i / 100 for i in range(50, 101)]
# The smallest fall of the median |log ratio| that counts as a move.
MOVE_THRESHOLD = 0.005
# Bounds on a results file (a stranger's): `kernels benchmark` writes a few KiB for one repo's dozens of
# workloads. Past them the file is refused whole.
MAX_FILE_BYTES = 16 << 20
MAX_RESULTS = 4096  # per file; each workload is analysed once however often it appears (`distinct`)
MAX_WORKLOAD_CHARS = 200
MAX_ITERATIONS = 1 << 31


@dataclasses.dataclass(frozen=True)
class Timed:
    """One result of kernels benchmark's JSON."""

    workload: str
    source: str  # the JSON it came from
    min_ms: float
    mean_ms: float
    iterations: int


def read_results(path: Path) -> list[Timed]:
    """The workloads of `kernels benchmark --output` JSON; CalibrationInputError, in one line that quotes nothing
    unescaped, for anything else (these files come from strangers: the README asks TPU owners for them)."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
        if len(raw) > MAX_FILE_BYTES:
            raise ValueError(f"larger than {MAX_FILE_BYTES >> 20} MiB")
        data = json.loads(raw.decode())
    except RecursionError:
        raise calibration.CalibrationInputError(f"{path}: nested too deeply to be `kernels benchmark` JSON") from None
    except (OSError, ValueError) as error:
        raise calibration.CalibrationInputError(
            f"{path}: not the JSON of `kernels benchmark --output` ({type(error).__name__}: {error})") from None
    results = data.get("results") if isinstance(data, dict) else None
    if not isinstance(results, list):
        raise calibration.CalibrationInputError(f"{path}: not the JSON of `kernels benchmark --output` (no results list)")
    if len(results) > MAX_RESULTS:
        raise calibration.CalibrationInputError(f"{path}: {len(results)} results, more than {MAX_RESULTS}")
    if not results:
        raise calibration.CalibrationInputError(f"{path}: no results")
    return [_timed(entry, f"{path}: result {index}", str(path)) for index, entry in enumerate(results)]


def _timed(entry, where: str, source: str) -> Timed:
    """One result, each field checked for its type and range before anything reads it."""
    if not isinstance(entry, dict) or not isinstance(entry.get("timingResults"), dict):
        raise calibration.CalibrationInputError(f"{where}: not an object with timingResults")
    workload, timing = entry.get("workload"), entry["timingResults"]
    if not (isinstance(workload, str) and 0 < len(workload) <= MAX_WORKLOAD_CHARS and workload.isprintable()):
        raise calibration.CalibrationInputError(
            f"{where}: workload must be a printable string of 1 to {MAX_WORKLOAD_CHARS} characters")
    if entry.get("verified") is not True and "verified" in entry:
        raise calibration.CalibrationInputError(f"{where}: {workload} failed its check against the reference"
                                                if entry["verified"] is False else f"{where}: verified is not a bool")
    for name in ("min_ms", "mean_ms"):
        value = timing.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise calibration.CalibrationInputError(f"{where}: {workload}: {name} is not a positive finite number")
    iterations = timing.get("iterations")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or not 0 < iterations <= MAX_ITERATIONS:
        raise calibration.CalibrationInputError(
            f"{where}: {workload}: iterations is not a whole number from 1 to {MAX_ITERATIONS}")
    return Timed(workload, source, float(timing["min_ms"]), float(timing["mean_ms"]), iterations)


def distinct(timed: list[Timed]) -> list[Timed]:
    """One result per workload, the fastest (what `measured` takes): a workload given many times, in one file or
    several, is analysed once."""
    fastest: dict[str, Timed] = {}
    for t in timed:
        if t.workload not in fastest or t.min_ms < fastest[t.workload].min_ms:
            fastest[t.workload] = t
    return list(fastest.values())


@dataclasses.dataclass
class Analysis:
    analysed: list  # calibration.Analysed, priced
    workloads: dict  # measurement identity -> (workload, interpret mode)
    skipped: list
    constant_points: list = dataclasses.field(default_factory=list)  # the microbenchmarks' (model_constant_fits)


def analyse(paths, chip: str | None, *, repos: Path | None = None, tokamax_paths=None,
            cache_dir: Path | None = calibration.DEFAULT_CACHE) -> Analysis:
    """Every workload of the JSON files at `paths` rebuilt and priced on `chip` (tokamax's on the chip they name)."""
    if chip is not None and chip not in CHIPS:
        raise calibration.CalibrationInputError(f"--chip {chip}: one of {', '.join(CHIPS)}")
    timed = distinct([t for path in paths for t in read_results(path)])
    result = Analysis([], {}, [])
    is_tokamax = {t.workload: t.workload.partition(".")[0] in benchmark_cases.TOKAMAX_CLASSES for t in timed}
    tokamax = [t for t in timed if is_tokamax[t.workload]]
    ours = [t for t in timed if not is_tokamax[t.workload]]
    if tokamax:
        _analyse_tokamax(result, tokamax, chip, tokamax_paths, cache_dir)
    if ours:
        if chip is None:
            raise calibration.CalibrationInputError(
                f"name the chip the benchmark ran on with --chip ({', '.join(CHIPS)}): kernels' JSON does not say")
        _analyse_ours(result, ours, chip, repos)
    return result


def _analyse_tokamax(result: Analysis, timed: list[Timed], chip, tokamax_paths, cache_dir) -> None:
    known = benchmark_cases.tokamax_measurements(tokamax_paths or calibration_fit.installed_paths())
    measurements = []
    for t in timed:
        entry = known.get(t.workload)
        if entry is None or (chip is not None and entry.chip != chip):
            why = "no such tokamax entry" if entry is None else f"timed on {entry.chip}, not {chip}"
            result.skipped.append({"workload": t.workload, "reason": why})
            continue
        measurement = dataclasses.replace(entry, source=t.source, times_ms=(t.min_ms,))
        result.workloads[measurement.identity] = (t.workload, False)
        measurements.append(measurement)
    analysed = calibration.analyse_measurements(measurements, calibration.AnalysisCache(cache_dir))
    _keep(result, analysed)


def _analyse_ours(result: Analysis, timed: list[Timed], chip: str, repos) -> None:
    benchmarks = benchmark_cases.OurBenchmarks(repos)
    analysed = []
    for t in timed:
        case = benchmarks.find(t.workload)
        if case is None:
            result.skipped.append({"workload": t.workload, "reason": "no kernel repo's benchmark defines it"})
            continue
        calls = benchmarks.calls_per_timing(case)
        if case.model_constant:
            term, x, seconds = model_constant_fits.point(case.case, 1e-3 * t.min_ms / calls)
            result.constant_points.append({"workload": t.workload, "chip": chip, "term": term, "x": x,
                                           "seconds": seconds, "interpret_mode": case.interpret_mode})
            continue
        measurement = benchmark_cases.WorkloadMeasurement(
            chip=chip, kind=f"{case.repo} {case.case_class.__name__}", source=t.source,
            call={"workload": t.workload}, config={"calls_per_timing": calls}, times_ms=(t.min_ms / calls,))
        result.workloads[measurement.identity] = (t.workload, case.interpret_mode)
        analysed.append(benchmark_cases.analyse_ours(benchmarks, case, measurement))
    _keep(result, analysed)


def _keep(result: Analysis, analysed) -> None:
    for entry in analysed:
        if entry.program is None:
            workload, _ = result.workloads.pop(entry.measurement.identity)
            result.skipped.append({"workload": workload, "reason": entry.reason})
        else:
            result.analysed.append(entry)


# ----------------------------------------------------------------------------- what the data would move


def current_values(chip: str, constants: calibration.ModelConstants) -> dict:
    """The values `constants` prices `chip` with, by field (None fields: the chip's calibrated ones)."""
    return {
        "grid_step_s": chip_constants.grid_step_s(chip),
        "ragged_dot_step_s": chip_constants.CONSTANTS["xla_ragged_dot_step_s"][chip],
        "hbm_fraction": dict(constants.hbm_fractions)[chip],
        "mxu_weight_load_fraction": constants.mxu_weight_load_fraction,
        "vector_elements_per_cycle": constants.vector_elements_per_cycle,
        "transcendental_elements_per_cycle": constants.transcendental_elements_per_cycle,
    }


SCANS = {
    "grid_step_s": calibration_fit.GRID,
    "ragged_dot_step_s": calibration_fit.GRID,
    "hbm_fraction": HBM_FRACTIONS,
    "mxu_weight_load_fraction": calibration_fit.LOAD_FRACTIONS,
    "vector_elements_per_cycle": calibration_fit.VECTOR_RATES,
    "transcendental_elements_per_cycle": calibration_fit.VECTOR_RATES,
}


def moves(analysed) -> dict:
    """Per chip and constant: its current value, the value that fits these entries best (median |log ratio|, the
    others held), the median |ratio - 1| at each, and whether the data moves it (by more than MOVE_THRESHOLD)."""
    found = {}
    for chip in sorted({a.measurement.chip for a in analysed}):
        entries = [a for a in analysed if a.measurement.chip == chip]
        base = calibration.ModelConstants()
        current = current_values(chip, base)
        pinned = dataclasses.replace(base, **{name: current[name] for name in ("grid_step_s", "ragged_dot_step_s",
                                                                               "hbm_fraction")})
        before = statistics.median(calibration_fit.errors(entries, pinned))
        per_constant = {}
        for name, grid in SCANS.items():
            scored = [(statistics.median(calibration_fit.errors(entries, dataclasses.replace(pinned, **{name: v}))),
                       v) for v in grid]
            after, value = min(scored, key=lambda pair: (round(pair[0], 9), abs(pair[1] - current[name])))
            per_constant[name] = {
                "current": current[name], "fitted": value,
                "median_abs_error_now": round(_ratio_error(before), 4),
                "median_abs_error_fitted": round(_ratio_error(after), 4),
                "moves": value != current[name] and before - after > MOVE_THRESHOLD,
            }
        found[chip] = {"entries": len(entries), "constants": per_constant}
    return found


def _ratio_error(log_error: float) -> float:
    """A median |log ratio| as the |ratio - 1| of a ratio above 1 (how the reports quote errors)."""
    return math.exp(log_error) - 1


# ----------------------------------------------------------------------------- the report


def make_report(analysis: Analysis, sources) -> dict:
    """`calibration.report`'s form, each entry also naming its workload and whether it ran in interpret mode."""
    constants = calibration.ModelConstants()
    records = []
    for analysed in analysis.analysed:
        workload, interpret_mode = analysis.workloads[analysed.measurement.identity]
        records.append(calibration.entry_record(analysed, constants) | {"workload": workload,
                                                                          "interpret_mode": interpret_mode})
    records.sort(key=lambda record: (record["chip"], record["workload"]))
    fitting = [a for a in analysis.analysed if not analysis.workloads[a.measurement.identity][1]]
    return {
        "what": f"kernels benchmark's timings ({', '.join(map(str, sources))}) against the performance model; measured = the fastest "
                "timing per call; ratio = predicted / measured; interpret-mode entries are listed, never fitted",
        "constants": dataclasses.asdict(constants),
        "summary": calibration.summarize([record for record in records if not record["interpret_mode"]]),
        "moves": moves(fitting),
        "model_constant_fits": model_constant_fits.fits(_points_by_term(analysis.constant_points)),
        "model_constant_points": analysis.constant_points,
        "entries": records,
        "skipped": sorted(analysis.skipped, key=lambda skipped: skipped["workload"]),
    }


def _points_by_term(points: list[dict]) -> dict:
    """The microbenchmarks' points measured on a TPU, by (chip, term): interpret-mode ones are never fitted."""
    found: dict = {}
    for p in points:
        if not p["interpret_mode"]:
            found.setdefault((p["chip"], p["term"]), []).append((p["x"], p["seconds"]))
    return found


def printed(report: dict) -> str:
    lines = [f"{'workload':58} {'chip':6} {'measured us':>12} {'modelled us':>12} {'ratio':>7}  regime"]
    for entry in report["entries"]:
        note = "  (interpret mode: the time means nothing)" if entry["interpret_mode"] else ""
        lines.append(f"{entry['workload']:58} {entry['chip']:6} {entry['measured_us']:12.2f} "
                     f"{entry['predicted_us']:12.2f} {entry['ratio']:7.3f}  {entry['regime']}{note}")
    for skipped in report["skipped"]:
        lines.append(f"{skipped['workload']:58} skipped: {skipped['reason']}")
    for chip, block in report["moves"].items():
        lines.append(f"{chip}: what {block['entries']} measured entries would move")
        for name, found in block["constants"].items():
            verdict = "moves" if found["moves"] else "stays"
            lines.append(f"  {name:36} {verdict}: {found['current']:.4g} -> {found['fitted']:.4g} "
                         f"(median error {found['median_abs_error_now']:.1%} -> {found['median_abs_error_fitted']:.1%})")
    for p in report["model_constant_points"]:
        note = "  (interpret mode: the time means nothing)" if p["interpret_mode"] else ""
        lines.append(f"{p['workload']:58} {p['chip']:6} {p['term']} at {p['x']:.4g}: {p['seconds'] * 1e6:.2f} us{note}")
    lines += model_constant_fits.printed(report["model_constant_fits"])
    if not report["moves"] and not report["model_constant_fits"]:
        lines.append("No entry measured on a TPU: no constant moves.")
    return "\n".join(escaped(line) for line in lines)


def run(paths, chip: str | None, out: Path, **options) -> dict:
    analysis = analyse(paths, chip, **options)
    report = make_report(analysis, paths)
    calibration.write_report(report, out)
    print(printed(report))
    print(f"{len(report['entries'])} entries modelled, {len(report['skipped'])} skipped; wrote {out}")
    return report
