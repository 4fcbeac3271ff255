"""The model's unstated costs fitted straight from the microbenchmarks (`model_constant_suites.py` of
ragged-dot-tpu's package), a least-squares line per term, against the values the model prices with:

- `grid_step`: time against grid steps; the slope is the fixed cost of a step (the model's `grid_step_s`);
- `kernel_dma`: time per copy against its bytes; the intercept is the fixed cost of one copy a kernel issues,
  the slope's inverse the rate one copy reaches, as a share of the chip's peak HBM bandwidth (the model prices
  a copy at `hbm_fraction` of the peak and no fixed cost of its own: a fitted fixed cost says what that leaves
  out);
- `hbm_stream`: time against the bytes a streaming Pallas copy reads and writes; the slope's inverse is the
  bandwidth it reaches, as a share of the peak (the model's `hbm_fraction`);
- `expert_gather`: the same for XLA's gather of whole expert weights (the model prices XLA ops' copies at
  `hbm_fraction` too).

A term moves when its fitted value differs from the model's by more than MOVE_TOLERANCE. Timings taken in
interpret mode are listed with their points but never fitted.
"""

from __future__ import annotations

import numpy as np

from benchmarks.perf import chip as chip_constants
from benchmarks.perf.calibration import ModelConstants
from tpu_kernels.runtime.hardware import tpu_generation

MOVE_TOLERANCE = 0.05
BF16_BYTES = 2


def point(case: dict, seconds_per_call: float) -> tuple[str, float, float]:
    """(term, x, seconds) of one microbenchmark case (its table entry) and its measured time per call."""
    if case["term"] == "steps":
        return "grid_step", float(case["value"]), seconds_per_call
    if case["term"] == "bytes" and "copies" in case:
        return "kernel_dma", float(case["value"]), seconds_per_call / case["copies"]
    if case["term"] == "bytes":
        return "hbm_stream", 2.0 * case["value"], seconds_per_call
    gathered = case["value"] * case["rows"] * case["columns"] * BF16_BYTES
    return "expert_gather", 2.0 * gathered, seconds_per_call


def line(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(intercept, slope) of the least-squares line through (x, seconds); None without two distinct x."""
    xs = np.array([x for x, _ in points])
    if len(set(xs.tolist())) < 2:
        return None
    slope, intercept = np.polyfit(xs, np.array([y for _, y in points]), 1)
    return float(intercept), float(slope)


def _moves(fitted: float, current: float) -> bool:
    return abs(fitted / current - 1) > MOVE_TOLERANCE


def term_fit(chip: str, term: str, points: list[tuple[float, float]]) -> dict:
    """One term's line on `chip` and what it says against the model's value."""
    found = {"points": [[x, y] for x, y in sorted(points)]}
    fitted = line(points)
    if fitted is None:
        return found | {"fit": None, "why": "fewer than two distinct sizes"}
    intercept, slope = fitted
    found |= {"intercept_s": intercept, "slope_s": slope}
    peak = tpu_generation(chip).device_hbm_bytes_per_s
    hbm_fraction = dict(ModelConstants().hbm_fractions)[chip]
    if term == "grid_step":
        current = chip_constants.grid_step_s(chip)
        return found | {"constant": "grid_step_s", "fitted": slope, "current": current,
                        "moves": _moves(slope, current)}
    if slope <= 0:
        return found | {"fit": None, "why": "time does not grow with bytes: no bandwidth to fit"}
    share = 1.0 / slope / peak
    found |= {"bytes_per_s": 1.0 / slope, "share_of_peak_hbm": share, "constant": "hbm_fraction",
              "fitted": share, "current": hbm_fraction, "moves": _moves(share, hbm_fraction)}
    if term == "kernel_dma":
        found["fixed_cost_per_copy_s"] = intercept
    return found


def fits(points: dict[tuple[str, str], list[tuple[float, float]]]) -> dict:
    """{chip: {term: term_fit}} of points measured on a TPU, by (chip, term)."""
    found: dict = {}
    for (chip, term), measured in sorted(points.items()):
        found.setdefault(chip, {})[term] = term_fit(chip, term, measured)
    return found


def printed(found: dict) -> list[str]:
    lines = []
    for chip, terms in found.items():
        lines.append(f"{chip}: the microbenchmarks' lines")
        for term, fit in terms.items():
            if fit.get("fitted") is None:
                lines.append(f"  {term:14} {len(fit['points'])} points: {fit.get('why')}")
                continue
            verdict = "moves" if fit["moves"] else "stays"
            extra = (f", fixed cost per copy {fit['fixed_cost_per_copy_s'] * 1e6:.2f} us"
                     if "fixed_cost_per_copy_s" in fit else "")
            lines.append(f"  {term:14} {fit['constant']} {verdict}: {fit['current']:.4g} -> {fit['fitted']:.4g} "
                         f"({len(fit['points'])} points{extra})")
    return lines
