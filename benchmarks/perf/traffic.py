"""What a replayed pallas_call moves and computes (`PallasCallTraffic`), and the time of its pipeline.

MXU time per matmul (`DotShape.mxu_flops(generation)`, in FLOPs at peak) is
charged per pass of the systolic array. Source: "How to Scale Your Model",
part "How to Think About TPUs" (jax-ml/scaling-book, tpus.md, Appendix B):
the MXU is a `mxu_size` x `mxu_size` systolic array (128 on v5e, 256 on v6e,
also in jax's TpuInfo) that holds a tile of the matmul's right-hand side (the
weights) while the left-hand side's rows stream through it, one row per
cycle (one bf16[8,128] @ bf16[128,128] per 8 cycles); "after that initial
bubble, new inputs and weights can be loaded in without an additional
bubble". So a matmul (m, k) @ (k, n) takes ceil(k / mxu) * ceil(n / mxu)
passes, one per weights tile. Loading a weights tile takes `mxu_size` cycles
(its rows enter one per cycle) and overlaps the previous pass only while
that pass streams rows, so a pass costs max(m rounded up to 8 sublanes,
mxu_size) cycles. Assumptions beyond the source: the next tile's load hides
entirely behind a pass of at least `mxu_size` rows, passes spread evenly over
the core's MXUs, and a matmul's rows are not split into several passes of the
same weights tile. A 32-row chunk on v6e thus costs as much MXU time as 256
rows: small row chunks are not free. The model charges a pass
max(m rounded up to 8 sublanes, ceil(fraction x mxu_size)) cycles, with
fraction the fitted share of a weights load a short pass cannot hide
(`chip.ModelRates.mxu_weight_load_fraction`; 1.0 is the rule above).

f32 matmuls are counted at the bf16 peak at DEFAULT precision (jax's Pallas
TPU matmul guide states v5e has "197 TFLOP/s of bf16/f32 compute") and at
1/6 of it at HIGHEST precision (six bf16 passes, as XLA emulates f32). This
is an assumption; our kernels multiply bf16.

A step's compute is max(its MXU time, its vector time) (vector work:
`benchmarks.perf.kernel_work`). `PallasCallTraffic.pipelined_seconds`
replays the double-buffered pipeline step by step: the first fetch and last
write-back are not overlapped, and each step costs max(its compute, the DMAs
of the neighbouring steps) + the step cost. DMA issue latency and HBM tile
granularity are not modelled. Every method that prices takes the MXU and
vector rates as `rates` (`chip.ModelRates`, by default the fitted
`chip.FITTED_RATES`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from jax._src.pallas import core as pallas_core

from . import chip
from .chip import FITTED_RATES, ModelRates
from tpu_kernels.runtime.hardware import TpuGeneration, round_up

# Six bf16 passes emulate an f32 matmul at HIGHEST precision.
_F32_HIGHEST_PASSES = 6


@dataclasses.dataclass(frozen=True)
class DotShape:
    """A matmul [batch] x (m, k) @ (k, n) on block shapes, run `count` times over the whole grid."""

    batch: int
    m: int
    k: int
    n: int
    lhs_dtype: str
    rhs_dtype: str
    precision: str
    count: int

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.k * self.n * self.count

    def mxu_flops(self, generation: TpuGeneration, rates: ModelRates = FITTED_RATES) -> int:
        """MXU time in FLOPs at peak: one pass per weights tile, each of at least the rows a weights load
        cannot hide behind (module docstring)."""
        mxu = generation.mxu_size
        rows_per_pass = max(round_up(self.m, generation.sublanes), math.ceil(rates.mxu_weight_load_fraction * mxu))
        passes = math.ceil(self.k / mxu) * math.ceil(self.n / mxu)
        return 2 * self.batch * rows_per_pass * mxu * mxu * passes * self.count

    def peak_flops_per_s(self, generation: TpuGeneration) -> float:
        dtypes = {self.lhs_dtype, self.rhs_dtype}
        if dtypes <= {"int8", "uint8"} and generation.int8_ops_per_s:
            return generation.int8_ops_per_s
        if dtypes <= {"int4", "uint4"} and generation.int4_ops_per_s:
            return generation.int4_ops_per_s
        if all(d.startswith("float8") for d in dtypes) and generation.fp8_flops_per_s:
            return generation.fp8_flops_per_s
        if "float32" in dtypes and self.precision == "HIGHEST":
            return generation.bf16_flops_per_s / _F32_HIGHEST_PASSES
        return generation.bf16_flops_per_s


def pipeline_seconds(
    fetched: np.ndarray,
    written: np.ndarray,
    compute: np.ndarray,
    *,
    prologue_bytes: float,
    bandwidth: float,
    step_overhead_s: float,
) -> float:
    """A double-buffered pipeline over steps: step t computes while t+1's blocks arrive and t-1's leave.

    = (prologue + first fetch + last write-back) / bandwidth + sum over steps of max(compute_t, DMA_t)
      + steps * overhead, with DMA_t = (bytes fetched for t+1 + bytes written after t-1) / bandwidth.
    `fetched[t]` are the bytes a step needs copied in, `written[t]` those it leaves to copy out, `compute[t]`
    its MXU seconds.
    """
    steps = len(compute)
    if steps == 0:
        return prologue_bytes / bandwidth
    dma = (np.append(fetched[1:], 0.0) + np.insert(written[:-1], 0, 0.0)) / bandwidth
    edges = (prologue_bytes + fetched[0] + written[-1]) / bandwidth
    return float(edges + np.maximum(compute, dma).sum() + steps * step_overhead_s)


@dataclasses.dataclass(frozen=True)
class OperandTraffic:
    """What the pipeline moves for one operand of a pallas_call.

    `hbm_bytes` is HBM -> on-chip for inputs and scalar-prefetch operands,
    on-chip -> HBM for outputs (plus read-backs of revisited output blocks
    under RevisitMode.ANY). `buffer_bytes` is the on-chip footprint of its
    buffers (`buffer_count` blocks, padded to the (sublane, 128) tile) in
    `memory_space`.
    """

    origin: str
    role: str  # "input" | "output" | "scalar_prefetch"
    memory_space: str  # "vmem" | "smem" | "any" | "hbm"
    array_shape: tuple[int, ...]
    dtype: str
    block_shape: tuple[int, ...]
    buffer_count: int
    transfers: int
    distinct_blocks: int
    hbm_bytes: int
    buffer_bytes: int
    revisits: int
    pipelined: bool
    # Bytes fetched for use at each grid step and written back after it.
    fetched_per_step: np.ndarray | None = dataclasses.field(compare=False, repr=False, default=None)
    written_per_step: np.ndarray | None = dataclasses.field(compare=False, repr=False, default=None)


@dataclasses.dataclass(frozen=True)
class PallasCallTraffic:
    """The replayed grid of one pallas_call."""

    name: str
    grid: tuple[int, ...]
    dimension_semantics: tuple[str, ...] | None
    steps: int
    active_steps: int
    operands: tuple[OperandTraffic, ...]
    dots: tuple[DotShape, ...]
    dots_exact: bool
    scratch_vmem_bytes: int
    vmem_limit_bytes: int | None
    cost_estimate: pallas_core.CostEstimate | None
    notes: tuple[str, ...]
    # How many times each matmul shape (a DotShape without its count) runs at each grid step.
    dots_per_step: dict[tuple, np.ndarray] = dataclasses.field(compare=False, repr=False, default_factory=dict)
    # On a megacore device (v5p), the core each grid step runs on: Mosaic splits the first "parallel"
    # grid dimension of more than one index into two halves. None when no dimension lets the grid split.
    megacore_core: np.ndarray | None = dataclasses.field(compare=False, repr=False, default=None)
    # Vector-unit work at each grid step, in register elements (`kernel_work.VECTOR_KEY`): VPU operations, and those
    # through the transcendental unit (exp, div, rsqrt, ...).
    vector_per_step: np.ndarray | None = dataclasses.field(compare=False, repr=False, default=None)
    transcendental_per_step: np.ndarray | None = dataclasses.field(compare=False, repr=False, default=None)
    # A kernel that copies its HBM operands itself, replayed on its scalars (`scalar_replay`): each step's phases,
    # the copies of one wait (or run of waits) and the work after it, which its own double buffering overlaps.
    phases: Any = dataclasses.field(compare=False, repr=False, default=None)

    @property
    def unmodelled_dmas(self) -> tuple[str, ...]:
        """Operands the kernel copies itself (memory space ANY/HBM): the replay does not see those copies."""
        return tuple(op.origin for op in self.operands if not op.pipelined)

    @property
    def inputs(self) -> tuple[OperandTraffic, ...]:
        return tuple(op for op in self.operands if op.role == "input")

    @property
    def outputs(self) -> tuple[OperandTraffic, ...]:
        return tuple(op for op in self.operands if op.role == "output")

    @property
    def hbm_read_bytes(self) -> int:
        return sum(op.hbm_bytes for op in self.operands if op.role != "output")

    @property
    def hbm_write_bytes(self) -> int:
        return sum(op.hbm_bytes for op in self.operands if op.role == "output")

    @property
    def hbm_bytes(self) -> int:
        return self.hbm_read_bytes + self.hbm_write_bytes

    @property
    def flops(self) -> int:
        """MXU FLOPs on the block shapes over the whole grid (no MXU padding)."""
        return sum(dot.flops for dot in self.dots)

    def mxu_flops(self, generation: str | TpuGeneration, rates: ModelRates = FITTED_RATES) -> int:
        gen = chip.as_generation(generation)
        return sum(dot.mxu_flops(gen, rates) for dot in self.dots)

    def pipelined_seconds(
        self,
        generation: str | TpuGeneration,
        step_overhead_s: float | None = None,
        hbm_fraction: float = 1.0,
        *,
        rates: ModelRates = FITTED_RATES,
    ) -> float:
        """Time of a double-buffered pipeline: step t computes while step t+1's blocks arrive and t-1's leave.

        = first fetch + sum over steps of max(compute_t, DMA_t) + last write-back + steps * overhead,
        with DMA_t = (bytes fetched for t+1 + bytes written after t-1) / HBM bandwidth. It charges what
        the aggregate roofline hides: the unoverlapped first and last transfers and steps whose DMA and
        compute do not balance.
        """
        gen = chip.as_generation(generation)
        step_overhead_s = chip.grid_step_s(gen.name) if step_overhead_s is None else step_overhead_s
        prologue = sum(op.hbm_bytes for op in self.operands if op.role == "scalar_prefetch")
        bandwidth = gen.hbm_bytes_per_s * hbm_fraction
        if self.phases is not None:
            return self._phased_seconds(gen, step_overhead_s, prologue, bandwidth, rates)
        fetched, written, compute = self._per_step(gen, rates)
        times = [
            pipeline_seconds(fetched[steps], written[steps], compute[steps], prologue_bytes=prologue,
                             bandwidth=bandwidth, step_overhead_s=step_overhead_s)
            for steps in self.core_steps(gen)
        ]
        return max(times)

    def _phased_seconds(self, gen: TpuGeneration, step_overhead_s: float, prologue: float, bandwidth: float,
                        rates: ModelRates) -> float:
        """The pipeline run phase by phase (`phases`): each phase's work overlaps the next phase's copies; the
        pipelined blocks of a step arrive with its first phase and leave after its last; overhead per grid step."""
        phase_step = self.phases.step
        fetched = sum(self.phases.read.values(), np.zeros(len(phase_step)))
        written = sum(self.phases.written.values(), np.zeros(len(phase_step)))
        first = np.searchsorted(phase_step, np.arange(self.steps))
        last = np.searchsorted(phase_step, np.arange(self.steps), side="right") - 1
        for op in self.operands:
            # The kernel's own copies are in the phases already; the pipeline's blocks are not.
            if op.memory_space not in ("any", "hbm", "host") and op.fetched_per_step is not None:
                np.add.at(fetched, first, op.fetched_per_step)
                np.add.at(written, last, op.written_per_step)
        compute = np.zeros(len(phase_step))
        vector = np.zeros(len(phase_step))
        for key, counts in self.phases.work.items():
            # kernel_work's keys: ("vector",), ("transcendental",), or a matmul's shape.
            if key == ("vector",):
                vector += counts / rates.vector_elements_per_s(gen)
            elif key == ("transcendental",):
                vector += counts / rates.transcendental_elements_per_s(gen)
            else:
                one = DotShape(*key, count=1)
                compute += counts * (one.mxu_flops(gen, rates) / one.peak_flops_per_s(gen))
        compute = np.maximum(compute, vector)
        times = []
        for steps in self.core_steps(gen):
            on_core = np.isin(phase_step, steps)
            times.append(pipeline_seconds(fetched[on_core], written[on_core], compute[on_core],
                                          prologue_bytes=prologue, bandwidth=bandwidth, step_overhead_s=0.0)
                         + len(steps) * step_overhead_s)
        return max(times)

    def core_steps(self, generation: str | TpuGeneration) -> list[np.ndarray]:
        """The grid steps each TensorCore of the device runs: all on one core unless megacore splits them."""
        gen = chip.as_generation(generation)
        if gen.cores_per_device == 1 or self.megacore_core is None:
            return [np.arange(self.steps)]
        return [np.flatnonzero(self.megacore_core == core) for core in range(gen.cores_per_device)]

    def _per_step(self, gen: TpuGeneration, rates: ModelRates) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """HBM bytes fetched for and written after each step, and its MXU seconds."""
        fetched = np.zeros(self.steps)
        written = np.zeros(self.steps)
        for op in self.operands:
            if op.fetched_per_step is not None:
                fetched += op.fetched_per_step
                written += op.written_per_step
        compute = np.zeros(self.steps)
        for key, counts in self.dots_per_step.items():
            one = DotShape(*key, count=1)
            compute += counts * (one.mxu_flops(gen, rates) / one.peak_flops_per_s(gen))
        return fetched, written, np.maximum(compute, self.vector_seconds_per_step(gen, rates))

    def vector_seconds_per_step(self, generation: str | TpuGeneration, rates: ModelRates = FITTED_RATES) -> np.ndarray:
        """Vector-unit seconds of each step: its register elements at `rates`, at the generation's clock."""
        gen = chip.as_generation(generation)
        seconds = np.zeros(self.steps)
        if self.vector_per_step is not None:
            seconds += self.vector_per_step / rates.vector_elements_per_s(gen)
        if self.transcendental_per_step is not None:
            seconds += self.transcendental_per_step / rates.transcendental_elements_per_s(gen)
        return seconds

    def core_bound_seconds(
        self, generation: str | TpuGeneration, hbm_fraction: float = 1.0, *, rates: ModelRates = FITTED_RATES
    ) -> tuple[float, float, int]:
        """(HBM seconds, MXU seconds, steps) of the busiest core: a megacore split halves them only where it applies."""
        gen = chip.as_generation(generation)
        fetched, written, compute = self._per_step(gen, rates)
        prologue = sum(op.hbm_bytes for op in self.operands if op.role == "scalar_prefetch")
        bandwidth = gen.hbm_bytes_per_s * hbm_fraction
        per_core = [((prologue + fetched[steps].sum() + written[steps].sum()) / bandwidth, compute[steps].sum(),
                     len(steps)) for steps in self.core_steps(gen)]
        return max(per_core, key=lambda entry: max(entry[0], entry[1]) + entry[2])

    @property
    def vmem_bytes(self) -> int:
        """VMEM held by the pipeline's buffers and the scratch operands."""
        blocks = sum(op.buffer_bytes for op in self.operands if op.memory_space == "vmem")
        return blocks + self.scratch_vmem_bytes


def dtype_name(dtype) -> str:
    return np.dtype(dtype).name
