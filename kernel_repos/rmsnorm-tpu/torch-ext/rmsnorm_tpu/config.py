"""Row blocks per shape, op and TPU generation, apart from the kernels.

Every op streams [rows, hidden] arrays in row blocks `(block_rows, hidden)`.
`select_config` takes a tuned block size from TUNED_CONFIGS when it holds the
shape, else the heuristic (`heuristic_config`): it fits the pipelined
buffers into the generation's default scoped VMEM and picks the number of
grid steps that balances the per-step cost against the unoverlapped first
load and last store of the pipeline. TPU facts (HBM bandwidth, VMEM, scoped
defaults, tiling, per-step cost) come from `_hardware.py`.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from ._hardware import (
    LANES, MIB, SUBLANES, check_generation, grid_step_overhead_s, max_vmem_limit_bytes, resolve_generation, round_up,
    sublane_multiple, tpu_generation,
)

# Share of the scoped VMEM limit the pipelined blocks may take; the rest is
# left to Mosaic's internal scratch. Chosen with margin: the f32 temporaries
# below are estimates calibrated against Mosaic's VMEM reports.
VMEM_BUDGET_FRACTION = 0.8
# Beyond this share of physical VMEM a block of the fewest rows is refused
# rather than the limit raised: 96 of the 128 MiB of v5e and v6e, 48 of the
# 64 MiB of v5p and TPU7x, below the most any of our kernels asks for
# (_hardware.max_vmem_limit_bytes: 100 and 56 MiB).
VMEM_CAPACITY_FRACTION = 0.75
# The scoped limit blocks are sized for on a generation whose default is not
# known (TPU7x: _hardware's docstring): the kernel asks for it explicitly.
# v6e's default, on a chip with as much VMEM per core as v5p.
EXPLICIT_SCOPED_VMEM_BYTES = 32 * MIB


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
    """Tiling of one kernel call: rows per block, and a VMEM limit when the default is too small."""

    block_rows: int
    vmem_limit_bytes: int | None = None


# Searched block sizes, keyed (generation, op, rows, hidden, dtype name). None
# so far: at 64 rows and more the heuristic's blocks move within 1.4% of the
# minimum HBM bytes and model at 91-94% of the HBM roofline at 8192 rows on
# v6e (`tpu-kernels bench rmsnorm`), leaving a search little to win.
TUNED_CONFIGS: dict[tuple[str, str, int, int, str], RowBlockConfig] = {}


def vmem_bytes(block_rows: int, hidden: int, dtype, op: str) -> int:
    """VMEM one call of `op` holds with `block_rows`-row blocks: double-buffered row blocks, f32 temporaries, vectors."""
    shape = OPS[op]
    padded_hidden = round_up(hidden, LANES)
    itemsize = jnp.dtype(dtype).itemsize
    per_row = padded_hidden * (2 * itemsize * shape.row_arrays + 4 * shape.f32_row_temporaries)
    # The weight block and the weight-gradient partials: a few sublanes of f32 each, double-buffered.
    vectors = 2 * 2 * SUBLANES * padded_hidden * 4
    return round_up(block_rows, sublane_multiple(dtype)) * per_row + vectors


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


def scoped_vmem(generation: str) -> tuple[int, int | None]:
    """The scoped VMEM limit blocks are sized for on `generation`, and the limit a kernel asks for to get it
    (None: the default is that limit)."""
    default = tpu_generation(generation).default_scoped_vmem_bytes
    return (default, None) if default else (EXPLICIT_SCOPED_VMEM_BYTES, EXPLICIT_SCOPED_VMEM_BYTES)


def heuristic_config(rows: int, hidden: int, dtype, generation: str, *, op: str = "rms_norm") -> RowBlockConfig:
    """Rows per block from the traffic time, the per-step cost and the scoped VMEM.

    The pipeline overlaps the DMA of block i+1 (and the write-back of block
    i-1) with the compute of block i, but not the first block's fetch nor the
    last block's compute and write-back: with n steps about 1/n of the traffic
    time T is exposed (the vector work per byte is of the order of the HBM time
    per byte here), while each step costs a fixed overhead c. n* = sqrt(T / c)
    minimises T/n + n*c; blocks are then made equal (so a ragged last block
    wastes little), aligned to the sublane multiple, and capped by what fits
    VMEM_BUDGET_FRACTION of the default scoped VMEM (of
    EXPLICIT_SCOPED_VMEM_BYTES, asked for, where the default is not known).
    Rows so wide that the fewest rows overflow it get a raised limit, up to
    VMEM_CAPACITY_FRACTION of physical VMEM.
    """
    generation = check_generation(generation)
    _check_op(op)
    if rows < 1 or hidden < 1:
        raise ValueError(f"rows and hidden must be >= 1, got rows={rows}, hidden={hidden}")
    dtype = jnp.dtype(dtype)
    facts = tpu_generation(generation)
    align = sublane_multiple(dtype)

    traffic_seconds = rows * hidden * dtype.itemsize * OPS[op].row_arrays / facts.hbm_bytes_per_s
    steps = max(1, round(math.sqrt(traffic_seconds / grid_step_overhead_s(generation))))

    scoped, vmem_limit_bytes = scoped_vmem(generation)
    budget = int(scoped * VMEM_BUDGET_FRACTION)
    fixed_bytes = vmem_bytes(0, hidden, dtype, op)
    bytes_per_aligned_rows = vmem_bytes(align, hidden, dtype, op) - fixed_bytes
    fitting_rows = max(0, budget - fixed_bytes) // bytes_per_aligned_rows * align
    if fitting_rows < align:
        # Even the smallest aligned block overflows the default: ask for more VMEM.
        needed = vmem_bytes(align, hidden, dtype, op)
        vmem_limit_bytes = round_up(int(needed / VMEM_BUDGET_FRACTION), MIB)
        if vmem_limit_bytes > min(facts.vmem_capacity_bytes * VMEM_CAPACITY_FRACTION, max_vmem_limit_bytes(generation)):
            raise ValueError(
                f"hidden={hidden} is too large for {op} on {generation}: one block of {align} rows "
                f"needs {needed / MIB:.1f} MiB of VMEM"
            )
        fitting_rows = align
    steps = max(steps, -(-rows // fitting_rows))
    block_rows = round_up(-(-rows // steps), align)
    if block_rows >= rows:
        # One block covering every row: a block dim equal to the array dim needs no alignment.
        block_rows = rows
    return RowBlockConfig(block_rows=block_rows, vmem_limit_bytes=vmem_limit_bytes)


def tuned_config(rows: int, hidden: int, dtype, generation: str, *, op: str = "rms_norm") -> RowBlockConfig | None:
    """The TUNED_CONFIGS entry for this shape, if there is one; checked like an explicit block size."""
    config = TUNED_CONFIGS.get((check_generation(generation), op, rows, hidden, jnp.dtype(dtype).name))
    if config is not None:
        check_block_rows(config.block_rows, rows, dtype)
    return config


def select_config(rows: int, hidden: int, dtype, generation: str | None = None, *, op: str = "rms_norm") -> RowBlockConfig:
    """Rows per block for `op` on [rows, hidden] arrays of `dtype` on `generation` (default: the current one)."""
    generation = resolve_generation(generation)
    _check_op(op)
    config = tuned_config(rows, hidden, dtype, generation, op=op)
    return config if config is not None else heuristic_config(rows, hidden, dtype, generation, op=op)
