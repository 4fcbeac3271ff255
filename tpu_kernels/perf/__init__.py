"""HBM traffic and roofline model of Pallas TPU kernels, for benchmarks without a TPU.

We have no TPU, so the speed of a kernel is argued from what a TPU does with
it. `model_pallas_traffic` traces a JAX function, finds every `pallas_call`
in it (also inside jit, custom_vjp/custom_jvp and scan; not inside lax.cond
or while_loop) and replays each call's grid the way the Mosaic TPU pipeline
runs it:

- Grid order: row-major over the grid, the last axis fastest, one step after
  the other on one TensorCore (a v5e, v6e or TPU7x device has one; "parallel"
  dimension semantics change nothing there). A v5p device is two TensorCores
  in megacore: the first "parallel" grid dimension with more than one index
  is split into two contiguous halves, one per core, and a call takes as long
  as its busier core (with no such dimension the grid runs on one core). The copy rules below are the ones jax
  documents for its pipeline emitter (docs/pallas/pipelining.md, "if the data
  slices between two consecutive iterations are the same, the pipeline will
  not issue a copy_in/copy_out"; docs/pallas/tpu/sparse.md on revisiting).
- An input block is copied HBM -> VMEM (or SMEM) at the first step and at
  every step whose block index differs from the previous step's. Revisiting a
  block that was fetched earlier but not at the previous step fetches it again.
- An output block is copied VMEM -> HBM when the next step's block index
  differs, and at the last step. An output block visited again after the
  pipeline left it is counted in `OperandTraffic.revisits`: under the default
  revisit mode its contents are then undefined (a kernel bug worth seeing);
  with `pl.Buffered(1, revisit=pl.RevisitMode.ANY)` Mosaic reads it back, and
  that read-back is counted as HBM traffic.
- Bytes of a block are those of its window clipped to the array (a partial
  edge block moves only its in-bounds part). HBM tiling granularity is
  ignored: a (1, 2048) bf16 row counts 4 KiB although the (8|16, 128)-tiled
  HBM layout makes the DMA touch more.
- Index maps are evaluated for all grid steps at once (vmapped) with the
  concrete values of the scalar-prefetch operands and dynamic grid sizes.
  Those values are computed by running the traced function's own jaxpr on the
  CPU up to each `pallas_call`, from the arguments passed concretely; the
  arguments given as `jax.ShapeDtypeStruct` (weights, activations) stay
  abstract and cost nothing. If a scalar-prefetch operand or a grid size
  depends on an abstract argument (or on a Pallas kernel's output), the model
  raises a ValueError naming it: pass that argument concretely.
- Operands in memory space ANY/HBM are not windowed: the kernel copies them
  itself with DMAs that the model does not see. The replay lists them
  (`unmodelled_dmas`, and the call's `notes`); `roofline` refuses to time
  such a call rather than call its copies free. Scalar-prefetch operands are copied to SMEM
  once before the grid starts and count as HBM reads. Scratch buffers move no
  HBM bytes.

MXU work is derived from the kernel body: every `dot_general` on the block
shapes, times the loop trip counts around it, at every grid step (so padding
rows inside a block are counted: the MXU computes them). A top-level `cond`
(`pl.when`) whose predicate depends only on program ids and scalar-prefetch
values is evaluated at every step, so compute a kernel skips (an empty group,
a masked tile) costs nothing. Any other `cond` counts its most expensive
branch and a `while` body counts once; `PallasCallTraffic.dots_exact` is
False then, and the `active_steps` callback can say which steps compute (the
pipeline's DMAs run on every step regardless).

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
rows: small row chunks are not free.

Vector-unit work: every elementwise or reducing op of the kernel body on an
array counts its (8 x 128) register elements (a [bq, 64] f32 block counts
[bq, 128]) at every step it runs, at VECTOR_ELEMENTS_PER_CYCLE, or at
TRANSCENDENTAL_ELEMENTS_PER_CYCLE for exp, log, div, rsqrt and the like; an
add of a matmul's result into an accumulator is the MXU's, not counted. A
step's compute is max(its MXU time, its vector time).

Modelled time of one call on one generation (`roofline(...).time_s`) =
    max(HBM bytes / (HBM bandwidth * hbm_fraction), compute) + grid steps * step cost,
with hbm_fraction the share of the peak bandwidth the DMAs reach (1.0 by
default) and the step cost calibrated per generation
(`grid_step_s`, tpu_kernels/perf/model_constants.json). `pipelined_time_s` replays the double-buffered
pipeline step by step instead: the first fetch and last write-back are not
overlapped, and each step costs max(its compute, the DMAs of the
neighbouring steps) + the step cost; it is never below `time_s`, and it is
the figure `tpu-kernels calibrate` holds against real chips (its errors per
chip and kind: benchmarks/results/calibration.json). DMA issue latency and
HBM tile granularity are not modelled.

Constants and their sources: HBM bandwidth, MXU peaks and size, VMEM
capacity, the default scoped VMEM limits and the per-grid-step cost come
from `tpu_kernels.runtime.hardware` (the module every built kernel carries as
`_hardware.py`), which reads jax's public TPU table
(`jax.experimental.pallas.tpu.get_tpu_info_for_chip`) and names the source
of each number it adds. Override the step cost with `step_overhead_s`.
- f32 matmuls: counted at the bf16 peak at DEFAULT precision (jax's Pallas TPU
  matmul guide states v5e has "197 TFLOP/s of bf16/f32 compute") and at 1/6
  of it at HIGHEST precision (six bf16 passes, as XLA emulates f32). This is
  an assumption; our kernels multiply bf16.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

import jax
import numpy as np
from jax._src import core as jax_core
from jax._src.pallas import core as pallas_core
from jax._src.state import discharge as state_discharge
from jax.extend import core as jex_core

from ..runtime.hardware import (
    GRID_STEP_OVERHEAD_S,
    TpuGeneration,
    padded_vmem_bytes,
    round_up,
    tpu_generation,
)

# Six bf16 passes emulate an f32 matmul at HIGHEST precision.
_F32_HIGHEST_PASSES = 6

# The model's fitted constants (tpu_kernels/perf/model_constants.json, written from benchmarks/calibration_fit.py):
# data, so that refitting them changes no code and re-prices cached replays without redoing them.
CONSTANTS = json.loads(resources.files(__package__).joinpath("model_constants.json").read_text())
# The cycles a weights tile takes to load into the MXU that a pass of fewer rows cannot hide, as a share of
# `mxu_size` (the scaling book implies all of them, 1.0: a pass would cost max(rows, mxu_size) cycles).
# Fitted on TPU7x, whose 128-row tiles on the 256-wide MXU cost what 128 rows cost, not 256; v5e's timings
# (128-row tiles on a 128-wide MXU) cannot tell.
MXU_WEIGHT_LOAD_FRACTION = CONSTANTS["mxu_weight_load_fraction"]
# Vector-unit throughput per TensorCore cycle, in (8 x 128) register elements: VPU operations, and
# operations through the transcendental unit. Fitted on TPU7x (the only chip with vector-bound timings:
# flash attention); assumed the same per cycle on every generation, at the clock `core_clock_hz` implies.
VECTOR_ELEMENTS_PER_CYCLE = CONSTANTS["vector_elements_per_cycle"]
TRANSCENDENTAL_ELEMENTS_PER_CYCLE = CONSTANTS["transcendental_elements_per_cycle"]


def grid_step_s(generation: str) -> float:
    """The calibrated fixed cost of one Pallas grid step on `generation` (model_constants.json)."""
    steps = CONSTANTS["grid_step_s"]
    return steps.get(generation, GRID_STEP_OVERHEAD_S)


# MXUs per TensorCore used to turn a bf16 peak into a clock: 4 on v4 and v5 ("How to Think About TPUs",
# which also gives v5e's 1.5 GHz clock); assumed 4 on later generations.
MXUS_PER_CORE = 4


def core_clock_hz(generation: str | TpuGeneration) -> float:
    """TensorCore clock implied by the bf16 peak: peak / (MXUs x 2 x mxu_size^2); 1.50 GHz on v5e, 1.75 GHz on v6e."""
    gen = _as_generation(generation)
    return gen.bf16_flops_per_s / (MXUS_PER_CORE * 2 * gen.mxu_size**2)


def vector_elements_per_s(generation: str | TpuGeneration) -> float:
    return VECTOR_ELEMENTS_PER_CYCLE * core_clock_hz(generation)


def transcendental_elements_per_s(generation: str | TpuGeneration) -> float:
    return TRANSCENDENTAL_ELEMENTS_PER_CYCLE * core_clock_hz(generation)

_UNPIPELINED_MEMORY_SPACES = ("any", "hbm", "host")
_SEMAPHORE_MEMORY_SPACES = ("semaphore_mem",)


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

    def mxu_flops(self, generation: TpuGeneration) -> int:
        """MXU time in FLOPs at peak: one pass per weights tile, each at least `mxu_size` rows (module docstring)."""
        mxu = generation.mxu_size
        rows_per_pass = max(round_up(self.m, generation.sublanes), math.ceil(MXU_WEIGHT_LOAD_FRACTION * mxu))
        passes = math.ceil(self.k / mxu) * math.ceil(self.n / mxu)
        return 2 * self.batch * rows_per_pass * mxu * mxu * passes * self.count

    def mxu_passes(self, generation: TpuGeneration) -> int:
        """Weights tiles loaded into the MXU over the whole grid."""
        mxu = generation.mxu_size
        return self.batch * math.ceil(self.k / mxu) * math.ceil(self.n / mxu) * self.count

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
    # Vector-unit work at each grid step, in register elements (`VECTOR_KEY`): VPU operations, and those
    # through the transcendental unit (exp, div, rsqrt, ...).
    vector_per_step: np.ndarray | None = dataclasses.field(compare=False, repr=False, default=None)
    transcendental_per_step: np.ndarray | None = dataclasses.field(compare=False, repr=False, default=None)

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

    def mxu_flops(self, generation: str | TpuGeneration) -> int:
        gen = _as_generation(generation)
        return sum(dot.mxu_flops(gen) for dot in self.dots)

    def compute_seconds(self, generation: str | TpuGeneration) -> float:
        gen = _as_generation(generation)
        return sum(dot.mxu_flops(gen) / dot.peak_flops_per_s(gen) for dot in self.dots)

    def pipelined_seconds(
        self, generation: str | TpuGeneration, step_overhead_s: float | None = None, hbm_fraction: float = 1.0
    ) -> float:
        """Time of a double-buffered pipeline: step t computes while step t+1's blocks arrive and t-1's leave.

        = first fetch + sum over steps of max(compute_t, DMA_t) + last write-back + steps * overhead,
        with DMA_t = (bytes fetched for t+1 + bytes written after t-1) / HBM bandwidth. It charges what
        the aggregate roofline hides: the unoverlapped first and last transfers and steps whose DMA and
        compute do not balance.
        """
        gen = _as_generation(generation)
        step_overhead_s = grid_step_s(gen.name) if step_overhead_s is None else step_overhead_s
        prologue = sum(op.hbm_bytes for op in self.operands if op.role == "scalar_prefetch")
        fetched, written, compute = self._per_step(gen)
        bandwidth = gen.hbm_bytes_per_s * hbm_fraction
        times = [
            pipeline_seconds(fetched[steps], written[steps], compute[steps], prologue_bytes=prologue,
                             bandwidth=bandwidth, step_overhead_s=step_overhead_s)
            for steps in self.core_steps(gen)
        ]
        return max(times)

    def core_steps(self, generation: str | TpuGeneration) -> list[np.ndarray]:
        """The grid steps each TensorCore of the device runs: all on one core unless megacore splits them."""
        gen = _as_generation(generation)
        if gen.cores_per_device == 1 or self.megacore_core is None:
            return [np.arange(self.steps)]
        return [np.flatnonzero(self.megacore_core == core) for core in range(gen.cores_per_device)]

    def _per_step(self, gen: TpuGeneration) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
            compute += counts * (one.mxu_flops(gen) / one.peak_flops_per_s(gen))
        return fetched, written, np.maximum(compute, self.vector_seconds_per_step(gen))

    def vector_seconds_per_step(self, generation: str | TpuGeneration) -> np.ndarray:
        """Vector-unit seconds of each step: its register elements at the generation's calibrated rates."""
        gen = _as_generation(generation)
        seconds = np.zeros(self.steps)
        if self.vector_per_step is not None:
            seconds += self.vector_per_step / vector_elements_per_s(gen)
        if self.transcendental_per_step is not None:
            seconds += self.transcendental_per_step / transcendental_elements_per_s(gen)
        return seconds

    def core_bound_seconds(self, generation: str | TpuGeneration, hbm_fraction: float = 1.0) -> tuple[float, float, int]:
        """(HBM seconds, MXU seconds, steps) of the busiest core: a megacore split halves them only where it applies."""
        gen = _as_generation(generation)
        fetched, written, compute = self._per_step(gen)
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

    @property
    def smem_bytes(self) -> int:
        return sum(op.buffer_bytes for op in self.operands if op.memory_space == "smem")


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
    def pipelined_pct_of_roofline(self) -> float | None:
        return None if self.roofline_s is None else 100.0 * self.roofline_s / self.pipelined_time_s


def _as_generation(generation: str | TpuGeneration) -> TpuGeneration:
    return generation if isinstance(generation, TpuGeneration) else tpu_generation(generation)


def roofline(
    traffic: PallasCallTraffic | Sequence[PallasCallTraffic],
    generation: str | TpuGeneration = "v6e",
    *,
    min_bytes: int | None = None,
    min_flops: int | None = None,
    step_overhead_s: float | None = None,
    hbm_fraction: float = 1.0,
) -> ModelledTime:
    """Modelled time of `traffic` (one call or several run one after another).

    `hbm_fraction` is the share of the peak HBM bandwidth the DMAs reach; the
    roofline (`min_bytes`, `min_flops`) is always taken at the peak.
    """
    calls = [traffic] if isinstance(traffic, PallasCallTraffic) else list(traffic)
    if not calls:
        raise ValueError("traffic: no pallas_call to model")
    gen = _as_generation(generation)
    step_overhead_s = grid_step_s(gen.name) if step_overhead_s is None else step_overhead_s
    if step_overhead_s < 0:
        raise ValueError(f"step_overhead_s must be >= 0, got {step_overhead_s}")
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
        call_hbm, call_compute, core_steps = call.core_bound_seconds(gen, hbm_fraction)
        call_overhead = core_steps * step_overhead_s
        call_time = max(call_hbm, call_compute) + call_overhead
        hbm_s += call_hbm
        compute_s += call_compute
        overhead_s += call_overhead
        time_s += call_time
        pipelined_s += call.pipelined_seconds(gen, step_overhead_s, hbm_fraction)
        per_call.append((call.name, call_time))
        limit = call.vmem_limit_bytes or gen.default_scoped_vmem_bytes or gen.vmem_capacity_bytes
        fits = fits and call.vmem_bytes <= limit
    roofline_s = None
    if min_bytes is not None or min_flops is not None:
        roofline_s = max((min_bytes or 0) / gen.hbm_bytes_per_s, (min_flops or 0) / gen.bf16_flops_per_s)
    return ModelledTime(
        generation=gen.name,
        time_s=time_s,
        pipelined_time_s=pipelined_s,
        hbm_bound_s=hbm_s,
        compute_bound_s=compute_s,
        overhead_s=overhead_s,
        hbm_bytes=sum(c.hbm_bytes for c in calls),
        mxu_flops=sum(c.mxu_flops(gen) for c in calls),
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


# A callback telling which grid steps run their compute:
#   active_steps(call_name, grid_indices[steps, ndim], scalar_prefetch_values) -> bool[steps] | None
ActiveStepsFn = Callable[[str, np.ndarray, tuple[np.ndarray, ...]], Any]


@dataclasses.dataclass(frozen=True)
class RaggedDotCall:
    """A `lax.ragged_dot_general` the traced function runs, with its group sizes where they are known.

    XLA compiles it into a windowed loop of its own (`tpu_kernels.perf.xla_ragged_dot` models it); the loop
    skips the windows a group does not touch, so its cost depends on the group sizes' values.
    """

    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    lhs_dtype: str
    rhs_dtype: str
    out_dtype: str
    dimension_numbers: Any  # lax.RaggedDotDimensionNumbers
    group_sizes: np.ndarray | None


@dataclasses.dataclass(frozen=True)
class ProgramReplay:
    """What the model replays of a traced function: its pallas_calls and its XLA ragged dots, each in execution order."""

    pallas_calls: tuple[PallasCallTraffic, ...]
    ragged_dots: tuple[RaggedDotCall, ...]


def model_pallas_traffic(fn: Callable, *args, active_steps: ActiveStepsFn | None = None) -> list[PallasCallTraffic]:
    """Replays every pallas_call of `fn(*args)` and counts its HBM traffic and MXU work.

    `args` are pytrees of concrete arrays (numpy or jax) and
    `jax.ShapeDtypeStruct`s; pass concretely every argument that a
    scalar-prefetch operand or a dynamic grid size is computed from (e.g.
    group sizes), the rest abstractly. Bind static arguments with
    functools.partial. Returns one `PallasCallTraffic` per pallas_call
    executed, in execution order (a call inside a scan appears once per
    iteration). A pallas_call inside `lax.cond` or `lax.while_loop` is not
    supported.
    """
    return list(replay_program(fn, *args, active_steps=active_steps).pallas_calls)


def replay_program(fn: Callable, *args, active_steps: ActiveStepsFn | None = None) -> ProgramReplay:
    """`model_pallas_traffic`, plus every `lax.ragged_dot_general` of `fn(*args)` with its group sizes' values.

    Pass the group sizes concretely to get their values (else `RaggedDotCall.group_sizes` is None).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    flat_args = jax.tree_util.tree_leaves(args)
    closed = jax.make_jaxpr(fn)(*args)
    is_known = [not isinstance(a, jax.ShapeDtypeStruct) for a in flat_args]
    calls: list[jax_core.JaxprEqn] = []

    # One jitted run of the function's jaxpr computes every known
    # scalar-prefetch operand and dynamic grid size: one XLA compile instead of
    # one per primitive, which dominates the cost otherwise.
    def known_call_operands(known_args, consts):
        known = iter(known_args)
        values = [next(known) if k else _UNKNOWN for k in is_known]
        calls.clear()
        operands: list[list[Any]] = []
        _Collector(calls, operands).run(closed.jaxpr, consts, values)
        return operands

    known_args = [a for a, k in zip(flat_args, is_known) if k]
    with jax.default_device(_host_device()):
        operand_values = _run_on_host(known_call_operands, known_args, list(closed.consts))
    pallas_calls, ragged_dots = [], []
    for eqn, values in zip(calls, operand_values):
        values = [_UNKNOWN if v is None else np.asarray(v) for v in values]
        if eqn.primitive.name == "pallas_call":
            pallas_calls.append(_replay_pallas_call(eqn, values, active_steps))
        else:
            ragged_dots.append(_ragged_dot_call(eqn, values[0]))
    return ProgramReplay(tuple(pallas_calls), tuple(ragged_dots))


def _ragged_dot_call(eqn: jax_core.JaxprEqn, group_sizes) -> RaggedDotCall:
    lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
    return RaggedDotCall(
        lhs_shape=tuple(int(d) for d in lhs.shape),
        rhs_shape=tuple(int(d) for d in rhs.shape),
        lhs_dtype=_dtype_name(lhs.dtype),
        rhs_dtype=_dtype_name(rhs.dtype),
        out_dtype=_dtype_name(eqn.outvars[0].aval.dtype),
        dimension_numbers=eqn.params["ragged_dot_dimension_numbers"],
        group_sizes=None if _is_unknown(group_sizes) else np.asarray(group_sizes, np.int64),
    )


class _Unknown:
    def __repr__(self):
        return "<unknown>"


_UNKNOWN = _Unknown()


def _is_unknown(value) -> bool:
    return value is _UNKNOWN


# The model's helper programs run once each on small integer arrays: XLA's CPU backend optimizations
# cost more compile time than they save (skipping them cuts compile time by about a quarter, measured here).
_HOST_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _run_on_host(fn: Callable, *args):
    """`jax.jit(fn)(*args)` on the host device, compiled without XLA's CPU optimizations."""
    return jax.jit(fn).lower(*args).compile(_HOST_COMPILE_OPTIONS)(*args)


def _host_device():
    """Where the model's small computations run: the CPU when jax has it, else the default device."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return jax.devices()[0]


def _num_grid_operands(eqn: jax_core.JaxprEqn) -> tuple[int, int]:
    """(leading captured constants, dynamic grid sizes + scalar-prefetch operands) of a pallas_call."""
    gm = eqn.params["grid_mapping"]
    small = gm.num_dynamic_grid_bounds + gm.num_index_operands
    return len(eqn.invars) - small - gm.num_inputs, small


# Primitives that call their one body on their operands unchanged; the model looks through them.
_CALL_PRIMITIVES = frozenset(
    {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "checkpoint", "remat"}
)


_RAGGED_DOT = "ragged_dot_general"


class _Collector:
    """Traces a jaxpr on the values known so far, collecting each pallas_call (and ragged dot) and its small operands.

    Runs under jax.jit: known values are tracers, the others `_UNKNOWN`.
    Everything that depends on an unknown value (or on a pallas_call output,
    which the model does not compute) stays unknown.
    """

    def __init__(self, calls: list[jax_core.JaxprEqn], operands: list[list[Any]]):
        self.calls = calls
        self.operands = operands
        self._has_pallas: dict[int, bool] = {}

    def contains_pallas(self, jaxpr: jax_core.Jaxpr) -> bool:
        key = id(jaxpr)
        if key not in self._has_pallas:
            self._has_pallas[key] = any(
                eqn.primitive.name in ("pallas_call", _RAGGED_DOT)
                or any(self.contains_pallas(sub) for sub in jax_core.jaxprs_in_params(eqn.params))
                for eqn in jaxpr.eqns
            )
        return self._has_pallas[key]

    def run(self, jaxpr: jax_core.Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[jax_core.Var, Any] = {}

        def read(atom):
            return atom.val if isinstance(atom, jax_core.Literal) else env[atom]

        for var, val in zip(jaxpr.constvars, consts):
            env[var] = val
        for var, val in zip(jaxpr.invars, args):
            env[var] = val
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            if eqn.primitive.name == "pallas_call":
                leading, small = _num_grid_operands(eqn)
                self.calls.append(eqn)
                self.operands.append([None if _is_unknown(v) else v for v in invals[leading : leading + small]])
                outvals = [_UNKNOWN] * len(eqn.outvars)
            elif eqn.primitive.name == _RAGGED_DOT:
                self.calls.append(eqn)
                self.operands.append([None if _is_unknown(invals[2]) else invals[2]])
                outvals = [_UNKNOWN] * len(eqn.outvars)
            elif any(self.contains_pallas(sub) for sub in jax_core.jaxprs_in_params(eqn.params)):
                outvals = self.descend(eqn, invals)
            elif any(_is_unknown(v) for v in invals):
                outvals = [_UNKNOWN] * len(eqn.outvars)
            else:
                with eqn.ctx.manager:
                    out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
                outvals = list(out) if eqn.primitive.multiple_results else [out]
            for var, val in zip(eqn.outvars, outvals):
                env[var] = val
        return [read(v) for v in jaxpr.outvars]

    def descend(self, eqn: jax_core.JaxprEqn, invals: list[Any]) -> list[Any]:
        """Runs a higher-order primitive whose body holds a pallas_call."""
        name = eqn.primitive.name
        params = eqn.params
        if name == "scan":
            return self._scan(params, invals)
        subs = [v for v in params.values() if isinstance(v, (jax_core.ClosedJaxpr, jax_core.Jaxpr))]
        if name in _CALL_PRIMITIVES and len(subs) == 1:
            sub = subs[0]
            body, consts = (sub.jaxpr, sub.consts) if isinstance(sub, jax_core.ClosedJaxpr) else (sub, ())
            if len(body.invars) == len(invals) and len(body.outvars) == len(eqn.outvars):
                return self.run(body, consts, invals)
        raise NotImplementedError(f"model_pallas_traffic cannot model a pallas_call inside `{name}`")

    def _scan(self, params, invals):
        body = params["jaxpr"]
        num_consts, num_carry, length = params["num_consts"], params["num_carry"], params["length"]
        consts = invals[:num_consts]
        carry = invals[num_consts : num_consts + num_carry]
        xs = invals[num_consts + num_carry :]
        ys_steps = []
        order = range(length - 1, -1, -1) if params["reverse"] else range(length)
        for i in order:
            x_i = [_UNKNOWN if _is_unknown(x) else x[i] for x in xs]
            out = self.run(body.jaxpr, body.consts, [*consts, *carry, *x_i])
            carry = out[:num_carry]
            ys_steps.append(out[num_carry:])
        if params["reverse"]:
            ys_steps.reverse()
        ys = []
        for j in range(len(body.jaxpr.outvars) - num_carry):
            column = [step[j] for step in ys_steps]
            ys.append(_UNKNOWN if not column or any(_is_unknown(c) for c in column) else jax.numpy.stack(column))
        return [*carry, *ys]


def _call_name(eqn: jax_core.JaxprEqn) -> str:
    name = eqn.params.get("name")
    if name:
        return str(name)
    debug_info = getattr(eqn.params["jaxpr"], "debug_info", None)
    return getattr(debug_info, "func_name", None) or "pallas_call"


def _memory_space_name(block_mapping: pallas_core.BlockMapping) -> str:
    space = block_mapping.block_aval.memory_space
    name = "default" if space is None else str(space).lower()
    return "vmem" if name == "default" else name


def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def _replay_pallas_call(eqn, small_operands: list[Any], active_steps_fn) -> PallasCallTraffic:
    """Replays one pallas_call given its dynamic grid sizes and scalar-prefetch operands."""
    params = eqn.params
    gm: pallas_core.GridMapping = params["grid_mapping"]
    name = _call_name(eqn)
    dynamic_values = small_operands[: gm.num_dynamic_grid_bounds]
    prefetch = small_operands[gm.num_dynamic_grid_bounds :]

    grid = []
    dynamic_sizes = iter(dynamic_values)
    for axis, size in enumerate(gm.grid):
        if pallas_core.is_dynamic_dim(size):
            value = next(dynamic_sizes)
            if _is_unknown(value):
                raise ValueError(
                    f"pallas_call {name}: grid axis {axis} has a dynamic size computed from an argument "
                    "given as ShapeDtypeStruct (or from a kernel output); pass that argument concretely"
                )
            grid.append(int(value.reshape(-1)[0]))
        else:
            grid.append(int(size))
    grid = tuple(grid)
    steps = math.prod(grid)
    # Row-major, last axis fastest: Mosaic's iteration order. A grid-less call runs once.
    grid_indices = np.indices(grid, dtype=np.int32).reshape(len(grid), steps).T

    operands = [_prefetch_traffic(position, aval) for position, aval in enumerate(gm.index_map_avals[len(grid) :])]
    notes: list[str] = []
    kept = []
    for number, block_mapping in enumerate(gm.block_mappings):
        space = _memory_space_name(block_mapping)
        if space not in _SEMAPHORE_MEMORY_SPACES:
            kept.append((block_mapping, "input" if number < gm.num_inputs else "output", space))
    windowed = [bm for bm, _, space in kept if space not in _UNPIPELINED_MEMORY_SPACES]
    indices = dict(zip(map(id, windowed), _block_indices(windowed, grid_indices, prefetch, name)))
    for block_mapping, role, space in kept:
        if space in _UNPIPELINED_MEMORY_SPACES:
            notes.append(f"{block_mapping.origin} is in memory space {space}: the kernel's own DMAs of it are not counted")
            operands.append(_unpipelined_traffic(block_mapping, role, space))
        else:
            operands.append(_operand_traffic(block_mapping, role, space, indices[id(block_mapping)]))

    compiler_params = params.get("compiler_params")
    dimension_semantics = getattr(compiler_params, "dimension_semantics", None)
    if dimension_semantics is not None:
        dimension_semantics = tuple(str(s).lower().split(".")[-1] for s in dimension_semantics)

    active = np.ones(steps, dtype=bool)
    if active_steps_fn is not None:
        mask = active_steps_fn(name, grid_indices, tuple(prefetch))
        if mask is not None:
            active = np.asarray(mask, dtype=bool)
            if active.shape != (steps,):
                raise ValueError(f"active_steps must return a bool array of shape ({steps},), got {active.shape}")
    megacore_core = _megacore_split(grid, grid_indices, dimension_semantics)
    step_dots, dots_exact = _grid_dots(params["jaxpr"], gm, grid, grid_indices, prefetch)
    work_per_step = {key: counts * active for key, counts in step_dots.items() if np.any(counts * active)}
    dots_per_step = {key: counts for key, counts in work_per_step.items() if _is_dot_key(key)}
    dots = tuple(DotShape(*key, count=int(counts.sum())) for key, counts in dots_per_step.items())
    no_work = np.zeros(steps, np.int64)

    return PallasCallTraffic(
        name=name,
        grid=grid,
        dimension_semantics=dimension_semantics,
        steps=steps,
        active_steps=int(active.sum()),
        operands=tuple(operands),
        dots=dots,
        dots_exact=dots_exact,
        scratch_vmem_bytes=sum(_scratch_vmem_bytes(aval) for aval in gm.scratch_avals),
        vmem_limit_bytes=getattr(compiler_params, "vmem_limit_bytes", None),
        cost_estimate=params.get("cost_estimate"),
        notes=tuple(notes),
        dots_per_step=dots_per_step,
        vector_per_step=work_per_step.get(VECTOR_KEY, no_work),
        transcendental_per_step=work_per_step.get(TRANSCENDENTAL_KEY, no_work),
        megacore_core=megacore_core,
    )


def _megacore_split(grid, grid_indices: np.ndarray, dimension_semantics) -> np.ndarray | None:
    """Each step's core (0 or 1) when a parallel grid dimension of more than one index lets a megacore split it.

    Assumption (jax's Pallas TPU docs describe megacore sharding along "parallel" dimensions but not the
    split itself): the first such dimension is cut into two contiguous halves, the first half on core 0.
    """
    for axis, semantics in enumerate(dimension_semantics or ()):
        if semantics in ("parallel", "core_parallel") and grid[axis] > 1:
            return (grid_indices[:, axis] >= (grid[axis] + 1) // 2).astype(np.int8)
    return None


def _prefetch_traffic(position: int, aval) -> OperandTraffic:
    """A scalar-prefetch operand: copied whole into SMEM once, before the first step."""
    shape = tuple(int(d) for d in aval.shape)
    return OperandTraffic(
        origin=f"scalar_prefetch[{position}]",
        role="scalar_prefetch",
        memory_space="smem",
        array_shape=shape,
        dtype=_dtype_name(aval.dtype),
        block_shape=shape,
        buffer_count=1,
        transfers=1,
        distinct_blocks=1,
        hbm_bytes=math.prod(shape) * np.dtype(aval.dtype).itemsize,
        buffer_bytes=padded_vmem_bytes(shape, aval.dtype),
        revisits=0,
        pipelined=True,
    )


def _unpipelined_traffic(block_mapping, role: str, space: str) -> OperandTraffic:
    return OperandTraffic(
        origin=block_mapping.origin,
        role=role,
        memory_space=space,
        array_shape=tuple(int(d) for d in block_mapping.array_aval.shape),
        dtype=_dtype_name(block_mapping.array_aval.dtype),
        block_shape=tuple(pallas_core.get_block_size(d) for d in block_mapping.block_shape),
        buffer_count=0,
        transfers=0,
        distinct_blocks=0,
        hbm_bytes=0,
        buffer_bytes=0,
        revisits=0,
        pipelined=False,
    )


def _scratch_vmem_bytes(aval) -> int:
    inner = getattr(aval, "inner_aval", aval)
    space = str(getattr(aval, "memory_space", "vmem")).lower()
    if space not in ("vmem", "default") or jax.dtypes.issubdtype(inner.dtype, jax.dtypes.extended):
        return 0
    return padded_vmem_bytes(tuple(inner.shape), inner.dtype)


def _block_indices(block_mappings, grid_indices: np.ndarray, prefetch: list[Any], call_name: str) -> list[np.ndarray]:
    """The block index tuple of each block mapping at every grid step, each (steps, rank).

    All index maps are vmapped over the steps and evaluated in one jitted call.
    A scalar-prefetch operand whose value is unknown may only be passed to
    index maps that do not read it.
    """
    steps, num_grid = grid_indices.shape
    if not block_mappings:
        return []
    if steps == 0:
        return [np.zeros((0, len(bm.block_shape)), np.int64) for bm in block_mappings]
    prefetch_args = []
    for position, value in enumerate(prefetch):
        if _is_unknown(value):
            for block_mapping in block_mappings:
                index_map = block_mapping.index_map_jaxpr.jaxpr
                if index_map.invars[num_grid + position] in _used_vars(index_map):
                    raise ValueError(
                        f"pallas_call {call_name}: the index map of {block_mapping.origin} reads scalar-prefetch "
                        f"operand {position}, which is computed from an argument given as ShapeDtypeStruct "
                        "(or from a kernel output); pass that argument concretely"
                    )
            ref_aval = block_mappings[0].index_map_jaxpr.in_avals[num_grid + position]
            value = np.zeros(ref_aval.inner_aval.shape, ref_aval.inner_aval.dtype)
        prefetch_args.append(value)

    index_maps = [
        (jax_core.jaxpr_as_fun(state_discharge.discharge_state(bm.index_map_jaxpr)), len(bm.block_shape))
        for bm in block_mappings
    ]

    def all_block_indices(step_index, grid_columns, prefetch_values):
        del step_index  # vmap needs one mapped argument, also for a grid-less call
        return [tuple(index_map(*grid_columns, *prefetch_values)[:rank]) for index_map, rank in index_maps]

    columns = [grid_indices[:, axis] for axis in range(num_grid)]
    batched = jax.vmap(all_block_indices, in_axes=(0, 0, None))
    with jax.default_device(_host_device()):
        results = _run_on_host(batched, np.arange(steps, dtype=np.int32), columns, prefetch_args)
    return [np.stack([np.asarray(c, dtype=np.int64) for c in result], axis=1).reshape(steps, -1) for result in results]


def _used_vars(jaxpr: jax_core.Jaxpr) -> set:
    used = set()
    for eqn in jaxpr.eqns:
        used.update(v for v in eqn.invars if isinstance(v, jax_core.Var))
    used.update(v for v in jaxpr.outvars if isinstance(v, jax_core.Var))
    return used


def _operand_traffic(block_mapping, role, space, block_indices) -> OperandTraffic:
    array_shape = tuple(int(d) for d in block_mapping.array_aval.shape)
    dtype = block_mapping.array_aval.dtype
    steps = block_indices.shape[0]
    itemsize = np.dtype(dtype).itemsize
    starts, sizes = [], []
    for axis, block_dim in enumerate(block_mapping.block_shape):
        column = block_indices[:, axis]
        match block_dim:
            case pallas_core.Blocked(block_size=size):
                starts.append(column * size)
                sizes.append(size)
            case pallas_core.Squeezed():
                starts.append(column)
                sizes.append(1)
            case pallas_core.Element(block_size=size, padding=(pad_low, _)):
                starts.append(column - pad_low)
                sizes.append(size)
            case _:
                raise NotImplementedError(
                    f"{block_mapping.origin}: block dimension {block_dim} is not supported by the traffic model"
                )
    clipped = np.ones(steps, dtype=np.int64)
    for start, size, dim in zip(starts, sizes, array_shape):
        clipped *= np.clip(np.minimum(start + size, dim) - np.maximum(start, 0), 0, None)
    step_bytes = clipped * itemsize

    changed_from_previous = np.ones(steps, dtype=bool)
    if steps > 1:
        changed_from_previous[1:] = np.any(block_indices[1:] != block_indices[:-1], axis=1)
    run_starts = np.flatnonzero(changed_from_previous)
    run_blocks = block_indices[run_starts]
    distinct, first_run = np.unique(run_blocks, axis=0, return_index=True)
    revisits = len(run_starts) - len(distinct)

    buffer_count = 2
    pipeline_mode = block_mapping.pipeline_mode
    if pipeline_mode is not None:
        buffer_count = pipeline_mode.buffer_count
    elif space == "vmem" and block_mapping.has_trivial_window():
        buffer_count = 1  # Mosaic single-buffers blocks that never move.

    fetched = np.zeros(steps, np.int64)
    written = np.zeros(steps, np.int64)
    if role == "input":
        transfer_steps = run_starts
        fetched[transfer_steps] = step_bytes[transfer_steps]
        revisits = 0
    else:
        transfer_steps = np.append(run_starts[1:] - 1, steps - 1) if steps else run_starts
        written[transfer_steps] = step_bytes[transfer_steps]
        revisit_any = pipeline_mode is not None and pipeline_mode.revisit == pallas_core.RevisitMode.ANY
        if revisit_any and revisits:
            is_first_visit = np.zeros(len(run_starts), dtype=bool)
            is_first_visit[first_run] = True
            read_back = run_starts[~is_first_visit]
            fetched[read_back] = step_bytes[read_back]
    hbm_bytes = int(fetched.sum() + written.sum())

    ref_shape = tuple(
        pallas_core.get_block_size(d)
        for d in block_mapping.block_shape
        if not isinstance(d, pallas_core.Squeezed)
    )
    return OperandTraffic(
        origin=block_mapping.origin,
        role=role,
        memory_space=space,
        array_shape=array_shape,
        dtype=_dtype_name(dtype),
        block_shape=tuple(pallas_core.get_block_size(d) for d in block_mapping.block_shape),
        buffer_count=buffer_count,
        transfers=int(len(transfer_steps)),
        distinct_blocks=int(len(distinct)),
        hbm_bytes=hbm_bytes,
        buffer_bytes=buffer_count * padded_vmem_bytes(ref_shape, dtype),
        revisits=int(revisits),
        pipelined=True,
        fetched_per_step=fetched,
        written_per_step=written,
    )


def _grid_dots(kernel, gm, grid, grid_indices: np.ndarray, prefetch: list[Any]) -> tuple[dict[tuple, np.ndarray], bool]:
    """How many times each matmul shape runs at every grid step, and whether that count is exact.

    A top-level `cond` (e.g. `pl.when`) whose predicate depends only on
    program ids and scalar-prefetch values is evaluated at every step, so
    skipped compute costs nothing. Other conds count their most expensive
    branch, a `while` body counts once; the count is then not exact.
    """
    steps = grid_indices.shape[0]
    per_step: dict[tuple, np.ndarray] = {}
    exact = True

    def add(found: dict[tuple, int], times: np.ndarray):
        for key, count in found.items():
            per_step[key] = per_step.get(key, np.zeros(steps, np.int64)) + count * times

    every_step = np.ones(steps, np.int64)
    products = _matmul_products(kernel)
    for eqn in kernel.eqns:
        if eqn.primitive.name == "cond" and _cond_has_dots(eqn):
            branch = _branch_at_each_step(kernel, eqn, gm, grid, grid_indices, prefetch)
            if branch is not None:
                for number, body in enumerate(eqn.params["branches"]):
                    found: dict[tuple, int] = {}
                    exact &= _collect_dots(body.jaxpr, 1, found)
                    add(found, (branch == number).astype(np.int64))
                continue
        found = {}
        exact &= _collect_dots_of_eqn(eqn, 1, found, products)
        add(found, every_step)
    return per_step, exact


def _cond_has_dots(eqn) -> bool:
    """Whether a cond holds work the model counts (matmuls or vector work) in some branch."""
    for branch in eqn.params["branches"]:
        found: dict[tuple, int] = {}
        _collect_dots(branch.jaxpr, 1, found)
        if found:
            return True
    return False


def _branch_at_each_step(kernel, cond_eqn, gm, grid, grid_indices, prefetch) -> np.ndarray | None:
    """The branch `cond_eqn` takes at every grid step, if its index depends only on program ids and scalar prefetch."""
    steps = grid_indices.shape[0]
    index = cond_eqn.invars[0]
    num_branches = len(cond_eqn.params["branches"])
    if isinstance(index, jax_core.Literal):
        return np.full(steps, int(np.clip(int(index.val), 0, num_branches - 1)))
    prefetch_refs = list(kernel.invars[: gm.num_index_operands])
    if any(_is_unknown(value) for value in prefetch):
        return None
    if any(
        eqn.primitive.name in ("swap", "addupdate") and eqn.invars[0] in prefetch_refs for eqn in kernel.eqns
    ):
        return None  # the kernel rewrites its scalar prefetch: its values are not the ones passed in
    producers = {id(var): eqn for eqn in kernel.eqns for var in eqn.outvars}
    slice_ids: set[int] = set()
    grid_vars: list[tuple[jax_core.Var, str, int]] = []
    pending = [index]
    while pending:
        var = pending.pop()
        if isinstance(var, jax_core.Literal) or any(var is ref for ref in prefetch_refs):
            continue
        eqn = producers.get(id(var))
        if eqn is None:
            return None  # a kernel input other than scalar prefetch
        if eqn.primitive.name in ("program_id", "num_programs"):
            if all(v is not var for v, _, _ in grid_vars):
                grid_vars.append((var, eqn.primitive.name, eqn.params["axis"]))
            continue
        if list(jax_core.jaxprs_in_params(eqn.params)):
            return None
        if eqn.effects and not (eqn.primitive.name == "get" and any(eqn.invars[0] is ref for ref in prefetch_refs)):
            return None
        if id(eqn) not in slice_ids:
            slice_ids.add(id(eqn))
            pending.extend(eqn.invars)
    eqns = [eqn for eqn in kernel.eqns if id(eqn) in slice_ids]
    predicate = jax_core.Jaxpr(
        constvars=[],
        invars=[v for v, _, _ in grid_vars] + prefetch_refs,
        outvars=[index],
        eqns=eqns,
        effects=jax_core.join_effects(*(eqn.effects for eqn in eqns)),
        debug_info=jex_core.DebugInfo("tpu_kernels.perf", "branch index of a kernel cond", None, None),
    )
    pure = jax_core.jaxpr_as_fun(state_discharge.discharge_state(jax_core.ClosedJaxpr(predicate, [])))
    grid_args = [
        grid_indices[:, axis] if kind == "program_id" else np.full(steps, grid[axis], np.int32)
        for _, kind, axis in grid_vars
    ]

    def branch_index(step, grid_columns, prefetch_values):
        del step  # vmap needs one mapped argument, also when no program id is read
        return pure(*grid_columns, *prefetch_values)[0]

    batched = jax.vmap(branch_index, in_axes=(0, 0, None))
    with jax.default_device(_host_device()):
        taken = _run_on_host(batched, np.arange(steps, dtype=np.int32), grid_args, list(prefetch))
    return np.clip(np.asarray(taken, dtype=np.int64), 0, num_branches - 1)


def _dot_key(eqn) -> tuple:
    lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    batch = math.prod(lhs.shape[d] for d in lhs_batch)
    k = math.prod(lhs.shape[d] for d in lhs_contract)
    m = math.prod(s for d, s in enumerate(lhs.shape) if d not in (*lhs_contract, *lhs_batch))
    n = math.prod(s for d, s in enumerate(rhs.shape) if d not in (*rhs_contract, *rhs_batch))
    precision = eqn.params.get("precision")
    if isinstance(precision, tuple):
        precision = precision[0]
    precision_name = "DEFAULT" if precision is None else getattr(precision, "name", str(precision))
    return (batch, m, k, n, _dtype_name(lhs.dtype), _dtype_name(rhs.dtype), precision_name)


def _flops_of(collected: dict[tuple, int]) -> int:
    return sum(2 * key[0] * key[1] * key[2] * key[3] * count for key, count in collected.items() if _is_dot_key(key))


# Vector-unit work of a kernel body, counted in (sublane x 128-lane) register elements: an array of shape
# [..., r, c] occupies prod(...) * round_up(r, 8) * round_up(c, 128) of them, however many it uses.
VECTOR_KEY = ("vector",)
TRANSCENDENTAL_KEY = ("transcendental",)
# Elementwise and reducing primitives the VPU runs (one op per register element)...
_VECTOR_PRIMITIVES = frozenset({
    "add", "sub", "mul", "neg", "max", "min", "abs", "sign", "floor", "ceil", "round", "select_n", "clamp",
    "convert_element_type", "and", "or", "not", "xor", "eq", "ne", "lt", "le", "gt", "ge", "integer_pow",
    "square", "shift_left", "shift_right_logical", "shift_right_arithmetic", "reduce_max", "reduce_min",
    "reduce_sum", "reduce_and", "reduce_or", "argmax", "argmin", "cumsum", "cummax",
})
# ...and those that go through the transcendental unit (and the VPU for their operands' handling).
_TRANSCENDENTAL_PRIMITIVES = frozenset({
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "erf", "erf_inv", "sin", "cos", "tan",
    "sqrt", "rsqrt", "cbrt", "div", "pow", "atan2",
})


def _is_dot_key(key: tuple) -> bool:
    return len(key) > 1


def _register_elements(aval) -> int:
    shape = tuple(int(d) for d in getattr(aval, "shape", ()))
    if not shape:
        return 0
    if len(shape) == 1:
        return round_up(shape[0], 128)
    *leading, rows, cols = shape
    return math.prod(leading) * round_up(rows, 8) * round_up(cols, 128)


def _vector_work(eqn) -> tuple[tuple, int] | None:
    """(key, register elements) of the vector work one run of `eqn` does, if it is vector work."""
    name = eqn.primitive.name
    if name not in _VECTOR_PRIMITIVES and name not in _TRANSCENDENTAL_PRIMITIVES:
        return None
    reducing = name.startswith(("reduce_", "arg", "cum"))
    elements = _register_elements(eqn.invars[0].aval if reducing else eqn.outvars[0].aval)
    if not elements:
        return None
    return (TRANSCENDENTAL_KEY if name in _TRANSCENDENTAL_PRIMITIVES else VECTOR_KEY), elements


def _collect_dots(jaxpr: jax_core.Jaxpr, multiplicity: int, collected: dict[tuple, int]) -> bool:
    exact = True
    products = _matmul_products(jaxpr)
    for eqn in jaxpr.eqns:
        exact &= _collect_dots_of_eqn(eqn, multiplicity, collected, products)
    return exact


def _matmul_products(jaxpr: jax_core.Jaxpr) -> set:
    """Variables holding a matmul's result: adding one to an accumulator is the MXU's accumulation, not VPU work."""
    return {var for eqn in jaxpr.eqns if eqn.primitive.name == "dot_general" for var in eqn.outvars}


def _collect_dots_of_eqn(eqn, multiplicity: int, collected: dict[tuple, int], products: set = frozenset()) -> bool:
    """Adds the matmuls (and vector work) one run of `eqn` performs; False if their number is only an upper bound."""
    name = eqn.primitive.name
    if name == "dot_general":
        key = _dot_key(eqn)
        collected[key] = collected.get(key, 0) + multiplicity
        return True
    accumulating = name == "add" and any(var in products for var in eqn.invars if isinstance(var, jax_core.Var))
    work = None if accumulating else _vector_work(eqn)
    if work is not None:
        key, elements = work
        collected[key] = collected.get(key, 0) + elements * multiplicity
        return True
    if name == "cond":
        exact = True
        branch_dots = []
        for branch in eqn.params["branches"]:
            found: dict[tuple, int] = {}
            exact &= _collect_dots(branch.jaxpr, multiplicity, found)
            branch_dots.append(found)
        costs = [(_flops_of(found), sum(c for key, c in found.items() if not _is_dot_key(key))) for found in branch_dots]
        for key, count in branch_dots[max(range(len(costs)), key=costs.__getitem__)].items():
            collected[key] = collected.get(key, 0) + count
        return exact and len({flops for flops, _ in costs}) == 1
    if name == "scan":
        return _collect_dots(eqn.params["jaxpr"].jaxpr, multiplicity * eqn.params["length"], collected)
    if name == "while":
        found = {}
        _collect_dots(eqn.params["body_jaxpr"].jaxpr, multiplicity, found)
        for key, count in found.items():
            collected[key] = collected.get(key, 0) + count
        return not any(_is_dot_key(key) for key in found)
    exact = True
    for sub in jax_core.jaxprs_in_params(eqn.params):
        exact &= _collect_dots(sub, multiplicity, collected)
    return exact
