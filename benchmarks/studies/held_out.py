"""Public real-chip timings the model was not fitted to, priced as held-out checks: `tpu-kernels bench held_out`.

Each check names its source (a URL), the chip, the shapes as the source gives them, the measured figure and the
model's, and their ratio (predicted / measured: below 1 where the model prices the call faster than the chip ran
it). Nothing here moves a constant.

- **A streamed copy** (`copy`): a copy's bandwidth on one core against the model's price of any copy, the peak HBM
  bandwidth of jax's table times the generation's fitted share (`perf.chip.ModelRates.hbm_fraction`).
- **Weight streaming** (`weight_streaming`): a grouped matmul whose time is its weights' streaming (a few rows per
  touched group) against the least time the model gives those bytes, the floor at the priced share. The kernel timed
  (tpu-inference's gmm_v2) is not one the lab rebuilds, so this checks the priced share, not a model of that kernel;
  its timings at one row per group, which it says pay a fixed per-call cost of about 35 us, are listed as left out.
- **Calibrate's entries** (`calibrate`): tokamax autotuning timings no fit has used, rebuilt and priced by
  `tpu-kernels calibrate` (its report is passed with `--calibration`): per file, the count, the median and 90th
  percentile of |ratio - 1|, the signed bias and each entry's ratio.

Output: benchmarks/results/held_out.json (`--out`); `tpu-kernels bench report` renders held_out.md from it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks.perf import FITTED_RATES
from benchmarks.studies import result_path, write_json
from tpu_kernels.runtime.hardware import tpu_generation

DEFAULT_OUT = result_path("held_out.json")
MIB = 2**20
TPU_INFERENCE_3520 = "https://github.com/vllm-project/tpu-inference/issues/3520"
# tpu-inference issue 3520 (2026-09-02): one TPU7x core (a JAX device), xprof device time, weights resident in HBM;
# lhs (M, 4096) bf16, rhs (E, K, N), `touched` groups of `rows` rows each.
COPY_CHECKS = ({"source": TPU_INFERENCE_3520, "chip": "tpu7x",
                "what": "streamed copy on one core (the issue's reference)", "measured_bytes_per_s": 3.21e12},)
STREAMING_CHECKS = tuple(
    {"source": TPU_INFERENCE_3520, "chip": "tpu7x", "kernel": "tpu-inference megablox gmm_v2", "experts": 64,
     "k": 4096, "n": 2048, "dtype": dtype, "touched": 30, "rows": 3, "weight_bytes": weight_mib * MIB,
     "measured_us": measured}
    for dtype, weight_mib, measured in (("fp8", 240, 81.9), ("bf16", 480, 159.8)))
LEFT_OUT = ({"source": TPU_INFERENCE_3520, "chip": "tpu7x",
             "what": "gmm_v2 at one row per touched group (E=512, 4096x256 and 512x4096, fp8 and bf16: 57.5-71.8 us)",
             "why": "the issue measures a fixed cost of about 35 us per call at one row per group; the kernel is not "
                    "one the lab rebuilds, and the floor leaves a kernel's fixed costs out"},)


def copy_check(check: dict) -> dict:
    generation = tpu_generation(check["chip"])
    share = FITTED_RATES.hbm_fraction(generation)
    modelled = generation.device_hbm_bytes_per_s * share
    return {**check, "kind": "copy", "hbm_share": share, "modelled_bytes_per_s": modelled,
            "ratio": round(check["measured_bytes_per_s"] / modelled, 4)}


def streaming_check(check: dict) -> dict:
    """The weights, the rows read and the rows written at the peak times the priced share."""
    generation = tpu_generation(check["chip"])
    share = FITTED_RATES.hbm_fraction(generation)
    rows = -(-check["touched"] * check["rows"] // 16) * 16  # the issue pads M to a multiple of 16
    moved = check["weight_bytes"] + rows * (check["k"] + check["n"]) * 2
    modelled = 1e6 * moved / (generation.device_hbm_bytes_per_s * share)
    return {**check, "kind": "weight_streaming", "hbm_share": share, "bytes": moved,
            "modelled_us": round(modelled, 2), "ratio": round(modelled / check["measured_us"], 4)}


def calibrate_check(report: dict, source_url: str) -> dict:
    """One calibrate report's priced entries: their spread of |ratio - 1|, signed bias and ratios."""
    entries = report["entries"]
    ratios = [e["ratio"] for e in entries]
    errors = sorted(abs(r - 1) for r in ratios)
    return {"kind": "calibrate", "source": source_url, "chips": sorted({e["chip"] for e in entries}),
            "kinds": sorted({e["kind"] for e in entries}), "count": len(entries),
            "skipped": dict(Counter(s.get("reason", "") for s in report.get("skipped", []))),
            "median_abs_error": round(statistics.median(errors), 4) if errors else None,
            "p90_abs_error": round(float(np.percentile(errors, 90)), 4) if errors else None,
            "median_signed": round(statistics.median(r - 1 for r in ratios), 4) if ratios else None,
            "entries": [{"call": e["call"], "config": e["config"], "measured_us": e["measured_us"],
                         "predicted_us": e["predicted_us"], "ratio": e["ratio"], "regime": e.get("regime")}
                        for e in entries]}


def study(calibrations: list[tuple[Path, str]]) -> dict:
    return {
        "benchmark": "benchmarks.studies.held_out",
        "what": sys.modules[__name__].__doc__.split("\n\n")[1].replace("\n", " "),
        "checks": [*(copy_check(c) for c in COPY_CHECKS), *(streaming_check(c) for c in STREAMING_CHECKS),
                   *(calibrate_check(json.loads(path.read_text()), url) for path, url in calibrations)],
        "left_out": list(LEFT_OUT),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", nargs=2, action="append", default=[], metavar=("REPORT", "SOURCE_URL"),
                        help="a `tpu-kernels calibrate` report of timings no fit used, and the URL of its timings")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    report = study([(Path(path), url) for path, url in args.calibration])
    print(f"wrote {write_json(args.out, report)}: {len(report['checks'])} checks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
