"""calibration.json and the model's constants -> the tables of how far the model can be trusted
(benchmarks/results/pages/calibration.md).

`python -m benchmarks calibrate` writes, per chip and kind of call, the model's error
on tokamax's measured timings and every entry it skipped with its reason;
`python -m benchmarks calibration_fit --write-constants` writes the constants
(benchmarks/perf/model_constants.json) that no public source states. The
peaks beside them are jax's TPU table's (`tpu_kernels.runtime.hardware`).
"""

from __future__ import annotations

import statistics
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
    """Per chip and kind: entries modelled and refused, the error's median, 90th percentile, signed bias (median and
    mean of ratio - 1) and worst ratio, and the medians and 90th percentiles on the entries that fitted the
    constants beside the held-out ones', with their counts."""
    refused = refusals(report)
    rows = ["| chip | kind | modelled | refused | median \\|ratio - 1\\| | 90th pct | signed bias, median / mean "
            "| worst ratio | fitted: n, median / p90 | held out: n, median / p90 |",
            "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for chip, kinds in sorted(report["summary"].items()):
        for kind, splits in sorted(kinds.items()):
            stats = splits["all"]
            reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(refused.get((chip, kind), {}).items()))
            rows.append(f"| {chip} | {kind} | {stats['count']} | {reasons or 'none'} "
                        f"| {100 * stats['median_abs_error']:.1f} % | {100 * stats['p90_abs_error']:.1f} % "
                        f"| {signed(stats)} | {stats['worst']['ratio']:.2f} "
                        f"| {split_cell(splits.get('fit'))} | {split_cell(splits.get('holdout'))} |")
    return "\n".join(rows)


def signed(stats: dict) -> str:
    """The signed bias, median / mean of ratio - 1 (below zero: the model is faster than the chip)."""
    if "median_signed_error" not in stats:
        return "not summarised"
    return f"{100 * stats['median_signed_error']:+.1f} % / {100 * stats['mean_signed_error']:+.1f} %"


def split_cell(stats: dict | None) -> str:
    if stats is None:
        return "none"
    return f"{stats['count']}, {percent(stats['median_abs_error'])} / {percent(stats['p90_abs_error'])}"


def bands(report: dict) -> str:
    """Per generation and kind, in each regime: the p90 error a figure takes, the signed bias (median / mean of
    ratio - 1) of the same timings, their number and chip; "no band" where that chip timed no such call in that
    regime."""
    rows = ["| generation | kind | " + " | ".join(f"{regime} p90, signed bias median / mean (timings, chip)"
                                               for regime in REGIMES) + " |",
            "| --- | --- |" + " ---: |" * len(REGIMES)]
    for generation in GENERATIONS:
        for kind in calibration_bands.KINDS:
            cells = []
            for regime in REGIMES:
                found = calibration_bands.error(kind, generation, regime, report["summary"])
                cells.append("no band" if found is None else
                             f"{100 * found['p90']:.1f} %, {bias(found)} ({found['count']}, {found['measured_on']})")
            rows.append(f"| {generation} | {kind} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def bias(found: dict) -> str:
    if found["median_signed"] is None:
        return "bias not summarised"
    return f"{100 * found['median_signed']:+.1f} / {100 * found['mean_signed']:+.1f} %"


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


def merged(report: dict, checks: tuple[dict, ...]) -> dict:
    """`report` with the summaries, entries and skipped entries of `checks` (reports of other chips, e.g. v5p's
    timings from a later tokamax) beside its own: the error table shows them all; the bands stay `report`'s."""
    found = {"summary": dict(report["summary"]), "entries": list(report.get("entries", ())),
             "skipped": list(report.get("skipped", ()))}
    for check in checks:
        overlap = set(found["summary"]) & set(check["summary"])
        if overlap:
            raise ValueError(f"calibration reports overlap on {', '.join(sorted(overlap))}: one report per chip")
        found["summary"].update(check["summary"])
        found["entries"] += check.get("entries", [])
        found["skipped"] += check.get("skipped", [])
    return found


# A held-out Pallas ragged dot priced further than this from its measurement is explained entry by entry.
OUTLIER_ERROR = 0.2
OUTLIER_KIND = "pallas_ragged_dot"


def outliers(report: dict) -> str:
    """Each held-out Pallas ragged-dot entry whose |ratio - 1| exceeds OUTLIER_ERROR: what it is, how the model
    splits its time, and what sets it apart from the entries the model prices well (`outlier_reason`)."""
    entries = [e for e in report["entries"] if e["kind"] == OUTLIER_KIND]
    found = [e for e in entries if e["split"] == "holdout" and abs(e["ratio"] - 1) > OUTLIER_ERROR]
    if not found:
        return f"No held-out {OUTLIER_KIND} entry is priced more than {100 * OUTLIER_ERROR:.0f} % from its timing."
    rows = [f"Held-out {OUTLIER_KIND} entries priced more than {100 * OUTLIER_ERROR:.0f} % from their timing:", "",
            "| chip | call | tiles (m, k, n) | measured µs | predicted µs | ratio | regime | kernel µs: copies / "
            "matmuls / grid steps | XLA ops µs (of them transposes) | why the model misses it |",
            "| --- | --- | --- | ---: | ---: | ---: | --- | --- | ---: | --- |"]
    for entry in sorted(found, key=lambda e: abs(e["ratio"] - 1), reverse=True):
        terms, config = entry["terms_us"], entry["config"]
        tiles = ", ".join(str(config.get(f"tile_{axis}", "-")) for axis in "mkn")
        rows.append(f"| {entry['chip']} | {entry['call']} | {tiles} | {entry['measured_us']:.0f} "
                    f"| {entry['predicted_us']:.0f} | {entry['ratio']:.2f} | {entry['regime']} "
                    f"| {terms['kernels_hbm']:.0f} / {terms['kernels_mxu']:.0f} / {terms['kernel_steps']} "
                    f"| {terms['xla_ops']:.0f} ({terms['xla_transposes']:.0f}) | {outlier_reason(entry, entries)} |")
    return "\n".join(rows)


def outlier_reason(entry: dict, entries: list[dict]) -> str:
    """What sets an outlier apart from the well-priced entries of its chip and kind, from their recorded terms."""
    problem = problem_of(entry)
    same_problem = [e for e in entries if e is not entry and e["chip"] == entry["chip"] and problem_of(e) == problem]
    peers = [e for e in entries if e["chip"] == entry["chip"] and abs(e["ratio"] - 1) <= OUTLIER_ERROR]
    transposes = entry["terms_us"]["xla_transposes"]
    reasons = []
    if transposes > 0.05 * entry["predicted_us"] and not any(e["terms_us"]["xla_transposes"] for e in peers):
        needed = (entry["measured_us"] - entry["predicted_us"] + transposes) / transposes
        reasons.append(
            f"XLA transposes around the kernel are {100 * transposes / entry['predicted_us']:.0f} % of its predicted "
            f"time, and none of the {len(peers)} well-priced entries of {entry['chip']} has any: priced by their "
            "bytes at the HBM rate, they are the one part of it no timing of the kind checks; for the measured time "
            f"they would cost {needed:.1f}x their price")
    if same_problem:
        others = ", ".join(f"{e['ratio']:.2f} ({e['call'].split(' ', 1)[0]}, {e['split']})" for e in same_problem)
        # The problem explains the miss only where its other timings miss the same way (by half the outlier error).
        alike = all((e["ratio"] - 1) * (entry["ratio"] - 1) > 0 and abs(e["ratio"] - 1) > OUTLIER_ERROR / 2
                    for e in same_problem)
        reasons.append(f"the other timings of this problem are priced at {others}: the miss follows the problem, "
                       "not the pass or the tiles" if alike else
                       f"the other timings of this problem are priced at {others}: the miss is not the problem's")
    reasons += pass_reason(entry, entries) + row_tile_reason(entry, entries)
    if entry["regime"] == "compute_bound" and entry["ratio"] < 1 and not reasons:
        reasons.append("priced at the MXU peak of its tiles and nothing else sets it apart from the well-priced "
                       "entries: the kernel's matmuls run slower on the chip than the model's MXU rate, for a "
                       "reason no recorded term shows")
    return "; ".join(reasons) or "no recorded term sets it apart from the well-priced entries: not identified"


# A row tile (or pass) whose entries' median signed error stands this far from the others' sets it apart.
ROW_TILE_BIAS = 0.05


def problem_of(entry: dict) -> tuple[str, str]:
    """An entry's problem, shared by its forward and gradient passes: the rows operand and the group count."""
    operands = entry["call"].split(" ")
    return operands[1], next((part for part in operands if part.startswith("G=")), "")


def biased_apart(entry: dict, entries: list[dict], group) -> tuple[int, float, int, float] | None:
    """Among the entries of the outlier's chip that `group` (entry -> key, None: not grouped) places, the count and
    median signed error of those in the outlier's group and of the rest, where the two medians stand more than
    ROW_TILE_BIAS apart; None where they do not, or either side is too thin to say."""
    key = group(entry)
    placed = [e for e in entries if e["chip"] == entry["chip"] and group(e) is not None]
    alike = [e["ratio"] - 1 for e in placed if group(e) == key]
    others = [e["ratio"] - 1 for e in placed if group(e) != key]
    if key is None or len(alike) < 2 or not others:
        return None
    bias, rest = statistics.median(alike), statistics.median(others)
    return None if abs(bias - rest) <= ROW_TILE_BIAS else (len(alike), bias, len(others), rest)


def pass_reason(entry: dict, entries: list[dict]) -> list[str]:
    """Whether the entries of the outlier's chip of its pass (forward, lhs or rhs gradient) are biased apart from
    the other passes'."""
    kind = entry["call"].split(" ", 1)[0]
    found = biased_apart(entry, entries, lambda e: e["call"].split(" ", 1)[0])
    if found is None:
        return []
    count, bias, others, rest = found
    return [f"the {count} {kind} entries of {entry['chip']} are priced at a median signed error of "
            f"{100 * bias:+.1f} %, the {others} of the other passes at {100 * rest:+.1f} %: the miss follows the pass"]


def row_tile_reason(entry: dict, entries: list[dict]) -> list[str]:
    """Whether the entries of the outlier's chip with its row tile (tile_m) are biased apart from the others."""
    found = biased_apart(entry, entries, lambda e: e["config"].get("tile_m"))
    if found is None:
        return []
    count, bias, others, rest = found
    return [f"the {count} entries of {entry['chip']} with its row tile ({entry['config']['tile_m']}) are priced at a "
            f"median signed error of {100 * bias:+.1f} %, the {others} with other row tiles at {100 * rest:+.1f} %: "
            "the miss follows the row tile, which enters the price through the unhidden share of each MXU weights "
            "load (`mxu_weight_load_fraction`, fitted on TPU7x and assumed on every generation)"]


def render_markdown(report: dict, model_constants: dict, hbm_fractions: dict,
                    checks: tuple[dict, ...] = ()) -> dict[str, str]:
    """The calibration tables by section: the model's error per chip and kind (`report`'s and `checks`'s), the band
    a figure takes per generation and regime (`report`'s), the held-out Pallas ragged dots it misses, and the
    constants the model prices with."""
    every = merged(report, checks)
    return {"error": error(every), "bands": bands(report), "outliers": outliers(every),
            "constants": constants(model_constants, hbm_fractions)}
