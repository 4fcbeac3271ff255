"""The share of the peak HBM bandwidth each TPU generation's copies reach, fitted on the timings bound by weight streaming.

The model prices every copy at `hbm_fraction` x the HBM bandwidth of jax's
TPU table (`benchmarks.perf.chip.ModelRates.hbm_fraction`). That share is
fitted here, per generation, on the measured entries (`python -m benchmarks calibrate`'s
analyses) whose time the model says is the time of streaming their weights:

- **bound by weight streaming**, in the model's own terms, priced at the peak
  bandwidth: a ragged dot (Pallas or XLA) whose copies (the kernels' HBM time,
  XLA's ragged-dot loops' bytes over the bandwidth, the other XLA ops) take at
  least STREAMING_MARGIN (2) times its matmuls (the kernels' and the loops' MXU
  time), so at any share above 1 / STREAMING_MARGIN the copies stay the longer
  term; whose weights (the right-hand side of a forward or lhs-gradient ragged
  dot, read once) are at least WEIGHTS_SHARE (80 %) of those copies, so the
  copies are the documented ones and not the model's reading of XLA's f32
  accumulator; and whose fixed step costs (grid steps, kept loop iterations)
  are under FIXED_SHARE (20 %) of its predicted time, so the share does not
  absorb the step cost's error. Entries that stream weights by the first two
  bounds but miss the third (or the next rule) are listed as left out, with
  the reason.
- an entry whose group sizes tokamax recorded as a count (`{num_groups,
  total_size}`, expanded at tokamax's seed) where the expansion leaves a group
  empty is left out, with the reason: which sizes were timed is not known, and
  the model skips an empty group's weights (tokamax's later files record the
  TPU7x decode call `[8,4096] x [8,4096,4096]` with every group holding one
  row, at about the time 0.0.12 recorded for the count: 93 and 95 µs).
- each kept entry's **implied share** is the one at which the model's
  pipelined price (copies, matmuls and the fitted step costs) equals the
  measured time (bisection: the price falls as the share rises). An entry the
  model prices slower than measured even at the peak implies a share of at
  least 1: it counts as 1 (the peak), and its price at the peak is recorded.
- a generation's share is the **median** of its entries' implied shares
  (rounded to 0.01); every entry, its split (`calibration.holdout`) and the
  spread are recorded. With so few entries per generation the median of all is
  the estimate; the split is recorded, not used.
- a generation without such an entry **borrows** the share of the generation
  named in BORROWED, and the record says so and why. A timing that two files
  hold (the same call, config and times) counts once.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.perf import calibration, program_time, tokamax_calls
from tpu_kernels.runtime.hardware import tpu_generation

STREAMING_MARGIN = 2.0
WEIGHTS_SHARE = 0.8
FIXED_SHARE = 0.2
GENERATIONS = ("v5e", "v5p", "v6e", "tpu7x")
# A generation without timings bound by weight streaming: the generation whose share it takes, and why.
BORROWED = {
    "v6e": ("v5e", "no v6e timing bound by weight streaming was given (the installed tokamax has none; a later "
                   "tokamax's are fitted in benchmarks/results/calibration_fit_v6e.json); v5e is the nearer measured "
                   "generation by HBM bandwidth per device (1.64 TB/s is 2.0x v5e's, 0.44x TPU7x's) and the one whose "
                   "step costs v6e already takes"),
    "v5p": ("v5e", "v5p has no entry the model can price bound by weight streaming (its XLA ragged dots compile to "
                   "Mosaic kernels the replay does not see, so the model refuses them); v5e is the same generation's "
                   "other chip"),
    "tpu7x": ("v5e", "TPU7x's weight-streaming timings (the XLA decode loop) spend over 20 % of their predicted time in "
                     "the loop's fixed per-iteration cost, and the one whose group sizes are known is priced slower "
                     "than measured at the peak; v5e is the only generation with a usable entry"),
}
_LOWEST_SHARE = 0.05


def streaming_terms(entry: calibration.Analysed, constants: calibration.ModelConstants) -> dict:
    """The entry's modelled time by term at the peak HBM bandwidth (µs): copies, the weights' share of them,
    matmuls, fixed step costs."""
    program = entry.price(dataclasses.replace(constants, hbm_fraction=1.0))
    generation = tpu_generation(program.generation)
    kernels = program.kernels
    loop_step_s = constants.ragged_dot_step_s
    if loop_step_s is None:
        loop_step_s = program_time.XLA_RAGGED_DOT_STEP_S.get(generation.name, program_time.XLA_RAGGED_DOT_STEP_S["v5e"])
    hbm, compute = program.copies_s, program.matmuls_s
    fixed = (kernels.overhead_s if kernels else 0.0) + program.ragged_dot_steps * loop_step_s
    weights = weights_bytes(entry.measurement) / generation.device_hbm_bytes_per_s
    return {"hbm_us": round(1e6 * float(hbm), 3), "weights_us": round(1e6 * weights, 3),
            "compute_us": round(1e6 * float(compute), 3), "fixed_us": round(1e6 * fixed, 3),
            "predicted_at_peak_us": round(1e6 * program.pipelined_time_s, 3)}


def weights_bytes(measurement: calibration.Measurement) -> int:
    """The bytes of the weights a forward or lhs-gradient ragged dot reads (its right-hand side); 0 otherwise."""
    if measurement.kind not in ("pallas_ragged_dot", "xla_ragged_dot"):
        return 0
    dims = measurement.call["ragged_dot_dimension_numbers"]["dot_dimension_numbers"]
    if not measurement.label.startswith(("fwd ", "dlhs ")) or dims == [[[0], [0]], [[], []]]:
        return 0
    rhs = tokamax_calls.array_type(measurement.call["rhs"])
    return int(np.prod(rhs.shape)) * np.dtype(rhs.dtype).itemsize


def streams_weights(terms: dict) -> bool:
    """Copies at least STREAMING_MARGIN x the matmuls, and the weights at least WEIGHTS_SHARE of the copies."""
    return (terms["hbm_us"] >= STREAMING_MARGIN * terms["compute_us"]
            and terms["weights_us"] >= WEIGHTS_SHARE * terms["hbm_us"])


def not_streaming_bound(terms: dict) -> str | None:
    """Why an entry is not bound by weight streaming (module docstring), or None when it is."""
    if terms["hbm_us"] < STREAMING_MARGIN * terms["compute_us"]:
        return f"copies {terms['hbm_us']:.1f} us < {STREAMING_MARGIN:g} x matmuls {terms['compute_us']:.1f} us"
    if terms["weights_us"] < WEIGHTS_SHARE * terms["hbm_us"]:
        return f"weights {terms['weights_us']:.1f} us < {WEIGHTS_SHARE:.0%} of the copies {terms['hbm_us']:.1f} us"
    if terms["fixed_us"] > FIXED_SHARE * terms["predicted_at_peak_us"]:
        return (f"fixed step costs {terms['fixed_us']:.1f} us > {FIXED_SHARE:.0%} of the predicted "
                f"{terms['predicted_at_peak_us']:.1f} us")
    return None


def unknown_group_sizes(measurement: calibration.Measurement) -> str | None:
    """Why the timed group sizes are not known (a count whose expansion leaves a group empty), or None."""
    sizes = measurement.call.get("group_sizes")
    if not isinstance(sizes, dict) or measurement.kind not in ("pallas_ragged_dot", "xla_ragged_dot"):
        return None
    empty = int((tokamax_calls.group_sizes_of(measurement.call) == 0).sum())
    if not empty:
        return None
    return (f"group sizes recorded as a count ({sizes['total_size']} rows in {sizes['num_groups']} groups) whose "
            f"expansion leaves {empty} groups empty: the timed sizes are not known")


def implied_fraction(entry: calibration.Analysed, constants: calibration.ModelConstants) -> float:
    """The share of the peak HBM bandwidth at which the model's price equals the measured time (1.0 when the
    price at the peak is already slower than measured)."""
    measured = entry.measurement.measured_us * 1e-6

    def price(share: float) -> float:
        return entry.price(dataclasses.replace(constants, hbm_fraction=share)).pipelined_time_s

    if price(1.0) >= measured:
        return 1.0
    low, high = _LOWEST_SHARE, 1.0
    if price(low) <= measured:
        return low
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if price(middle) > measured else (low, middle)
    return (low + high) / 2


def entry_record(entry: calibration.Analysed, terms: dict, share: float | None) -> dict:
    m = entry.measurement
    record = {"file": "/".join(Path(m.source).parts[-3:]), "call": m.label, "config": m.config,
              "measured_us": round(m.measured_us, 2), "split": "holdout" if calibration.holdout(m) else "fit",
              "terms_at_peak_us": terms,
              "ratio_at_peak": round(terms["predicted_at_peak_us"] / m.measured_us, 4)}
    if share is not None:
        record["implied_hbm_fraction"] = round(share, 4)
    return record


def fit_chip(entries: Sequence[calibration.Analysed], constants: calibration.ModelConstants) -> dict:
    """One generation's share from its entries (module docstring): the used entries, the left-out ones, why."""
    used, left_out, seen = [], [], set()
    for entry in entries:
        if (entry.measurement.identity, entry.measurement.times_ms) in seen:  # one timing in two files
            continue
        seen.add((entry.measurement.identity, entry.measurement.times_ms))
        terms = streaming_terms(entry, constants)
        why = unknown_group_sizes(entry.measurement) or not_streaming_bound(terms)
        if why is None:
            used.append(entry_record(entry, terms, implied_fraction(entry, constants)))
        elif streams_weights(terms):  # weight streaming by its terms, left out for its step costs or group sizes
            left_out.append({**entry_record(entry, terms, None), "left_out": why})
    if not used:
        return {"hbm_fraction": None, "entries": [], "left_out": left_out}
    shares = sorted(record["implied_hbm_fraction"] for record in used)
    return {
        "hbm_fraction": round(statistics.median(shares), 2),
        "derived": f"median of {len(shares)} entries' implied shares (an entry priced slower than measured at "
                   "the peak counts as 1)",
        "spread": {"min": shares[0], "max": shares[-1]},
        "entries": used,
        "left_out": left_out,
    }


def fit_hbm_fractions(analysed: Sequence[calibration.Analysed], constants_by_chip: dict | None = None) -> dict:
    """Per generation: its fitted share and the entries it came from, or the generation it borrows from."""
    constants_by_chip = constants_by_chip or {}
    results = {}
    for chip in sorted({a.measurement.chip for a in analysed}):
        on_chip = [a for a in analysed if a.measurement.chip == chip]
        results[chip] = fit_chip(on_chip, constants_by_chip.get(chip, calibration.ModelConstants()))
    for chip in GENERATIONS:
        fitted = results.get(chip, {}).get("hbm_fraction")
        source, why = BORROWED.get(chip, (None, None))
        if fitted is None and source is not None and results.get(source, {}).get("hbm_fraction") is not None:
            results[chip] = {**results.get(chip, {"entries": [], "left_out": []}),
                             "hbm_fraction": results[source]["hbm_fraction"], "borrowed_from": source,
                             "derived": f"borrowed from {source}: {why}"}
    return results


def fractions(results: dict) -> dict[str, float]:
    """The fitted or borrowed share per generation (generations with neither stream at the peak: left out)."""
    return {chip: found["hbm_fraction"] for chip, found in sorted(results.items()) if found.get("hbm_fraction")}
