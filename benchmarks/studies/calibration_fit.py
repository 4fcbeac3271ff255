"""Fit the performance model's constants to tokamax's measured TPU timings, and report the error on held-out entries.

The model (`benchmarks.perf`, `xla_program`, `xla_ragged_dot`) has
constants the Pallas guides and XLA do not state: the fixed cost of one
Pallas grid step, the vector unit's rates (elements per cycle, plain and
transcendental), and the fixed cost of one kept iteration of XLA's ragged dot
loop. This script analyses every entry `python -m benchmarks calibrate` can rebuild
(cached compiles and replays), then per chip scans a grid of values for each
in turn (and the unhidden share of an MXU weights load), pricing the "fit" half of the entries (`calibration.holdout`) and
keeping the value with the smallest median |log(predicted / measured)|; the
"holdout" half is priced only at the chosen values, and its errors are the
ones to quote. Per chip, a profile of the grid step against the HBM share
(`step_share_profile`) says whether its timings tell the two apart. Then, per
generation, the share of the peak HBM bandwidth its
copies reach, on the entries bound by weight streaming (`hbm_fraction_fit`: its
docstring defines them), from PATH's entries and those of `--hbm-paths` (timing
files used for that fit only, e.g. a later tokamax's). Writes
benchmarks/results/calibration_fit.json.

Usage:
    python -m benchmarks calibration_fit [PATH ...] [--hbm-paths PATH ...] [--out FILE]
        [--write-constants [--constants FILE] [--hbm-fractions FILE]]
    (or JAX_PLATFORMS=cpu python -m benchmarks.studies.calibration_fit)
(PATH defaults to the installed tokamax's autotuning folders of TPU chips; --out to
benchmarks/results/calibration_fit.json, --constants to benchmarks/perf/model_constants.json and
--hbm-fractions to benchmarks/perf/hbm_fractions.json, all relative to the current directory: the project's
checkout.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np

from benchmarks.studies import MissingInput, hbm_fraction_fit, result_path, write_json
from benchmarks.perf import calibration

# The checkout's source of the model's constants, relative to the current directory.
CONSTANTS = Path("benchmarks") / "perf" / "model_constants.json"
HBM_FRACTIONS = Path("benchmarks") / "perf" / "hbm_fractions.json"

# Scanned step costs (seconds): 0 to 2 us in 0.01 us steps; vector rates (register elements per cycle):
# powers of two from 64 to 16384.
GRID = [round(0.01e-6 * i, 10) for i in range(201)]
VECTOR_RATES = [float(2**i) for i in range(6, 15)]
# The unhidden share of an MXU weights load: 1/8 to 1 in eighths.
LOAD_FRACTIONS = [i / 8 for i in range(1, 9)]
# The step-against-share profile (`step_share_profile`): steps across and beyond the v6e range robustness prices,
# shares of the peak HBM bandwidth in hundredths.
PROFILE_STEPS_US = (0.0, 0.02, 0.05, 0.1, 0.157, 0.2, 0.34, 0.5, 0.75, 1.0)
PROFILE_SHARES = tuple(round(0.6 + 0.01 * i, 2) for i in range(41))


def installed_paths() -> list[Path]:
    import tokamax

    root = Path(tokamax.__file__).parent / "data" / "autotuning"
    return [folder for folder in sorted(root.iterdir()) if folder.name in calibration.CHIP_FOLDERS]


def ratios(entries, constants) -> list[float]:
    return [entry.price(constants).pipelined_time_s * 1e6 / entry.measurement.measured_us for entry in entries]


def errors(entries, constants) -> list[float]:
    return [abs(math.log(r)) for r in ratios(entries, constants)]


def stats(entries, constants) -> dict:
    """|predicted / measured - 1| over `entries`: count, median, 90th percentile, worst, entries within 2x."""
    values = ratios(entries, constants)
    ratio_errors = sorted(abs(r - 1) for r in values)
    return {"count": len(values), "median_abs_error": round(statistics.median(ratio_errors), 4),
            "p90_abs_error": round(float(np.percentile(ratio_errors, 90)), 4),
            "worst_abs_error": round(max(ratio_errors), 4),
            "within_2x": sum(1 for r in values if 0.5 <= r <= 2)}


def fit(entries, grid: list[dict], base: calibration.ModelConstants) -> dict:
    """The point of `grid` (overrides of `base`) minimizing the median log error on the fit half of `entries`."""
    fitting = [a for a in entries if not calibration.holdout(a.measurement)]
    held = [a for a in entries if calibration.holdout(a.measurement)]
    if not fitting:
        return {"count": 0, "constants": base}
    scored = []
    for point in grid:
        constants = dataclasses.replace(base, **point)
        scored.append((statistics.median(errors(fitting, constants)), json.dumps(point, sort_keys=True)))
    _, best = min(scored)
    constants = dataclasses.replace(base, **json.loads(best))
    return {
        "chosen": json.loads(best),
        "fit": stats(fitting, constants),
        "holdout": stats(held, constants) if held else None,
        "all": stats(entries, constants),
        "constants": constants,
    }


def scan(name: str, values) -> list[dict]:
    return [{name: value} for value in values]


def main_fits(analysed) -> dict:
    """Per chip: the grid step and the vector rates on all Pallas entries (ragged dot and flash attention,
    alternating two rounds of coordinate descent), then the XLA ragged dot loop's step. Each on the fit
    half; errors per kind on both halves at the chosen constants."""
    results = {}
    for chip in sorted({a.measurement.chip for a in analysed}):
        on_chip = [a for a in analysed if a.measurement.chip == chip]
        by_kind = {kind: [a for a in on_chip if a.measurement.kind == kind] for kind in calibration.KINDS}
        pallas = by_kind["pallas_ragged_dot"] + by_kind["flash_attention"] + by_kind["flash_attention_vjp"]
        constants = calibration.ModelConstants()
        rates = [{"vector_elements_per_cycle": v, "transcendental_elements_per_cycle": t}
                 for v in VECTOR_RATES for t in VECTOR_RATES]
        for _ in range(2):
            if pallas:
                constants = fit(pallas, scan("grid_step_s", GRID), constants)["constants"]
                constants = fit(pallas, rates, constants)["constants"]
                constants = fit(pallas, scan("mxu_weight_load_fraction", LOAD_FRACTIONS), constants)["constants"]
        if by_kind["xla_ragged_dot"]:
            constants = fit(by_kind["xla_ragged_dot"], scan("ragged_dot_step_s", GRID), constants)["constants"]
        chip_results = {"constants": dataclasses.asdict(constants)}
        for kind, entries in by_kind.items():
            if entries:
                found = fit(entries, [{}], constants)
                found.pop("constants")
                found.pop("chosen")
                chip_results[kind] = found
        results[chip] = chip_results
    return results


def step_share_profile(analysed) -> dict:
    """Per chip, whether its Pallas timings tell the grid step from the HBM share: at each step of PROFILE_STEPS_US,
    the share of PROFILE_SHARES that fits the fit half best (the other constants at the model's), that median |log ratio|
    and the held-out errors there. A flat profile is a step the timings do not identify: a cheaper step is made up
    by a lower share at almost the same error."""
    profiles = {}
    for chip in sorted({a.measurement.chip for a in analysed}):
        pallas = [a for a in analysed if a.measurement.chip == chip
                  and a.measurement.kind in ("pallas_ragged_dot", "flash_attention", "flash_attention_vjp")]
        fitting = [a for a in pallas if not calibration.holdout(a.measurement)]
        held = [a for a in pallas if calibration.holdout(a.measurement)]
        if not fitting:
            continue
        rows = []
        for step_us in PROFILE_STEPS_US:
            scored = []
            for share in PROFILE_SHARES:
                constants = calibration.ModelConstants(grid_step_s=step_us * 1e-6, hbm_fraction=share)
                scored.append((statistics.median(errors(fitting, constants)), share, constants))
            error, share, constants = min(scored, key=lambda found: found[:2])
            rows.append({"grid_step_us": step_us, "best_hbm_fraction": share, "fit_median_log_error": round(error, 4),
                         "holdout": stats(held, constants) if held else None})
        profiles[chip] = rows
    return profiles


# Constants a chip takes from elsewhere than its fit here, by (key in model_constants.json, chip): v5p's from v5e (its
# timings do not identify its own: `step_share_profile`; its XLA ragged dots are not modelled), v6e's grid step from
# Hugging Face's measured v6e layer (moe_layer.json hf_257us: v6e's tokamax timings do not identify it).
BORROWED_STEPS = {("grid_step_s", "v5p"): "v5e", ("xla_ragged_dot_step_s", "v5p"): "v5e"}
NOT_FROM_THIS_FIT = {("grid_step_s", "v6e")}


def write_constants(results: dict, path: Path = CONSTANTS) -> None:
    """Fitted per-chip steps into model_constants.json, but for `NOT_FROM_THIS_FIT` and `BORROWED_STEPS`; vector
    rates and the MXU load share from TPU7x (no other chip's timings are vector-bound or use 128-row tiles on a
    256-wide MXU)."""
    constants = json.loads(path.read_text())
    for field, key in (("grid_step_s", "grid_step_s"), ("ragged_dot_step_s", "xla_ragged_dot_step_s")):
        for chip, fitted in results.items():
            if (key, chip) not in NOT_FROM_THIS_FIT:
                constants[key][chip] = fitted["constants"][field]
        for (borrowing_key, chip), source in BORROWED_STEPS.items():
            if borrowing_key == key:
                constants[key][chip] = constants[key][source]
    if "tpu7x" in results:
        for field in ("vector_elements_per_cycle", "transcendental_elements_per_cycle", "mxu_weight_load_fraction"):
            constants[field] = results["tpu7x"]["constants"][field]
    path.write_text(json.dumps(constants, indent=1) + "\n")


def write_hbm_fractions(fits: dict, sources: list[str], path: Path = HBM_FRACTIONS) -> None:
    """The fitted (or borrowed) share of the peak HBM bandwidth per generation into hbm_fractions.json."""
    shares = hbm_fraction_fit.fractions(fits)
    notes = {chip: found["derived"] for chip, found in sorted(fits.items()) if chip in shares}
    data = {"what": "the share of the peak HBM bandwidth (jax's TPU table) each generation's copies reach, fitted "
                    "by `python -m benchmarks calibration_fit` on the measured entries bound by weight streaming "
                    "(benchmarks/studies/hbm_fraction_fit.py; the entries: benchmarks/results/calibration_fit.json)",
            "hbm_fraction": shares, "hbm_fraction_note": notes, "sources": sources}
    path.write_text(json.dumps(data, indent=1) + "\n")


def hbm_fits(analysed, results: dict) -> dict:
    """The HBM share per generation (`hbm_fraction_fit`), each chip priced at its fitted constants."""
    by_chip = {}
    for chip, fitted in results.items():
        values = dict(fitted["constants"], hbm_fraction=None)
        values["hbm_fractions"] = tuple(tuple(pair) for pair in values["hbm_fractions"])
        by_chip[chip] = calibration.ModelConstants(**values)
    return hbm_fraction_fit.fit_hbm_fractions(analysed, by_chip)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path)
    parser.add_argument("--hbm-paths", nargs="*", type=Path, default=[],
                        help="more timing files for the HBM share fit only (e.g. a later tokamax's autotuning folders)")
    parser.add_argument("--hbm-fractions", type=Path, default=HBM_FRACTIONS,
                        help=f"the hbm_fractions.json --write-constants updates (default: {HBM_FRACTIONS})")
    parser.add_argument("--out", type=Path, default=result_path("calibration_fit.json"))
    parser.add_argument("--write-constants", action="store_true",
                        help="write the fitted constants to --constants (per-chip steps; the vector rates and MXU "
                             "load share from the chip with vector-bound timings, TPU7x)")
    parser.add_argument("--constants", type=Path, default=CONSTANTS,
                        help=f"the model_constants.json to update (default: {CONSTANTS}, in the project's checkout)")
    args = parser.parse_args(argv)
    if args.write_constants and not args.constants.is_file():
        raise MissingInput(f"no model constants at {args.constants} (relative to {Path.cwd()}): run from a checkout "
                           "of the tpu-kernels project, or pass --constants FILE")
    paths = args.paths or installed_paths()
    analysed, _ = calibration.analyse(paths)
    results = main_fits(analysed)
    more, _ = calibration.analyse(args.hbm_paths) if args.hbm_paths else ([], [])
    streaming = hbm_fits(analysed + more, results)
    sources = [_shown(path) for path in [*paths, *args.hbm_paths]]
    report = {
        "what": "constants fitted per chip on the 'fit' half (median |log ratio|): the grid step and vector rates "
                "on all Pallas entries, then XLA's ragged dot loop step; errors per kind on both halves and all "
                "entries, as |predicted / measured - 1|; hbm_fraction: per generation, the share of the peak HBM "
                "bandwidth on the entries bound by weight streaming (hbm_fraction_method; the timing files: "
                "hbm_fraction_sources, tokamax-<commit> naming a later openxla/tokamax's data folder)",
        "grid_us": [GRID[0] * 1e6, GRID[-1] * 1e6, 0.01],
        "vector_rates_per_cycle": VECTOR_RATES,
        "fits": results,
        "step_share_profile": step_share_profile(analysed),
        "hbm_fraction": streaming,
        "hbm_fraction_method": hbm_fraction_fit.__doc__.split("\n\n", 1)[1].strip(),
        "hbm_fraction_sources": sources,
    }
    write_json(args.out, report, sort_keys=True)
    if args.write_constants:
        write_constants(results, args.constants)
        write_hbm_fractions(streaming, sources, args.hbm_fractions)
    print(json.dumps(results, indent=1, sort_keys=True))
    return 0


def _shown(path: Path) -> str:
    """A timing folder or file as the record shows it: from site-packages on, else its last three parts."""
    parts = Path(path).resolve().parts
    return "/".join(parts[parts.index("site-packages"):] if "site-packages" in parts else parts[-3:])


if __name__ == "__main__":
    sys.exit(main())
