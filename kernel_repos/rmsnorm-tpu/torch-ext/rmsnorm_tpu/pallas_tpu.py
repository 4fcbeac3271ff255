"""Pallas TPU kernels for RMSNorm, fused residual-add + RMSNorm, and their backward.

All kernels view the input as a matrix [rows, hidden] and stream it through
VMEM in row blocks of shape (block_rows, hidden): the whole hidden dimension
sits in one block (allowed for any hidden size, because a block dimension equal
to the array dimension is exempt from the (8, 128) tiling rule), so each row is
read from HBM once and written once; the reduction over hidden never leaves
VMEM. The grid runs over row blocks; the last block may be ragged, and Pallas
masks its out-of-bounds rows on store. Rows never mix in the forward kernels,
so garbage in the padding rows of a ragged block cannot reach a valid output;
the backward kernels reduce over rows for the weight gradient and mask those
rows explicitly.

Math is in float32 whatever the input dtype; outputs take the input dtype.

The block size comes from `select_config(rows, hidden, dtype, generation)`,
which fits the pipelined buffers into the generation's scoped VMEM and picks
the number of grid steps that balances per-step overhead against the
unoverlapped first load and last store of the pipeline.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
MIB = 1024 * 1024
LANES = 128


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
    """What the tiling needs to know about one TPU generation (per TensorCore)."""

    name: str
    hbm_bytes_per_second: float
    # The VMEM limit Mosaic compiles a kernel against unless told otherwise.
    scoped_vmem_bytes: int
    vmem_capacity_bytes: int


# HBM bandwidth and VMEM capacity as in jax's TpuInfo table; the scoped
# defaults measured with libtpu's compile-only topologies.
GENERATIONS = {
    "v5e": TpuGeneration("v5e", hbm_bytes_per_second=8.2e11, scoped_vmem_bytes=16 * MIB, vmem_capacity_bytes=128 * MIB),
    "v6e": TpuGeneration(
        "v6e", hbm_bytes_per_second=1.64e12, scoped_vmem_bytes=32 * MIB, vmem_capacity_bytes=128 * MIB
    ),
}
DEFAULT_GENERATION = "v6e"
# Chips outside the table get the v5e budget: 16 MiB of scoped VMEM is the
# smallest default of any TPU generation, so its tiles compile everywhere.
FALLBACK_GENERATION = "v5e"

# Fixed cost of one grid step of a Pallas TPU pipeline (DMA issue, semaphore
# waits, loop bookkeeping), from the Pallas TPU pipelining documentation.
GRID_STEP_OVERHEAD_SECONDS = 0.35e-6
# Share of the scoped VMEM limit the pipelined blocks may take; the rest is
# left to Mosaic's internal scratch.
VMEM_BUDGET_FRACTION = 0.8
# Beyond this share of physical VMEM we refuse rather than raise the limit.
VMEM_CAPACITY_FRACTION = 0.75


@dataclasses.dataclass(frozen=True)
class KernelShape:
    """What one kernel streams, and the per-row VMEM footprint select_config sizes blocks by.

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


KERNELS = {
    "rms_norm": KernelShape(row_inputs=1, row_outputs=1, weight_gradient=False, f32_row_temporaries=1),
    "fused_add_rms_norm": KernelShape(row_inputs=2, row_outputs=2, weight_gradient=False, f32_row_temporaries=2),
    "rms_norm_backward": KernelShape(row_inputs=2, row_outputs=1, weight_gradient=True, f32_row_temporaries=4),
    "fused_add_rms_norm_backward": KernelShape(
        row_inputs=3, row_outputs=1, weight_gradient=True, f32_row_temporaries=4
    ),
}


@dataclasses.dataclass(frozen=True)
class RowBlockConfig:
    """Tiling of one kernel call: rows per block, and a VMEM limit when the default is too small."""

    block_rows: int
    vmem_limit_bytes: int | None = None


def current_generation() -> str:
    """The TPU generation JAX runs on, DEFAULT_GENERATION off-TPU."""
    device = jax.devices()[0]
    if device.platform != "tpu":
        return DEFAULT_GENERATION
    kind = device.device_kind.lower()
    if "v6" in kind:
        return "v6e"
    if "v5 lite" in kind or "v5e" in kind:
        return "v5e"
    return FALLBACK_GENERATION


def sublane_multiple(dtype) -> int:
    """Row-block alignment: 8 sublanes of 32-bit words, packed 2 per word for 16-bit types."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _vmem_bytes(block_rows: int, hidden: int, dtype, kernel_shape: KernelShape) -> int:
    padded_hidden = _round_up(hidden, LANES)
    itemsize = jnp.dtype(dtype).itemsize
    per_row = padded_hidden * (2 * itemsize * kernel_shape.row_arrays + 4 * kernel_shape.f32_row_temporaries)
    # The weight block and the weight-gradient partials: a few sublanes of f32 each, double-buffered.
    vectors = 2 * 2 * 8 * padded_hidden * 4
    return _round_up(block_rows, sublane_multiple(dtype)) * per_row + vectors


def select_config(rows: int, hidden: int, dtype, generation: str, *, kernel: str = "rms_norm") -> RowBlockConfig:
    """Rows per block for `kernel` on [rows, hidden] arrays of `dtype` on a TPU `generation`.

    The pipeline overlaps the DMA of block i+1 (and the write-back of block
    i-1) with the compute of block i, but not the first block's fetch nor the
    last block's compute and write-back: with n steps about 1/n of the traffic
    time T is exposed (the vector work per byte is of the order of the HBM time
    per byte here), while each step costs a fixed overhead c. n* = sqrt(T / c)
    minimises T/n + n*c; blocks are then made equal (so a ragged last block
    wastes little), aligned to the sublane multiple, and capped by what fits
    the scoped VMEM.
    """
    if generation not in GENERATIONS:
        raise ValueError(f"generation must be one of {sorted(GENERATIONS)}, got {generation!r}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {sorted(KERNELS)}, got {kernel!r}")
    if rows < 1 or hidden < 1:
        raise ValueError(f"rows and hidden must be >= 1, got rows={rows}, hidden={hidden}")
    dtype = jnp.dtype(dtype)
    chip = GENERATIONS[generation]
    kernel_shape = KERNELS[kernel]
    align = sublane_multiple(dtype)

    traffic_seconds = rows * hidden * dtype.itemsize * kernel_shape.row_arrays / chip.hbm_bytes_per_second
    steps = max(1, round(math.sqrt(traffic_seconds / GRID_STEP_OVERHEAD_SECONDS)))

    budget = int(chip.scoped_vmem_bytes * VMEM_BUDGET_FRACTION)
    fixed_bytes = _vmem_bytes(0, hidden, dtype, kernel_shape)
    bytes_per_aligned_rows = _vmem_bytes(align, hidden, dtype, kernel_shape) - fixed_bytes
    fitting_rows = max(0, budget - fixed_bytes) // bytes_per_aligned_rows * align
    vmem_limit_bytes = None
    if fitting_rows < align:
        # Even the smallest aligned block overflows the default: ask for more VMEM.
        needed = _vmem_bytes(align, hidden, dtype, kernel_shape)
        vmem_limit_bytes = _round_up(int(needed / VMEM_BUDGET_FRACTION), MIB)
        if vmem_limit_bytes > chip.vmem_capacity_bytes * VMEM_CAPACITY_FRACTION:
            raise ValueError(
                f"hidden={hidden} is too large for {kernel} on {generation}: one block of {align} rows "
                f"needs {needed / MIB:.1f} MiB of VMEM"
            )
        fitting_rows = align
    steps = max(steps, -(-rows // fitting_rows))
    block_rows = _round_up(-(-rows // steps), align)
    if block_rows >= rows:
        # One block covering every row: a block dim equal to the array dim needs no alignment.
        block_rows = rows
    return RowBlockConfig(block_rows=block_rows, vmem_limit_bytes=vmem_limit_bytes)


@dataclasses.dataclass(frozen=True)
class RowKernelLayout:
    """Grid, BlockSpecs and operand shapes of one kernel call."""

    grid: tuple[int]
    in_specs: tuple[pl.BlockSpec, ...]
    out_specs: tuple[pl.BlockSpec, ...]
    in_shapes: tuple[jax.ShapeDtypeStruct, ...]
    out_shapes: tuple[jax.ShapeDtypeStruct, ...]
    config: RowBlockConfig


def row_kernel_layout(
    kernel: str, rows: int, hidden: int, dtype, weight_dtype, generation: str, block_rows: int | None = None
) -> RowKernelLayout:
    """The grid and blocks `kernel` uses for [rows, hidden] inputs; `block_rows` overrides select_config."""
    config = select_config(rows, hidden, dtype, generation, kernel=kernel)
    if block_rows is not None:
        align = sublane_multiple(dtype)
        if not (block_rows == rows or (block_rows >= align and block_rows % align == 0)):
            raise ValueError(
                f"block_rows must be a multiple of {align} for {jnp.dtype(dtype)} or equal rows={rows}, "
                f"got {block_rows}"
            )
        config = dataclasses.replace(config, block_rows=min(block_rows, rows))
    shape = KERNELS[kernel]
    num_blocks = pl.cdiv(rows, config.block_rows)
    row_spec = pl.BlockSpec((config.block_rows, hidden), lambda i: (i, 0))
    row = jax.ShapeDtypeStruct((rows, hidden), dtype)
    # Same block index on every step: the pipeline fetches the weight once.
    in_specs = (row_spec,) * shape.row_inputs + (pl.BlockSpec((1, hidden), lambda i: (0, 0)),)
    in_shapes = (row,) * shape.row_inputs + (jax.ShapeDtypeStruct((1, hidden), weight_dtype),)
    out_specs, out_shapes = (row_spec,) * shape.row_outputs, (row,) * shape.row_outputs
    if shape.weight_gradient:
        # One float32 partial weight gradient per row block, summed outside the kernel.
        out_specs += (pl.BlockSpec((None, 1, hidden), lambda i: (i, 0, 0)),)
        out_shapes += (jax.ShapeDtypeStruct((num_blocks, 1, hidden), jnp.float32),)
    return RowKernelLayout((num_blocks,), in_specs, out_specs, in_shapes, out_shapes, config)


def _inverse_rms(x, eps: float):
    return jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def _scale(weight_ref, offset: float):
    return offset + weight_ref[...].astype(jnp.float32)


def _rms_norm_body(x_ref, weight_ref, y_ref, *, eps: float, offset: float):
    x = x_ref[...].astype(jnp.float32)
    y_ref[...] = (x * _inverse_rms(x, eps) * _scale(weight_ref, offset)).astype(y_ref.dtype)


def _fused_add_rms_norm_body(x_ref, residual_ref, weight_ref, y_ref, new_residual_ref, *, eps: float, offset: float):
    # Normalise the sum as rounded to the residual dtype, exactly what the unfused
    # `norm(x + residual)` of a transformers decoder layer sees.
    total = x_ref[...].astype(jnp.float32) + residual_ref[...].astype(jnp.float32)
    total = total.astype(new_residual_ref.dtype)
    new_residual_ref[...] = total
    total = total.astype(jnp.float32)
    y_ref[...] = (total * _inverse_rms(total, eps) * _scale(weight_ref, offset)).astype(y_ref.dtype)


def _backward_body(*refs, eps: float, offset: float, rows: int, block_rows: int, with_residual_grad: bool):
    if with_residual_grad:
        grad_ref, residual_grad_ref, x_ref, weight_ref, dx_ref, weight_grad_ref = refs
    else:
        grad_ref, x_ref, weight_ref, dx_ref, weight_grad_ref = refs
    x = x_ref[...].astype(jnp.float32)
    grad = grad_ref[...].astype(jnp.float32)
    inverse_rms = _inverse_rms(x, eps)
    normed = x * inverse_rms
    scaled_grad = grad * _scale(weight_ref, offset)
    # d/dx of x * r(x) * s, with r = (mean(x^2) + eps)^-1/2: r * (g*s - n * mean(g*s*n)).
    dx = inverse_rms * (scaled_grad - normed * jnp.mean(scaled_grad * normed, axis=-1, keepdims=True))
    if with_residual_grad:
        dx = dx + residual_grad_ref[...].astype(jnp.float32)
    dx_ref[...] = dx.astype(dx_ref.dtype)

    weight_grad_terms = grad * normed
    if rows % block_rows:
        # The ragged last block holds uninitialised rows; this sum over rows must not see them.
        row_ids = pl.program_id(0) * block_rows + jax.lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
        weight_grad_terms = jnp.where(row_ids < rows, weight_grad_terms, 0.0)
    weight_grad_ref[...] = jnp.sum(weight_grad_terms, axis=0, keepdims=True)


def _check_inputs(name: str, row_arrays: dict[str, jax.Array], weight: jax.Array, eps: float) -> None:
    first_name, first = next(iter(row_arrays.items()))
    if first.ndim < 1:
        raise ValueError(f"{name}: {first_name} must have at least one dimension (the hidden size)")
    for array_name, array in row_arrays.items():
        if array.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: {array_name} must be float32 or bfloat16, got {array.dtype}")
        if array.shape != first.shape or array.dtype != first.dtype:
            raise ValueError(
                f"{name}: {array_name} {array.dtype}{list(array.shape)} must match "
                f"{first_name} {first.dtype}{list(first.shape)}"
            )
    if weight.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: weight must be float32 or bfloat16, got {weight.dtype}")
    if weight.shape != (first.shape[-1],):
        raise ValueError(
            f"{name}: weight shape {list(weight.shape)} must be [{first.shape[-1]}], the hidden size of {first_name}"
        )
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"{name}: eps must be a finite number > 0, got {eps!r}")


# Per element, roughly: square, sum, scale, weight multiply (+ the add, + the backward's products).
FLOPS_PER_ELEMENT = {"rms_norm": 4, "fused_add_rms_norm": 5, "rms_norm_backward": 10, "fused_add_rms_norm_backward": 11}


def _run(kernel: str, make_body, row_arrays, weight, generation: str | None, block_rows: int | None):
    """Run `kernel` on arrays [..., hidden] viewed as [rows, hidden]; make_body(layout) gives the kernel body."""
    hidden = row_arrays[0].shape[-1]
    as_rows = [a.reshape(-1, hidden) for a in row_arrays]
    rows = as_rows[0].shape[0]
    layout = row_kernel_layout(
        kernel, rows, hidden, as_rows[0].dtype, weight.dtype, generation or current_generation(), block_rows
    )
    bytes_accessed = sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in layout.in_shapes + layout.out_shapes)
    single_output = len(layout.out_shapes) == 1
    call = pl.pallas_call(
        make_body(layout),
        grid=layout.grid,
        in_specs=list(layout.in_specs),
        out_specs=layout.out_specs[0] if single_output else list(layout.out_specs),
        out_shape=layout.out_shapes[0] if single_output else list(layout.out_shapes),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), vmem_limit_bytes=layout.config.vmem_limit_bytes
        ),
        cost_estimate=pl.CostEstimate(
            flops=FLOPS_PER_ELEMENT[kernel] * rows * hidden, transcendentals=rows, bytes_accessed=bytes_accessed
        ),
        name=kernel,
    )
    return call(*as_rows, weight.reshape(1, hidden))


_STATIC = ("eps", "offset", "generation", "block_rows")


@functools.partial(jax.jit, static_argnames=_STATIC)
def rms_norm(
    x: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    offset: float = 0.0,
    generation: str | None = None,
    block_rows: int | None = None,
) -> jax.Array:
    """y = x / sqrt(mean(x^2, -1) + eps) * (offset + weight), over the last axis of x."""
    _check_inputs("rms_norm", {"x": x}, weight, eps)
    if x.size == 0:
        return jnp.zeros(x.shape, x.dtype)
    body = functools.partial(_rms_norm_body, eps=float(eps), offset=float(offset))
    return _run("rms_norm", lambda layout: body, [x], weight, generation, block_rows).reshape(x.shape)


@functools.partial(jax.jit, static_argnames=_STATIC)
def fused_add_rms_norm(
    x: jax.Array,
    residual: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    offset: float = 0.0,
    generation: str | None = None,
    block_rows: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(rms_norm(x + residual), x + residual) in one pass over memory; the sum is rounded to x's dtype."""
    _check_inputs("fused_add_rms_norm", {"x": x, "residual": residual}, weight, eps)
    if x.size == 0:
        return jnp.zeros(x.shape, x.dtype), jnp.zeros(x.shape, x.dtype)
    body = functools.partial(_fused_add_rms_norm_body, eps=float(eps), offset=float(offset))
    y, new_residual = _run("fused_add_rms_norm", lambda layout: body, [x, residual], weight, generation, block_rows)
    return y.reshape(x.shape), new_residual.reshape(x.shape)


def _backward(kernel: str, grads, x, weight, eps, offset, generation, block_rows):
    def make_body(layout: RowKernelLayout):
        return functools.partial(
            _backward_body,
            eps=float(eps),
            offset=float(offset),
            rows=layout.in_shapes[0].shape[0],
            block_rows=layout.config.block_rows,
            with_residual_grad=len(grads) == 2,
        )

    dx, weight_grad_partials = _run(kernel, make_body, [*grads, x], weight, generation, block_rows)
    return dx.reshape(x.shape), jnp.sum(weight_grad_partials, axis=(0, 1)).astype(weight.dtype)


@functools.partial(jax.jit, static_argnames=_STATIC)
def rms_norm_backward(
    grad: jax.Array,
    x: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    offset: float = 0.0,
    generation: str | None = None,
    block_rows: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(dL/dx, dL/dweight) of rms_norm given dL/dy = grad."""
    _check_inputs("rms_norm_backward", {"x": x, "grad": grad}, weight, eps)
    if x.size == 0:
        return jnp.zeros(x.shape, x.dtype), jnp.zeros(weight.shape, weight.dtype)
    return _backward("rms_norm_backward", (grad,), x, weight, eps, offset, generation, block_rows)


@functools.partial(jax.jit, static_argnames=_STATIC)
def fused_add_rms_norm_backward(
    grad_y: jax.Array,
    grad_new_residual: jax.Array,
    new_residual: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    offset: float = 0.0,
    generation: str | None = None,
    block_rows: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(dL/d(x + residual), dL/dweight) of fused_add_rms_norm; dL/dx and dL/dresidual both equal the first."""
    _check_inputs(
        "fused_add_rms_norm_backward",
        {"new_residual": new_residual, "grad_y": grad_y, "grad_new_residual": grad_new_residual},
        weight,
        eps,
    )
    if new_residual.size == 0:
        return jnp.zeros(new_residual.shape, new_residual.dtype), jnp.zeros(weight.shape, weight.dtype)
    grads = (grad_y, grad_new_residual)
    return _backward(
        "fused_add_rms_norm_backward", grads, new_residual, weight, eps, offset, generation, block_rows
    )
