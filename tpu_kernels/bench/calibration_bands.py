"""The model's calibrated error per kind of work, as bands around a benchmark's modelled time.

`tpu-kernels calibrate` holds the model against tokamax's measured TPU timings
and writes, per chip and kind, the median, 90th percentile and worst
|predicted / measured - 1| (benchmarks/results/calibration.json, `summary`).
A benchmark's modelled time is a sum of terms of different kinds: Pallas
kernels (priced like tokamax's Pallas ragged dot or flash attention), XLA's
ragged-dot loops, and the other XLA ops (sorts, gathers, fusions), which no
measurement covers. `band` applies each calibrated term's error to that term
and leaves the uncalibrated terms as they are, so a band says how far the
measured figures of that kind stray, not how far the whole layer can.

Which measurements apply to a generation (`MEASURED_ON`): v5e's and TPU7x's
own; v6e and v5p have none, their model constants are v5e's, and so are their
bands (every v6e figure says so, `measured_on`).

The report is read from `CALIBRATION`, benchmarks/results/calibration.json
relative to the current directory.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tpu_kernels.bench import MissingInput, result_path

CALIBRATION = result_path("calibration.json")
# The chip whose measurements stand for each generation's.
MEASURED_ON = {"v5e": "v5e", "v6e": "v5e", "v5p": "v5e", "tpu7x": "tpu7x"}
KINDS = ("pallas_ragged_dot", "xla_ragged_dot", "flash_attention", "flash_attention_vjp")


@functools.cache
def _read(path: Path) -> dict:
    if not path.is_file():
        raise MissingInput(f"no calibration report at {path}: the calibrated error bands need it; run from a "
                           "checkout of the tpu-kernels project, or write one with `tpu-kernels calibrate`")
    return json.loads(path.read_text())["summary"]


def _summary() -> dict:
    return _read(CALIBRATION.absolute())


def error(kind: str, generation: str) -> dict | None:
    """The calibrated error of `kind` for `generation` (None where no chip measured that kind)."""
    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} is not a calibrated kind ({', '.join(KINDS)})")
    chip = MEASURED_ON.get(generation)
    stats = _summary().get(chip, {}).get(kind, {}).get("all") if chip else None
    if stats is None:
        # Measured on no chip that stands for this generation: the nearest evidence is another chip's.
        for other, kinds in sorted(_summary().items()):
            if kind in kinds:
                stats, chip = kinds[kind]["all"], other
                break
        else:
            return None
    return {
        "kind": kind,
        "measured_on": chip,
        "own_measurements": chip == generation,
        "count": stats["count"],
        "median": stats["median_abs_error"],
        "p90": stats["p90_abs_error"],
        "worst_ratio": stats["worst"]["ratio"],
    }


def band(terms_s: dict[str, float], generation: str, *, uncalibrated_s: float = 0.0) -> dict:
    """Band around sum(terms_s) + uncalibrated_s: each calibrated term at its median and p90 error.

    `terms_s` maps a calibrated kind to the seconds of the modelled time priced as that kind.
    """
    total = sum(terms_s.values()) + uncalibrated_s
    median = sum(s * error(kind, generation)["median"] for kind, s in terms_s.items() if s)
    p90 = sum(s * error(kind, generation)["p90"] for kind, s in terms_s.items() if s)
    return {
        "median_us": [round(1e6 * (total - median), 2), round(1e6 * (total + median), 2)],
        "p90_us": [round(1e6 * (total - p90), 2), round(1e6 * (total + p90), 2)],
        "uncalibrated_us": round(1e6 * uncalibrated_s, 2),
    }


def describe(kind: str, generation: str) -> str:
    """One line: the error of `kind` on `generation`, and whose measurements it rests on."""
    found = error(kind, generation)
    if found is None:
        return f"{kind}: no measurement on any chip"
    where = ("" if found["own_measurements"] else
             f"; {generation} has no measurements: {found['measured_on']}'s constants and error")
    return (f"{kind} on {found['measured_on']} ({found['count']} entries): median {100 * found['median']:.1f} %, "
            f"p90 {100 * found['p90']:.1f} %, worst ratio {found['worst_ratio']:.2f}{where}")


def bands_used(generations, kinds) -> dict:
    """The error table a benchmark's JSON carries: per generation and kind."""
    return {generation: {kind: error(kind, generation) for kind in kinds} for generation in generations}
