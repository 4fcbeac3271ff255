"""Flash attention for TPU, written in Pallas (pure JAX, no torch): the forward kernel and the differentiable function.

One forward kernel serves prefill, chunked prefill and decode:

* The grid is (batch, kv_head, q_block, kv_block). One grid step handles the
  whole query-head group of one KV head, so every K/V block is fetched once per
  query block and never once per query head (GQA by head mapping in the index
  maps, no copies of K/V).
* Softmax is computed online in float32 (running max, running sum, float32
  accumulator in VMEM scratch). Attention sinks (a learned logit per query
  head that joins the softmax denominator and attends to nothing, as in
  GPT-OSS) start the running max and sum: max = sink, sum = 1.
* For every (batch, q_block) the range of KV blocks that hold at least one
  visible key is computed up front (`common.masking.kv_block_ranges`) and handed to
  the kernel by scalar prefetch. KV blocks outside that range are neither
  computed (``pl.when``) nor fetched: the K/V index maps clamp the block index
  into the range, so the pipeline sees an unchanged block index and issues no DMA.
* q and k have one head dim D, v and the output another, Dv (equal but for
  latent attention: 192 and 128 expanded, 576 and 512 absorbed).
* Decode (one query position) packs each KV head's group of query heads into
  the rows of one block, so a decode step is one (group, D) x (D, block_kv)
  matmul per KV head and reads each KV block exactly once; one step spans
  several KV heads so that its DMA outweighs the per-step overhead.
* q, K, V and the output are each read and written in the layout XLA stores
  it in by default: row-major [B, H, S, D], or where XLA stores it
  sequence-minor (a head dim that is no multiple of 128, e.g. 64, 192 or
  576, over more than a few positions: `common.layout.sequence_minor_by_default`)
  as its swapped view [B, H, D, S], a free bitcast. Such a K (V) comes in
  [D, block_kv] tiles: the logits are q [rows, D] @ k^T [D, block_kv] (the
  PV product contracts the keys, the lanes of p and of v^T). Such a
  prefill's q comes in [group, D, block_q] tiles, transposed once per query
  block (at its first KV step) into a scratch of rows that every KV step
  multiplies, and such an output block is the finished accumulator
  transposed back: XLU work of the order of one q tile per query block,
  against the block's matmuls. Reading them row-major there would make XLA
  copy each on every call (at decode the whole cache), and the output back.
  Decode reads q row-major: one position is stored so.
* No padding copies: ragged edge blocks are masked with ``jnp.where`` before the
  exponential and the values past the valid length (V rows, or keys-minor
  lanes) are zeroed before the PV matmul, so whatever lies past the arrays'
  ends (NaN in interpret mode) never reaches the result.
* Besides the output the kernel writes the log-sum-exp of every query row
  (float32 [B, Hq, Sq]; -inf for a row that sees no key and has no sink), which
  the backward kernels (`flash_backward/kernel.py`) read instead of recomputing
  the softmax statistics.

Semantics: see `common/masking.py`. Rows that see no key come out as zeros.

`differentiable_flash_attention` is differentiable (a `jax.custom_vjp` whose
backward runs the Pallas kernels of `flash_backward/kernel.py`) with respect
to q, k, v and the sinks. A call's `Problem` (`common.masking.prepare`) gets its
tiles from `tiles.select`, its plan (the grid) from `plan.make`, and `call`
runs it; the backward's seams are `flash_backward`'s.
Inputs are assumed valid: the torch op checks them (`ops.py`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._hardware import TpuGeneration, resolve_target
from ..common import masking, softmax
from ..common.heads import loop_over_heads
from ..common.masking import Attention, Prepared, Problem
from ..common.tiles import AttentionConfig
from ..flash_backward.kernel import attention_backward
from ..flash_backward.tiles import BackwardConfig
from .plan import ForwardPlan, make

class _ForwardRefs(NamedTuple):
    q: object
    k: object
    v: object
    mask: object | None
    sinks: object | None
    out: object
    lse: object
    max: object  # [slices, rows, 1] f32: running max of each row's logits
    sum: object  # [slices, rows, 1] f32: running sum of each row's exponentials
    acc: object  # [slices, rows, Dv] f32
    q_rows: object | None = None  # [slices, rows, D]: q read queries-minor, transposed once per query block

    @property
    def softmax(self) -> softmax.SoftmaxState:
        return softmax.SoftmaxState(self.max, self.sum, self.acc)


class _Position(NamedTuple):
    """Where a grid step is: its KV block's first key, its queries' first position, the batch's offset and length."""

    key_start: object
    q_first: object
    q_offset: object
    kv_valid: object


def _visibility(refs: _ForwardRefs, at: _Position, problem: Problem, plan: ForwardPlan):
    """(visible, bias or None, valid values of the V tile) of a tile that needs element masks."""
    rows, block_kv = problem.group if plan.decode else plan.block_q, plan.block_kv
    key_pos = at.key_start + jax.lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
    if plan.decode:
        query_pos = at.q_offset
    else:
        query_pos = at.q_first + jax.lax.broadcasted_iota(jnp.int32, (rows, block_kv), 0)
    visible = masking.positional_visibility(problem, query_pos, key_pos, at.kv_valid)
    bias = None
    if refs.mask is not None:
        allowed, bias = masking.explicit_mask(problem, refs.mask[...])
        visible = visible & jnp.broadcast_to(allowed, (rows, block_kv))
        if bias is not None:
            bias = jnp.broadcast_to(bias, (rows, block_kv))
    values_minor = plan.sequence_minor.v
    tile = (problem.v_head_dim, block_kv) if values_minor else (block_kv, problem.v_head_dim)
    value_pos = at.key_start + jax.lax.broadcasted_iota(jnp.int32, tile, _key_axis(values_minor))
    return visible, bias, value_pos < at.kv_valid


def _key_axis(keys_minor: bool) -> int:
    """The axis of a K or V tile the keys run along: [block_kv, D] row-major, [D, block_kv] keys-minor."""
    return 1 if keys_minor else 0


def _attend_block(refs: _ForwardRefs, at: _Position, problem: Problem, plan: ForwardPlan, apply_mask: bool) -> None:
    """The online softmax over one KV block for every slice of the step.

    k and v refs are [kv heads of this step, block_kv, D or Dv] (keys-minor:
    [..., D or Dv, block_kv]): one KV head shared by every slice (prefill: the
    group's query heads), or one per slice (decode: a slice is one KV head's
    group of query rows).
    """
    visible = bias = value_valid = None
    if apply_mask:
        visible, bias, value_valid = _visibility(refs, at, problem, plan)
    k_axis, v_axis = _key_axis(plan.sequence_minor.k), _key_axis(plan.sequence_minor.v)

    def load_kv(head):
        k, v = refs.k[head], refs.v[head]
        if value_valid is not None:
            # Zero the values past the valid length (rows, or keys-minor lanes): p is 0 there, but 0 * NaN is NaN.
            v = jnp.where(value_valid, v, jnp.zeros_like(v))
        return k, v

    queries = refs.q if refs.q_rows is None else refs.q_rows

    def attend(s, k, v):
        raw = softmax.raw_logits(queries[s], k, key_axis=k_axis, precision=problem.precision)
        logits = masking.capped_logits(problem, raw)
        if bias is not None:
            logits = logits + bias
        if visible is not None:
            logits = jnp.where(visible, logits, -jnp.inf)
        softmax.update(refs.softmax, s, logits, v, key_axis=v_axis, precision=problem.precision)

    shared_kv = None if plan.decode else load_kv(0)

    def attend_slice(s):
        attend(s, *(load_kv(s) if plan.decode else shared_kv))

    loop_over_heads(refs.max.shape[0], attend_slice)


def _forward_kernel(q_offset_ref, kv_valid_ref, block_lo_ref, block_hi_ref, q_ref, k_ref, v_ref, *rest,
                    problem: Problem, plan: ForwardPlan):
    rest = list(rest)
    mask_ref = rest.pop(0) if problem.mask_kind is not None else None
    sinks_ref = rest.pop(0) if problem.has_sinks else None
    refs = _ForwardRefs(q_ref, k_ref, v_ref, mask_ref, sinks_ref, *rest)
    b, qi, kv_step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    slot = b * plan.num_q_blocks + qi
    # The KV steps of a query block walk its range of KV blocks from the first.
    kv_block = block_lo_ref[slot] + kv_step

    @pl.when(kv_step == 0)
    def _init():
        softmax.start(refs.softmax, None if sinks_ref is None else sinks_ref[...])
        if refs.q_rows is not None:
            # q^T [D, block_q] -> [block_q, D] once per query block, so that every KV step multiplies row-major q.
            def transpose_query(s):
                refs.q_rows[s] = refs.q[s].T

            loop_over_heads(refs.q_rows.shape[0], transpose_query)

    q_offset, kv_valid = q_offset_ref[b], kv_valid_ref[b]
    key_start = kv_block * plan.block_kv
    if plan.decode:
        q_first = q_last = q_offset
    else:
        q_first, q_last = masking.query_block_positions(problem, q_offset, qi, plan.block_q)
    needs_mask = masking.tile_needs_mask(
        problem, key_start=key_start, block_kv=plan.block_kv, kv_valid=kv_valid, q_first=q_first, q_last=q_last
    )
    at = _Position(key_start, q_first, q_offset, kv_valid)
    masking.run_tile(kv_block <= block_hi_ref[slot], needs_mask,
                     lambda apply_mask: _attend_block(refs, at, problem, plan, apply_mask))

    @pl.when(kv_step == plan.num_kv_steps - 1)
    def _finalize():
        _store_output(refs, plan.sequence_minor.out)
        # log(0) = -inf for a row that saw nothing (its max is -inf too: the sum stays -inf).
        lse = refs.max[...] + jnp.log(refs.sum[...])
        if plan.decode:
            refs.lse[...] = lse
        else:
            # [group, block_q, 1] -> [group, 1, block_q]: query positions along lanes.
            refs.lse[...] = lse.reshape(refs.lse.shape)


def _store_output(refs: _ForwardRefs, queries_minor: bool) -> None:
    """The accumulator over the softmax sum into the output block: [slices, rows, Dv], or queries-minor [slices, Dv,
    rows] (each slice transposed)."""

    if not queries_minor:
        refs.out[...] = softmax.normalized(refs.softmax, ...).astype(refs.out.dtype)
        return

    def store_transposed(s):
        refs.out[s] = softmax.normalized(refs.softmax, s).T.astype(refs.out.dtype)

    loop_over_heads(refs.acc.shape[0], store_transposed)


class _QueryLayout(NamedTuple):
    """How the kernel sees q, its output and the log-sum-exp."""

    q: jax.Array  # q as the kernel reads it
    q_spec: pl.BlockSpec
    out_shape: tuple[int, ...]  # the output as the kernel writes it
    out_spec: pl.BlockSpec
    lse_shape: tuple[int, ...]
    lse_spec: pl.BlockSpec
    slices: int  # the softmax scratch is [slices, rows, ...]
    rows: int


def _query_layout(q, problem: Problem, plan: ForwardPlan) -> _QueryLayout:
    """q's, the output's and the log-sum-exp's layout: in decode a slice's rows are one KV head's group of query
    heads, in prefill a query block of one of the group's heads."""
    batch, _, q_len, head_dim = q.shape
    v_head_dim = problem.v_head_dim
    kv_heads, group, block_q, heads_per_step = problem.kv_heads, problem.group, plan.block_q, plan.heads_per_step
    if plan.decode:

        def decode_index_map(b, h, qi, kv_step, *_):
            return (b, h, 0, 0)

        return _QueryLayout(
            # [B, Hq, 1, D] -> [B, Hkv, G, D] is free: each KV head's group of
            # query heads becomes the rows of one slice.
            q=q.reshape(batch, kv_heads, group, head_dim),
            q_spec=pl.BlockSpec((None, heads_per_step, group, head_dim), decode_index_map),
            out_shape=(batch, kv_heads, group, v_head_dim),
            out_spec=pl.BlockSpec((None, heads_per_step, group, v_head_dim), decode_index_map),
            lse_shape=(batch, kv_heads, group, 1),
            lse_spec=pl.BlockSpec((None, heads_per_step, group, 1), decode_index_map),
            slices=heads_per_step,
            rows=group,
        )

    def lse_index_map(b, h, qi, kv_step, *_):
        return (b, h, 0, 0, qi)

    def q_index_map(b, h, qi, kv_step, *_):
        return (b, h, qi, 0)

    def queries_minor_index_map(b, h, qi, kv_step, *_):
        return (b, h, 0, qi)

    def query_side(dim: int, queries_minor: bool):
        """(shape, BlockSpec) of q (dim D) or the output (Dv): [B, Hq, Sq, dim], or queries-minor its swapped view
        [B, Hq, dim, Sq], a bitcast of XLA's layout."""
        if queries_minor:
            return (batch, problem.q_heads, dim, q_len), pl.BlockSpec((None, group, dim, block_q),
                                                                      queries_minor_index_map)
        return (batch, problem.q_heads, q_len, dim), pl.BlockSpec((None, group, block_q, dim), q_index_map)

    _, q_spec = query_side(head_dim, plan.sequence_minor.q)
    out_shape, out_spec = query_side(v_head_dim, plan.sequence_minor.out)
    return _QueryLayout(
        q=jnp.swapaxes(q, 2, 3) if plan.sequence_minor.q else q,
        q_spec=q_spec,
        out_shape=out_shape,
        out_spec=out_spec,
        # Query positions along lanes, one row per query head: what the backward kernels read.
        lse_shape=(batch, kv_heads, group, 1, q_len),
        lse_spec=pl.BlockSpec((None, None, group, 1, block_q), lse_index_map),
        slices=group,
        rows=block_q,
    )


def _kv_layout(k, v, plan: ForwardPlan):
    """(K's BlockSpec, V's BlockSpec, k and v as the kernel reads them): each [B, Hkv, Skv, D] row-major, or where
    XLA stores it keys-minor (`plan.sequence_minor`) its swapped view [B, Hkv, D, Skv], a bitcast of that layout."""
    nq, heads_per_step, block_kv = plan.num_q_blocks, plan.heads_per_step, plan.block_kv

    def kv_block(b, qi, kv_step, lo_ref, hi_ref):
        return masking.block_of_step(lo_ref, hi_ref, b * nq + qi, kv_step)

    def keys_minor_index_map(b, h, qi, kv_step, q_offset_ref, kv_valid_ref, lo_ref, hi_ref):
        return (b, h, 0, kv_block(b, qi, kv_step, lo_ref, hi_ref))

    def index_map(b, h, qi, kv_step, q_offset_ref, kv_valid_ref, lo_ref, hi_ref):
        return (b, h, kv_block(b, qi, kv_step, lo_ref, hi_ref), 0)

    def layout(array, keys_minor: bool):
        head_dim = array.shape[3]
        if keys_minor:
            spec = pl.BlockSpec((None, heads_per_step, head_dim, block_kv), keys_minor_index_map)
            return spec, jnp.swapaxes(array, 2, 3)
        return pl.BlockSpec((None, heads_per_step, block_kv, head_dim), index_map), array

    (k_spec, k), (v_spec, v) = layout(k, plan.sequence_minor.k), layout(v, plan.sequence_minor.v)
    return k_spec, v_spec, k, v


def _cost_estimate(q, k, v, problem: Problem, plan: ForwardPlan) -> pl.CostEstimate:
    """The forward's cost for XLA's scheduler: the visible pairs' work, q and out moved once, K/V once per pass."""
    batch, q_heads, q_len, head_dim = q.shape
    itemsize = jnp.dtype(q.dtype).itemsize
    visible_pairs = masking.static_visible_pairs(problem)
    out_size = batch * q_heads * q_len * problem.v_head_dim
    return pl.CostEstimate(
        flops=int(2 * batch * q_heads * visible_pairs * (head_dim + problem.v_head_dim)),
        transcendentals=int(batch * q_heads * visible_pairs),
        bytes_accessed=int(
            (q.size + out_size) * itemsize
            + (k.size + v.size) * itemsize * masking.static_kv_passes(problem, plan.block_q, plan.block_kv)
            + batch * q_heads * q_len * 4
        ),
    )


def call(q: jax.Array, k: jax.Array, v: jax.Array, prepared: Prepared,
         plan: ForwardPlan) -> tuple[jax.Array, jax.Array]:
    """The forward kernel as `plan` says, on q, k, v and the arrays `prepare` made of the call's options: (out, the
    log-sum-exp [B, Hq, Sq]) (inputs of the plan's non-empty problem, assumed valid)."""
    problem = plan.problem
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, group = problem.kv_heads, problem.group
    block_q, block_kv, nq, heads_per_step = plan.block_q, plan.block_kv, plan.num_q_blocks, plan.heads_per_step
    block_lo, block_hi = masking.kv_block_ranges(problem, prepared, block_q, block_kv)

    grid = (batch, kv_heads // heads_per_step, nq, plan.num_kv_steps)
    layout = _query_layout(q, problem, plan)
    k_spec, v_spec, k_read, v_read = _kv_layout(k, v, plan)
    in_specs = [layout.q_spec, k_spec, v_spec]
    operands = [layout.q, k_read, v_read]
    if prepared.mask is not None:
        broadcast_batch = problem.mask_batch == 1

        def mask_index_map(b, h, qi, kv_step, q_offset_ref, kv_valid_ref, lo_ref, hi_ref):
            kv_block = masking.block_of_step(lo_ref, hi_ref, b * nq + qi, kv_step)
            return (0 if broadcast_batch else b, 0, qi, kv_block)

        in_specs.append(pl.BlockSpec((None, None, block_q, block_kv), mask_index_map))
        operands.append(prepared.mask)
    if prepared.sinks is not None:
        # Laid out to broadcast onto the running max: [slices, rows, 1].
        if plan.decode:
            sinks = prepared.sinks.reshape(kv_heads, group, 1)
            in_specs.append(pl.BlockSpec((heads_per_step, group, 1), lambda b, h, *_: (h, 0, 0)))
        else:
            sinks = prepared.sinks.reshape(kv_heads, group, 1, 1)
            in_specs.append(pl.BlockSpec((None, group, 1, 1), lambda b, h, *_: (h, 0, 0, 0)))
        operands.append(sinks)

    out, lse = pl.pallas_call(
        functools.partial(_forward_kernel, problem=problem, plan=plan),
        out_shape=(jax.ShapeDtypeStruct(layout.out_shape, q.dtype),
                   jax.ShapeDtypeStruct(layout.lse_shape, jnp.float32)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=grid,
            in_specs=in_specs,
            out_specs=(layout.out_spec, layout.lse_spec),
            scratch_shapes=[
                pltpu.VMEM((layout.slices, layout.rows, 1), jnp.float32),
                pltpu.VMEM((layout.slices, layout.rows, 1), jnp.float32),
                pltpu.VMEM((layout.slices, layout.rows, problem.v_head_dim), jnp.float32),
                *([pltpu.VMEM((layout.slices, layout.rows, head_dim), q.dtype)] if plan.sequence_minor.q else []),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=plan.vmem_limit_bytes,
        ),
        cost_estimate=_cost_estimate(q, k, v, problem, plan),
        name="attention_tpu_flash",
    )(prepared.q_offset, prepared.kv_valid, block_lo, block_hi, *operands)
    out = jnp.swapaxes(out, 2, 3) if plan.sequence_minor.out else out.reshape(batch, q_heads, q_len, -1)
    return out, lse.reshape(batch, q_heads, q_len)


def flash_attention_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    config: AttentionConfig | None = None,
    generation: str | TpuGeneration | None = None,
    **options,
) -> tuple[jax.Array, jax.Array]:
    """(out [B, Hq, Sq, Dv], log-sum-exp float32 [B, Hq, Sq]) of `differentiable_flash_attention`; `options` those
    of `masking.Attention`."""
    return attention_forward(q, k, v, Attention(**options), resolve_target(generation), config)


def attention_forward(q: jax.Array, k: jax.Array, v: jax.Array, attention: Attention, target: TpuGeneration,
                      config: AttentionConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """`flash_attention_forward` of an `Attention` value on `target` (a generation's facts, resolved once).

    The log-sum-exp is that of each row's softmax denominator, the sink
    included; -inf for a row that sees no key and has no sink.
    Without a batch, a query head, a query or a key no kernel runs: every row
    sees no key.
    """
    batch, q_heads, q_len, _ = q.shape
    if 0 in (batch, q_heads, q_len, k.shape[2]):
        sinks = attention.sinks
        no_key = jnp.full((q_heads,), -jnp.inf, jnp.float32) if sinks is None else sinks.astype(jnp.float32)
        out = jnp.zeros((batch, q_heads, q_len, v.shape[3]), q.dtype)
        return out, jnp.broadcast_to(no_key[None, :, None], (batch, q_heads, q_len))
    problem, prepared = masking.prepare(q, k, attention, v_head_dim=v.shape[3])
    return call(q, k, v, prepared, make(problem, target, config))


class _Tiling(NamedTuple):
    """The static arguments of `_differentiable_attention` besides the `Attention` (custom_vjp keeps them apart)."""

    config: AttentionConfig | None
    backward_config: BackwardConfig | None
    target: TpuGeneration


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _differentiable_attention(tiling: _Tiling, q, k, v, attention: Attention):
    out, _ = attention_forward(q, k, v, attention, tiling.target, tiling.config)
    return out


def _attention_vjp_forward(tiling: _Tiling, q, k, v, attention: Attention):
    out, lse = attention_forward(q, k, v, attention, tiling.target, tiling.config)
    return out, (q, k, v, attention, out, lse)


def _attention_vjp_backward(tiling: _Tiling, residuals, d_out):
    q, k, v, attention, out, lse = residuals
    dq, dk, dv, d_sinks = attention_backward(d_out, q, k, v, out, lse, attention, tiling.target,
                                             tiling.backward_config)
    # Offsets, lengths and the mask are not differentiated (None: a zero cotangent).
    no_gradient = dict(q_offset=None, kv_lengths=None, attention_mask=None)
    return dq, dk, dv, dataclasses.replace(attention, sinks=d_sinks, **no_gradient)


_differentiable_attention.defvjp(_attention_vjp_forward, _attention_vjp_backward)


def differentiable_flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    config: AttentionConfig | None = None,
    backward_config: BackwardConfig | None = None,
    generation: str | TpuGeneration | None = None,
    **options,
) -> jax.Array:
    """Attention of q[B, Hq, Sq, D] over k[B, Hkv, Skv, D], v[B, Hkv, Skv, Dv] -> [B, Hq, Sq, Dv]; differentiable.

    `options` are those of `masking.Attention` (scale, causal, q_offset,
    kv_lengths, sliding_window, softcap, attention_mask, sinks). Tiles:
    `config` and `backward_config`, else those of `tiles.select` and
    `flash_backward.tiles.select` for `generation` (a name or its facts;
    default this device's), resolved once here. jax.grad/jax.vjp run the backward Pallas kernels
    (`flash_backward.kernel.attention_backward`) for q, k, v and sinks;
    offsets, lengths and the mask get no gradient. Inputs are assumed valid
    (see the module docstring).
    """
    tiling = _Tiling(config, backward_config, resolve_target(generation))
    return _differentiable_attention(tiling, q, k, v, Attention(**options))
