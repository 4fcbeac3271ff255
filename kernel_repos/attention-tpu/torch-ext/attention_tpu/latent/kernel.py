"""Latent attention for TPU (multi-head latent attention in its absorbed form), written in Pallas (pure JAX, no
torch): what it computes is `common/latent.py`'s; visibility (causal, offsets, lengths, window, explicit mask) and
soft-cap are `common/masking.py`'s.

* The grid is (batch, head block, query block, KV block). The cache is one KV head shared by every query head, so a
  step takes a block of heads (in decode all of them) against one block of keys, and each KV block is read once per
  head block and query block: in decode, once.
* Keys come from two arrays, the latent [block_kv, L] and the rope [block_kv, R] tiles; the values are the very latent
  tile the keys were read from: nothing is concatenated or read twice. The logits are q_latent . latent^T + q_rope .
  rope^T (two products into one float32 accumulator), the output softmax . latent.
* Decode (up to `tiles.PACKED_QUERIES_MAX` queries) packs the step's heads x queries into the rows of one block
  (q viewed as [B, 1, H x Sq, L], a free reshape; row r is head r // Sq, query r % Sq), so a KV block costs one
  logit product and one value product. A prefill's step loops over its heads, each a query block of rows, against
  the one K/V tile (as the flash kernel's prefill does).
* The online softmax is `common/softmax.py`'s. For every (batch, query block) the range of KV blocks holding a visible
  key is computed up front (`masking.kv_block_ranges`) and reaches the kernel by scalar prefetch; blocks outside it
  are neither computed nor fetched (the index maps clamp into the range, so the pipeline issues no DMA).
* Layouts as XLA stores them by default: the rope keys [B, 1, S, R] at R = 64 (or 32) are stored keys-minor over
  more than 64 keys (`layout.sequence_minor_by_default`) and read as their swapped view [B, 1, R, S], a free bitcast;
  so is a prefill's q_rope, transposed once per query block into a scratch of rows. The latent (L a multiple of 128)
  and q_latent are stored row-major.
* No padding copies: the logits of keys past a sequence's length or the cache's end are masked to -inf before the
  exponential, and in the one block a sequence's length ends in the values past it are zeroed before the value
  product (0 x NaN is NaN), so whatever lies there never reaches the result. Rows that see no key come out as zeros.
* Attention sinks (one learned logit per query head, as HY-v4 has them) start each row's running max and sum (max =
  sink, sum = 1: `softmax.start`); a packed row takes its head's sink. A row that sees no key still comes out as
  zeros: its sum is the sink's alone, its accumulator 0.

`call` runs the kernel as a `plan.LatentPlan` says; `latent_attention` is the JAX function. Inputs are assumed
valid: the torch op checks them (`latent_ops.py`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._hardware import TpuGeneration, resolve_target
from ..common import masking, softmax
from ..common.heads import loop_over_heads
from ..common.latent import latent_problem
from ..common.masking import Attention, Prepared
from .plan import LatentPlan, make
from .tiles import LatentConfig


class _Refs(NamedTuple):
    q_latent: object  # [slices, rows, L]
    q_rope: object | None  # [slices, rows, R], or queries-minor [slices, R, rows]
    latent: object  # [block_kv, L]
    rope: object | None  # [block_kv, R], or keys-minor [R, block_kv]
    mask: object | None  # [mask rows, block_kv]: the step's queries
    sinks: object | None  # f32 [rows, 1] (packed: each row its head's) or [slices, 1, 1]
    out: object  # [slices, rows, L]
    max: object  # [slices, rows, 1] f32
    sum: object  # [slices, rows, 1] f32
    acc: object  # [slices, rows, L] f32
    q_rope_rows: object | None  # [slices, rows, R]: queries-minor q_rope transposed once per query block

    @property
    def softmax(self) -> softmax.SoftmaxState:
        return softmax.SoftmaxState(self.max, self.sum, self.acc)


def _refs(plan: LatentPlan, refs) -> _Refs:
    """The kernel's refs by name, from the positional ones (the absent inputs and scratch left out)."""
    refs = list(refs)
    attention = plan.problem.attention
    has_rope, has_mask = plan.problem.rope_dim > 0, attention.mask_kind is not None

    def take(present):
        return refs.pop(0) if present else None

    q_latent, q_rope, latent, rope, mask = take(True), take(has_rope), take(True), take(has_rope), take(has_mask)
    sinks = take(attention.has_sinks)
    out, max_ref, sum_ref, acc = (take(True) for _ in range(4))
    return _Refs(q_latent, q_rope, latent, rope, mask, sinks, out, max_ref, sum_ref, acc,
                 take(plan.q_rope_queries_minor))


class _Position(NamedTuple):
    """Where a grid step is: its KV block's first key, its first query's position, the batch's valid keys."""

    key_start: object
    q_first: object
    kv_valid: object


def _row_queries(plan: LatentPlan, shape):
    """The query (of the step's) each row of a tile of `shape` holds: packed rows are head-major, so row r holds
    query r % Sq; a prefill slice's rows are its query block's."""
    rows = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    return jax.lax.rem(rows, plan.problem.attention.q_len) if plan.packed else rows


def _mask_rows(plan: LatentPlan, mask_tile, shape):
    """The explicit mask's tile [the step's queries, block_kv] as float32 rows of the logits' tile `shape`. Packed
    rows pick their query's row (a select per query: the few of a decode step); one query broadcasts."""
    mask = mask_tile.astype(jnp.float32)
    q_len = plan.problem.attention.q_len
    if not plan.packed or q_len == 1:
        return mask
    query = _row_queries(plan, shape)
    rows = jnp.broadcast_to(mask[0:1], shape)
    for i in range(1, q_len):
        rows = jnp.where(query == i, mask[i:i + 1], rows)
    return rows


def _visibility(refs: _Refs, at: _Position, plan: LatentPlan):
    """(visible, bias or None) of a tile that needs element masks."""
    attention = plan.problem.attention
    shape = (plan.rows, plan.block_kv)
    key_pos = at.key_start + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    if plan.packed and attention.q_len == 1:
        query_pos = at.q_first
    else:
        query_pos = at.q_first + _row_queries(plan, shape)
    visible = masking.positional_visibility(attention, query_pos, key_pos, at.kv_valid)
    bias = None
    if refs.mask is not None:
        allowed, bias = masking.explicit_mask(attention, _mask_rows(plan, refs.mask[...], shape))
        visible = visible & jnp.broadcast_to(allowed, shape)
        if bias is not None:
            bias = jnp.broadcast_to(bias, shape)
    return visible, bias


def _attend_block(refs: _Refs, at: _Position, plan: LatentPlan, apply_mask: bool, zero_values: bool) -> None:
    """The online softmax over one KV block for every slice of the step: the keys are the latent and rope tiles, the
    values the latent tile (zeroed past the valid keys where `zero_values`: the block a sequence's length ends in)."""
    attention = plan.problem.attention
    precision = attention.precision
    visible, bias = _visibility(refs, at, plan) if apply_mask else (None, None)
    latent = refs.latent[...]
    if zero_values:
        key_pos = at.key_start + jax.lax.broadcasted_iota(jnp.int32, (plan.block_kv, 1), 0)
        latent = jnp.where(key_pos < at.kv_valid, latent, jnp.zeros_like(latent))
    q_rope = refs.q_rope if refs.q_rope_rows is None else refs.q_rope_rows

    def attend(s):
        raw = softmax.raw_logits(refs.q_latent[s], latent, key_axis=0, precision=precision)
        if refs.rope is not None:
            raw = raw + softmax.raw_logits(q_rope[s], refs.rope[...], key_axis=1 if plan.rope_keys_minor else 0,
                                           precision=precision)
        logits = masking.capped_logits(attention, raw)
        if bias is not None:
            logits = logits + bias
        if visible is not None:
            logits = jnp.where(visible, logits, -jnp.inf)
        softmax.update(refs.softmax, s, logits, latent, key_axis=0, precision=precision)

    loop_over_heads(plan.slices, attend)


def _latent_kernel(q_offset_ref, kv_valid_ref, block_lo_ref, block_hi_ref, *refs, plan: LatentPlan):
    refs = _refs(plan, refs)
    attention = plan.problem.attention
    b, qi, kv_step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    slot = b * plan.num_q_blocks + qi
    # The KV steps of a query block walk its range of KV blocks from the first.
    kv_block = block_lo_ref[slot] + kv_step

    @pl.when(kv_step == 0)
    def _init():
        softmax.start(refs.softmax, None if refs.sinks is None else refs.sinks[...])
        if refs.q_rope_rows is not None:
            def transpose_query(s):
                refs.q_rope_rows[s] = refs.q_rope[s].T

            loop_over_heads(plan.slices, transpose_query)

    q_offset, kv_valid = q_offset_ref[b], kv_valid_ref[b]
    key_start = kv_block * plan.block_kv
    q_first, q_last = masking.query_block_positions(attention, q_offset, qi, plan.block_q)
    needs_mask = masking.tile_needs_mask(attention, key_start=key_start, block_kv=plan.block_kv, kv_valid=kv_valid,
                                         q_first=q_first, q_last=q_last)
    at = _Position(key_start, q_first, kv_valid)
    in_range = kv_block <= block_hi_ref[slot]
    ends_in_block = key_start + plan.block_kv > kv_valid
    masking.run_tile(in_range & jnp.logical_not(ends_in_block), needs_mask,
                     lambda apply_mask: _attend_block(refs, at, plan, apply_mask, zero_values=False))
    pl.when(in_range & ends_in_block)(lambda: _attend_block(refs, at, plan, True, zero_values=True))

    @pl.when(kv_step == plan.num_kv_steps - 1)
    def _finalize():
        refs.out[...] = softmax.normalized(refs.softmax, ...).astype(refs.out.dtype)


class _Operands(NamedTuple):
    """The arrays the kernel reads (as it views them) and their block specs, in the kernel's order."""

    arrays: list
    specs: list


def _query_operands(q_latent, q_rope, plan: LatentPlan) -> tuple[_Operands, pl.BlockSpec]:
    """(q_latent's and q_rope's operands, the output's spec). Packed, each is viewed as [B, 1, H x Sq, width] (a
    free reshape: a step's heads x queries become the rows of one slice), and so is the output; else [B, H, Sq,
    width] blocks of a query block of the step's heads, q_rope queries-minor as its swapped view [B, H, R, Sq] (a
    bitcast of XLA's layout) where the plan says so."""
    batch, heads, q_len, _ = q_latent.shape
    hps, block_q = plan.heads_per_step, plan.block_q
    arrays = [q_latent] if q_rope is None else [q_latent, q_rope]
    if plan.packed:
        def packed_index_map(b, h, qi, kv_step, *_):
            return (b, 0, h, 0)

        views = [x.reshape(batch, 1, heads * q_len, x.shape[-1]) for x in arrays]
        specs = [pl.BlockSpec((None, 1, plan.rows, x.shape[-1]), packed_index_map) for x in views]
        return _Operands(views, specs), specs[0]

    def index_map(b, h, qi, kv_step, *_):
        return (b, h, qi, 0)

    def queries_minor_index_map(b, h, qi, kv_step, *_):
        return (b, h, 0, qi)

    specs = [pl.BlockSpec((None, hps, block_q, x.shape[-1]), index_map) for x in arrays]
    if plan.q_rope_queries_minor:
        arrays[1] = jnp.swapaxes(q_rope, 2, 3)
        specs[1] = pl.BlockSpec((None, hps, q_rope.shape[-1], block_q), queries_minor_index_map)
    return _Operands(arrays, specs), specs[0]


def _cache_operands(latent, rope, mask, plan: LatentPlan) -> _Operands:
    """The latent's, the rope's ([B, 1, S, R], or keys-minor its view [B, 1, R, S]) and the mask's operands, each
    block the step's KV block of its range (clamped: no DMA past the range)."""
    nq, block_kv, block_q = plan.num_q_blocks, plan.block_kv, plan.block_q

    def kv_block(b, qi, kv_step, lo_ref, hi_ref):
        return masking.block_of_step(lo_ref, hi_ref, b * nq + qi, kv_step)

    def rows_index_map(b, h, qi, kv_step, q_offset_ref, kv_valid_ref, lo_ref, hi_ref):
        return (b, 0, kv_block(b, qi, kv_step, lo_ref, hi_ref), 0)

    operands = _Operands([latent], [pl.BlockSpec((None, None, block_kv, latent.shape[-1]), rows_index_map)])
    if rope is not None:
        rope_dim = rope.shape[-1]
        if plan.rope_keys_minor:
            def keys_minor_index_map(b, h, qi, kv_step, q_offset_ref, kv_valid_ref, lo_ref, hi_ref):
                return (b, 0, 0, kv_block(b, qi, kv_step, lo_ref, hi_ref))

            operands.arrays.append(jnp.swapaxes(rope, 2, 3))
            operands.specs.append(pl.BlockSpec((None, None, rope_dim, block_kv), keys_minor_index_map))
        else:
            operands.arrays.append(rope)
            operands.specs.append(pl.BlockSpec((None, None, block_kv, rope_dim), rows_index_map))
    if mask is not None:
        broadcast_batch = mask.shape[0] == 1

        def mask_index_map(b, h, qi, kv_step, q_offset_ref, kv_valid_ref, lo_ref, hi_ref):
            return (0 if broadcast_batch else b, 0, qi, kv_block(b, qi, kv_step, lo_ref, hi_ref))

        operands.arrays.append(mask)
        operands.specs.append(pl.BlockSpec((None, None, block_q, block_kv), mask_index_map))
    return operands


def _sinks_operands(sinks, plan: LatentPlan) -> _Operands:
    """The sinks (float32 [H], or None: no operand) laid out to broadcast onto a step's running max [slices, rows,
    1]: packed, one per row ([H x Sq, 1], each head's repeated over its queries, the rows head-major); else one per
    slice ([H, 1, 1])."""
    if sinks is None:
        return _Operands([], [])
    if plan.packed:
        rows = jnp.repeat(sinks, plan.problem.attention.q_len)[:, None]
        return _Operands([rows], [pl.BlockSpec((plan.rows, 1), lambda b, h, *_: (h, 0))])
    return _Operands([sinks[:, None, None]], [pl.BlockSpec((plan.heads_per_step, 1, 1), lambda b, h, *_: (h, 0, 0))])


def _cost_estimate(q_latent, latent, plan: LatentPlan) -> pl.CostEstimate:
    """The cost for XLA's scheduler: the visible pairs' work, q and out moved once, the cache once per pass (per head
    block and query block)."""
    problem = plan.problem
    batch, heads = q_latent.shape[:2]
    itemsize = jnp.dtype(q_latent.dtype).itemsize
    pairs = batch * heads * masking.static_visible_pairs(problem.attention)
    passes = masking.static_kv_passes(problem.attention, plan.block_q, plan.block_kv) * (heads // plan.heads_per_step)
    cache_bytes = batch * problem.attention.kv_len * problem.key_dim * itemsize
    q_bytes = batch * heads * problem.attention.q_len * problem.key_dim * itemsize
    return pl.CostEstimate(flops=int(2 * pairs * (problem.key_dim + problem.latent_dim)), transcendentals=int(pairs),
                           bytes_accessed=int(2 * q_bytes + cache_bytes * passes))


def call(q_latent: jax.Array, q_rope: jax.Array | None, latent: jax.Array, rope: jax.Array | None,
         prepared: Prepared, plan: LatentPlan) -> jax.Array:
    """The kernel as `plan` says, on the call's arrays (q_rope and rope None where R = 0) and those `prepare` made of
    its options: the output [B, H, Sq, L] (inputs of the plan's non-empty problem, assumed valid)."""
    batch, heads, _, latent_dim = q_latent.shape
    block_lo, block_hi = masking.kv_block_ranges(plan.problem.attention, prepared, plan.block_q, plan.block_kv)
    queries, out_spec = _query_operands(q_latent, q_rope, plan)
    cache = _cache_operands(latent, rope, prepared.mask, plan)
    sinks = _sinks_operands(prepared.sinks, plan)
    slices, rows = plan.slices, plan.rows
    scratch = [pltpu.VMEM((slices, rows, 1), jnp.float32), pltpu.VMEM((slices, rows, 1), jnp.float32),
               pltpu.VMEM((slices, rows, latent_dim), jnp.float32)]
    if plan.q_rope_queries_minor:
        scratch.append(pltpu.VMEM((slices, rows, plan.problem.rope_dim), q_latent.dtype))
    out = pl.pallas_call(
        functools.partial(_latent_kernel, plan=plan),
        out_shape=jax.ShapeDtypeStruct(queries.arrays[0].shape, q_latent.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(batch, heads // plan.heads_per_step, plan.num_q_blocks, plan.num_kv_steps),
            in_specs=[*queries.specs, *cache.specs, *sinks.specs],
            out_specs=out_spec,
            scratch_shapes=scratch,
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=plan.vmem_limit_bytes,
        ),
        cost_estimate=_cost_estimate(q_latent, latent, plan),
        name="attention_tpu_latent",
    )(prepared.q_offset, prepared.kv_valid, block_lo, block_hi, *queries.arrays, *cache.arrays, *sinks.arrays)
    return out.reshape(q_latent.shape)


def attend(q_latent: jax.Array, q_rope: jax.Array | None, latent: jax.Array, rope: jax.Array | None,
           attention: Attention, target: TpuGeneration, config: LatentConfig | None = None) -> jax.Array:
    """`latent_attention` of an `Attention` value on `target` (a generation's facts, resolved once). Without a batch,
    a head, a query or a key no kernel runs: every row sees no key."""
    batch, heads, q_len, _ = q_latent.shape
    if 0 in (batch, heads, q_len, latent.shape[2]):
        return jnp.zeros(q_latent.shape, q_latent.dtype)
    problem, prepared = latent_problem(q_latent, q_rope, latent, attention)
    return call(q_latent, q_rope, latent, rope, prepared, make(problem, target, config))


def latent_attention(q_latent: jax.Array, q_rope: jax.Array | None, latent: jax.Array, rope: jax.Array | None, *,
                     config: LatentConfig | None = None, generation: str | TpuGeneration | None = None,
                     **options) -> jax.Array:
    """Latent attention of q_latent [B, H, Sq, L] and q_rope [B, H, Sq, R] over the cache latent [B, 1, S, L] and
    rope [B, 1, S, R] (q_rope and rope None where R = 0) -> [B, H, Sq, L] in q's dtype (`common/latent.py`).

    `options` are those of `masking.Attention`: scale (default (L + R) ** -0.5), causal, q_offset (int or [B]),
    kv_lengths [B], sliding_window, softcap, attention_mask [B or 1, 1, Sq, S] (bool or int8, nonzero = attend, or
    floating, additive), sinks [H] (float; one logit per query head in every row's softmax, attending to nothing; a
    row that sees no key is still 0). Tiles: `config`, else `tiles.select`'s for `generation` (a name or its facts;
    default this device's), resolved once here. Not differentiable (inference only). Inputs are assumed valid
    (the torch op checks them).
    """
    return attend(q_latent, q_rope, latent, rope, Attention(**options), resolve_target(generation), config)
