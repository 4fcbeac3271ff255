"""Flash attention for TPU, written in Pallas (pure JAX, no torch).

One kernel serves prefill, chunked prefill and decode:

* The grid is (batch, kv_head, q_block, kv_block). One grid step handles the
  whole query-head group of one KV head, so every K/V block is fetched once per
  query block and never once per query head (GQA by head mapping in the index
  maps, no copies of K/V).
* Softmax is computed online in float32 (running max, running sum, float32
  accumulator in VMEM scratch).
* For every (batch, q_block) the range of KV blocks that hold at least one
  visible key is computed up front and handed to the kernel by scalar prefetch.
  KV blocks outside that range are neither computed (``pl.when``) nor fetched:
  the K/V index maps clamp the block index into the range, so the pipeline sees
  an unchanged block index and issues no DMA.
* Decode (one query position) packs each KV head's group of query heads into
  the rows of one block, so a decode step is one (group, D) x (D, block_kv)
  matmul per KV head and reads each KV block exactly once; one step spans
  several KV heads so that its DMA outweighs the per-step overhead.
* No padding copies: ragged edge blocks are masked with ``jnp.where`` before the
  exponential and the V rows past the valid length are zeroed before the PV
  matmul, so whatever lies past the arrays' ends (NaN in interpret mode) never
  reaches the result.

Semantics (positions are KV-cache positions):
  query i of batch b sits at position ``q_offset[b] + i``; key j is visible to
  it when ``j < kv_lengths[b]``, ``j <= position`` (causal), ``j > position -
  sliding_window`` (sliding window) and ``attention_mask[b, 0, i, j]`` allows it.
  Rows that see no key come out as zeros.

Tile sizes come from `config.select_config`. Inputs are assumed valid: the
torch op checks them (`ops.py`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .config import AttentionConfig, check_config, is_decode, select_config

SUPPORTED_HEAD_DIMS = (64, 128, 256)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the kernel body needs to know at trace time."""

    batch: int
    q_len: int
    kv_len: int
    group: int
    head_dim: int
    block_q: int
    block_kv: int
    num_q_blocks: int
    num_kv_blocks: int
    num_kv_steps: int  # grid steps along the KV axis: at most num_kv_blocks
    decode: bool
    scale: float
    causal: bool
    sliding_window: int | None
    softcap: float | None
    mask_kind: str | None  # None, "bool" (int8, nonzero = visible) or "bias" (float32 additive)
    mask_floor: float  # bias values at or below this are masked-out keys
    mask_batch: int
    precision: jax.lax.Precision | None


def _attention_kernel(
    q_offset_ref,
    kv_valid_ref,
    block_lo_ref,
    block_hi_ref,
    q_ref,
    k_ref,
    v_ref,
    *rest,
    st: _Static,
):
    if st.mask_kind is None:
        mask_ref = None
        o_ref, max_ref, sum_ref, acc_ref = rest
    else:
        mask_ref, o_ref, max_ref, sum_ref, acc_ref = rest
    b, qi, kv_step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    slot = b * st.num_q_blocks + qi
    first_block, last_block = block_lo_ref[slot], block_hi_ref[slot]
    # The KV steps of a query block walk its range of KV blocks from the first.
    kv_block = first_block + kv_step
    q_offset = q_offset_ref[b]
    kv_valid = kv_valid_ref[b]
    num_slices = max_ref.shape[0]

    @pl.when(kv_step == 0)
    def _init():
        max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, jnp.float32)
        sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    key_start = kv_block * st.block_kv
    if st.decode:
        q_first = q_last = q_offset
    else:
        q_first = q_offset + qi * st.block_q
        q_last = q_offset + jnp.minimum((qi + 1) * st.block_q, st.q_len) - 1

    # A block needs element masks when any of its keys is invisible to any of
    # its queries; interior blocks of a causal prefill skip that VPU work.
    needs_mask = key_start + st.block_kv > kv_valid
    if st.causal:
        needs_mask = needs_mask | (key_start + st.block_kv - 1 > q_first)
    if st.sliding_window is not None:
        needs_mask = needs_mask | (key_start <= q_last - st.sliding_window)
    if st.mask_kind is not None:
        needs_mask = True

    rows = st.group if st.decode else st.block_q

    def step(apply_mask: bool):
        # k_ref/v_ref are [kv heads of this step, block_kv, D]: one KV head
        # shared by every slice (prefill: the group's query heads), or one per
        # slice (decode: a slice is one KV head's group of query rows).
        visible = bias = value_valid = None
        if apply_mask:
            key_pos = key_start + jax.lax.broadcasted_iota(jnp.int32, (rows, st.block_kv), 1)
            visible = key_pos < kv_valid
            if st.causal or st.sliding_window is not None:
                if st.decode:
                    query_pos = q_offset
                else:
                    query_pos = q_first + jax.lax.broadcasted_iota(jnp.int32, (rows, st.block_kv), 0)
                if st.causal:
                    visible = visible & (key_pos <= query_pos)
                if st.sliding_window is not None:
                    visible = visible & (key_pos > query_pos - st.sliding_window)
            if st.mask_kind is not None:
                mask = mask_ref[...]
                if st.mask_kind == "bool":
                    allowed = mask.astype(jnp.int32) != 0
                else:
                    bias = mask.astype(jnp.float32)
                    allowed = bias > st.mask_floor
                visible = visible & jnp.broadcast_to(allowed, (rows, st.block_kv))
                if bias is not None:
                    bias = jnp.broadcast_to(bias, (rows, st.block_kv))
            value_pos = key_start + jax.lax.broadcasted_iota(jnp.int32, (st.block_kv, st.head_dim), 0)
            value_valid = value_pos < kv_valid

        def load_kv(head):
            k = k_ref[head]
            v = v_ref[head]
            if value_valid is not None:
                # Zero V rows past the valid length: p is 0 there, but 0 * NaN is NaN.
                v = jnp.where(value_valid, v, jnp.zeros_like(v))
            return k, v

        def attend(s, k, v):
            q = q_ref[s]
            logits = jax.lax.dot_general(
                q,
                k,
                (((1,), (1,)), ((), ())),
                preferred_element_type=jnp.float32,
                precision=st.precision,
            )
            logits = logits * st.scale
            if st.softcap is not None:
                logits = st.softcap * jnp.tanh(logits / st.softcap)
            if bias is not None:
                logits = logits + bias
            if visible is not None:
                logits = jnp.where(visible, logits, -jnp.inf)
            max_prev = max_ref[s]
            max_next = jnp.maximum(max_prev, jnp.max(logits, axis=1, keepdims=True))
            # A row that has seen no visible key yet keeps max -inf; shift by 0
            # instead so exp() gives 0 rather than exp(-inf + inf) = NaN.
            shift = jnp.where(max_next == -jnp.inf, 0.0, max_next)
            probs = jnp.exp(logits - shift)
            rescale = jnp.exp(max_prev - shift)
            sum_ref[s] = rescale * sum_ref[s] + jnp.sum(probs, axis=1, keepdims=True)
            acc_ref[s] = rescale * acc_ref[s] + jax.lax.dot_general(
                probs.astype(v.dtype),
                v,
                (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32,
                precision=st.precision,
            )
            max_ref[s] = max_next

        if st.decode:
            def attend_slice(s):
                attend(s, *load_kv(s))
        else:
            shared_kv = load_kv(0)

            def attend_slice(s):
                attend(s, *shared_kv)

        if num_slices == 1:
            attend_slice(0)
        else:

            def body(s, carry):
                attend_slice(s)
                return carry

            jax.lax.fori_loop(0, num_slices, body, None)

    in_range = kv_block <= last_block
    if st.mask_kind is not None:
        pl.when(in_range)(lambda: step(apply_mask=True))
    else:
        pl.when(in_range & needs_mask)(lambda: step(apply_mask=True))
        pl.when(in_range & jnp.logical_not(needs_mask))(lambda: step(apply_mask=False))

    @pl.when(kv_step == st.num_kv_steps - 1)
    def _finalize():
        total = sum_ref[...]
        safe_total = jnp.where(total == 0.0, 1.0, total)
        out = jnp.where(total == 0.0, 0.0, acc_ref[...] / safe_total)
        o_ref[...] = out.astype(o_ref.dtype)


def _num_kv_steps(num_kv_blocks, block_q, block_kv, causal, sliding_window):
    """Grid length along the KV axis: the most KV blocks one query block can need.

    With causality, a sliding window w bounds what block_q consecutive
    positions see to w + block_q - 1 consecutive keys (a mask only removes keys
    from that), so windowed attention over a long cache runs a short KV axis
    instead of idling through the whole cache.
    """
    if sliding_window is None or not causal:
        return num_kv_blocks
    return min(num_kv_blocks, pl.cdiv(sliding_window + block_q - 1, block_kv) + 1)


def _kv_block_ranges(q_offset, kv_valid, mask_first, mask_last, st: _Static):
    """First and last KV block with a visible key, per (batch, q_block), flattened.

    An empty range comes out as last = first - 1 (nothing computed, and the
    clamped index maps keep pointing at one block, so nothing more is fetched).
    """
    q_block_index = jnp.arange(st.num_q_blocks, dtype=jnp.int32)
    q_first = q_offset[:, None] + q_block_index * st.block_q
    q_last = q_offset[:, None] + jnp.minimum((q_block_index + 1) * st.block_q, st.q_len) - 1
    key_first = jnp.zeros_like(q_first)
    key_last = jnp.broadcast_to(kv_valid[:, None] - 1, q_first.shape)
    if st.causal:
        key_last = jnp.minimum(key_last, q_last)
    if st.sliding_window is not None:
        key_first = jnp.maximum(key_first, q_first - st.sliding_window + 1)
    if mask_first is not None:
        key_first = jnp.maximum(key_first, mask_first)
        key_last = jnp.minimum(key_last, mask_last)
    first_block = jnp.clip(key_first // st.block_kv, 0, st.num_kv_blocks - 1)
    last_block = jnp.where(key_last >= key_first, key_last // st.block_kv, first_block - 1)
    return first_block.reshape(-1).astype(jnp.int32), last_block.reshape(-1).astype(jnp.int32)


def _mask_key_ranges(visible, st: _Static):
    """First and last visible key per (batch, q_block) of an explicit mask [Bm, 1, Sq, Skv]."""
    any_visible = jnp.any(visible, axis=-1)[:, 0]
    first = jnp.argmax(visible, axis=-1)[:, 0].astype(jnp.int32)
    last = (st.kv_len - 1 - jnp.argmax(visible[..., ::-1], axis=-1)[:, 0]).astype(jnp.int32)
    first = jnp.where(any_visible, first, st.kv_len)
    last = jnp.where(any_visible, last, -1)
    padded = st.num_q_blocks * st.block_q - st.q_len
    first = jnp.pad(first, ((0, 0), (0, padded)), constant_values=st.kv_len)
    last = jnp.pad(last, ((0, 0), (0, padded)), constant_values=-1)
    first = first.reshape(first.shape[0], st.num_q_blocks, st.block_q).min(axis=-1)
    last = last.reshape(last.shape[0], st.num_q_blocks, st.block_q).max(axis=-1)
    return (jnp.broadcast_to(first, (st.batch, st.num_q_blocks)), jnp.broadcast_to(last, (st.batch, st.num_q_blocks)))


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float | None = None,
    causal: bool = True,
    q_offset: int | jax.Array | None = None,
    kv_lengths: jax.Array | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    attention_mask: jax.Array | None = None,
    config: AttentionConfig | None = None,
    generation: str | None = None,
) -> jax.Array:
    """Attention of q[B, Hq, Sq, D] over k, v[B, Hkv, Skv, D] -> [B, Hq, Sq, D].

    q_offset: KV position of the first query (int or integer [B]); default
      Skv - Sq, i.e. the queries are the last Sq positions (decode and chunked
      prefill against a cache).
    kv_lengths: integer [B]; keys at and past kv_lengths[b] are masked.
    sliding_window: w lets the query at position p see keys in (p - w, p].
    softcap: logits become softcap * tanh(logits / softcap).
    attention_mask: optional [B or 1, 1, Sq, Skv], bool (True = attend) or
      floating (added to the logits; values at the dtype's minimum mask the
      key out), combined with all of the above.

    Inputs are assumed valid (see the module docstring).
    """
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    dtype = jnp.dtype(q.dtype)

    mask_kind, mask_floor, mask = None, 0.0, None
    if attention_mask is not None:
        if jnp.dtype(attention_mask.dtype) == jnp.bool_:
            mask_kind, mask = "bool", attention_mask.astype(jnp.int8)
        else:
            mask_kind = "bias"
            mask_floor = float(jnp.finfo(attention_mask.dtype).min)
            mask = attention_mask.astype(jnp.float32)
    if config is not None:
        check_config(config, q_len=q_len, kv_len=kv_len, kv_heads=kv_heads)
    else:
        config = select_config(
            q_heads=q_heads,
            kv_heads=kv_heads,
            q_len=q_len,
            kv_len=kv_len,
            head_dim=head_dim,
            dtype=dtype,
            mask_dtype=None if mask is None else mask.dtype,
            generation=generation,
        )
    decode = is_decode(q_len)
    block_q = 1 if decode else config.block_q
    num_kv_blocks = pl.cdiv(kv_len, config.block_kv)
    st = _Static(
        batch=batch,
        q_len=q_len,
        kv_len=kv_len,
        group=group,
        head_dim=head_dim,
        block_q=block_q,
        block_kv=config.block_kv,
        num_q_blocks=pl.cdiv(q_len, block_q),
        num_kv_blocks=num_kv_blocks,
        num_kv_steps=_num_kv_steps(num_kv_blocks, block_q, config.block_kv, causal, sliding_window),
        decode=decode,
        scale=float(head_dim**-0.5 if scale is None else scale),
        causal=bool(causal),
        sliding_window=sliding_window,
        softcap=None if softcap is None else float(softcap),
        mask_kind=mask_kind,
        mask_floor=mask_floor,
        mask_batch=1 if mask is None else mask.shape[0],
        precision=jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None,
    )

    if q_offset is None:
        q_offset = kv_len - q_len
    q_offset = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (batch,))
    kv_valid = jnp.full((batch,), kv_len, jnp.int32)
    if kv_lengths is not None:
        kv_valid = jnp.clip(kv_lengths.astype(jnp.int32), 0, kv_len)
    mask_first = mask_last = None
    if mask is not None:
        visible = mask != 0 if mask_kind == "bool" else mask > mask_floor
        mask_first, mask_last = _mask_key_ranges(visible, st)
    block_lo, block_hi = _kv_block_ranges(q_offset, kv_valid, mask_first, mask_last, st)
    return _flash_attention_call(q, k, v, mask, q_offset, kv_valid, block_lo, block_hi, st, config)


def _kv_block_of_step(b, qi, kv_step, block_lo_ref, block_hi_ref, num_q_blocks):
    """The KV block a grid step reads: its range's first block + step, held at the range's last block.

    Steps past the range keep the block index of the previous step, so the
    pipeline fetches nothing for them.
    """
    slot = b * num_q_blocks + qi
    first = block_lo_ref[slot]
    return jnp.minimum(first + kv_step, jnp.maximum(block_hi_ref[slot], first))


def _flash_attention_call(q, k, v, mask, q_offset, kv_valid, block_lo, block_hi, st: _Static, config):
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads = k.shape[1]
    group, block_q, block_kv = st.group, st.block_q, st.block_kv
    nq = st.num_q_blocks

    def kv_index_map(b, h, qi, kv_step, q_offset_ref, kv_valid_ref, lo_ref, hi_ref):
        return (b, h, _kv_block_of_step(b, qi, kv_step, lo_ref, hi_ref, nq), 0)

    heads_per_step = config.kv_heads_per_step if st.decode else 1
    grid = (batch, kv_heads // heads_per_step, nq, st.num_kv_steps)
    if st.decode:
        # [B, Hq, 1, D] -> [B, Hkv, G, D] is free: each KV head's group of
        # query heads becomes the rows of one slice.
        q_in = q.reshape(batch, kv_heads, group, head_dim)
        q_block = (None, heads_per_step, group, head_dim)

        def q_index_map(b, h, qi, kv_step, *_):
            return (b, h, 0, 0)

        slices, rows = heads_per_step, group
    else:
        q_in = q
        q_block = (None, group, block_q, head_dim)

        def q_index_map(b, h, qi, kv_step, *_):
            return (b, h, qi, 0)

        slices, rows = group, block_q

    in_specs = [
        pl.BlockSpec(q_block, q_index_map),
        pl.BlockSpec((None, heads_per_step, block_kv, head_dim), kv_index_map),
        pl.BlockSpec((None, heads_per_step, block_kv, head_dim), kv_index_map),
    ]
    operands = [q_in, k, v]
    if mask is not None:
        broadcast_batch = st.mask_batch == 1

        def mask_index_map(b, h, qi, kv_step, q_offset_ref, kv_valid_ref, lo_ref, hi_ref):
            kv_block = _kv_block_of_step(b, qi, kv_step, lo_ref, hi_ref, nq)
            return (0 if broadcast_batch else b, 0, qi, kv_block)

        in_specs.append(pl.BlockSpec((None, None, block_q, block_kv), mask_index_map))
        operands.append(mask)

    itemsize = jnp.dtype(q.dtype).itemsize
    visible_pairs = _static_visible_pairs(st)
    cost = pl.CostEstimate(
        flops=int(4 * batch * q_heads * visible_pairs * head_dim),
        transcendentals=int(batch * q_heads * visible_pairs),
        bytes_accessed=int(2 * q.size * itemsize + 2 * k.size * itemsize * _static_kv_passes(st)),
    )
    out = pl.pallas_call(
        functools.partial(_attention_kernel, st=st),
        out_shape=jax.ShapeDtypeStruct(q_in.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=grid,
            in_specs=in_specs,
            out_specs=pl.BlockSpec(q_block, q_index_map),
            scratch_shapes=[
                pltpu.VMEM((slices, rows, 1), jnp.float32),
                pltpu.VMEM((slices, rows, 1), jnp.float32),
                pltpu.VMEM((slices, rows, head_dim), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=config.vmem_limit_bytes,
        ),
        cost_estimate=cost,
        name="attention_tpu_flash",
    )(q_offset, kv_valid, block_lo, block_hi, *operands)
    return out.reshape(q.shape)


def _static_visible_pairs(st: _Static) -> int:
    """(query, key) pairs visible with the default q_offset and full lengths (for cost estimates)."""
    positions = np.arange(st.kv_len - st.q_len, st.kv_len)
    last = np.minimum(st.kv_len - 1, positions) if st.causal else np.full_like(positions, st.kv_len - 1)
    first = np.maximum(0, positions - st.sliding_window + 1) if st.sliding_window is not None else 0
    return int(np.clip(last - first + 1, 0, None).sum())


def _static_kv_passes(st: _Static) -> float:
    """Average number of times the K/V arrays are streamed, with the default q_offset."""
    offset = st.kv_len - st.q_len
    blocks = 0
    for qi in range(st.num_q_blocks):
        q_first = offset + qi * st.block_q
        q_last = offset + min((qi + 1) * st.block_q, st.q_len) - 1
        hi = min(st.kv_len - 1, q_last) if st.causal else st.kv_len - 1
        lo = max(0, q_first - st.sliding_window + 1) if st.sliding_window is not None else 0
        if hi >= lo:
            blocks += hi // st.block_kv - lo // st.block_kv + 1
    return blocks / st.num_kv_blocks
