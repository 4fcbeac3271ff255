"""The modelled time of a compiled program: its Pallas kernels by grid replay, the XLA ops around them by traffic.

`model_program` joins `benchmarks.perf.xla_program`'s reading of the
compiled program (each XLA op's traffic and placement, each Pallas kernel's
operand placement) with `benchmarks.perf`'s grid replay of the kernels:
kernel operands XLA placed in VMEM move no HBM bytes inside the kernel (the
prefetch that brought them there is an XLA op), and

    time = sum over kernels of perf.roofline time
         + max(sum over XLA ops of max(HBM bytes / (HBM bandwidth * hbm_fraction),
                                       VMEM bytes / VMEM bandwidth),
               XLA FLOPs / bf16 peak)

where XLA FLOPs are the compiled module's `cost_analysis()["flops"]` less
the kernels' own `CostEstimate` FLOPs (XLA reports a Pallas call's estimate
as its cost); per-op FLOPs are not available, hence the module-level max.

with VMEM bandwidth = 22 x HBM bandwidth ("VMEM bandwidth is around 22x
higher than HBM bandwidth": "How to Scale Your Model", part "How to Think
About TPUs", jax-ml/scaling-book tpus.md). XLA's ragged dot loops
(`benchmarks.perf.xla_ragged_dot`) are priced by replaying them, not by
their traffic. Not modelled: a fixed cost per XLA op (XLA's own estimates,
reported as `estimated_cycles`, suggest ~2,100 cycles for small ops touching
HBM), vector-unit work beyond its VMEM traffic, sort networks' compute,
overlap of prefetches with compute (every HBM byte is charged once,
serially), while-loop bodies without a known trip count (counted once) and
HBM tile padding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from . import chip, hlo, xla_ragged_dot
from .chip import FITTED_RATES, ModelRates
from .modelled_time import ModelledTime, regime, roofline, with_operands_on_chip
from .program_replay import RaggedDotCall
from .traffic import PallasCallTraffic
from .xla_program import CompiledProgram
from tpu_kernels.runtime.hardware import TpuGeneration, tpu_generation

VMEM_BANDWIDTH_OVER_HBM = 22.0
# Fixed cost of one kept iteration of XLA's ragged dot loop (`xla_ragged_dot`), per generation, fitted to
# tokamax's measured XLA ragged dots (model_constants.json).
XLA_RAGGED_DOT_STEP_S = chip.CONSTANTS["xla_ragged_dot_step_s"]


@dataclasses.dataclass(frozen=True)
class ProgramTime:
    """Modelled time of a compiled program: its Pallas kernels (grid replay) plus its XLA ops."""

    generation: str
    step_overhead_s: float
    hbm_fraction: float
    kernels: ModelledTime | None
    xla_s: float
    ragged_dot_s: float
    xla_flops: float
    xla_hbm_bytes: int
    xla_vmem_bytes: int
    xla_ops: int
    xla_estimated_cycles: int
    xla_ops_without_estimate: int
    xla_transpose_s: float = 0.0  # the part of `xla_s`'s traffic that transposing copies move (at its HBM time)
    xla_relayout_s: float = 0.0  # ... that relayouts of arguments move (`CompiledProgram.relayout_bytes`)
    xla_prefetch_s: float = 0.0  # ... that XLA's prefetches into VMEM move (`CompiledProgram.prefetch_bytes`)
    ragged_dot_hbm_bytes: int = 0  # what XLA's ragged dot loops copy (`xla_ragged_dot.Modelled.hbm_bytes`)
    ragged_dot_mxu_s: float = 0.0  # ... their matmuls' MXU time, over the device's cores
    ragged_dot_steps: int = 0  # ... their kept iterations (each costs the fitted step cost)

    @property
    def xla_estimated_s(self) -> float:
        """XLA's own estimate for the ops it annotated, at `clock_hz` (no estimate for the rest)."""
        return self.xla_estimated_cycles / clock_hz(self.generation)

    @property
    def time_s(self) -> float:
        return (self.kernels.time_s if self.kernels else 0.0) + self.xla_s + self.ragged_dot_s

    @property
    def pipelined_time_s(self) -> float:
        return (self.kernels.pipelined_time_s if self.kernels else 0.0) + self.xla_s + self.ragged_dot_s

    @property
    def hbm_bytes(self) -> int:
        return (self.kernels.hbm_bytes if self.kernels else 0) + self.xla_hbm_bytes

    @property
    def copies_s(self) -> float:
        """The copies' time: the kernels' HBM time, the XLA ops' (all traffic) and XLA's ragged-dot loops' bytes at
        the priced share of the HBM bandwidth."""
        bandwidth = tpu_generation(self.generation).device_hbm_bytes_per_s * self.hbm_fraction
        return ((self.kernels.hbm_bound_s if self.kernels else 0.0) + self.xla_s
                + self.ragged_dot_hbm_bytes / bandwidth)

    @property
    def matmuls_s(self) -> float:
        """The matmuls' MXU time: the kernels' and XLA's ragged-dot loops'."""
        return (self.kernels.compute_bound_s if self.kernels else 0.0) + self.ragged_dot_mxu_s

    @property
    def regime(self) -> str:
        return regime(self.copies_s, self.matmuls_s)


def _dense_flops(call: RaggedDotCall) -> float:
    """The FLOPs XLA's cost analysis reports for a ragged dot: every row against every group's weights."""
    shape = xla_ragged_dot.shape_of(call)
    return 2.0 * shape.groups * shape.m * shape.k * shape.n


def clock_hz(generation: str | TpuGeneration) -> float:
    """TensorCore clock implied by the bf16 peak (`chip.core_clock_hz`)."""
    return chip.core_clock_hz(generation)


def kernels_as_placed(program: CompiledProgram, calls: Sequence[PallasCallTraffic]) -> list[PallasCallTraffic]:
    """The replayed calls with the operands XLA placed in VMEM moving no HBM bytes.

    Kernels and replays are matched in program order; a kernel's last
    operands are its pipelined inputs (after dynamic grid sizes and scalar
    prefetch), its results its outputs.
    """
    if len(program.kernels) != len(calls):
        raise ValueError(
            f"the compiled program has {len(program.kernels)} Pallas kernels but {len(calls)} were replayed: "
            "they cannot be matched"
        )
    placed = []
    for kernel, call in zip(program.kernels, calls):
        inputs = [position for position, op in enumerate(call.operands) if op.role == "input"]
        outputs = [position for position, op in enumerate(call.operands) if op.role == "output"]
        input_spaces = kernel.operand_spaces[len(kernel.operand_spaces) - len(inputs):]
        on_chip = [position for position, space in zip(inputs, input_spaces) if space == hlo.VMEM]
        kept = [position for position, space in zip(outputs, kernel.result_spaces) if space == hlo.VMEM]
        if on_chip:
            call = with_operands_on_chip(call, on_chip, "XLA placed this operand in VMEM before the kernel")
        if kept:
            call = with_operands_on_chip(call, kept, "XLA keeps this result in VMEM")
        placed.append(call)
    return placed


def model_program(
    program: CompiledProgram,
    calls: Sequence[PallasCallTraffic],
    *,
    ragged_dots: Sequence[RaggedDotCall] = (),
    step_overhead_s: float | None = None,
    ragged_dot_step_s: float | None = None,
    hbm_fraction: float | None = None,
    rates: ModelRates = FITTED_RATES,
) -> ProgramTime:
    """Modelled time of `program` whose Pallas kernels were replayed as `calls` (module docstring).

    `ragged_dots` are the program's `lax.ragged_dot_general`s as `perf.replay_program` found them, in
    order: each is priced by replaying XLA's loop for it (`xla_ragged_dot`). Compute is priced at the MXU and
    vector rates `rates`, copies at `hbm_fraction` of the peak HBM bandwidth (None: the generation's share in
    `rates`).
    """
    gen: TpuGeneration = tpu_generation(program.generation)
    hbm_fraction = rates.hbm_fraction(gen) if hbm_fraction is None else hbm_fraction
    step_overhead_s = chip.grid_step_s(gen.name) if step_overhead_s is None else step_overhead_s
    if ragged_dot_step_s is None:
        ragged_dot_step_s = XLA_RAGGED_DOT_STEP_S.get(gen.name, XLA_RAGGED_DOT_STEP_S["v5e"])
    placed = kernels_as_placed(program, calls)
    kernels = (roofline(placed, gen, step_overhead_s=step_overhead_s, hbm_fraction=hbm_fraction, rates=rates)
               if placed else None)
    hbm_bandwidth = gen.device_hbm_bytes_per_s * hbm_fraction
    vmem_bandwidth = gen.device_hbm_bytes_per_s * VMEM_BANDWIDTH_OVER_HBM
    looped = [op for op in program.ops if op.ragged_dot is not None]
    if len(looped) != len(ragged_dots):
        raise ValueError(
            f"the compiled program has {len(looped)} ragged dot loops but {len(ragged_dots)} ragged dots were "
            "replayed: pass perf.replay_program(...).ragged_dots"
        )
    ragged = [xla_ragged_dot.model(call, op.ragged_dot, gen, step_overhead_s=ragged_dot_step_s,
                                   hbm_fraction=hbm_fraction, rates=rates) for op, call in zip(looped, ragged_dots)]
    transfer_s = sum(max(op.hbm_bytes / hbm_bandwidth, op.vmem_bytes / vmem_bandwidth)
                     for op in program.ops if op.ragged_dot is None)
    kernel_flops = sum(call.cost_estimate.flops for call in calls if call.cost_estimate is not None)
    # XLA's cost analysis counts a ragged dot densely over every group; its loop is priced apart.
    dense_ragged_flops = sum(_dense_flops(call) for call in ragged_dots)
    xla_flops = max(program.cost_analysis.get("flops", 0.0) - kernel_flops - dense_ragged_flops, 0.0)
    xla_s = max(transfer_s, xla_flops / gen.device_bf16_flops_per_s)
    moving = program.moving_ops
    return ProgramTime(
        generation=program.generation,
        step_overhead_s=step_overhead_s,
        hbm_fraction=hbm_fraction,
        kernels=kernels,
        xla_s=xla_s,
        ragged_dot_s=sum(r.seconds for r in ragged),
        xla_flops=xla_flops,
        xla_hbm_bytes=program.hbm_bytes,
        xla_vmem_bytes=program.vmem_bytes,
        xla_ops=len(moving),
        xla_estimated_cycles=sum(op.estimated_cycles or 0 for op in moving),
        xla_ops_without_estimate=sum(op.estimated_cycles is None for op in moving),
        xla_transpose_s=sum(op.hbm_bytes for op in program.transpose_ops) / hbm_bandwidth,
        xla_relayout_s=program.relayout_bytes / hbm_bandwidth,
        xla_prefetch_s=program.prefetch_bytes / hbm_bandwidth,
        ragged_dot_hbm_bytes=sum(r.hbm_bytes for r in ragged),
        ragged_dot_mxu_s=sum(r.mxu_seconds for r in ragged) / gen.cores_per_device,
        ragged_dot_steps=sum(r.steps for r in ragged),
    )
