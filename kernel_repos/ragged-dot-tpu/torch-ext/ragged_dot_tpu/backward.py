"""Backward of the grouped matmul and of the grouped experts layer, on our Pallas kernels.

For `out = ragged_dot(lhs, rhs, group_sizes)`:
- `d_lhs` is a grouped matmul of `d_out` against the same weights read the
  other way round (`transpose_rhs` flipped): no transposed copy of the
  weights is made;
- `d_rhs` is the transposed grouped matmul (`tgmm.kernel.transposed_grouped_matmul`), with its
  operands swapped for the `[G, N, K]` layout.
Rows past `sum(group_sizes)` get a zero `d_lhs` and their `d_out` is never
read. `differentiable_ragged_dot` attaches this backward with `jax.custom_vjp`.

`grouped_experts_backward` differentiates the experts layer of `layer.py` from
the two projections' kernel outputs saved by its forward, so the backward
runs four grouped matmuls (two `d_lhs`, two `tgmm`) and no forward one again.

One-byte (int8 / fp8) weights serve inference: `without_gradient` runs their
forward and refuses a backward instead of differentiating around the scales.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from ._hardware import TpuGeneration, resolve_target
from .common.gates import gated, split_gate_up
from .common.routing import sort_by_expert
from .gmm import kernel as gmm_kernel
from .gmm.kernel import grouped_matmul
from .plan import ExpertsPlan, MatmulBackwardPlan, plan_ragged_dot_backward
from .problem import ExpertWeights, MatmulProblem
from .tgmm import kernel as tgmm_kernel


QUANTIZED_BACKWARD_REFUSAL = (
    "no gradient through int8 / float8_e4m3fn / packed int4 weights: quantized weights serve inference only; "
    "train with bfloat16 or float32 weights (kernelize without quantize_experts)"
)


def without_gradient(name: str, compute: Callable, *arrays):
    """`compute(*arrays)`, whose backward raises NotImplementedError (one-byte weights: inference only)."""

    @jax.custom_vjp
    def call(*arrays):
        return compute(*arrays)

    def forward(*arrays):
        return compute(*arrays), None

    def refuse(_residuals, _d_out):
        raise NotImplementedError(f"{name}: {QUANTIZED_BACKWARD_REFUSAL}")

    call.defvjp(forward, refuse)
    return call(*arrays)


def ragged_dot_backward(
    d_out: jax.Array, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool,
    generation: str | TpuGeneration | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`(d_lhs[M, K], d_rhs)` of `grouped_matmul(lhs, rhs, group_sizes, transpose_rhs=...)`; d_rhs has rhs's
    layout.

    With an empty dimension both are zeros and no kernel runs.
    """
    m, n = d_out.shape
    if 0 in (m, n, lhs.shape[1], rhs.shape[0]):
        return jnp.zeros(lhs.shape, lhs.dtype), jnp.zeros(rhs.shape, rhs.dtype)
    dtype = jnp.dtype(lhs.dtype).name
    forward = MatmulProblem(m, lhs.shape[1], n, rhs.shape[0], dtype, dtype, transpose_rhs=bool(transpose_rhs))
    plan = plan_ragged_dot_backward(forward, resolve_target(generation))
    return matmul_backward(d_out, lhs, rhs, group_sizes, plan)


def matmul_backward(d_out: jax.Array, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                    plan: MatmulBackwardPlan) -> tuple[jax.Array, jax.Array]:
    """`ragged_dot_backward` as `plan` says."""
    d_out = d_out.astype(lhs.dtype)
    d_lhs = gmm_kernel.call(d_out, rhs, group_sizes, plan.d_lhs)
    operands = (d_out, lhs) if plan.swapped else (lhs, d_out)
    d_rhs = tgmm_kernel.call(*operands, group_sizes, plan.d_rhs)
    return d_lhs, d_rhs


def differentiable_ragged_dot(lhs, rhs, group_sizes, transpose_rhs: bool, zero_rows_past_groups: bool,
                              generation: str | TpuGeneration | None):
    """`grouped_matmul` whose gradient runs the backward kernels (`ragged_dot_backward`), both on `generation` (a
    name or a target, resolved here). A function around the `jax.custom_vjp` object, as the package exports
    functions (its symbols are read as the source's defs)."""
    return _differentiable_ragged_dot(lhs, rhs, group_sizes, transpose_rhs, zero_rows_past_groups,
                                      resolve_target(generation))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _differentiable_ragged_dot(lhs, rhs, group_sizes, transpose_rhs: bool, zero_rows_past_groups: bool,
                               target: TpuGeneration):
    return grouped_matmul(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs,
                          zero_rows_past_groups=zero_rows_past_groups, generation=target)


def _ragged_dot_vjp_forward(lhs, rhs, group_sizes, transpose_rhs, zero_rows_past_groups, target):
    out = _differentiable_ragged_dot(lhs, rhs, group_sizes, transpose_rhs, zero_rows_past_groups, target)
    return out, (lhs, rhs, group_sizes)


def _ragged_dot_vjp_backward(transpose_rhs, zero_rows_past_groups, target, residuals, d_out):
    lhs, rhs, group_sizes = residuals
    d_lhs, d_rhs = ragged_dot_backward(d_out, lhs, rhs, group_sizes, transpose_rhs=transpose_rhs,
                                       generation=target)
    return d_lhs, d_rhs, None


_differentiable_ragged_dot.defvjp(_ragged_dot_vjp_forward, _ragged_dot_vjp_backward)


def grouped_experts_backward(
    plan: ExpertsPlan,
    d_y: jax.Array,
    hidden_states: jax.Array,
    top_k_index: jax.Array,
    top_k_weights: jax.Array,
    weights: ExpertWeights,
    gate_up_out: jax.Array,
    down_out: jax.Array,
) -> tuple[jax.Array, jax.Array, ExpertWeights]:
    """Gradients of `layer.grouped_experts` from its saved kernel outputs.

    `gate_up_out[M, 2I]` and `down_out[M, H]` are the two grouped matmuls'
    outputs of the forward (rows sorted by expert, rows past the groups
    unwritten). Returns `(d_hidden_states, d_top_k_weights, d_expert_weights)`,
    each in its input's dtype (`d_expert_weights` an `ExpertWeights` of the
    projections' and biases' gradients; None where there is no bias). Sentinel
    picks (id == num_experts) get a zero routing-weight gradient and feed no
    other gradient. Each weight is read, and its gradient written, in the
    order XLA stores it (`plan.orientation`), as the forward reads it.
    """
    problem = plan.problem
    num_tokens, top_k, num_experts = problem.tokens, problem.top_k, problem.num_experts
    dtype, f32, gate = hidden_states.dtype, jnp.float32, problem.gate
    order, group_sizes = sort_by_expert(top_k_index, num_experts)
    tokens = order // top_k
    live = (jnp.arange(order.shape[0]) < group_sizes.sum())[:, None]
    bias_rows = jnp.minimum(top_k_index.reshape(-1)[order], num_experts - 1)
    read = weights.as_read(plan.orientation, weights_transposed=problem.weights_transposed)

    # The gate again, elementwise, from the saved projection (biased by the kernel); its vjp gives d_gate_up.
    gate_up = jnp.where(live, gate_up_out.astype(f32), 0.0)

    def gated_intermediate(gate_up):
        return gated(*split_gate_up(gate_up, interleaved=gate.interleaved), gate.activation, alpha=gate.alpha,
                     limit=gate.limit)

    intermediate, gate_vjp = jax.vjp(gated_intermediate, gate_up)
    out = down_out.astype(f32)

    d_picked = d_y[tokens].astype(f32)
    d_top_k_weights_sorted = jnp.where(live[:, 0], jnp.sum(jnp.where(live, out, 0.0) * d_picked, axis=-1), 0.0)
    d_out = jnp.where(live, d_picked * top_k_weights.reshape(-1)[order].astype(f32)[:, None], 0.0)

    # A swapped weights view's gradient comes in the view's order; swapped back it is again a bitcast.
    d_intermediate, d_down_proj = matmul_backward(d_out.astype(dtype), intermediate.astype(dtype), read.down_proj,
                                                  group_sizes, plan.down_backward)
    if plan.orientation.down_transposed != problem.weights_transposed:
        d_down_proj = jnp.swapaxes(d_down_proj, 1, 2)
    (d_gate_up,) = gate_vjp(d_intermediate.astype(f32))
    d_gate_up = jnp.where(live, d_gate_up, 0.0)
    d_rows, d_gate_up_proj = matmul_backward(d_gate_up.astype(dtype), hidden_states[tokens], read.gate_up_proj,
                                             group_sizes, plan.gate_up_backward)
    if plan.orientation.gate_up_transposed != problem.weights_transposed:
        d_gate_up_proj = jnp.swapaxes(d_gate_up_proj, 1, 2)

    d_hidden = jnp.zeros((num_tokens, problem.hidden), f32).at[tokens].add(d_rows.astype(f32))
    d_top_k_weights = jnp.zeros(order.shape, f32).at[order].set(d_top_k_weights_sorted).reshape(num_tokens, top_k)
    d_expert_weights = ExpertWeights(d_gate_up_proj, d_down_proj)
    if weights.gate_up_bias is not None:
        # Rows past the groups carry zero gradients, so clamping their expert id adds nothing.
        d_expert_weights = d_expert_weights._replace(
            gate_up_bias=jnp.zeros(weights.gate_up_bias.shape, f32).at[bias_rows].add(d_gate_up).astype(
                weights.gate_up_bias.dtype),
            down_bias=jnp.zeros(weights.down_bias.shape, f32).at[bias_rows].add(d_out).astype(weights.down_bias.dtype))
    return d_hidden.astype(dtype), d_top_k_weights.astype(top_k_weights.dtype), d_expert_weights
