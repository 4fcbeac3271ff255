"""The whole routed-experts computation of a gated MoE layer as one JAX function.

`experts_layer` describes the call (`problem.ExpertsProblem`) and plans it
once (`plan.plan_experts`); everything below runs that plan. Two ways to
run it, picked by the plan (the rule is `plan.fused_path_config`):
- decode-sized calls: one fused kernel (`fused.kernel.fused_experts`) that
  streams each active expert's weights once and keeps everything else in VMEM;
- larger calls: sort the picks by expert, two grouped matmuls
  (`gmm.kernel.call`, each adding its biases; the first copying
  each pick's row from its token where it can) with the gate between them,
  then each token's picks weighted and summed in f32 (where it can, by the
  combine kernel, `combine/kernel.py`, which copies only the live picks' rows).
Either way, on a TPU this is one compiled program per layer instead of a
chain of small torch ops, and expert-parallel sentinel picks
(id == num_experts) get no kernel work.

`experts_layer` is differentiable (`jax.custom_vjp`). Under differentiation
the forward always takes the grouped path, whose two kernel outputs are the
residuals the backward needs (`backward.grouped_experts_backward`: two d_lhs
grouped matmuls and two tgmm, nothing recomputed but the elementwise gate).
The fused decode kernel keeps nothing of its intermediate (that is its
point), so it has no backward of its own: its backward would have to run the
grouped forward anyway, and training calls are large (T in the thousands),
where the rule picks the grouped path regardless.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ._hardware import TpuGeneration, resolve_target
from .backward import grouped_experts_backward, without_gradient
from .combine import kernel as combine_kernel
from .common.gates import gated, split_gate_up
from .common.routing import sort_by_expert
from .fused import kernel as fused_kernel
from .gmm import kernel as gmm_kernel
from .plan import ExpertsPlan, plan_experts
from .problem import ExpertsProblem, ExpertWeights, describe_experts


def experts_layer(hidden_states: jax.Array, top_k_index: jax.Array, top_k_weights: jax.Array, *weights: jax.Array | None,
                  fused: bool | None = None, generation: str | TpuGeneration | None = None, **gate) -> jax.Array:
    """Gated experts per pick, weighted and summed per token.

    `weights` and `gate` (activation, weights_transposed, interleaved, alpha,
    limit) as `problem.describe_experts` takes them. `fused` forces one of
    the two paths (None: the rule, `plan.fused_path_config`); `generation`
    (a name or a target, resolved here) picks the tiles (None: this device's). Differentiable in hidden_states,
    top_k_weights, the weights and biases (module docstring); sentinel picks
    get a zero routing-weight gradient. Without tokens, picks, hidden size or experts
    the result is zeros and no kernel runs; without intermediate columns each pick
    adds its expert's down bias (nothing without biases), and no kernel runs either.
    """
    problem, weights = describe_experts(hidden_states, top_k_index, top_k_weights, *weights, **gate)
    if problem.empty:
        return jnp.zeros(hidden_states.shape, hidden_states.dtype)
    if problem.intermediate == 0:
        return _routed_down_bias(hidden_states, top_k_index, top_k_weights, weights.down_bias)
    plan = plan_experts(problem, resolve_target(generation), fused=fused)
    return planned_experts(plan, hidden_states, top_k_index, top_k_weights, weights)


def _routed_down_bias(hidden_states, top_k_index, top_k_weights, down_bias) -> jax.Array:
    """The layer when the experts have no intermediate columns: every expert's output is its down bias."""
    if down_bias is None:
        return jnp.zeros(hidden_states.shape, hidden_states.dtype)
    live = top_k_index < down_bias.shape[0]  # a sentinel pick (another rank's expert) adds nothing
    picked = jnp.take(down_bias, jnp.where(live, top_k_index, 0), axis=0).astype(jnp.float32)
    routing = jnp.where(live, top_k_weights, 0).astype(jnp.float32)
    return jnp.einsum("tk,tkh->th", routing, picked).astype(hidden_states.dtype)


def planned_experts(plan: ExpertsPlan, hidden_states: jax.Array, top_k_index: jax.Array, top_k_weights: jax.Array,
                    weights: ExpertWeights) -> jax.Array:
    """`experts_layer` as `plan` says; one-byte weights run without a gradient (they serve inference)."""
    if weights.quantized:
        return without_gradient("gated_experts", functools.partial(_experts_forward, plan), hidden_states,
                                top_k_index, top_k_weights, weights)
    return _differentiable_experts(plan, hidden_states, top_k_index, top_k_weights, weights)


def _experts_forward(plan: ExpertsPlan, hidden_states, top_k_index, top_k_weights, weights: ExpertWeights):
    if plan.fused is not None:
        read = weights.as_read(plan.orientation, weights_transposed=plan.problem.weights_transposed)
        return fused_kernel.call(hidden_states, top_k_index, top_k_weights, read, plan.fused)
    return grouped_experts(plan, hidden_states, top_k_index, top_k_weights, weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _differentiable_experts(plan: ExpertsPlan, hidden_states, top_k_index, top_k_weights, weights):
    return _experts_forward(plan, hidden_states, top_k_index, top_k_weights, weights)


def _experts_vjp_forward(plan: ExpertsPlan, hidden_states, top_k_index, top_k_weights, weights):
    out, kernel_outputs = grouped_experts(plan, hidden_states, top_k_index, top_k_weights, weights,
                                          return_residuals=True)
    return out, (hidden_states, top_k_index, top_k_weights, weights, kernel_outputs)


def _experts_vjp_backward(plan: ExpertsPlan, residuals, d_out):
    hidden_states, top_k_index, top_k_weights, weights, kernel_outputs = residuals
    d_hidden, d_top_k_weights, d_expert_weights = grouped_experts_backward(
        plan, d_out, hidden_states, top_k_index, top_k_weights, weights, *kernel_outputs)
    # The expert ids are integers: no cotangent.
    return d_hidden, None, d_top_k_weights, d_expert_weights


_differentiable_experts.defvjp(_experts_vjp_forward, _experts_vjp_backward)


def grouped_experts(
    plan: ExpertsPlan,
    hidden_states: jax.Array,
    top_k_index: jax.Array,
    top_k_weights: jax.Array,
    weights: ExpertWeights,
    return_residuals: bool = False,
) -> jax.Array | tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """`experts_layer` as two grouped matmuls around XLA ops, with `plan`'s tiles.

    With `return_residuals`, also the two kernels' outputs `(gate_up_out,
    down_out)` that `backward.grouped_experts_backward` differentiates from.

    The grouped matmuls compute only the rows of live picks: sentinels sort
    to the tail, past every group, and the kernels leave those rows unwritten
    (`zero_rows_past_groups=False`); everything that reads them here masks
    them first. Without residuals the first kernel runs
    `plan.forward_gate_up`: where it can, it copies each pick's row from its
    token itself (no `[T x K, H]` gather in XLA; sentinel picks copy
    nothing) and gates its own output; otherwise the gate runs in XLA. The
    backward needs the sorted rows, so with residuals they are gathered in
    XLA. Without residuals, where it can (`plan.combine`), the second kernel
    leaves its rows as packed words and the combine kernel sums each token's
    live picks, copying only their rows; otherwise the per-token sum runs in
    XLA over all T x K picks. The biases are the kernels'
    (`MatmulProblem.bias`). Each projection is read in the order
    XLA stores it (`plan.orientation`).
    """
    problem, gate = plan.problem, plan.problem.gate
    top_k, num_experts = problem.top_k, problem.num_experts
    read = weights.as_read(plan.orientation, weights_transposed=problem.weights_transposed)
    order, group_sizes = sort_by_expert(top_k_index, num_experts)
    first = plan.gate_up if return_residuals else plan.forward_gate_up
    row_token = (order // top_k).astype(jnp.int32)
    if first.problem.gathered:
        first_out = gmm_kernel.call(hidden_states, read.gate_up_proj, group_sizes, first, read.gate_up_scales,
                                    weights.gate_up_bias, row_token)
    else:
        first_out = gmm_kernel.call(hidden_states[row_token], read.gate_up_proj, group_sizes, first,
                                    read.gate_up_scales, weights.gate_up_bias)
    if first.problem.gate is not None:
        activated = first_out
    else:
        live = (jnp.arange(first_out.shape[0]) < group_sizes.sum())[:, None]
        # Split before casting: XLA then fuses the split, the casts and the gate into one pass over the kernel's
        # bf16 output; splitting the f32 sum instead makes it write and reread [M, 2I] f32 copies (GPT-OSS's
        # even/odd columns: 4 of them).
        gate_part, up = (part.astype(jnp.float32) for part in split_gate_up(first_out, interleaved=gate.interleaved))
        # Rows past the groups were never written: keep whatever they hold out of the gate.
        activated = gated(jnp.where(live, gate_part, 0.0), jnp.where(live, up, 0.0), gate.activation,
                          alpha=gate.alpha, limit=gate.limit).astype(hidden_states.dtype)
    down = plan.down if return_residuals else plan.forward_down
    down_out = gmm_kernel.call(activated, read.down_proj, group_sizes, down, read.down_scales, weights.down_bias)
    position, live = _pick_positions(order, group_sizes, problem)
    if down.problem.packed_out:
        return combine_kernel.call(down_out, position, top_k_weights, live, plan.combine)
    result = _weighted_sum_per_token(down_out, position, live, top_k_weights, problem).astype(hidden_states.dtype)
    return (result, (first_out, down_out)) if return_residuals else result


def _pick_positions(order, group_sizes, problem: ExpertsProblem) -> tuple[jax.Array, jax.Array]:
    """Each pick's row among the sorted rows, and whether it is live (in a group: not a sentinel): [T, K] each."""
    position = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    position = position.reshape(problem.tokens, problem.top_k)
    return position, position < group_sizes.sum()


def _weighted_sum_per_token(down_out, position, live_picks, top_k_weights, problem: ExpertsProblem) -> jax.Array:
    """Each token's picks' rows of `down_out` (sorted by expert, biased by the kernel), weighted and summed: [T, H]
    f32.

    One pick slot at a time: XLA fuses the gathers, the masks and the sum
    into one pass that reads each pick's row once and writes [T, H].
    (Un-sorting by a scatter instead writes and rereads T x K f32 rows three
    times, most of a prefill layer's HBM traffic; a [T, K, H] gather is
    relaid out when K is not a multiple of 8.)
    """
    num_tokens, top_k = problem.tokens, problem.top_k
    pick_weights = jnp.where(live_picks, top_k_weights.astype(jnp.float32), 0.0)
    result = jnp.zeros((num_tokens, problem.hidden), jnp.float32)
    for slot in range(top_k):
        # Rows past the groups were never written: masked before they are weighted.
        picked = jnp.where(live_picks[:, slot, None], down_out[position[:, slot]].astype(jnp.float32), 0.0)
        result = result + pick_weights[:, slot, None] * picked
    return result
