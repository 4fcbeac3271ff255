"""calibration.json and the model's constants -> benchmarks/README.md's tables of how far the model can be trusted.

`tpu-kernels calibrate` writes, per chip and kind of call, the model's error
on tokamax's measured timings and every entry it skipped with its reason;
`tpu-kernels bench calibration_fit --write-constants` writes the constants
(benchmarks/perf/model_constants.json) that no public source states. The
peaks beside them are jax's TPU table's (`tpu_kernels.runtime.hardware`).
"""

from __future__ import annotations

from collections import Counter
from pathlib import PurePosixPath

from benchmarks.studies import calibration_bands
from benchmarks.perf.modelled_time import REGIMES
from benchmarks.perf.tokamax_calls import CHIP_FOLDERS, KIND_FILES
from tpu_kernels.runtime.hardware import tpu_generation

# Generations in the tables' column order.
GENERATIONS = ("v5e", "v6e", "v5p", "tpu7x")
# A skipped entry with this reason had nothing to hold the model against: not a refusal.
NOT_MEASURED = "no timing recorded"


def where_skipped(entry: dict) -> tuple[str | None, str | None]:
    """The chip and kind of a skipped entry, from the tokamax file it came from (None where neither is known)."""
    path = PurePosixPath(entry.get("file", ""))
    return CHIP_FOLDERS.get(path.parent.name), KIND_FILES.get(path.name)


def refusals(report: dict) -> dict[tuple[str, str], Counter]:
    """Per (chip, kind), how many measured entries the model refused, by the reason's first clause."""
    refused: dict[tuple[str, str], Counter] = {}
    for entry in report["skipped"]:
        chip, kind = where_skipped(entry)
        reason = entry["reason"].split(":")[0]
        if chip and kind and reason != NOT_MEASURED:
            refused.setdefault((chip, kind), Counter())[reason] += 1
    return refused


def error(report: dict) -> str:
    """Per chip and kind: entries modelled and refused, the error's median, 90th percentile and worst ratio, and the
    median on the entries that fitted the constants beside the held-out ones'."""
    refused = refusals(report)
    rows = ["| chip | kind | modelled | refused | median \\|ratio - 1\\| | 90th pct | worst ratio "
            "| median fitted / held out |", "| --- | --- | ---: | --- | ---: | ---: | ---: | --- |"]
    for chip, kinds in sorted(report["summary"].items()):
        for kind, splits in sorted(kinds.items()):
            stats = splits["all"]
            reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(refused.get((chip, kind), {}).items()))
            fitted, held_out = (splits.get(split, {}).get("median_abs_error") for split in ("fit", "holdout"))
            rows.append(f"| {chip} | {kind} | {stats['count']} | {reasons or 'none'} "
                        f"| {100 * stats['median_abs_error']:.1f} % | {100 * stats['p90_abs_error']:.1f} % "
                        f"| {stats['worst']['ratio']:.2f} | {percent(fitted)} / {percent(held_out)} |")
    return "\n".join(rows)


def bands(report: dict) -> str:
    """Per generation and kind, the p90 error a figure takes in each regime, the chip and the number of timings it
    rests on; "no band" where that chip timed no such call in that regime."""
    rows = ["| generation | kind | " + " | ".join(f"{regime} p90 (timings, chip)" for regime in REGIMES) + " |",
            "| --- | --- |" + " ---: |" * len(REGIMES)]
    for generation in GENERATIONS:
        for kind in calibration_bands.KINDS:
            cells = []
            for regime in REGIMES:
                found = calibration_bands.error(kind, generation, regime, report["summary"])
                cells.append("no band" if found is None else
                             f"{100 * found['p90']:.1f} % ({found['count']}, {found['measured_on']})")
            rows.append(f"| {generation} | {kind} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def percent(share: float | None) -> str:
    return "none" if share is None else f"{100 * share:.1f} %"


def constants(model_constants: dict, hbm_fractions: dict) -> str:
    """Per generation: the chip's peaks from jax's table, the fitted share of the HBM peak its copies reach, then
    every other fitted constant (per generation or one for all), with the note model_constants.json gives for it;
    under the table, how each generation's HBM share was found."""
    rows = ["| per device | " + " | ".join(GENERATIONS) + " | source |", "| --- |" + " ---: |" * len(GENERATIONS) + " --- |"]
    chips = [tpu_generation(generation) for generation in GENERATIONS]
    rows.append("| HBM bandwidth, GB/s | " + " | ".join(f"{chip.device_hbm_bytes_per_s / 1e9:.0f}" for chip in chips)
                + " | jax's TPU table |")
    rows.append("| bf16 MXU peak, TFLOP/s | "
                + " | ".join(f"{chip.device_bf16_flops_per_s / 1e12:.0f}" for chip in chips) + " | jax's TPU table |")
    rows.append("| TensorCores | " + " | ".join(str(chip.cores_per_device) for chip in chips) + " | jax's TPU table |")
    shares = hbm_fractions["hbm_fraction"]
    rows.append("| `hbm_fraction` | " + " | ".join(format_constant("hbm_fraction", shares.get(generation))
                                                  for generation in GENERATIONS) + " | fitted: see below |")
    for name, value in model_constants.items():
        if name == "what" or name.endswith("_note"):
            continue
        note = model_constants.get(f"{name}_note") or model_constants.get("vector_and_mxu_note", "")
        if isinstance(value, dict):
            cells = [format_constant(name, value.get(generation)) for generation in GENERATIONS]
        else:
            cells = [format_constant(name, value)] * len(GENERATIONS)
        rows.append(f"| `{name}` | " + " | ".join(cells) + f" | {note} |")
    rows.append("")
    rows += [f"- `hbm_fraction`, {generation}: {note}" for generation, note in sorted(hbm_fractions["hbm_fraction_note"].items())]
    return "\n".join(rows)


def format_constant(name: str, value) -> str:
    if value is None:
        return "none"
    if name.endswith("_s") and isinstance(value, float):
        return f"{value * 1e6:.2f} µs"
    return f"{value:g}" if isinstance(value, float) else str(value)


def render_markdown(report: dict, model_constants: dict, hbm_fractions: dict) -> dict[str, str]:
    """The calibration tables by section: the model's error per chip and kind, the band a figure takes per
    generation and regime, and the constants the model prices with."""
    return {"error": error(report), "bands": bands(report), "constants": constants(model_constants, hbm_fractions)}
