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

A call is a `NormProblem` (the op, rows, hidden and dtype): its block size
comes from `tiles.select(problem, target)`, the grid it gives from
`plan.make(problem, target, config=None)`, and `call(rows, weight, plan)`
runs it. The four JAX
functions (`rms_norm_forward`, `fused_add_rms_norm_forward`,
`rms_norm_backward`, `fused_add_rms_norm_backward`) take the same keyword
options (eps, offset, generation, block_rows; see `_row_norm`);
`differentiable_rms_norm` and `differentiable_fused_add_rms_norm` join each
forward to its backward (a `jax.custom_vjp`), for the torch ops. Inputs are
assumed valid: the torch ops check them (`ops.py`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._hardware import TpuGeneration, resolve_target
from ..problem import NormProblem
from .plan import RowPlan, make
from .tiles import OPS, RowBlockConfig, check_block_rows, vmem_bytes, vmem_limit


class _RowBlocks(NamedTuple):
    """BlockSpecs and operand shapes of one kernel call: the row inputs and the weight, then the outputs."""

    in_specs: tuple[pl.BlockSpec, ...]
    out_specs: tuple[pl.BlockSpec, ...]
    in_shapes: tuple[jax.ShapeDtypeStruct, ...]
    out_shapes: tuple[jax.ShapeDtypeStruct, ...]


def _row_blocks(plan: RowPlan, dtype, weight_dtype) -> _RowBlocks:
    """The blocks `plan`'s grid moves, for row arrays of `dtype` and a weight of `weight_dtype`."""
    shape, hidden = plan.shape, plan.hidden
    row_spec = pl.BlockSpec((plan.block_rows, hidden), lambda i: (i, 0))
    row = jax.ShapeDtypeStruct((plan.rows, hidden), dtype)
    # Same block index on every step: the pipeline fetches the weight once.
    in_specs = (row_spec,) * shape.row_inputs + (pl.BlockSpec((1, hidden), lambda i: (0, 0)),)
    in_shapes = (row,) * shape.row_inputs + (jax.ShapeDtypeStruct((1, hidden), weight_dtype),)
    out_specs, out_shapes = (row_spec,) * shape.row_outputs, (row,) * shape.row_outputs
    if shape.weight_gradient:
        # One float32 partial weight gradient per row block, summed outside the kernel.
        out_specs += (pl.BlockSpec((None, 1, hidden), lambda i: (i, 0, 0)),)
        out_shapes += (jax.ShapeDtypeStruct((plan.num_blocks, 1, hidden), jnp.float32),)
    return _RowBlocks(in_specs, out_specs, in_shapes, out_shapes)


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


def _backward_body(*refs, eps: float, offset: float, plan: RowPlan):
    # The fused op's backward also takes the new residual's gradient, which passes straight to dx.
    with_residual_grad = plan.op == "fused_add_rms_norm_backward"
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
    if plan.rows % plan.block_rows:
        # The ragged last block holds uninitialised rows; this sum over rows must not see them.
        row_ids = pl.program_id(0) * plan.block_rows + jax.lax.broadcasted_iota(jnp.int32, (plan.block_rows, 1), 0)
        weight_grad_terms = jnp.where(row_ids < plan.rows, weight_grad_terms, 0.0)
    weight_grad_ref[...] = jnp.sum(weight_grad_terms, axis=0, keepdims=True)


# Per element, roughly: square, sum, scale, weight multiply (+ the add, + the backward's products).
FLOPS_PER_ELEMENT = {"rms_norm": 4, "fused_add_rms_norm": 5, "rms_norm_backward": 10, "fused_add_rms_norm_backward": 11}


_STATIC = ("eps", "offset", "generation", "block_rows")

# Each op's kernel body; the backward ops share one, told apart by the plan's op.
_BODIES = {
    "rms_norm": _rms_norm_body,
    "fused_add_rms_norm": _fused_add_rms_norm_body,
    "rms_norm_backward": _backward_body,
    "fused_add_rms_norm_backward": _backward_body,
}


def call(as_rows: Sequence[jax.Array], weight: jax.Array, plan: RowPlan, *, eps: float,
         offset: float = 0.0) -> tuple[jax.Array, ...]:
    """`plan`'s kernel on [rows, hidden] arrays and the [hidden] weight; its outputs as a tuple, one or several."""
    blocks = _row_blocks(plan, as_rows[0].dtype, weight.dtype)
    bytes_accessed = sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in blocks.in_shapes + blocks.out_shapes)
    single_output = len(blocks.out_shapes) == 1
    options = dict(eps=eps, offset=offset)
    if plan.shape.weight_gradient:
        options["plan"] = plan  # the backward body masks the rows past the end of a ragged last block
    run = pl.pallas_call(
        functools.partial(_BODIES[plan.op], **options),
        grid=(plan.num_blocks,),
        in_specs=list(blocks.in_specs),
        out_specs=blocks.out_specs[0] if single_output else list(blocks.out_specs),
        out_shape=blocks.out_shapes[0] if single_output else list(blocks.out_shapes),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), vmem_limit_bytes=plan.vmem_limit_bytes
        ),
        cost_estimate=pl.CostEstimate(
            flops=FLOPS_PER_ELEMENT[plan.op] * plan.rows * plan.hidden, transcendentals=plan.rows,
            bytes_accessed=bytes_accessed,
        ),
        name=plan.op,
    )
    outputs = run(*as_rows, weight.reshape(1, plan.hidden))
    return (outputs,) if single_output else tuple(outputs)


def _callers_config(problem: NormProblem, target: TpuGeneration, block_rows: int | None) -> RowBlockConfig | None:
    """The caller's `block_rows` (checked, at most all rows) with the VMEM limit that block needs, as a tuned entry
    gets (`tiles.tuned_config`); None without one (the plan's `tiles.select`)."""
    if block_rows is None:
        return None
    check_block_rows(block_rows, problem.rows, problem.dtype)
    block_rows = min(block_rows, problem.rows)
    needed = vmem_bytes(block_rows, problem.hidden, problem.dtype, problem.op)
    return RowBlockConfig(block_rows, vmem_limit(needed, target))


def _row_norm(
    op: str,
    row_arrays: tuple[jax.Array, ...],
    weight: jax.Array,
    *,
    eps: float,
    offset: float = 0.0,
    generation: str | TpuGeneration | None = None,
    block_rows: int | None = None,
) -> tuple[jax.Array, ...]:
    """`op`'s outputs: its row outputs shaped like the row inputs, then dL/dweight for a backward op.

    The one signature of the keyword options the public functions pass through: eps is added to
    mean(x^2), the scale is offset + weight, generation picks the tiling (a name or its facts, resolved here once;
    None: this device's), block_rows
    overrides the selected row block.
    """
    shape = OPS[op]
    x = row_arrays[0]
    if x.size == 0:
        # No rows: a grid of zero blocks has nothing to run, so skip the kernel.
        empty = (jnp.zeros(x.shape, x.dtype),) * shape.row_outputs
        if shape.weight_gradient:
            empty += (jnp.zeros(weight.shape, weight.dtype),)
        return empty

    # Leading dimensions flattened: the kernels see [rows, hidden].
    hidden = x.shape[-1]
    as_rows = [a.reshape(-1, hidden) for a in row_arrays]
    rows = as_rows[0].shape[0]
    problem = NormProblem(op, rows, hidden, jnp.dtype(as_rows[0].dtype).name)
    target = resolve_target(generation)
    plan = make(problem, target, _callers_config(problem, target, block_rows))
    outputs = call(as_rows, weight, plan, eps=float(eps), offset=float(offset))
    results = tuple(output.reshape(x.shape) for output in outputs[: shape.row_outputs])
    if shape.weight_gradient:
        # Sum the per-block float32 partials the kernel wrote.
        results += (jnp.sum(outputs[-1], axis=(0, 1)).astype(weight.dtype),)
    return results


def _resolving_generation(function):
    """`function` jitted, its `generation` resolved before the jit: a None that reached the jit as a static argument
    would be cached as whatever it resolved to at the first call, and a later TPU_KERNELS_GENERATION ignored."""
    jitted = jax.jit(function, static_argnames=_STATIC)

    @functools.wraps(function)
    def entry(*arrays, generation: str | TpuGeneration | None = None, **options):
        return jitted(*arrays, generation=resolve_target(generation), **options)

    return entry


@_resolving_generation
def rms_norm_forward(x: jax.Array, weight: jax.Array, **options) -> jax.Array:
    """y = x / sqrt(mean(x^2, -1) + eps) * (offset + weight), over the last axis of x."""
    (y,) = _row_norm("rms_norm", (x,), weight, **options)
    return y


@_resolving_generation
def fused_add_rms_norm_forward(x: jax.Array, residual: jax.Array, weight: jax.Array,
                               **options) -> tuple[jax.Array, jax.Array]:
    """(rms_norm(x + residual), x + residual) in one pass over memory; the sum is rounded to x's dtype."""
    return _row_norm("fused_add_rms_norm", (x, residual), weight, **options)


@_resolving_generation
def rms_norm_backward(grad: jax.Array, x: jax.Array, weight: jax.Array, **options) -> tuple[jax.Array, jax.Array]:
    """(dL/dx, dL/dweight) of rms_norm_forward given dL/dy = grad."""
    return _row_norm("rms_norm_backward", (grad, x), weight, **options)


@_resolving_generation
def fused_add_rms_norm_backward(
    grad_y: jax.Array, grad_new_residual: jax.Array, new_residual: jax.Array, weight: jax.Array, **options
) -> tuple[jax.Array, jax.Array]:
    """(dL/d(x + residual), dL/dweight) of fused_add_rms_norm_forward; dL/dx and dL/dresidual both equal the first."""
    return _row_norm("fused_add_rms_norm_backward", (grad_y, grad_new_residual, new_residual), weight, **options)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def differentiable_rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float) -> jax.Array:
    """`rms_norm_forward`, whose gradients run `rms_norm_backward`."""
    return rms_norm_forward(x, weight, eps=eps, offset=offset)


def _rms_norm_vjp_forward(x, weight, eps, offset):
    return rms_norm_forward(x, weight, eps=eps, offset=offset), (x, weight)


def _rms_norm_vjp_backward(eps, offset, residuals, grad):
    x, weight = residuals
    return rms_norm_backward(grad, x, weight, eps=eps, offset=offset)


differentiable_rms_norm.defvjp(_rms_norm_vjp_forward, _rms_norm_vjp_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def differentiable_fused_add_rms_norm(x: jax.Array, residual: jax.Array, weight: jax.Array, eps: float,
                                      offset: float) -> tuple[jax.Array, jax.Array]:
    """`fused_add_rms_norm_forward`, whose gradients run `fused_add_rms_norm_backward`."""
    return fused_add_rms_norm_forward(x, residual, weight, eps=eps, offset=offset)


def _fused_vjp_forward(x, residual, weight, eps, offset):
    y, new_residual = fused_add_rms_norm_forward(x, residual, weight, eps=eps, offset=offset)
    # The norm's input is the new residual: keeping it (an output) spares keeping x and residual.
    return (y, new_residual), (new_residual, weight)


def _fused_vjp_backward(eps, offset, residuals, grads):
    new_residual, weight = residuals
    grad_sum, weight_grad = fused_add_rms_norm_backward(*grads, new_residual, weight, eps=eps, offset=offset)
    return grad_sum, grad_sum, weight_grad


differentiable_fused_add_rms_norm.defvjp(_fused_vjp_forward, _fused_vjp_backward)
