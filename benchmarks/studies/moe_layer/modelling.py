"""A compiled layer and its kernels' replays under the calibrated model: its time, band and terms."""

from __future__ import annotations

from benchmarks import perf
from benchmarks.studies import calibration_bands
from benchmarks.perf import program_time
from tpu_kernels.runtime.hardware import tpu_generation

from .cache import first_line
from .shapes import Case


def price(program, replayed: perf.ProgramReplay, hbm_fraction: float | None = None) -> program_time.ProgramTime:
    """The layer under the calibrated model: Pallas kernels, XLA's ragged-dot loops and the other XLA ops, their
    copies at `hbm_fraction` of the peak HBM bandwidth (None: the generation's fitted share)."""
    return program_time.model_program(program, replayed.pallas_calls, ragged_dots=replayed.ragged_dots,
                                      hbm_fraction=hbm_fraction)


def timings(program, replayed: perf.ProgramReplay, case: Case, generation: str) -> dict:
    """Modelled layer time (headline: calibrated pipelined figure), its error band, and where it goes.

    A program the model cannot price (an XLA ragged-dot loop whose bounds XLA left empty) gives
    {"modelled": False, "error": why}.
    """
    try:
        head = price(program, replayed)
        at_85 = price(program, replayed, hbm_fraction=0.85)
    except ValueError as error:
        return {"modelled": False, "error": f"not modelled: {first_line(error)}"}
    kernels = head.kernels
    peak = tpu_generation(generation).device_bf16_flops_per_s  # on v5p both TensorCores
    placed = program_time.kernels_as_placed(program, replayed.pallas_calls) if replayed.pallas_calls else []
    kernels_s = kernels.pipelined_time_s if kernels else 0.0
    band = calibration_bands.band({"pallas_ragged_dot": kernels_s, "xla_ragged_dot": head.ragged_dot_s},
                                  generation, head.regime, uncalibrated_s=head.xla_s)
    return {
        "headline_us": round(head.pipelined_time_s * 1e6, 3),
        "band": band,
        "us": {"pipelined": round(head.pipelined_time_s * 1e6, 3),
               "pipelined_hbm85": round(at_85.pipelined_time_s * 1e6, 3),
               "overlap": round(head.time_s * 1e6, 3)},
        # The same, with the XLA ops at XLA's own cycle estimate where that is higher (ops without one excluded).
        "with_xla_estimate_us": round(
            (head.pipelined_time_s - head.xla_s + max(head.xla_s, head.xla_estimated_s)) * 1e6, 3),
        "over_roofline": head.pipelined_time_s / case.roofline_s(generation),
        "mxu_utilisation_pct": 100.0 * case.useful_flops / peak / head.pipelined_time_s,
        "kernels": None if kernels is None else {
            "us": round(kernels_s * 1e6, 3),
            "overlap_us": round(kernels.time_s * 1e6, 3),
            "hbm_bytes": kernels.hbm_bytes,
            "hbm_us": round(kernels.hbm_bound_s * 1e6, 3),
            "mxu_us": round(kernels.compute_bound_s * 1e6, 3),
            "grid_steps": kernels.steps,
            "step_cost_us": round(kernels.overhead_s * 1e6, 3),
            "mxu_flops": kernels.mxu_flops,
            "fits_vmem": kernels.fits_vmem,
            "vmem_bytes": kernels.vmem_bytes,
            "calls": [{"name": c.name, "grid": list(c.grid), "hbm_bytes": c.hbm_bytes, "steps": c.steps,
                       "notes": list(c.notes)} for c in placed],
        },
        "xla_ragged_dot_us": round(head.ragged_dot_s * 1e6, 3),
        "xla_ops": {
            "us": round(head.xla_s * 1e6, 3),
            "hbm_bytes": head.xla_hbm_bytes,
            "vmem_bytes": head.xla_vmem_bytes,
            "flops": head.xla_flops,
            "count": head.xla_ops,
            "xla_estimated_cycles": head.xla_estimated_cycles,
            "xla_estimated_us": round(head.xla_estimated_s * 1e6, 3),
            "ops_without_xla_estimate": head.xla_ops_without_estimate,
            "relayout_hbm_bytes": program.relayout_bytes,
            "relayout_us": round(head.xla_relayout_s * 1e6, 3),
            "vmem_prefetch_hbm_bytes": program.prefetch_bytes,
            "vmem_prefetch_us": round(head.xla_prefetch_s * 1e6, 3),
        },
        "hbm_bytes": head.hbm_bytes,
        "bytes_over_min": head.hbm_bytes / case.min_bytes,
        "placements": program.placements(),
        "memory": program.memory,
        "notes": list(program.notes),
    }


def standalone(replayed: perf.ProgramReplay, generation: str) -> perf.ModelledTime:
    """A rival's grouped matmul alone, under the calibrated model (its pallas_calls)."""
    return perf.roofline(list(replayed.pallas_calls), generation)


def joined(replays) -> perf.ProgramReplay:
    """Several replays (one per projection) as one program's, in order."""
    return perf.ProgramReplay(tuple(c for r in replays for c in r.pallas_calls),
                              tuple(d for r in replays for d in r.ragged_dots))
