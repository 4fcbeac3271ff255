"""Row blocks of the kernels (`kernel.py`) per shape, op and TPU generation.

Every op streams [rows, hidden] arrays in row blocks `(block_rows, hidden)`;
what each op streams, and the VMEM it takes per row, is its `OpShape` (OPS).
`select` takes the block of TUNED_TILES (tuned_tiles.json, beside this
module) when it holds the shape, else the heuristic (`heuristic_config`): it
picks the number of grid steps that balances the per-step cost against the
unoverlapped first load and last store of the pipeline, within the VMEM budget
(`vmem_budget`). Each call asks Mosaic for a scoped VMEM limit from its working
set (`vmem_limit`). Budget and limit are the VMEM policy every tpu-kernels
build shares (`_hardware.py`, with this kernel's WORKING_SET_MARGIN and
WORKING_SET_BOUND_BYTES), as are the TPU facts (HBM bandwidth, VMEM, scoped
defaults, tiling, per-step cost); the tuned table has the form every kernel's
has (`_tuning.py`). The functions here take the generation's facts (`target`,
a `_hardware.TpuGeneration` its caller resolved once).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import NamedTuple

import jax.numpy as jnp

from .._hardware import (
    LANES, MIB, SUBLANES, SUPPORTED_GENERATIONS, TpuGeneration, grid_step_overhead_s, round_up, sublane_multiple,
    VmemPolicy, tpu_generation, vmem_budget_bytes,
)
from .._tuning import read_tuned_tiles
from ..problem import NormProblem

# The policy's `margin` on the VMEM estimate (`vmem_bytes`): the blocks take at
# most 80% of what is asked for them. Its f32 temporaries are estimates,
# calibrated against Mosaic's VMEM reports.
WORKING_SET_MARGIN = 1.25
# The default scoped VMEM taken where none is known (TPU7x: _hardware's
# docstring): v6e's, on a chip with as much VMEM per core as v5p.
ASSUMED_DEFAULT_SCOPED_VMEM_BYTES = 32 * MIB
# Working sets the heuristic stays within (the policy's `bound_bytes`): what
# the generation's default scoped VMEM holds with the margin. Blocks are sized
# by the step count (`heuristic_config`); this bound caps them at the largest
# row counts to blocks of the size the estimate's temporaries were calibrated
# at (Mosaic's reports of blocks overflowing those defaults on v5e and v6e).
WORKING_SET_BOUND_BYTES = {
    generation: int((tpu_generation(generation).default_scoped_vmem_bytes or ASSUMED_DEFAULT_SCOPED_VMEM_BYTES)
                    / WORKING_SET_MARGIN)
    for generation in SUPPORTED_GENERATIONS
}


@dataclasses.dataclass(frozen=True)
class OpShape:
    """What one op's kernel streams, and the per-row VMEM footprint blocks are sized by.

    row_inputs / row_outputs: [rows, hidden] arrays the pipeline streams (each
    double-buffered in VMEM); the weight comes in once as [1, hidden], and the
    backward kernels write one float32 [1, hidden] weight-gradient partial per
    row block. f32_row_temporaries: float32 [block_rows, hidden] scratch Mosaic
    allocates for the body, rounded up from the scoped VMEM totals that
    CompileTimeScopedVmemOom reports for oversized blocks on v5e and v6e
    (bfloat16 inputs need the most: their upcasts).
    """

    row_inputs: int
    row_outputs: int
    weight_gradient: bool
    f32_row_temporaries: int

    @property
    def row_arrays(self) -> int:
        return self.row_inputs + self.row_outputs


OPS = {
    "rms_norm": OpShape(row_inputs=1, row_outputs=1, weight_gradient=False, f32_row_temporaries=1),
    "fused_add_rms_norm": OpShape(row_inputs=2, row_outputs=2, weight_gradient=False, f32_row_temporaries=2),
    "rms_norm_backward": OpShape(row_inputs=2, row_outputs=1, weight_gradient=True, f32_row_temporaries=4),
    "fused_add_rms_norm_backward": OpShape(row_inputs=3, row_outputs=1, weight_gradient=True, f32_row_temporaries=4),
}


@dataclasses.dataclass(frozen=True)
class RowBlockConfig:
    """Tiling of one kernel call: rows per block, and the scoped VMEM limit asked for (None: Mosaic's default)."""

    block_rows: int
    vmem_limit_bytes: int | None = None


class TunedKey(NamedTuple):
    """The shape an op's row block was tuned at."""

    generation: str
    op: str
    rows: int
    hidden: int
    dtype: str


class RowBlockTiles(NamedTuple):
    """A tuned row block: a RowBlockConfig's but the VMEM limit, which follows from it (`vmem_limit`)."""

    block_rows: int


# Row blocks tuned per shape, taken over the heuristic by `select`: data
# in tuned_tiles.json beside this module. None so far: at 64 rows and more the
# heuristic's blocks move within 1.4% of the minimum HBM bytes and model at
# 91-94% of the HBM roofline at 8192 rows on v6e (`python -m benchmarks
# rmsnorm`), leaving a search little to win.
TUNED_TILES_FILE = Path(__file__).with_name("tuned_tiles.json")
TUNED_TILES: dict[TunedKey, RowBlockTiles] = read_tuned_tiles(TUNED_TILES_FILE, TunedKey, RowBlockTiles)


def vmem_bytes(block_rows: int, hidden: int, dtype, op: str) -> int:
    """VMEM one call of `op` holds with `block_rows`-row blocks: double-buffered row blocks, f32 temporaries,
    vectors."""
    shape = OPS[op]
    padded_hidden = round_up(hidden, LANES)
    itemsize = jnp.dtype(dtype).itemsize
    per_row = padded_hidden * (2 * itemsize * shape.row_arrays + 4 * shape.f32_row_temporaries)
    # The weight block and the weight-gradient partials: a few sublanes of f32 each, double-buffered.
    vectors = 2 * 2 * SUBLANES * padded_hidden * 4
    return round_up(block_rows, sublane_multiple(dtype)) * per_row + vectors


# The policy's budget (`vmem_budget(target)`) and limit (`vmem_limit(working_set_bytes, target)`) the blocks are
# sized and asked for by.
VMEM_POLICY = VmemPolicy(WORKING_SET_MARGIN, WORKING_SET_BOUND_BYTES)
vmem_budget, vmem_limit = VMEM_POLICY.budget, VMEM_POLICY.limit


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")


def check_block_rows(block_rows: int, rows: int, dtype) -> None:
    """Raises ValueError unless `block_rows` is all rows or a positive multiple of the sublane tile."""
    align = sublane_multiple(dtype)
    if not (block_rows == rows or (block_rows >= align and block_rows % align == 0)):
        raise ValueError(
            f"block_rows must be a multiple of {align} for {jnp.dtype(dtype)} or equal rows={rows}, got {block_rows}"
        )


def heuristic_config(problem: NormProblem, target: TpuGeneration) -> RowBlockConfig:
    """Rows per block of `problem` from the traffic time, the per-step cost and the VMEM budget.

    The pipeline overlaps the DMA of block i+1 (and the write-back of block
    i-1) with the compute of block i, but not the first block's fetch nor the
    last block's compute and write-back: with n steps about 1/n of the traffic
    time T is exposed (the vector work per byte is of the order of the HBM time
    per byte here), while each step costs a fixed overhead c. n* = sqrt(T / c)
    minimises T/n + n*c; blocks are then made equal (so a ragged last block
    wastes little), aligned to the sublane multiple, and capped by the VMEM
    budget (`vmem_budget`). Rows so wide that the fewest rows pass it take
    the fewest rows, if they fit what a kernel may ask for at all (the
    policy's budget without WORKING_SET_BOUND_BYTES).
    """
    op, rows, hidden, dtype = problem
    _check_op(op)
    if rows < 1 or hidden < 1:
        raise ValueError(f"rows and hidden must be >= 1, got rows={rows}, hidden={hidden}")
    dtype = jnp.dtype(dtype)
    align = sublane_multiple(dtype)

    traffic_seconds = rows * hidden * dtype.itemsize * OPS[op].row_arrays / target.hbm_bytes_per_s
    steps = max(1, round(math.sqrt(traffic_seconds / grid_step_overhead_s(target.name))))

    fixed_bytes = vmem_bytes(0, hidden, dtype, op)
    bytes_per_aligned_rows = vmem_bytes(align, hidden, dtype, op) - fixed_bytes
    fitting_rows = max(0, vmem_budget(target) - fixed_bytes) // bytes_per_aligned_rows * align
    if fitting_rows < align:
        needed = vmem_bytes(align, hidden, dtype, op)
        if needed > vmem_budget_bytes(target.name, margin=WORKING_SET_MARGIN):
            raise ValueError(
                f"hidden={hidden} is too large for {op} on {target.name}: one block of {align} rows "
                f"needs {needed / MIB:.1f} MiB of VMEM"
            )
        fitting_rows = align
    steps = max(steps, -(-rows // fitting_rows))
    block_rows = round_up(-(-rows // steps), align)
    if block_rows >= rows:
        # One block covering every row: a block dim equal to the array dim needs no alignment.
        block_rows = rows
    return RowBlockConfig(block_rows, vmem_limit(vmem_bytes(block_rows, hidden, dtype, op), target))


def tuned_config(problem: NormProblem, target: TpuGeneration) -> RowBlockConfig | None:
    """The config of the TUNED_TILES entry for `problem`'s shape, if there is one: its block, checked like an
    explicit block size, and the VMEM limit it needs."""
    op, rows, hidden, dtype = problem
    tiles = TUNED_TILES.get(TunedKey(target.name, op, rows, hidden, jnp.dtype(dtype).name))
    if tiles is None:
        return None
    check_block_rows(tiles.block_rows, rows, dtype)
    return RowBlockConfig(tiles.block_rows, vmem_limit(vmem_bytes(tiles.block_rows, hidden, dtype, op), target))


def select(problem: NormProblem, target: TpuGeneration) -> RowBlockConfig:
    """Rows per block for `problem` on `target` (a generation's facts, resolved once by the caller): the tuned
    entry of its shape, else the heuristic's."""
    _check_op(problem.op)
    config = tuned_config(problem, target)
    return config if config is not None else heuristic_config(problem, target)
