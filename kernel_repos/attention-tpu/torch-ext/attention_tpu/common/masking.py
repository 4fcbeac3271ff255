"""What the forward and backward kernels share: the call's options, the problem, which pairs are visible, block ranges.

`Attention` is the value a caller describes a call with (everything beyond
q, k and v); `prepare` turns it and the shapes into the static `Problem` and
the `Prepared` arrays the kernels read.

Positions are KV-cache positions: query i of batch b sits at ``q_offset[b] +
i``; key j is visible to it when ``j < kv_valid[b]``, ``j <= position``
(causal), ``j > position - sliding_window`` (sliding window) and the explicit
mask allows it. The kernels walk, per block of one axis, only the range of
blocks of the other axis that holds a visible pair; the ranges are computed
here, up front, and reach the kernels by scalar prefetch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["q_offset", "kv_lengths", "attention_mask", "sinks"],
                   meta_fields=["scale", "causal", "sliding_window", "softcap"])
@dataclasses.dataclass(frozen=True)
class Attention:
    """One attention call beyond q[B, Hq, Sq, D], k[B, Hkv, Skv, D] and v[B, Hkv, Skv, Dv]: which pairs are visible,
    and the logits.

    scale: multiplies q.k (default D ** -0.5, D the query and key head dim).
    causal: a query at position p sees keys at positions <= p.
    q_offset: KV position of the first query (int or integer [B]); default
      Skv - Sq, i.e. the queries are the last Sq positions (decode and chunked
      prefill against a cache).
    kv_lengths: integer [B]; keys at and past kv_lengths[b] are masked.
    sliding_window: w lets the query at position p see keys in (p - w, p].
    softcap: logits become softcap * tanh(logits / softcap).
    attention_mask: optional [B or 1, 1, Sq, Skv], bool or int8 (nonzero =
      attend) or floating (added to the logits; values at the dtype's minimum
      mask the key out), combined with all of the above. Not differentiated.
    sinks: optional [Hq]: a logit per query head that joins every row's
      softmax denominator and attends to nothing (GPT-OSS); not scaled or capped.

    A pytree: the arrays are its leaves, the rest static.
    """

    scale: float | None = None
    causal: bool = True
    sliding_window: int | None = None
    softcap: float | None = None
    q_offset: jax.Array | int | None = None
    kv_lengths: jax.Array | None = None
    attention_mask: jax.Array | None = None
    sinks: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Problem:
    """The static description of one attention call (shapes and options; no tile sizes)."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int  # of q and k
    v_head_dim: int  # of v and the output (latent attention's differs from head_dim)
    scale: float
    causal: bool
    sliding_window: int | None
    softcap: float | None
    mask_kind: str | None  # None, "bool" (int8, nonzero = visible) or "bias" (float32 additive)
    mask_floor: float  # bias values at or below this are masked-out keys
    mask_batch: int
    has_sinks: bool
    dtype: str
    # The query offset when the caller gave an int (or none: the default): grid lengths are then exact.
    static_q_offset: int | None

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    @classmethod
    def of_shape(cls, *, q_heads: int, kv_heads: int, q_len: int, kv_len: int, head_dim: int, dtype, mask_dtype=None,
                 sliding_window: int | None = None, causal: bool = True, batch: int = 1,
                 v_head_dim: int | None = None) -> Problem:
        """The problem of a call of this shape, as `prepare` makes it (default scale, no softcap or sinks, the
        queries last in the keys), with a mask of `mask_dtype` (a float one adds, any other selects) if given;
        `v_head_dim` defaults to `head_dim`."""
        mask_kind = None if mask_dtype is None else "bias" if jnp.issubdtype(mask_dtype, jnp.floating) else "bool"
        floor = float(jnp.finfo(mask_dtype).min) if mask_kind == "bias" else 0.0
        return cls(batch=batch, q_heads=q_heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len, head_dim=head_dim,
                   v_head_dim=head_dim if v_head_dim is None else v_head_dim, scale=float(head_dim**-0.5),
                   causal=bool(causal),
                   sliding_window=None if sliding_window is None else int(sliding_window), softcap=None,
                   mask_kind=mask_kind, mask_floor=floor, mask_batch=1, has_sinks=False, dtype=jnp.dtype(dtype).name,
                   static_q_offset=kv_len - q_len)

    @property
    def mask_dtype(self) -> str | None:
        """The mask's dtype as the kernels read it (`prepare`): int8 for a "bool" mask, float32 for a "bias"."""
        return {None: None, "bool": "int8", "bias": "float32"}[self.mask_kind]

    @property
    def precision(self) -> jax.lax.Precision | None:
        # float32 inputs multiply at float32 precision; bfloat16 ones in one MXU pass.
        return jax.lax.Precision.HIGHEST if self.dtype == "float32" else None


@dataclasses.dataclass(frozen=True)
class Prepared:
    """The arrays every kernel reads besides q, k, v: per-batch offsets and lengths, the mask, the sinks."""

    q_offset: jax.Array  # int32 [B]
    kv_valid: jax.Array  # int32 [B], clipped to [0, Skv]
    mask: jax.Array | None  # int8 or float32 [Bm, 1, Sq, Skv]
    sinks: jax.Array | None  # float32 [Hq]


def prepare(q: jax.Array, k: jax.Array, attention: Attention, *,
            v_head_dim: int | None = None) -> tuple[Problem, Prepared]:
    """The Problem and the prepared arrays of one call (inputs assumed valid); `v_head_dim`, the values' (and the
    output's) head dim, defaults to k's."""
    scale, causal, sliding_window, softcap = (attention.scale, attention.causal, attention.sliding_window,
                                              attention.softcap)
    q_offset, kv_lengths, attention_mask, sinks = (attention.q_offset, attention.kv_lengths, attention.attention_mask,
                                                   attention.sinks)
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    mask_kind, mask_floor, mask = None, 0.0, None
    if attention_mask is not None:
        if not jnp.issubdtype(attention_mask.dtype, jnp.floating):
            # bool, or bool as int8 (as it crosses from torch): nonzero = visible.
            mask_kind, mask = "bool", attention_mask.astype(jnp.int8)
        else:
            mask_kind = "bias"
            mask_floor = float(jnp.finfo(attention_mask.dtype).min)
            mask = attention_mask.astype(jnp.float32)
    static_q_offset = kv_len - q_len if q_offset is None else q_offset if isinstance(q_offset, int) else None
    problem = Problem(
        batch=batch,
        q_heads=q_heads,
        kv_heads=kv_heads,
        q_len=q_len,
        kv_len=kv_len,
        head_dim=head_dim,
        v_head_dim=head_dim if v_head_dim is None else v_head_dim,
        scale=float(head_dim**-0.5 if scale is None else scale),
        causal=bool(causal),
        sliding_window=None if sliding_window is None else int(sliding_window),
        softcap=None if softcap is None else float(softcap),
        mask_kind=mask_kind,
        mask_floor=mask_floor,
        mask_batch=1 if mask is None else mask.shape[0],
        has_sinks=sinks is not None,
        dtype=jnp.dtype(q.dtype).name,
        static_q_offset=static_q_offset,
    )
    if q_offset is None:
        q_offset = kv_len - q_len
    q_offset = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (batch,))
    kv_valid = jnp.full((batch,), kv_len, jnp.int32)
    if kv_lengths is not None:
        kv_valid = jnp.clip(kv_lengths.astype(jnp.int32), 0, kv_len)
    prepared = Prepared(
        q_offset=q_offset,
        kv_valid=kv_valid,
        mask=mask,
        sinks=None if sinks is None else sinks.astype(jnp.float32),
    )
    return problem, prepared


def mask_visible(problem: Problem, mask: jax.Array) -> jax.Array:
    """bool [Bm, 1, Sq, Skv]: where the explicit mask lets a key through."""
    return mask != 0 if problem.mask_kind == "bool" else mask > problem.mask_floor


# In-kernel helpers. `query_pos` and `key_pos` are int32 arrays of one shape
# (a tile, either orientation); everything here is elementwise.


def positional_visibility(problem: Problem, query_pos, key_pos, kv_valid):
    """Visible (query, key) pairs by lengths, causality and the window (not the explicit mask)."""
    visible = key_pos < kv_valid
    if problem.causal:
        visible = visible & (key_pos <= query_pos)
    if problem.sliding_window is not None:
        visible = visible & (key_pos > query_pos - problem.sliding_window)
    return visible


def query_block_positions(problem: Problem, q_offset, qi, block_q: int):
    """Positions of the first and last query of query block qi."""
    return q_offset + qi * block_q, q_offset + jnp.minimum((qi + 1) * block_q, problem.q_len) - 1


def tile_needs_mask(problem: Problem, *, key_start, block_kv: int, kv_valid, q_first, q_last):
    """Whether a tile may hold a pair that lengths, causality, the window or an explicit mask hide.

    Tiles inside the visible region skip the element masks (VPU work).
    """
    if problem.mask_kind is not None:
        return True
    needs_mask = key_start + block_kv > kv_valid
    if problem.causal:
        needs_mask = needs_mask | (key_start + block_kv - 1 > q_first)
    if problem.sliding_window is not None:
        needs_mask = needs_mask | (key_start <= q_last - problem.sliding_window)
    return needs_mask


def run_tile(in_range, needs_mask, step) -> None:
    """step(apply_mask) on a tile in its walked range: with element masks where needed, else without."""
    if needs_mask is True:
        pl.when(in_range)(lambda: step(True))
        return
    pl.when(in_range & needs_mask)(lambda: step(True))
    pl.when(in_range & jnp.logical_not(needs_mask))(lambda: step(False))


def explicit_mask(problem: Problem, mask_tile):
    """(allowed, bias or None) of a tile of the explicit mask."""
    if problem.mask_kind == "bool":
        return mask_tile.astype(jnp.int32) != 0, None
    bias = mask_tile.astype(jnp.float32)
    return bias > problem.mask_floor, bias


def capped_logits(problem: Problem, raw):
    """Scaled (and soft-capped) logits from raw q.k products; float32."""
    logits = raw * problem.scale
    if problem.softcap is not None:
        logits = problem.softcap * jnp.tanh(logits / problem.softcap)
    return logits


def softcap_slope(problem: Problem, capped):
    """d capped / d (scaled logit) = 1 - tanh^2, from the capped value itself."""
    tanh = capped / problem.softcap
    return 1.0 - tanh * tanh


# Block ranges, computed outside the kernels.


def _blocks_spanned(first, last, block: int) -> int:
    """Most blocks any [first, last] interval touches (intervals with last < first touch none); at least 1."""
    spans = np.where(last >= first, last // block - first // block + 1, 0)
    return max(1, int(spans.max(initial=0)))


def kv_steps(problem: Problem, num_kv_blocks: int, block_q: int, block_kv: int) -> int:
    """Grid length along the KV axis of a kernel walking KV blocks per query block.

    With a static query offset, the most KV blocks a query block's visible keys
    span (lengths and a mask only remove keys from those). Otherwise a bound:
    with causality, a sliding window w limits what block_q consecutive
    positions see to w + block_q - 1 consecutive keys, so windowed attention
    over a long cache runs a short KV axis.
    """
    if problem.static_q_offset is not None:
        q_first = problem.static_q_offset + np.arange(0, problem.q_len, block_q)
        q_last = np.minimum(q_first + block_q, problem.static_q_offset + problem.q_len) - 1
        key_first = np.zeros_like(q_first)
        if problem.sliding_window is not None:
            key_first = np.maximum(key_first, q_first - problem.sliding_window + 1)
        last_key = problem.kv_len - 1
        key_last = np.minimum(q_last, last_key) if problem.causal else np.full_like(q_last, last_key)
        return min(num_kv_blocks, _blocks_spanned(key_first, key_last, block_kv))
    if problem.sliding_window is None or not problem.causal:
        return num_kv_blocks
    return min(num_kv_blocks, pl.cdiv(problem.sliding_window + block_q - 1, block_kv) + 1)


def q_steps(problem: Problem, num_q_blocks: int, block_q: int, block_kv: int) -> int:
    """Grid length along the query axis of a kernel walking query blocks per KV block.

    With a static query offset, the most query blocks that see some key of one
    KV block span. Otherwise a bound: with causality and a window w, the keys
    of one KV block are seen by at most block_kv + w - 1 consecutive query positions.
    """
    if problem.static_q_offset is not None:
        key_first = np.arange(0, problem.kv_len, block_kv)
        key_last = np.minimum(key_first + block_kv, problem.kv_len) - 1
        query_first = np.zeros_like(key_first)
        query_last = np.full_like(key_first, problem.q_len - 1)
        if problem.causal:
            query_first = np.maximum(query_first, key_first - problem.static_q_offset)
        if problem.sliding_window is not None:
            query_last = np.minimum(query_last, key_last + problem.sliding_window - 1 - problem.static_q_offset)
        return min(num_q_blocks, _blocks_spanned(query_first, query_last, block_q))
    if problem.sliding_window is None or not problem.causal:
        return num_q_blocks
    return min(num_q_blocks, pl.cdiv(problem.sliding_window + block_kv - 1, block_q) + 1)


def _block_range(first, last, block: int, num_blocks: int):
    """Blocks holding [first, last] (elementwise); an empty range comes out as last block = first block - 1."""
    first_block = jnp.clip(first // block, 0, num_blocks - 1)
    last_block = jnp.where(last >= first, last // block, first_block - 1)
    return first_block.reshape(-1).astype(jnp.int32), last_block.reshape(-1).astype(jnp.int32)


def _first_and_last(visible, axis: int, extent: int):
    """First and last True index along `axis` (extent when none / -1 when none)."""
    any_visible = jnp.any(visible, axis=axis)
    first = jnp.argmax(visible, axis=axis).astype(jnp.int32)
    last = (extent - 1 - jnp.argmax(jnp.flip(visible, axis=axis), axis=axis)).astype(jnp.int32)
    return jnp.where(any_visible, first, extent), jnp.where(any_visible, last, -1)


def _per_block(values, block: int, reduce, fill):
    """Reduce the last axis of `values` over blocks of `block` (the ragged tail padded with `fill`)."""
    extent = values.shape[-1]
    num_blocks = pl.cdiv(extent, block)
    padded = jnp.pad(values, [(0, 0)] * (values.ndim - 1) + [(0, num_blocks * block - extent)], constant_values=fill)
    return reduce(padded.reshape(*values.shape[:-1], num_blocks, block), axis=-1)


def kv_block_ranges(problem: Problem, prepared: Prepared, block_q: int, block_kv: int):
    """First and last KV block holding a key visible to the query block, per (batch, q block), flattened."""
    num_q_blocks = pl.cdiv(problem.q_len, block_q)
    q_block_index = jnp.arange(num_q_blocks, dtype=jnp.int32)
    q_first = prepared.q_offset[:, None] + q_block_index * block_q
    q_last = prepared.q_offset[:, None] + jnp.minimum((q_block_index + 1) * block_q, problem.q_len) - 1
    key_first = jnp.zeros_like(q_first)
    key_last = jnp.broadcast_to(prepared.kv_valid[:, None] - 1, q_first.shape)
    if problem.causal:
        key_last = jnp.minimum(key_last, q_last)
    if problem.sliding_window is not None:
        key_first = jnp.maximum(key_first, q_first - problem.sliding_window + 1)
    if prepared.mask is not None:
        first, last = _first_and_last(mask_visible(problem, prepared.mask)[:, 0], axis=-1, extent=problem.kv_len)
        key_first = jnp.maximum(key_first, _per_block(first, block_q, jnp.min, problem.kv_len))
        key_last = jnp.minimum(key_last, _per_block(last, block_q, jnp.max, -1))
    return _block_range(key_first, key_last, block_kv, pl.cdiv(problem.kv_len, block_kv))


def q_block_ranges(problem: Problem, prepared: Prepared, block_q: int, block_kv: int):
    """First and last query block holding a query that sees a key of the KV block, per (batch, kv block), flattened."""
    num_kv_blocks = pl.cdiv(problem.kv_len, block_kv)
    key_first = jnp.arange(num_kv_blocks, dtype=jnp.int32)[None, :] * block_kv
    key_last = jnp.minimum(key_first + block_kv, prepared.kv_valid[:, None]) - 1
    offset = prepared.q_offset[:, None]
    query_first = jnp.zeros_like(key_last)
    query_last = jnp.full_like(key_last, problem.q_len - 1)
    if problem.causal:
        query_first = jnp.maximum(query_first, key_first - offset)
    if problem.sliding_window is not None:
        query_last = jnp.minimum(query_last, key_last + problem.sliding_window - 1 - offset)
    # A block past the valid keys has key_last < key_first: no query sees it.
    query_last = jnp.where(key_last >= key_first, query_last, -1)
    if prepared.mask is not None:
        visible = mask_visible(problem, prepared.mask)[:, 0]  # [Bm, Sq, Skv]
        in_block = _per_block(visible, block_kv, jnp.any, False)  # [Bm, Sq, kv blocks]
        first, last = _first_and_last(in_block, axis=1, extent=problem.q_len)
        query_first = jnp.maximum(query_first, first)
        query_last = jnp.minimum(query_last, last)
    return _block_range(query_first, query_last, block_q, pl.cdiv(problem.q_len, block_q))


def block_of_step(lo_ref, hi_ref, slot, step):
    """The block a grid step reads: its range's first block + step, held at the range's last block.

    Steps past the range keep the block index of the previous step, so the
    pipeline fetches nothing for them.
    """
    first = lo_ref[slot]
    return jnp.minimum(first + step, jnp.maximum(hi_ref[slot], first))


# Static estimates for cost hints (the default q_offset and full lengths).


def static_visible_pairs(problem: Problem) -> int:
    """(query, key) pairs visible with the default q_offset and full lengths."""
    positions = np.arange(problem.kv_len - problem.q_len, problem.kv_len)
    if problem.causal:
        last = np.minimum(problem.kv_len - 1, positions)
    else:
        last = np.full_like(positions, problem.kv_len - 1)
    first = 0 if problem.sliding_window is None else np.maximum(0, positions - problem.sliding_window + 1)
    return int(np.clip(last - first + 1, 0, None).sum())


def static_kv_passes(problem: Problem, block_q: int, block_kv: int) -> float:
    """Average number of times the K/V arrays are streamed by a kernel walking KV blocks per query block."""
    offset = problem.kv_len - problem.q_len
    blocks = 0
    for qi in range(pl.cdiv(problem.q_len, block_q)):
        q_first = offset + qi * block_q
        q_last = offset + min((qi + 1) * block_q, problem.q_len) - 1
        hi = min(problem.kv_len - 1, q_last) if problem.causal else problem.kv_len - 1
        lo = 0 if problem.sliding_window is None else max(0, q_first - problem.sliding_window + 1)
        if hi >= lo:
            blocks += hi // block_kv - lo // block_kv + 1
    return blocks / pl.cdiv(problem.kv_len, block_kv)
