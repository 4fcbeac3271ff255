"""The experts layer of a decode step as one Pallas TPU kernel.

`fused_experts(hidden_states[T, H], top_k_index[T, K], top_k_weights[T, K],
gate_up_proj, down_proj, biases...) -> [T, H]`: for each active expert,
gate_up -> gated activation -> down on the rows that picked it, weighted by
their routing weights and summed into the tokens' outputs, with every
intermediate in VMEM.

Schedule: the grid is (steps, I tiles); an item is one active expert
(`common.routing.expert_plan`), and each step runs `plan.experts_per_step` items
one after the other, each from its own slot of weights blocks (several only
with the whole I: a grid step has a fixed cost, which they then share). So:
- an expert without picks has no grid step and its weights are never read;
  other ranks' sentinel picks reach no item at all;
- each active expert's weights are read exactly once (one block per I tile);
- the hidden states are one resident block read once, and the output one
  resident block written once, at the last step.
A call without live picks runs one empty item over one I tile (Pallas
fetches the blocks of a grid's first step; a zero-step grid is not relied
upon): it writes zeros and reads one block of one expert's weights.

On a megacore device (v5p: two TensorCores, `plan.cores` 2) the grid is
(cores, steps per core, I tiles per core), its first axis "parallel", and
each core sums into an f32 partial output of its own, which XLA adds. The
cores split either the items (`plan.cores_per_expert` 1: each takes a
contiguous half) or every item's I tiles (`plan.cores_per_expert` 2: each
takes a contiguous run of them, the second core one fewer when they are
odd, its last step then computing nothing). A slot past its core's items is
empty and keeps the blocks of its last real item, which the pipeline does
not fetch again (`schedule.slot_item`), as does a step past the core's I tiles;
only at a core's first step can a slot without any item fetch blocks it
does not use.

The routing (`top_k_index`, `top_k_weights`) is resident too. At each item
the kernel sums each token's weights for the item's expert; the expert's
rows are the tokens of nonzero weight, in token order (a row's rank is the
count of such tokens before it, a matmul with a triangular matrix). Rows are
worked in chunks of `chunk_rows`, by a loop over the chunks the expert's
picks fill. A chunk gathers its rows from the resident
hidden states with a one-hot matmul (`[T, c]` one-hot, contracted over the
tokens: exact), runs the expert, and scatters its results back with the
one-hot scaled by the routing weights (exact for weights the activation
dtype holds; f32 weights under bf16 activations go in two bf16 parts). The
one-hot matmuls cost 2 x T x H multiply-adds per row, which decode hides
under the weights' DMA (see plan.FUSED_MAX_TOKENS).

Interleaved gate/up columns (GPT-OSS) are split in the transposed
orientation: the chunk's gate_up projection is computed as `[2 I, c]`, whose
even and odd rows Mosaic reads with strided loads (lanes have no strided
load); with fp8 on the fp8 MXU, in row orientation, by a 0/1 matmul per 256
columns (`common.gates.deinterleaved_gated`), each giving the down projection one
K block. Biases come in blocks of tiles.BIAS_BLOCK_EXPERTS experts (int8's
and int4's scales in blocks of SCALE_BLOCK_EXPERTS) and the kernel selects
its expert's row.

Quantized weights (`common/quant.py`) are read as one byte each (int4: half a
byte): int8 blocks are cast to the activation dtype at each matmul; fp8 and
int4 blocks are dequantized (int4: unpacked) once per step into VMEM scratch,
which the matmuls read, except fp8 on a generation with an fp8 MXU
(`plan.fp8_matmul`), whose matmuls take the fp8 blocks as they are and the
rows quantized to fp8 (`common.quant.fp8_matmul`); int8's and int4's per-channel
scales multiply the matmul's result (as the biases, in blocks of
SCALE_BLOCK_EXPERTS experts). The plan picks these once (`fused/expert.py`):
the weights' decoder (`weights_decoder`: how blocks are made ready each step
and multiplied) and the gate's layout (`expert_rows_of`: gate-then-up,
interleaved, interleaved on the fp8 MXU); the body only walks items and chunks.

`fused_experts` plans a call (`plan.make`); `call` runs a
plan. Inputs are assumed valid (`ops.py` checks them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._hardware import TpuGeneration, resolve_target
from ..common.quant import INT4, scheme_of
from ..common.routing import expert_plan
from ..problem import ExpertWeights, describe_experts
from .expert import Expert, SlotRefs, dot, expert_bias, expert_rows_of, split_refs, weights_decoder
from .plan import FusedPlan, make
from .schedule import core_i_tile, grid_position, slot_item, slot_spec, weight_blocks
from .tiles import FusedConfig


def _token_columns(index_ref, weights_ref, expert, tokens: int):
    """This expert's routing weight per token and each token's rank among its rows, as `[T, 1]` f32 columns.

    A token's weight is the sum of its picks of the expert (repeated picks
    add up); its rows are the tokens of nonzero weight. The rank is a prefix
    count, a matmul of the 0/1 mask with a strictly lower triangle: 0/1
    operands in one bf16 pass and sums below 2^24, exact.
    """
    weights = jnp.sum(jnp.where(index_ref[...] == expert, weights_ref[...].astype(jnp.float32), 0.0), axis=1,
                      keepdims=True)
    row = lax.broadcasted_iota(jnp.int32, (tokens, tokens), 0)
    col = lax.broadcasted_iota(jnp.int32, (tokens, tokens), 1)
    picked = (weights != 0.0).astype(jnp.float32)
    rank = dot((col < row).astype(jnp.float32), picked, 1, 0, lax.Precision.DEFAULT)
    return weights, rank


def _expert_step(slot: int, refs: SlotRefs, expert_ref, rows_ref, count_ref, hidden_ref, index_ref, weights_ref,
                 core, step, i_step, last_i, plan: FusedPlan) -> None:
    """One slot's expert at this grid step: its rows gathered, run through the I tile, weighted and added to
    their tokens' outputs (a loop over the chunks its picks fill, none for a slot without an item; `pl.when`s skip
    a step past the core's I tiles)."""
    problem, chunk = plan.problem, plan.chunk_rows
    dtype = hidden_ref.dtype
    item, real = slot_item(core, step, slot, count_ref[0], plan)
    expert_id, picks = expert_ref[item], jnp.where(real, rows_ref[item], 0)
    i_tile, own_tile = core_i_tile(core, i_step, plan)
    decoder = weights_decoder(plan)
    blocks = decoder.ready(refs, picks, own_tile, i_tile, plan)
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT
    valid_i = problem.intermediate - i_tile * plan.tile_i if problem.intermediate % plan.tile_i else None
    expert = Expert(expert_id, decoder, *blocks, dtype, precision, valid_i)
    weight_column, rank_column = _token_columns(index_ref, weights_ref, expert_id, problem.tokens)

    def one_hot(first):
        """[T, chunk]: column r is the one-hot of the expert's row first + r (none past its rows)."""
        slot_rows = (first + lax.broadcasted_iota(jnp.int32, (1, chunk), 1)).astype(jnp.float32)
        return jnp.logical_and(weight_column != 0.0, rank_column == slot_rows)

    def gather(first):
        return dot(one_hot(first).astype(dtype), hidden_ref[...], 0, 0, precision).astype(dtype)

    def scatter(first, out_rows):
        """Adds the chunk's rows, times their routing weights, to their tokens' outputs."""
        if refs.down_bias is not None:
            bias = expert_bias(refs.down_bias, expert_id)
            # Cores sharing the expert each scatter a partial sum over their I tiles: the bias goes in one.
            out_rows = out_rows + (bias if plan.cores_per_expert == 1 else jnp.where(core == 0, bias, 0.0))
        out_rows = out_rows.astype(dtype)
        weighted = jnp.where(one_hot(first), weight_column, 0.0)  # [T, chunk] f32
        high = weighted.astype(dtype)
        total = dot(high, out_rows, 1, 0, precision)
        if jnp.dtype(problem.routing_dtype).itemsize > jnp.dtype(problem.dtype).itemsize:
            # f32 routing weights under narrower activations: scattered in two parts, exact.
            low = (weighted - high.astype(jnp.float32)).astype(dtype)
            total = total + dot(low, out_rows, 1, 0, precision)
        refs.out_acc[...] += total

    # A loop over the expert's live chunks, not one `pl.when` per chunk unrolled: Mosaic's compile time grows
    # with the matmuls the body holds (chunks x experts_per_step copies unrolled, experts_per_step looped),
    # and the traffic model counts the loop's trips at each step from its bound.
    # picks >= 0, so truncating division; `//` lowers `sign`, whose Mosaic rule needs a TPU device.
    live_chunks = lax.div(picks + chunk - 1, chunk)
    if plan.i_tiles_per_core == 1:  # each core's I tile, if any, is its own: the second of two
        def run_chunk(j, carry):
            first = pl.multiple_of(j * chunk, chunk)
            scatter(first, expert_rows_of(plan)(gather(first), refs, expert, plan))
            return carry

        lax.fori_loop(0, live_chunks, run_chunk, ())
        return
    _chunks_over_i_tiles(live_chunks, own_tile, i_step, last_i, gather, scatter, refs, expert, plan)


def _body(expert_ref, rows_ref, count_ref, hidden_ref, index_ref, weights_ref, *refs, plan: FusedPlan):
    slot_refs = split_refs(refs, plan)
    shared = slot_refs[0]
    core, step, i_step, steps, i_steps = grid_position(plan)
    last_i = i_steps - 1

    @pl.when(jnp.logical_and(step == 0, i_step == 0))
    def _():
        shared.out_acc[...] = jnp.zeros_like(shared.out_acc)

    for slot, refs_of_slot in enumerate(slot_refs):
        _expert_step(slot, refs_of_slot, expert_ref, rows_ref, count_ref, hidden_ref, index_ref, weights_ref, core,
                     step, i_step, last_i, plan)

    @pl.when(jnp.logical_and(step == steps - 1, i_step == last_i))
    def _():
        shared.out[...] = shared.out_acc[...].astype(shared.out.dtype)


def _chunks_over_i_tiles(live_chunks, own_tile, i_step, last_i, gather, scatter, refs: SlotRefs, expert: Expert,
                         plan: FusedPlan) -> None:
    """I tiled: the rows are gathered at the core's first I step, the output summed over its own tiles and
    scattered at its last step. Each phase is a top-level `pl.when` around its loop over the live chunks, so that
    the traffic model evaluates which steps run which matmuls, and how many times."""
    chunk = plan.chunk_rows

    def over_live_chunks(work):
        def run_chunk(j, carry):
            work(pl.ds(pl.multiple_of(j * chunk, chunk), chunk))
            return carry

        def loop():
            lax.fori_loop(0, live_chunks, run_chunk, ())

        return loop

    def gather_rows(rows):
        refs.rows_cache[rows, :] = gather(rows.start)

    def add_tile(rows):
        part = expert_rows_of(plan)(refs.rows_cache[rows, :], refs, expert, plan)
        refs.partial_out[rows, :] = jnp.where(i_step == 0, part, refs.partial_out[rows, :] + part)

    pl.when(i_step == 0)(over_live_chunks(gather_rows))
    pl.when(own_tile)(over_live_chunks(add_tile))
    pl.when(i_step == last_i)(over_live_chunks(lambda rows: scatter(rows.start, refs.partial_out[rows, :])))


def fused_experts(hidden_states: jax.Array, top_k_index: jax.Array, top_k_weights: jax.Array, *weights: jax.Array | None,
                  config: FusedConfig | None = None, generation: str | TpuGeneration | None = None,
                  **gate) -> jax.Array:
    """Gated experts per pick, weighted and summed per token, in one pallas_call (see the module docstring).

    Arguments as `layer.experts_layer`; picks with id == E are sentinels.
    Blocks: `config`, else the plan's on `generation` (a name or a target, resolved here;
    default this device's: `fused.plan.make`). Inputs are
    assumed valid (`ops.py`). Without tokens, picks, hidden size or experts
    there is nothing to compute: the result is zeros and no kernel runs.
    """
    problem, weights = describe_experts(hidden_states, top_k_index, top_k_weights, *weights, **gate)
    if problem.empty:
        return jnp.zeros(hidden_states.shape, hidden_states.dtype)
    plan = make(problem, resolve_target(generation), config)
    read = weights.as_read(plan.orientation, weights_transposed=problem.weights_transposed)
    return call(hidden_states, top_k_index, top_k_weights, read, plan)


def _cost(plan: FusedPlan, weights: ExpertWeights) -> pl.CostEstimate:
    """What is read: the tokens and the routing once, the weights of the experts expected active (which experts
    are picked is data, unknown when this is traced), the output once."""
    problem = plan.problem
    tokens, hidden, intermediate, picks = problem.tokens, problem.hidden, problem.intermediate, problem.picks
    itemsize = jnp.dtype(problem.dtype).itemsize
    scale_bytes = sum(scales[0].size * 4 for scales in (weights.gate_up_scales, weights.down_scales)
                      if scales is not None)
    weight_bytes = 0.5 if scheme_of(problem.weights_dtype) == INT4 else jnp.dtype(problem.weights_dtype).itemsize
    bytes_per_expert = (3 * intermediate * hidden * weight_bytes
                        + ((2 * intermediate + hidden) * itemsize if problem.has_bias else 0) + scale_bytes)
    routing_bytes = picks * 4 + picks * jnp.dtype(problem.routing_dtype).itemsize
    return pl.CostEstimate(
        flops=int(2 * picks * (3 * intermediate * hidden + 2 * tokens * hidden)),
        transcendentals=int(picks * intermediate),
        bytes_accessed=int(2 * tokens * hidden * itemsize + plan.active_experts * bytes_per_expert + routing_bytes),
    )


def call(hidden_states: jax.Array, top_k_index: jax.Array, top_k_weights: jax.Array, weights: ExpertWeights,
         plan: FusedPlan) -> jax.Array:
    """`fused_experts` as `plan` says, with `weights` as the kernel reads them (`ExpertWeights.as_read`)."""
    problem = plan.problem
    tokens, hidden, top_k, dtype = problem.tokens, problem.hidden, problem.top_k, hidden_states.dtype
    items = expert_plan(top_k_index, problem.num_experts)

    def resident(shape):
        return pl.BlockSpec(shape, lambda *_: (0,) * len(shape), pipeline_mode=pl.Buffered(1))

    specs = weight_blocks(plan, weights)
    scratch = [pltpu.VMEM((tokens, hidden), jnp.float32)]
    if problem.gate.interleaved and not plan.fp8_matmul:
        scratch.append(pltpu.VMEM((2 * plan.tile_i, plan.chunk_rows), jnp.float32))
    if plan.i_tiles_per_core > 1:
        rows = plan.chunks * plan.chunk_rows
        scratch += [pltpu.VMEM((rows, hidden), dtype), pltpu.VMEM((rows, hidden), jnp.float32)]
    # A call without live picks runs its one empty item over one I tile only: one block of weights read.
    i_grid = plan.i_tiles_per_core if plan.i_tiles_per_core == 1 else jnp.where(items.rows[0] > 0,
                                                                                  plan.i_tiles_per_core, 1)
    item_cores = plan.cores // plan.cores_per_expert
    per_core = (items.count[0] + item_cores - 1) // item_cores
    steps = (per_core + plan.experts_per_step - 1) // plan.experts_per_step
    weight_specs = [slot_spec(spec, slot, plan) for slot in range(plan.experts_per_step) for spec in specs.in_specs]
    if plan.cores == 1:
        # Every step adds into the one resident output: no axis can be split.
        grid, semantics = (steps, i_grid), ("arbitrary", "arbitrary")
        out_shape = jax.ShapeDtypeStruct((tokens, hidden), dtype)
        out_spec = pl.BlockSpec((tokens, hidden), lambda *_: (0, 0))
    else:
        grid, semantics = (plan.cores, steps, i_grid), ("parallel", "arbitrary", "arbitrary")
        out_shape = jax.ShapeDtypeStruct((plan.cores, tokens, hidden), jnp.float32)
        out_spec = pl.BlockSpec((None, tokens, hidden), lambda core, *_: (core, 0, 0))
    run = pl.pallas_call(
        functools.partial(_body, plan=plan),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=grid,
            in_specs=[resident((tokens, hidden)), resident((tokens, top_k)), resident((tokens, top_k)),
                      *weight_specs],
            out_specs=out_spec,
            scratch_shapes=scratch + specs.scratch,
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=plan.vmem_limit_bytes),
        cost_estimate=_cost(plan, weights),
        name="fused_experts",
    )
    operands = specs.operands * plan.experts_per_step
    out = run(items.expert, items.rows, items.count, hidden_states, top_k_index, top_k_weights, *operands)
    return out if plan.cores == 1 else jnp.sum(out, axis=0).astype(dtype)
