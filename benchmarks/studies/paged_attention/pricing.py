"""One kernel call's replay priced on one generation against the HBM roofline and the MXU peak, with the copies
XLA makes of its arguments in the program a user compiles around it (`bench.relayouts`)."""

from __future__ import annotations

from benchmarks import perf
from benchmarks.studies import calibration_bands
from benchmarks.perf.chip import as_generation
from benchmarks.studies.relayouts import relayout_fields

from .shapes import Batch, Model, minimum_bytes, useful_flops

# The calibration kind whose measured error stands for these kernels' (the forward attention kernels').
BAND_KIND = "flash_attention"


# Rivals run at their best configuration: in the serving systems they come from, the cache is allocated in jax by
# the code that calls the kernel, which can keep it in the kernel's layout.
RIVAL_RELAYOUT = ("not charged: a rival at its best configuration (its serving system allocates the cache and can keep "
                  "it in the kernel's layout); relayout_if_default_layout_us is what a call on a cache in XLA's "
                  "default layout would add")


def price(calls, batch: Batch, model: Model, generation: str, relayout=None, charge_relayout: bool = True) -> dict:
    """Modelled time (calibrated pipelined figure, at the fitted HBM share and at the peak) against the rooflines:
    the kernel's, plus the relayout copies XLA makes around it (`bench.relayouts`, None: not probed, said in the row;
    `charge_relayout=False`: a rival's, recorded beside its time, not in it)."""
    min_bytes, flops = minimum_bytes(batch, model), useful_flops(batch, model)
    fitted = perf.roofline(calls, generation, min_bytes=min_bytes)
    at_peak = perf.roofline(calls, generation, min_bytes=min_bytes, hbm_fraction=1.0)
    fraction = perf.FITTED_RATES.hbm_fraction(generation)
    gen = as_generation(generation)
    mxu_floor_s = flops / gen.device_bf16_flops_per_s
    charged = relayout_fields(relayout)
    if not charge_relayout:
        charged = {"relayout_us": None, "relayout_missing": RIVAL_RELAYOUT,
                   "relayout_if_default_layout_us": charged["relayout_us"]}
    relayout_s = (charged["relayout_us"] or 0.0) * 1e-6
    relayout_peak_s = charged.get("relayout_at_peak_bw_us", 0.0) * 1e-6
    time_s = fitted.pipelined_time_s + relayout_s
    return {
        "modelled_time_us": time_s * 1e6,
        "kernel_time_us": fitted.pipelined_time_s * 1e6,
        **charged,
        "modelled_time_at_peak_bw_us": (at_peak.pipelined_time_s + relayout_peak_s) * 1e6,
        "hbm_roofline_us": fitted.roofline_s * 1e6,
        "pct_of_hbm_roofline_peak": 100.0 * fitted.roofline_s / (at_peak.pipelined_time_s + relayout_peak_s),
        "pct_of_hbm_roofline_fitted": 100.0 * fitted.roofline_s / fraction / time_s,
        "pct_of_mxu_peak": 100.0 * mxu_floor_s / time_s,
        # The model's terms: what the time is made of (copies, matmuls or vector work, grid steps).
        "hbm_term_us": fitted.hbm_bound_s * 1e6,
        "compute_term_us": fitted.compute_bound_s * 1e6,
        "step_overhead_us": fitted.overhead_s * 1e6,
        "bound": fitted.bound,
        "hbm_bytes": fitted.hbm_bytes,
        "bytes_ratio": fitted.hbm_bytes / min_bytes,
        "mxu_flops": fitted.mxu_flops,
        "grid_steps": fitted.steps,
        # The copies the kernel issues itself (a per-copy issue cost is charged on them: robustness.json).
        "dma_copies": sum(int(call.phases.copies.sum()) for call in calls if call.phases is not None),
        "fits_vmem": fitted.fits_vmem,
        # The band covers the kernel's calibrated error; the relayout copies are uncalibrated XLA ops.
        **calibration_bands.p90_fields(calibration_bands.band({BAND_KIND: fitted.pipelined_time_s}, generation,
                                                              fitted.regime, uncalibrated_s=relayout_s)),
    }


def terms(calls, generation: str) -> dict:
    """The call's compute split: MXU seconds, vector-unit seconds (all steps), for the "why" of a comparison."""
    gen = as_generation(generation)
    mxu = vector = 0.0
    for call in calls:
        vector += float(call.vector_seconds_per_step(gen).sum())
        mxu += sum(float((counts * perf.DotShape(*key, count=1).mxu_flops(gen) /
                          perf.DotShape(*key, count=1).peak_flops_per_s(gen)).sum())
                   for key, counts in call.dots_per_step.items())
    return {"mxu_us": mxu * 1e6, "vector_us": vector * 1e6}
