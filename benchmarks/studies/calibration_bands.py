"""The model's calibrated error per kind of work, as bands around a benchmark's modelled time.

`python -m benchmarks calibrate` holds the model against tokamax's measured TPU timings
and writes, per chip and kind, the median, 90th percentile and worst
|predicted / measured - 1| (benchmarks/results/calibration.json, `summary`).
A benchmark's modelled time is a sum of terms of different kinds: Pallas
kernels (priced like tokamax's Pallas ragged dot or flash attention), XLA's
ragged-dot loops, and the other XLA ops (sorts, gathers, fusions), which no
measurement covers. `band` applies each calibrated term's error to that term
and leaves the uncalibrated terms as they are, so a band says how far the
measured figures of that kind stray, not how far the whole layer can.

The error is taken in the regime of the figure (`perf.modelled_time.regime`): a
`streaming` (decode-like) figure takes the error of the measured calls whose
copies were the longer term, a `compute_bound` one that of the calls whose
matmuls were. Where the chip standing for a generation has no measured call of
that kind in that regime, the figure carries no band (`band` returns None for
it, with the reason): the other regime's error is not evidence.

Which measurements apply to a generation (`MEASURED_ON`): v5e's and TPU7x's
own. v5p's and v6e's (from a later tokamax: `CHECKS`) check the model without
being fitted or making bands: both take v5e's model constants and bands (every
such figure says so, `measured_on`). v6e's timings do not identify its grid-step
cost (benchmarks/results/calibration_fit_v6e.json: the fit trades it against the
HBM share at almost the same error), so they hold the borrowed constants to
account instead of replacing them.

The report is read from `CALIBRATION`, benchmarks/results/calibration.json
relative to the current directory.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from benchmarks.studies import MissingInput, result_path
from benchmarks.perf.modelled_time import REGIMES

CALIBRATION = result_path("calibration.json")
# The chip whose measurements stand for each generation's.
MEASURED_ON = {"v5e": "v5e", "v6e": "v5e", "v5p": "v5e", "tpu7x": "tpu7x"}
KINDS = ("pallas_ragged_dot", "xla_ragged_dot", "flash_attention", "flash_attention_vjp")
# Generations whose own timings of some kinds check the model in a report of their own (not fitted, no bands of
# their own): the kinds, and the report.
CHECKS = {"v5p": (("pallas_ragged_dot",), "benchmarks/results/calibration_v5p.json"),
          "v6e": (("pallas_ragged_dot", "xla_ragged_dot", "flash_attention"),
                  "benchmarks/results/calibration_v6e.json")}


@functools.cache
def _read(path: Path) -> dict:
    if not path.is_file():
        raise MissingInput(f"no calibration report at {path}: the calibrated error bands need it; run from a "
                           "checkout of the tpu-kernels project, or write one with `python -m benchmarks calibrate`")
    return json.loads(path.read_text())["summary"]


def _summary() -> dict:
    return _read(CALIBRATION.absolute())


def error(kind: str, generation: str, regime: str, summary: dict | None = None) -> dict | None:
    """The calibrated error of `kind` in `regime` for `generation`; None where the chip that stands for it has
    no call of that kind in that regime (or no chip measured that kind). `summary`: a calibration report's
    (default: CALIBRATION's)."""
    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} is not a calibrated kind ({', '.join(KINDS)})")
    if regime not in REGIMES:
        raise ValueError(f"regime: {regime!r} is not one of {', '.join(REGIMES)}")
    summary = _summary() if summary is None else summary
    chip = MEASURED_ON.get(generation)
    block = summary.get(chip, {}).get(kind) if chip else None
    if block is None:
        # Measured on no chip that stands for this generation: the nearest evidence is another chip's.
        for other, kinds in sorted(summary.items()):
            if kind in kinds:
                block, chip = kinds[kind], other
                break
        else:
            return None
    stats = block.get("regimes", {}).get(regime)
    if stats is None:
        return None
    return {
        "kind": kind,
        "regime": regime,
        "measured_on": chip,
        "own_measurements": chip == generation,
        "count": stats["count"],
        "median": stats["median_abs_error"],
        "p90": stats["p90_abs_error"],
        # Older reports (before the signed bias was summarised) have none: None, not a made-up zero.
        "median_signed": stats.get("median_signed_error"),
        "mean_signed": stats.get("mean_signed_error"),
        "worst_ratio": stats["worst"]["ratio"],
    }


def band(terms_s: dict[str, float], generation: str, regime: str, *, uncalibrated_s: float = 0.0) -> dict:
    """Band around sum(terms_s) + uncalibrated_s: each calibrated term at its median and p90 error in `regime`.

    `terms_s` maps a calibrated kind to the seconds of the modelled time priced as that kind. Where a term's kind
    has no calibrated error in that regime, the band is None and `no_band` says why.
    """
    total = sum(terms_s.values()) + uncalibrated_s
    errors = {kind: error(kind, generation, regime) for kind, s in terms_s.items() if s}
    missing = sorted(kind for kind, found in errors.items() if found is None)
    if missing:
        chip = MEASURED_ON.get(generation, generation)
        return {"regime": regime, "median_us": None, "p90_us": None, "uncalibrated_us": round(1e6 * uncalibrated_s, 2),
                "no_band": f"no {' or '.join(missing)} timing in the {regime} regime on {chip} (the chip whose "
                           f"timings stand for {generation}): no calibrated error for this figure"}
    median = sum(terms_s[kind] * found["median"] for kind, found in errors.items())
    p90 = sum(terms_s[kind] * found["p90"] for kind, found in errors.items())
    return {
        "regime": regime,
        "median_us": [round(1e6 * (total - median), 2), round(1e6 * (total + median), 2)],
        "p90_us": [round(1e6 * (total - p90), 2), round(1e6 * (total + p90), 2)],
        "uncalibrated_us": round(1e6 * uncalibrated_s, 2),
        "points": {kind: found["count"] for kind, found in errors.items()},
    }


def span(p90_us: list[float] | None, digits: int = 0, dash: str = "-") -> str:
    """A band as a table shows it: "low-high", or "no band" where the figure has none (`band`)."""
    if p90_us is None:
        return "no band"
    low, high = p90_us
    return f"{low:.{digits}f}{dash}{high:.{digits}f}"


def p90_fields(found: dict) -> dict:
    """A band as a benchmark row carries it: `band_p90_us` (None without a band), its regime, and why there is
    no band."""
    fields = {"band_p90_us": found["p90_us"], "band_regime": found["regime"]}
    if "no_band" in found:
        fields["no_band"] = found["no_band"]
    return fields


def describe(kind: str, generation: str, regime: str | None = None) -> str:
    """One line: the error of `kind` in `regime` (None: in each regime) on `generation`, and whose measurements it
    rests on."""
    if regime is None:
        return "; ".join(describe(kind, generation, each) for each in REGIMES)
    found = error(kind, generation, regime)
    if found is None:
        return f"{kind}, {regime}: no timing in this regime on {MEASURED_ON.get(generation, generation)}: no band"
    where = "" if found["own_measurements"] else f"; {borrowed(generation, found['measured_on'], kind)}"
    bias = ("" if found["median_signed"] is None else
            f", signed bias {100 * found['median_signed']:+.1f} % (mean {100 * found['mean_signed']:+.1f} %)")
    return (f"{kind}, {regime}, on {found['measured_on']} ({found['count']} entries): median "
            f"{100 * found['median']:.1f} %, p90 {100 * found['p90']:.1f} %{bias}, worst ratio "
            f"{found['worst_ratio']:.2f}{where}")


def borrowed(generation: str, measured_on: str, kind: str | None = None) -> str:
    """Whose constants and error a generation's figures (of `kind`, None: of any) take, and whether its own timings
    check them."""
    kinds, report = CHECKS.get(generation, ((), ""))
    if kinds and (kind is None or kind in kinds):
        return (f"{generation}'s figures take {measured_on}'s constants and error; {generation}'s own timings of "
                f"{', '.join(kinds)} check them ({report})")
    if kinds:
        return f"{generation} has no timing of {kind}: {measured_on}'s constants and error"
    return f"{generation} has no measurements: {measured_on}'s constants and error"


def bands_used(generations, kinds) -> dict:
    """The error table a benchmark's JSON carries: per generation, kind and regime."""
    return {generation: {kind: {regime: error(kind, generation, regime) for regime in REGIMES} for kind in kinds}
            for generation in generations}
