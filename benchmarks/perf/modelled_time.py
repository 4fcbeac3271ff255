"""The modelled time of replayed pallas_calls on one TPU generation: `roofline` and its `ModelledTime`.

Modelled time of one call on one generation (`roofline(...).time_s`) =
    max(HBM bytes / (HBM bandwidth * hbm_fraction), compute) + grid steps * step cost,
with hbm_fraction the share of the peak bandwidth the DMAs reach (by default
the generation's fitted share, `rates.hbm_fraction`) and the step cost calibrated per generation (`chip.grid_step_s`,
benchmarks/perf/model_constants.json; override it with `step_overhead_s`);
compute at the MXU and vector rates `rates` (default the fitted
`chip.FITTED_RATES`).
`pipelined_time_s` sums `PallasCallTraffic.pipelined_seconds`; it is never
below `time_s`, and it is the figure `python -m benchmarks calibrate` holds against
real chips (its errors per chip and kind: benchmarks/results/calibration.json).
A call whose operands the kernel copies itself (memory space ANY/HBM) is
refused rather than timed as if those copies were free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from . import chip
from .chip import FITTED_RATES, ModelRates
from .traffic import PallasCallTraffic
from tpu_kernels.runtime.hardware import TpuGeneration

# The regimes the model's calibrated error is given for (`regime`).
REGIMES = ("streaming", "compute_bound")


def regime(copies_s: float, matmuls_s: float) -> str:
    """`streaming` (decode-like: the copies are the longer term, as when a decode step streams weights or a KV
    cache) or `compute_bound` (the matmuls are)."""
    return "streaming" if copies_s >= matmuls_s else "compute_bound"

@dataclasses.dataclass(frozen=True)
class ModelledTime:
    """Modelled run time of one or more pallas_calls on one TPU generation.

    `time_s` = sum over calls of max(hbm_bound, compute_bound) + overhead.
    `pipelined_time_s` = sum over calls of `PallasCallTraffic.pipelined_seconds`,
    a step-by-step double-buffering estimate (never below `time_s`).
    `roofline_s` is the caller's lower bound, max(min_bytes / HBM bandwidth,
    min_flops / bf16 peak), and `pct_of_roofline` = 100 * roofline_s / time_s.
    `fits_vmem` compares each call's VMEM use with its `vmem_limit_bytes`, or
    the generation's default scoped limit, or its VMEM capacity.
    """

    generation: str
    time_s: float
    pipelined_time_s: float
    hbm_bound_s: float
    compute_bound_s: float
    overhead_s: float
    hbm_bytes: int
    mxu_flops: int
    steps: int
    roofline_s: float | None
    pct_of_roofline: float | None
    vmem_bytes: int
    fits_vmem: bool
    per_call: tuple[tuple[str, float], ...]

    @property
    def bound(self) -> str:
        return "hbm" if self.hbm_bound_s >= self.compute_bound_s else "compute"

    @property
    def regime(self) -> str:
        return regime(self.hbm_bound_s, self.compute_bound_s)

    @property
    def pipelined_pct_of_roofline(self) -> float | None:
        return None if self.roofline_s is None else 100.0 * self.roofline_s / self.pipelined_time_s


def roofline(
    traffic: PallasCallTraffic | Sequence[PallasCallTraffic],
    generation: str | TpuGeneration = "v6e",
    *,
    min_bytes: int | None = None,
    min_flops: int | None = None,
    step_overhead_s: float | None = None,
    hbm_fraction: float | None = None,
    rates: ModelRates = FITTED_RATES,
) -> ModelledTime:
    """Modelled time of `traffic` (one call or several run one after another).

    `hbm_fraction` is the share of the peak HBM bandwidth the DMAs reach (None: the generation's share in
    `rates`); the roofline (`min_bytes`, `min_flops`) is always taken at the peak.
    """
    calls = [traffic] if isinstance(traffic, PallasCallTraffic) else list(traffic)
    if not calls:
        raise ValueError("traffic: no pallas_call to model")
    gen = chip.as_generation(generation)
    step_overhead_s = chip.grid_step_s(gen.name) if step_overhead_s is None else step_overhead_s
    if step_overhead_s < 0:
        raise ValueError(f"step_overhead_s must be >= 0, got {step_overhead_s}")
    hbm_fraction = rates.hbm_fraction(gen) if hbm_fraction is None else hbm_fraction
    if not 0 < hbm_fraction <= 1:
        raise ValueError(f"hbm_fraction must be in (0, 1], got {hbm_fraction}")
    time_s = pipelined_s = hbm_s = compute_s = overhead_s = 0.0
    per_call = []
    fits = True
    for call in calls:
        if call.unmodelled_dmas:
            raise ValueError(
                f"pallas_call {call.name}: operands {', '.join(call.unmodelled_dmas)} stay in HBM (memory space "
                "ANY) and the kernel copies them itself; the model cannot see those copies, so it cannot time "
                "this kernel"
            )
        call_hbm, call_compute, core_steps = call.core_bound_seconds(gen, hbm_fraction, rates=rates)
        call_overhead = core_steps * step_overhead_s
        call_time = max(call_hbm, call_compute) + call_overhead
        hbm_s += call_hbm
        compute_s += call_compute
        overhead_s += call_overhead
        time_s += call_time
        pipelined_s += call.pipelined_seconds(gen, step_overhead_s, hbm_fraction, rates=rates)
        per_call.append((call.name, call_time))
        limit = call.vmem_limit_bytes or gen.default_scoped_vmem_bytes or gen.vmem_capacity_bytes
        fits = fits and call.vmem_bytes <= limit
    roofline_s = None
    if min_bytes is not None or min_flops is not None:
        # The device's peaks: on v5p both TensorCores', whether or not the grid splits over them.
        roofline_s = max((min_bytes or 0) / gen.device_hbm_bytes_per_s, (min_flops or 0) / gen.device_bf16_flops_per_s)
    return ModelledTime(
        generation=gen.name,
        time_s=time_s,
        pipelined_time_s=pipelined_s,
        hbm_bound_s=hbm_s,
        compute_bound_s=compute_s,
        overhead_s=overhead_s,
        hbm_bytes=sum(c.hbm_bytes for c in calls),
        mxu_flops=sum(c.mxu_flops(gen, rates) for c in calls),
        steps=sum(c.steps for c in calls),
        roofline_s=roofline_s,
        pct_of_roofline=None if roofline_s is None else 100.0 * roofline_s / time_s,
        vmem_bytes=max(c.vmem_bytes for c in calls),
        fits_vmem=fits,
        per_call=tuple(per_call),
    )


def with_operands_on_chip(call: PallasCallTraffic, positions: Sequence[int], why: str) -> PallasCallTraffic:
    """`call` with the operands at `positions` (indices into `call.operands`) moving no HBM bytes.

    For an operand the surrounding program placed in VMEM (XLA's memory-space
    assignment can prefetch a custom call's operand into VMEM, or keep its
    output there): the pipeline's copies of it then stay on chip, and the
    HBM traffic belongs to whatever brought it there.
    """
    operands = list(call.operands)
    for position in positions:
        op = operands[position]
        zeros = None if op.fetched_per_step is None else np.zeros_like(op.fetched_per_step)
        operands[position] = dataclasses.replace(op, hbm_bytes=0, fetched_per_step=zeros, written_per_step=zeros)
    notes = (*call.notes, *(f"{call.operands[p].origin}: {why}" for p in positions))
    return dataclasses.replace(call, operands=tuple(operands), notes=notes)
