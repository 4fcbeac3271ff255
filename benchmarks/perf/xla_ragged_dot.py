"""XLA's own TPU ragged dot (`lax.ragged_dot_general`) as the performance model prices it.

XLA compiles a ragged dot into one fused convolution over the groups
(`convolution_algorithm_config.is_ragged_dot`), masked per group and summed,
whose backend config gives the loop XLA emits for it (`window_config`):
`iteration_bounds` = (output column windows, groups, output row windows, 1,
contracting chunks), an output window of (8 x a) rows x (128 x b) columns, a
kernel-operand window whose size gives the contracting chunk, and an iteration
skipper (`ITERATION_SKIPPER_MODE_GROUP_STARTS`) that skips the iterations
whose window holds no row of the group. Its cost analysis counts the
convolution densely over every group (G times the real work), which is why
pricing it by XLA's FLOPs was 4x to 100x too slow.

This module replays that loop with the group sizes' values, in XLA's order
(column windows, then groups, then row windows, then contracting chunks),
visiting only the iterations the skipper keeps, and prices each like a
pipeline step (`traffic.pipeline_seconds`):

- forward and lhs-gradient modes (the ragged dimension is the output's rows):
  an iteration reads its lhs window (rows x chunk) and, when the group, chunk
  or column window changed, its weights window (chunk x columns), and runs
  that matmul on the MXU;
- weight-gradient mode (the ragged dimension is contracted): an iteration
  reads the lhs and rhs chunks of the group's rows (when they changed);
- the output window accumulates in HBM, in f32: read and written at every
  visit of a group (forward and lhs-gradient modes: once over its chunks), at
  every kept iteration in weight-gradient mode. Not documented by XLA; it is
  the reading that explains the measured times whose output windows are
  large next to their matmuls (v5e forward, K = 256 and 512: 31.5 and
  19.3 ms where matmuls and inputs alone take under 9 ms; weight gradients,
  2.5x to 3x the time of their inputs and matmuls), while lhs gradients split
  into 6 contracting chunks would take 2.5x their measured time if every
  chunk paid it. On v6e (`RESIDENT_WEIGHT_GRADIENT_ACCUMULATOR`) a weight
  gradient's output window is written once per visit and never read: each
  group's window is its own, so it starts at zero and stays on chip across
  the group's contracting chunks. tokamax's v6e timings (openxla/tokamax
  d52c079) say so: at one read and write per kept iteration its 25 weight
  gradients were priced 2.4x to 6.1x slow (median 3.7x), written once they
  are priced at a median 1.03x (90th percentile of |ratio - 1| 20 %, at
  v6e's fitted constants), within the error of v6e's forward calls (76 %). v5e's and TPU7x's timings say
  the opposite (written once, their weight gradients price at a median 0.44x
  and 0.58x), though TPU7x compiles the same calls to the same loop windows
  and ran them 1.9x to 2x slower than v6e: the difference is in code the HLO
  does not show, so the rule is per generation, from its own timings;
- each kept iteration costs `step_overhead_s` besides its copies and matmul
  (fitted: `benchmarks.perf.calibration`); skipped iterations cost nothing.

Where XLA leaves `iteration_bounds` empty (some lhs-gradient shapes; its own
cost model gives no estimate for them either) the model refuses: taking the
loop as its others are (one contracting chunk) was 1.2x to 3.5x too slow on
the measured ones.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np

from .chip import FITTED_RATES, ModelRates
from .program_replay import RaggedDotCall
from .traffic import DotShape, pipeline_seconds
from tpu_kernels.runtime.hardware import TpuGeneration

# The f32 accumulator of the groups' masked sum (module docstring).
ACCUMULATOR_BYTES = 4
# Generations whose weight-gradient ragged dots keep the output window on chip across a group's contracting chunks
# (module docstring): v6e, by its own timings; v5e's and TPU7x's timings say the accumulator goes through HBM at every
# kept iteration. v5p's XLA ragged dots are not modelled (they compile to Mosaic kernels).
RESIDENT_WEIGHT_GRADIENT_ACCUMULATOR = frozenset({"v6e"})
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int32": 4}
_WINDOW_CONFIG = re.compile(r'"window_config":(\{[^{}]*\})')


@dataclasses.dataclass(frozen=True)
class Windows:
    """The loop XLA emits for one ragged dot (module docstring), in XLA's units."""

    iteration_bounds: tuple[int, ...]
    kernel_window: tuple[int, ...]
    output_window: tuple[int, ...]


def is_ragged_dot_fusion(backend_config: str) -> bool:
    return '"is_ragged_dot":true' in backend_config


def parse_windows(backend_config: str) -> Windows | None:
    """The windows of the (non-mask) window config in a fusion's backend config text, if any."""
    for match in _WINDOW_CONFIG.finditer(backend_config):
        config = json.loads(match.group(1))
        if config.get("is_mask"):
            continue
        kernel = tuple(int(v) for v in config.get("kernel_window_bounds", []))
        output = tuple(int(v) for v in config.get("output_window_bounds", []))
        if len(kernel) == 3 and len(output) == 3:
            return Windows(tuple(int(v) for v in config.get("iteration_bounds", [])), kernel, output)
    return None


@dataclasses.dataclass(frozen=True)
class Shape:
    """A ragged dot in the model's terms: mode, sizes, dtypes."""

    mode: str  # "forward" (lhs [M,K] x rhs [G,K,N]), "lhs_gradient" (rhs [G,N,K]), "weight_gradient" (rhs [M,N])
    m: int
    k: int
    n: int
    groups: int
    lhs_bytes: int  # itemsize
    rhs_bytes: int
    out_bytes: int
    lhs_dtype: str
    rhs_dtype: str


def shape_of(call: RaggedDotCall) -> Shape:
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = call.dimension_numbers.dot_dimension_numbers
    if lhs_batch or rhs_batch or len(call.lhs_shape) != 2:
        raise ValueError(f"ragged dot with batch dimensions or lhs rank {len(call.lhs_shape)} is not modelled")
    lhs_ragged = tuple(call.dimension_numbers.lhs_ragged_dimensions)
    rhs_group = tuple(call.dimension_numbers.rhs_group_dimensions)
    m, k = call.lhs_shape
    sizes = dict(lhs_bytes=_ITEMSIZE[call.lhs_dtype], rhs_bytes=_ITEMSIZE[call.rhs_dtype],
                 out_bytes=_ITEMSIZE[call.out_dtype], lhs_dtype=call.lhs_dtype, rhs_dtype=call.rhs_dtype)
    if lhs_ragged != (0,):
        raise ValueError(f"ragged dot with lhs ragged dimensions {lhs_ragged} is not modelled")
    if tuple(lhs_contract) == (1,) and rhs_group == (0,) and len(call.rhs_shape) == 3:
        groups = call.rhs_shape[0]
        if tuple(rhs_contract) == (1,):
            return Shape("forward", m, k, call.rhs_shape[2], groups, **sizes)
        if tuple(rhs_contract) == (2,):
            return Shape("lhs_gradient", m, k, call.rhs_shape[1], groups, **sizes)
    if tuple(lhs_contract) == (0,) and tuple(rhs_contract) == (0,) and not rhs_group and len(call.rhs_shape) == 2:
        groups = len(call.group_sizes) if call.group_sizes is not None else None
        if groups is None:
            raise ValueError("a weight-gradient ragged dot needs its group sizes to be modelled")
        return Shape("weight_gradient", m, k, call.rhs_shape[1], groups, **sizes)
    raise ValueError(f"ragged dot dimension numbers {call.dimension_numbers} are not modelled")


def group_bounds(shape: Shape, group_sizes: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, str | None]:
    """Each group's [start, end) rows; equal groups (and a note saying so) when the sizes are not known."""
    note = None
    if group_sizes is None:
        sizes = np.full(shape.groups, shape.m // shape.groups, np.int64)
        sizes[: shape.m % shape.groups] += 1
        note = "group sizes unknown: modelled as equal groups"
    else:
        sizes = np.minimum(np.asarray(group_sizes, np.int64), shape.m)
    ends = np.minimum(np.cumsum(sizes), shape.m)
    starts = np.concatenate([[0], ends[:-1]])
    return starts, ends, note


@dataclasses.dataclass(frozen=True)
class Modelled:
    seconds: float
    steps: int
    iterations: int
    hbm_bytes: int
    mxu_seconds: float
    note: str | None


def model(
    call: RaggedDotCall,
    windows: Windows,
    generation: TpuGeneration,
    *,
    step_overhead_s: float,
    hbm_fraction: float | None = None,
    rates: ModelRates = FITTED_RATES,
) -> Modelled:
    """Modelled time of one XLA ragged dot (module docstring); copies at `hbm_fraction` of the peak HBM
    bandwidth (None: the generation's share in `rates`)."""
    hbm_fraction = rates.hbm_fraction(generation) if hbm_fraction is None else hbm_fraction
    sizes = None if call.group_sizes is None else tuple(int(v) for v in call.group_sizes)
    key = (call.lhs_shape, call.rhs_shape, call.lhs_dtype, call.rhs_dtype, call.out_dtype,
           repr(call.dimension_numbers), sizes)
    cache_key = (key, windows, generation.name, hbm_fraction, rates)
    free = _WITHOUT_STEP_COST.get(cache_key)
    if free is None:
        free = _WITHOUT_STEP_COST[cache_key] = _model(call, windows, generation, hbm_fraction=hbm_fraction,
                                                      rates=rates)
    # The pipeline's time is linear in the fixed cost per kept iteration.
    return dataclasses.replace(free, seconds=free.seconds + free.steps * step_overhead_s)


# Models of calls already seen, at no fixed cost per iteration (pricing repeats them at other costs).
_WITHOUT_STEP_COST: dict[tuple, Modelled] = {}


def _steps(shape, starts, ends, *, rows, chunk, col_windows, row_windows, chunks) -> list[tuple[int, int, int, int]]:
    """The loop's steps that touch a group's rows: (column window, group, row window, chunk)."""
    steps = []
    for col in range(col_windows):
        for group in range(shape.groups):
            start, end = int(starts[group]), int(ends[group])
            if end <= start:
                continue
            if shape.mode == "weight_gradient":
                first, last = start // chunk, (end - 1) // chunk
                steps.extend((col, group, row, piece) for row in range(row_windows) for piece in range(first, last + 1))
            else:
                first, last = start // rows, (end - 1) // rows
                steps.extend((col, group, row, piece) for row in range(first, last + 1) for piece in range(chunks))
    return steps


def _model(
    call: RaggedDotCall, windows: Windows, generation: TpuGeneration, *, hbm_fraction: float, rates: ModelRates
) -> Modelled:
    shape = shape_of(call)
    rows = 8 * windows.output_window[1]
    cols = 128 * windows.output_window[2]
    if shape.mode == "weight_gradient":
        row_extent, contract_extent, chunk = shape.k, shape.m, 8 * windows.kernel_window[1]
    elif shape.mode == "forward":
        row_extent, contract_extent, chunk = shape.m, shape.k, 8 * windows.kernel_window[1]
    else:
        row_extent, contract_extent, chunk = shape.m, shape.k, 128 * windows.kernel_window[2]
    bounds = windows.iteration_bounds
    if len(bounds) != 5:
        raise ValueError(
            f"XLA left the loop bounds of this ragged dot ({shape.mode}, lhs {call.lhs_shape}, rhs {call.rhs_shape}) "
            "empty, and its own cost model gives it no estimate: its loop cannot be read from the compiled "
            "program, so it is not modelled"
        )
    chunk = math.ceil(contract_extent / bounds[4])
    col_windows = math.ceil(shape.n / cols)
    row_windows = math.ceil(row_extent / rows)
    chunks = math.ceil(contract_extent / chunk)
    iterations = col_windows * shape.groups * row_windows * chunks
    starts, ends, note = group_bounds(shape, call.group_sizes)

    steps = _steps(shape, starts, ends, rows=rows, chunk=chunk, col_windows=col_windows, row_windows=row_windows,
                   chunks=chunks)
    if not steps:
        return Modelled(0.0, 0, iterations, 0, 0.0, note)
    index = np.asarray(steps, np.int64)
    col, group, row, piece = index.T
    width = np.minimum(cols, shape.n - col * cols)
    height = np.minimum(rows, row_extent - row * rows)
    depth = np.minimum(chunk, contract_extent - piece * chunk)

    def changed(*keys):
        stacked = np.stack(keys, axis=1)
        moved = np.ones(len(stacked), bool)
        moved[1:] = np.any(stacked[1:] != stacked[:-1], axis=1)
        return moved

    if shape.mode == "weight_gradient":
        lhs = np.where(changed(row, piece), depth * height * shape.lhs_bytes, 0)
        rhs = np.where(changed(col, piece), depth * width * shape.rhs_bytes, 0)
    else:
        lhs = np.where(changed(row, piece), height * depth * shape.lhs_bytes, 0)
        rhs = np.where(changed(group, piece, col), depth * width * shape.rhs_bytes, 0)
    accumulator = height * width * ACCUMULATOR_BYTES
    if shape.mode == "weight_gradient" and generation.name in RESIDENT_WEIGHT_GRADIENT_ACCUMULATOR:
        arriving = np.zeros(len(steps), bool)  # the window starts at zero on chip
        leaving = np.append(changed(col, group, row)[1:], True)
    elif shape.mode == "weight_gradient":
        arriving = leaving = np.ones(len(steps), bool)
    else:
        arriving = changed(col, group, row)
        leaving = np.append(arriving[1:], True)
    fetched = lhs + rhs + np.where(arriving, accumulator, 0)
    written = np.where(leaving, accumulator, 0)
    m, k, n = height, depth, width
    compute = np.zeros(len(steps))
    for key in set(zip(m.tolist(), k.tolist(), n.tolist())):
        dot = DotShape(1, key[0], key[1], key[2], shape.lhs_dtype, shape.rhs_dtype, "DEFAULT", 1)
        seconds = dot.mxu_flops(generation, rates) / dot.peak_flops_per_s(generation)
        compute[(m == key[0]) & (k == key[1]) & (n == key[2])] = seconds
    bandwidth = generation.device_hbm_bytes_per_s * hbm_fraction
    seconds = pipeline_seconds(fetched.astype(float), written.astype(float), compute / generation.cores_per_device,
                                    prologue_bytes=0.0, bandwidth=bandwidth, step_overhead_s=0.0)
    return Modelled(seconds, len(steps), iterations, int(fetched.sum() + written.sum()), float(compute.sum()), note)
