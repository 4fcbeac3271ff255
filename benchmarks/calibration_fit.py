"""Fit the performance model's constants to tokamax's measured TPU timings, and report the error on held-out entries.

The model (`tpu_kernels.perf`, `xla_program`, `xla_ragged_dot`) has two
constants the Pallas guides and XLA do not state: the fixed cost of one
Pallas grid step and of one kept iteration of XLA's ragged dot loop. This
script analyses every entry `tpu-kernels calibrate` can rebuild (cached
compiles and replays), then for each constant and chip scans a grid of
values, pricing the "fit" half of the entries (`calibration.holdout`) and
keeping the value with the smallest median |log(predicted / measured)|;
the "holdout" half is priced only at the chosen value, and its errors are the
ones to quote. Writes benchmarks/results/calibration_fit.json.

Usage:
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/calibration_fit.py [PATH ...] [--out FILE]
(PATH defaults to the installed tokamax's autotuning folders of TPU chips.)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tpu_kernels import calibration  # noqa: E402

# Scanned values (seconds): 0 to 2 us in 0.01 us steps.
GRID = [round(0.01e-6 * i, 10) for i in range(201)]
CONSTANT_OF_KIND = {"pallas_ragged_dot": "grid_step_s", "flash_attention": "grid_step_s",
                    "flash_attention_vjp": "grid_step_s", "xla_ragged_dot": "ragged_dot_step_s"}


def installed_paths() -> list[Path]:
    import tokamax

    root = Path(tokamax.__file__).parent / "data" / "autotuning"
    return [folder for folder in sorted(root.iterdir()) if folder.name in calibration.CHIP_FOLDERS]


def errors(entries, constants) -> list[float]:
    return [abs(math.log(entry.price(constants).pipelined_time_s * 1e6 / entry.measurement.measured_us))
            for entry in entries]


def stats(values: list[float]) -> dict:
    ratio_errors = sorted(math.exp(v) - 1 for v in values)
    return {"count": len(values), "median_abs_error": round(statistics.median(ratio_errors), 4),
            "p90_abs_error": round(float(np.percentile(ratio_errors, 90)), 4),
            "worst_abs_error": round(max(ratio_errors), 4)}


def fit(analysed, kinds: tuple[str, ...], constant: str) -> dict:
    """The grid value of `constant` minimizing the median log error on the fit entries of `kinds`."""
    chosen = [a for a in analysed if a.measurement.kind in kinds]
    fitting = [a for a in chosen if not calibration.holdout(a.measurement)]
    held = [a for a in chosen if calibration.holdout(a.measurement)]
    if not fitting:
        return {"count": 0}
    scores = []
    for value in GRID:
        constants = calibration.ModelConstants(**{constant: value})
        scores.append((statistics.median(errors(fitting, constants)), value))
    best_score, best = min(scores)
    constants = calibration.ModelConstants(**{constant: best})
    return {
        "constant": constant,
        "value_us": round(best * 1e6, 3),
        "fit": stats(errors(fitting, constants)),
        "holdout": stats(errors(held, constants)) if held else None,
        "scan_median_error_at_us": {f"{v * 1e6:.2f}": round(math.exp(s) - 1, 4)
                                    for s, v in scores[:: 10]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "calibration_fit.json")
    args = parser.parse_args(argv)
    analysed, _ = calibration.analyse(args.paths or installed_paths())
    results = {}
    for chip in sorted({a.measurement.chip for a in analysed}):
        on_chip = [a for a in analysed if a.measurement.chip == chip]
        for kind in sorted({a.measurement.kind for a in on_chip}):
            results.setdefault(chip, {})[kind] = fit(on_chip, (kind,), CONSTANT_OF_KIND[kind])
        pallas = tuple(k for k in ("pallas_ragged_dot", "flash_attention", "flash_attention_vjp")
                       if any(a.measurement.kind == k for a in on_chip))
        if len(pallas) > 1:
            results[chip]["all_pallas"] = fit(on_chip, pallas, "grid_step_s")
    report = {
        "what": "each constant fitted per chip and kind on the 'fit' half (median |log ratio|), errors on both halves",
        "grid_us": [GRID[0] * 1e6, GRID[-1] * 1e6, 0.01],
        "fits": results,
    }
    args.out.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    print(json.dumps(results, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
