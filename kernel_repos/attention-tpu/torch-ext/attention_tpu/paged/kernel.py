"""Ragged paged attention for TPU, written in Pallas (pure JAX, no torch): one call over a batch that mixes prefill
chunks and decode rows, reading K/V from the pages of a paged cache in place.

Layout and semantics: `common/paged.py`.

* The grid is one step per block of `block_q` packed query rows. q is laid out per KV head, its rows being
  (token, query head of the group) pairs: [Hkv, tokens * group, D] (a copy of q, never of the cache), so one
  step's block of q, its output and its softmax state are plain 2-D tiles per KV head.
* Scalar prefetch hands the kernel cu_q_lens, kv_lens, the page table (flattened) and, per step, the first
  and last sequence owning one of its query rows.
* The K and V caches stay in HBM (`pl.ANY`). A step walks its sequences in order and, per sequence, the K/V
  blocks of `block_kv` keys its queries see (causality and the window bound the range), counted from the chunk
  holding the first key one of its rows sees (without a window, key 0). Each block is one DMA per chunk: a page,
  or a part of one (when a block is smaller than a page, and under a window at most an eighth of it), straight
  from the cache page the page table names into a double-buffered VMEM buffer of the cache's [tokens, Hkv, D]
  layout; the next block (of the same sequence, or the next sequence's first) is in flight while the current one
  is computed. Chunks past a sequence's keys are not fetched.
* q and k have one head dim D, v and the output another, Dv (equal but for latent attention).
* Keys-minor (`PagedProblem.keys_minor`, `values_minor`, each cache by its head dim: a head_dim that is no multiple
  of 128, e.g. 64 or 576, over pages of a multiple of 128 tokens, which XLA stores [pages, Hkv, D, page] by
  default): the kernel reads such a cache as `cache.transpose(0, 2, 3, 1)`, a free view of that layout, and each
  chunk (a multiple of 128 keys; under a window 128) lands in a [Hkv, D, block_kv] buffer, so each KV head's K^T
  (V^T) is a plain [D, block_kv] tile; the other cache, if row-major, is read in the same chunks
  (`lane_chunks`). A cache of any other layout is copied by XLA first. Contiguous keys at such a head_dim (XLA
  stores [total_k, Hkv, 64] as [Hkv, 64, total_k]) are read so too when total_k is a multiple of 128: a sequence's
  blocks then start at the 128-row tile holding its first key, a DMA per tile holding one of its keys.
* Once a sequence's blocks are done, the row tiles (of `min_tile_q` tokens) no later sequence shares are normalized
  into the output while the next sequence's first block is in flight; the step's last tiles after its last one.
* Per block and KV head, every row tile of the sequence that sees a key of the block runs one (rows, D) x
  (D, block_kv) matmul and the online softmax (float32 state in VMEM scratch). A sequence's tiles are of `tile_q`
  tokens, or of `min_tile_q` (rows of the dtype's native tile) when those cover its rows in at most half the rows:
  a decode row of a group of 8 in bfloat16 runs a 16-row tile, not a 128-row one. Rows of other sequences in a tile are
  masked out, which leaves their state unchanged; decode rows of several sequences thus share a tile. Sinks
  start a row's running max and sum (max = sink, sum = 1).
* V rows past a sequence's keys are zeroed in the buffer (contiguous keys and keys-minor: masked per head) before
  the PV matmul and invalid logits are replaced before the exponential, so stale pages or NaN never reach the result.
  Page table entries are clamped into the cache.

* A ring of window slots (`window_ring`, transformers' sliding-layer pages: key j at slot j % window) is read as
  a windowless call over each sequence's live slots: decode rows see them all, and their order is no softmax's.

Rows that see no key, and rows past cu_q_lens[-1], come out as zeros. Inputs are assumed valid: the torch op
checks them (`paged_ops.py`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._hardware import LANES, TpuGeneration, resolve_target
from ..common import masking, softmax
from ..common.paged import PagedProblem, paged_problem
from .plan import PagedPlan, make
from .tiles import PagedConfig

class _Refs(NamedTuple):
    cu_q: object  # SMEM [S + 1]
    kv_lens: object  # SMEM [S]
    table: object  # SMEM [S * pages_per_seq]
    q: object  # [Hkv, block rows, D]
    k_hbm: object  # [num_pages, page_size, Hkv, D]; keys-minor [num_pages, Hkv, D, page_size]
    v_hbm: object  # likewise, of Dv
    sinks: object | None  # [Hkv, block rows, 1] f32
    out: object  # [Hkv, block rows, Dv]
    k_buf: object  # [2, chunks per block, chunk, Hkv, D]; keys-minor [2, Hkv, D, block_kv]
    v_buf: object  # likewise, of Dv
    sems: object  # DMA [2 (K, V), 2 (slot)]
    max: object  # [Hkv, block rows, 1] f32
    sum: object
    acc: object  # [Hkv, block rows, Dv] f32

    @property
    def softmax(self) -> softmax.SoftmaxState:
        return softmax.SoftmaxState(self.max, self.sum, self.acc)


class _Span(NamedTuple):
    """One sequence within one grid step: its packed rows [row_first, row_last] there, the offset from a packed row
    to its position, its keys, and the K/V blocks its rows see: blocks 0..last_block of block_kv keys from
    key_origin, the start of the chunk holding the first key a row sees (under a window a sequence's keys start
    anywhere: a window of block_kv - chunk keys is one block)."""

    seq: object
    row_first: object
    row_last: object
    to_position: object
    kv_len: object
    key_origin: object
    last_block: object

    @property
    def has_blocks(self):
        return self.last_block >= 0


def _div(value, divisor: int):
    """value // divisor for a non-negative value (Mosaic lowers floor division of signed scalars only on a TPU)."""
    return jax.lax.div(value, jnp.int32(divisor))


def _for_each(first, last, body, carry):
    """body(i, carry) for i = first..last (none if last < first), returning the carry: one `while` loop.

    Not `lax.fori_loop`: Pallas lowers a fori loop whose trip count is only known at run time to a main loop and a
    remainder loop, each with its own copy of the body, so the kernel's three nested loops would hand Mosaic eight
    copies of a row tile's work to compile. A `while` loop whose predicate is not `i < upper` keeps one."""

    def step(state):
        i, inner = state
        return i + 1, body(i, inner)

    return jax.lax.while_loop(lambda state: state[0] <= last, step, (first, carry))[1]


def _key_range(problem: PagedProblem, first_position, last_position, kv_len):
    """First and last key seen by queries at positions [first_position, last_position] (last < first: none)."""
    last_key = kv_len - 1
    if problem.causal:
        last_key = jnp.minimum(last_key, last_position)
    first_key = jnp.int32(0)
    if problem.sliding_window is not None:
        first_key = jnp.maximum(first_key, first_position - problem.sliding_window + 1)
    return first_key, last_key


def _span(refs: _Refs, problem: PagedProblem, plan: PagedPlan, seq, block_start) -> _Span:
    q_start, q_end, kv_len = refs.cu_q[seq], refs.cu_q[seq + 1], refs.kv_lens[seq]
    row_first = jnp.maximum(q_start, block_start)
    row_last = jnp.minimum(jnp.minimum(q_end, block_start + plan.block_q), problem.total_q) - 1
    # Bottom-right alignment: the sequence's last query sits at its last key, kv_len - 1.
    to_position = kv_len - q_end
    first_key, last_key = _key_range(problem, row_first + to_position, row_last + to_position, kv_len)
    has_keys = (row_last >= row_first) & (last_key >= first_key)
    if problem.contiguous and problem.lane_chunks:  # blocks on whole lanes of the array: from the tile of the first key
        first_row = jnp.clip(refs.table[seq], 0, problem.page_size - 1)
        key_origin = _div(first_row + first_key, LANES) * LANES - first_row
    else:
        key_origin = _div(first_key, plan.chunk) * plan.chunk
    last_block = jnp.where(has_keys, _div(jnp.maximum(last_key - key_origin, 0), plan.block_kv), -1)
    return _Span(seq, row_first, row_last, to_position, kv_len, key_origin, last_block)


def _block_key(plan: PagedPlan, span: _Span, block):
    """The first key of one of the sequence's K/V blocks (contiguous keys read keys-minor: negative where the block
    starts on rows of the sequences before)."""
    return span.key_origin + block * plan.block_kv


def _contiguous_rows(refs: _Refs, problem: PagedProblem, plan: PagedPlan, span: _Span, block):
    """Contiguous keys: (the first row a block's DMAs read, how many rows before the block's first key it is).

    Row-major, one DMA per block: one reading past the keys' last row would leave the array, so the last blocks
    read the last block_kv rows. Keys-minor, a DMA per 128-row tile (chunk) holding a key of the sequence: such a
    tile lies within the array (its rows are a multiple of 128), and the others are not fetched."""
    first = jnp.clip(refs.table[span.seq], 0, problem.page_size - 1) + _block_key(plan, span, block)
    if problem.lane_chunks:
        return first, 0
    start = jnp.minimum(first, problem.page_size - plan.block_kv)
    return start, first - start


def _chunk_copy(refs: _Refs, problem: PagedProblem, plan: PagedPlan, span: _Span, block, slot, c):
    """(whether chunk c of a block holds a key of the sequence, its K and V copy descriptors)."""
    every = slice(None)
    token = _block_key(plan, span, block) + c * plan.chunk
    if problem.contiguous:
        page, first = 0, _contiguous_rows(refs, problem, plan, span, block)[0] + c * plan.chunk
    else:
        column = jnp.minimum(_div(token, problem.page_size), problem.pages_per_seq - 1)
        page = jnp.clip(refs.table[span.seq * problem.pages_per_seq + column], 0, problem.num_pages - 1)
        first = jax.lax.rem(token, problem.page_size)
    if problem.lane_chunks:  # on a lane tile (so are a block's origin and its chunks): Mosaic's DMA needs it known
        first = pl.multiple_of(first, plan.chunk)
    whole_page = not problem.contiguous and plan.chunk == problem.page_size
    rows = every if whole_page else pl.ds(first, plan.chunk)
    lanes = pl.ds(pl.multiple_of(c * plan.chunk, plan.chunk), plan.chunk)

    def copy(hbm, buf, keys_minor: bool, semaphore: int):
        source = (page, every, every, rows) if keys_minor else (page, rows)
        target = (slot, every, every, lanes) if keys_minor else (slot, c)
        return pltpu.make_async_copy(hbm.at[source], buf.at[target], refs.sems.at[semaphore, slot])

    k_copy = copy(refs.k_hbm, refs.k_buf, problem.keys_minor, 0)
    v_copy = copy(refs.v_hbm, refs.v_buf, problem.values_minor, 1)
    return token < span.kv_len, k_copy, v_copy  # chunks past the keys are not fetched


def _for_each_chunk(plan: PagedPlan, body) -> None:
    """body(c) for each chunk of a block: a loop of a known trip count (one copy of the body for Mosaic, not one per
    chunk: a block of 16-token pages has up to 64)."""
    jax.lax.fori_loop(0, plan.chunks_per_block, lambda c, carry: (body(c), carry)[1], 0)


def _copy_block(refs, problem, plan, span: _Span, block, slot, *, wait: bool) -> None:
    """Starts the K and V copies of a block's chunks that hold keys of the sequence, or (wait) waits for them."""

    def chunk(c):
        needed, k_copy, v_copy = _chunk_copy(refs, problem, plan, span, block, slot, c)

        @pl.when(needed)
        def _copy():
            for copy in (k_copy, v_copy):
                if wait:
                    copy.wait()
                else:
                    copy.start()

    _for_each_chunk(plan, chunk)


def _clear_values_past_keys(refs: _Refs, problem: PagedProblem, plan: PagedPlan, span: _Span, block, slot) -> None:
    """Zeroes a block's V rows past the sequence's keys: chunks not fetched (stale) and a page's rows past them
    (whatever the cache holds). p is 0 there, but 0 * NaN is NaN; a K row's logits are replaced instead."""
    zeros = jnp.zeros(refs.v_buf.shape[2:], refs.v_buf.dtype)

    def chunk(c):
        keys = span.kv_len - (_block_key(plan, span, block) + c * plan.chunk)  # the sequence's keys in the chunk

        @pl.when(keys <= 0)
        def _not_fetched():
            refs.v_buf[slot, c] = zeros

        @pl.when((keys > 0) & (keys < plan.chunk))
        def _rows_past_the_keys():
            def zero_row(row, carry):
                refs.v_buf[slot, c, row] = zeros[0]
                return carry

            _for_each(keys, plan.chunk - 1, zero_row, 0)

    _for_each_chunk(plan, chunk)


def _row_tokens(shape, group: int):
    """The token (row // group) of each row of a tile, broadcast along axis 1."""
    rows = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    if group & (group - 1) == 0:
        return rows >> (group.bit_length() - 1)
    # Exact for any row count a tile has: (row + 0.5) / group is never within rounding of an integer.
    return ((rows.astype(jnp.float32) + 0.5) * (1.0 / group)).astype(jnp.int32)


def _attend_tile(refs: _Refs, problem: PagedProblem, plan: PagedPlan, span: _Span, head: int, tile_q: int, tile,
                 block_start, key_start, buffer_start, k, v) -> None:
    """The online softmax of row tile `tile` (of tile_q tokens) of one KV head over one K/V block (its buffer's
    first key is key buffer_start; keys before key_start belong to the previous block): k, v [block_kv, D], or
    keys-minor k^T, v^T [D, block_kv]."""
    rows = tile_q * problem.group
    shape = (rows, plan.block_kv)
    row0 = pl.multiple_of(tile * rows, rows)
    token = block_start + tile * tile_q + _row_tokens(shape, problem.group)
    position = token + span.to_position
    key_pos = buffer_start + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    visible = (token >= span.row_first) & (token <= span.row_last) & (key_pos < span.kv_len)
    if problem.contiguous:  # a block's keys from key_start (keys-minor: from 0, rows before are other sequences')
        visible = visible & (key_pos >= jnp.maximum(key_start, 0))
    if problem.causal:
        visible = visible & (key_pos <= position)
    if problem.sliding_window is not None:
        visible = visible & (key_pos > position - problem.sliding_window)
    q = refs.q[head, pl.ds(row0, rows), :]
    raw = softmax.raw_logits(q, k, key_axis=1 if problem.keys_minor else 0, precision=problem.precision)
    logits = jnp.where(visible, masking.capped_logits(problem, raw), -jnp.inf)
    softmax.update(refs.softmax, (head, pl.ds(row0, rows), slice(None)), logits, v,
                   key_axis=1 if problem.values_minor else 0, precision=problem.precision)


def _tile_sees_block(problem: PagedProblem, plan: PagedPlan, span: _Span, tile_q: int, tile, block_start, key_start):
    """Whether some row of the tile (of tile_q tokens) that belongs to the sequence sees a key of the block."""
    first = jnp.maximum(span.row_first, block_start + tile * tile_q)
    last = jnp.minimum(span.row_last, block_start + (tile + 1) * tile_q - 1)
    first_key, last_key = _key_range(problem, first + span.to_position, last + span.to_position, span.kv_len)
    last_key = jnp.minimum(last_key, key_start + plan.block_kv - 1)
    first_key = jnp.maximum(first_key, key_start)
    return (last >= first) & (last_key >= first_key)


def _tile_range(span: _Span, tile_q: int, block_start):
    """The first and last row tile (of tile_q tokens) of the step holding a row of the sequence."""
    return _div(span.row_first - block_start, tile_q), _div(span.row_last - block_start, tile_q)


def _small_tiles_are_fewer_rows(plan: PagedPlan, span: _Span, block_start):
    """Whether the sequence's rows in the step span at most half the rows in tiles of min_tile_q tokens that they
    span in tiles of tile_q (a decode row: 2 tokens' rows instead of tile_q tokens'). A longer chunk runs the
    large tiles: many small matmuls cost more than the rows they save (an MXU pass has a floor of rows, each tile
    its loop and softmax bookkeeping)."""
    small_first, small_last = _tile_range(span, plan.min_tile_q, block_start)
    first, last = _tile_range(span, plan.tile_q, block_start)
    return 2 * (small_last - small_first + 1) * plan.min_tile_q <= (last - first + 1) * plan.tile_q


def _head_keys_and_values(refs: _Refs, problem: PagedProblem, plan: PagedPlan, span: _Span, slot, head: int,
                          key_start, buffer_start):
    """One KV head's keys and values of the block in slot `slot`: [block_kv, D] and [block_kv, Dv], keys-minor each
    [D or Dv, block_kv].

    A block's values that are not the sequence's keys are zeroed: p is 0 there, but 0 * NaN is NaN (a key's logits
    are replaced instead). Contiguous keys: rows before the block's first key or past the sequence's keys are other
    rows of the array, which past cu_k_lens[-1] may hold NaN (keys-minor, a block may start on the rows before the
    sequence's); pages read keys-minor: lanes past the sequence's keys (chunks not fetched, a page's lanes past
    them). Only a block holding some is masked. (Row-major pages:
    `_clear_values_past_keys` zeroed those rows in the buffer.)"""
    def head_of(buf, keys_minor: bool, head_dim: int):
        return buf[slot, head] if keys_minor else buf[slot, :, :, head, :].reshape(plan.block_kv, head_dim)

    k = head_of(refs.k_buf, problem.keys_minor, problem.head_dim)
    v = head_of(refs.v_buf, problem.values_minor, problem.v_head_dim)
    if not (problem.contiguous or problem.values_minor):
        return k, v
    key_axis = 1 if problem.values_minor else 0
    first_key = jnp.maximum(key_start, 0)
    needs_mask = (buffer_start < first_key) | (buffer_start + plan.block_kv > span.kv_len)

    def masked():
        value_pos = buffer_start + jax.lax.broadcasted_iota(jnp.int32, v.shape, key_axis)
        return jnp.where((value_pos >= first_key) & (value_pos < span.kv_len), v, jnp.zeros_like(v))

    return k, jax.lax.cond(needs_mask, masked, lambda: v)


def _attend_block(refs: _Refs, problem: PagedProblem, plan: PagedPlan, span: _Span, block, slot,
                  block_start) -> None:
    """Every KV head's row tiles of the sequence over one K/V block (in VMEM slot `slot`), in tiles of tile_q
    tokens or, when those are at most half the rows, of min_tile_q."""
    key_start = buffer_start = _block_key(plan, span, block)
    if problem.contiguous:
        buffer_start = key_start - _contiguous_rows(refs, problem, plan, span, block)[1]

    def run_tiles(tile_q: int, head: int, k, v):
        first_tile, last_tile = _tile_range(span, tile_q, block_start)

        def tile_body(tile, carry):
            pl.when(_tile_sees_block(problem, plan, span, tile_q, tile, block_start, key_start))(
                lambda: _attend_tile(refs, problem, plan, span, head, tile_q, tile, block_start, key_start,
                                     buffer_start, k, v))
            return carry

        _for_each(first_tile, last_tile, tile_body, 0)

    # A head's keys and values are read once for both tile sizes: reading them out of the buffer is most of the code
    # Mosaic compiles (row-major pages: a relayout of every key's row).
    small = None if plan.min_tile_q == plan.tile_q else _small_tiles_are_fewer_rows(plan, span, block_start)
    for head in range(problem.kv_heads):
        k, v = _head_keys_and_values(refs, problem, plan, span, slot, head, key_start, buffer_start)
        if small is None:
            run_tiles(plan.tile_q, head, k, v)
        else:
            pl.when(small)(functools.partial(run_tiles, plan.min_tile_q, head, k, v))
            pl.when(jnp.logical_not(small))(functools.partial(run_tiles, plan.tile_q, head, k, v))


def _write_out(refs: _Refs, plan: PagedPlan, first, last) -> None:
    """Normalizes row tiles first..last (of min_tile_q tokens) of the step into the output block."""
    rows = refs.out.shape[1] // (plan.block_q // plan.min_tile_q)

    def tile(index, carry):
        at = (slice(None), pl.ds(pl.multiple_of(index * rows, rows), rows), slice(None))
        refs.out[at] = softmax.normalized(refs.softmax, at).astype(refs.out.dtype)
        return carry

    _for_each(first, last, tile, 0)


def _paged_kernel(cu_q_ref, kv_lens_ref, table_ref, seq_first_ref, seq_last_ref, q_ref, k_hbm, v_hbm, *rest,
                  problem: PagedProblem, plan: PagedPlan):
    rest = list(rest)
    sinks_ref = rest.pop(0) if problem.has_sinks else None
    refs = _Refs(cu_q_ref, kv_lens_ref, table_ref, q_ref, k_hbm, v_hbm, sinks_ref, *rest)
    step = pl.program_id(0)
    block_start = step * plan.block_q
    softmax.start(refs.softmax, None if sinks_ref is None else sinks_ref[...])
    last_seq = seq_last_ref[step]

    def seq_body(seq, carry):
        # in_flight: this sequence's first block is already on its way into `slot`; written: the row tiles (of
        # min_tile_q tokens) of the step already normalized into the output.
        slot, in_flight, written = carry
        span = _span(refs, problem, plan, seq, block_start)
        pl.when(span.has_blocks & (in_flight == 0))(
            lambda: _copy_block(refs, problem, plan, span, 0, slot, wait=False))
        has_next = seq < last_seq
        following = _span(refs, problem, plan, jnp.minimum(seq + 1, last_seq), block_start)
        prefetch_next = has_next & following.has_blocks

        def block_body(block, slot):
            other = 1 - slot

            @pl.when(block < span.last_block)
            def _next_of_this_sequence():
                _copy_block(refs, problem, plan, span, block + 1, other, wait=False)

            @pl.when((block == span.last_block) & prefetch_next)
            def _first_of_the_next():
                _copy_block(refs, problem, plan, following, 0, other, wait=False)

            _copy_block(refs, problem, plan, span, block, slot, wait=True)
            if not (problem.contiguous or problem.values_minor):
                _clear_values_past_keys(refs, problem, plan, span, block, slot)
            _attend_block(refs, problem, plan, span, block, slot, block_start)
            return other

        slot = _for_each(jnp.int32(0), span.last_block, block_body, slot)
        # The tiles whose rows are all this sequence's or earlier ones' are final: normalized now, while the next
        # sequence's first block is in flight, rather than every row after the last copy.
        finished = jnp.maximum(written, _div(span.row_last + 1 - block_start, plan.min_tile_q))
        _write_out(refs, plan, written, finished - 1)
        return slot, (span.has_blocks & prefetch_next).astype(jnp.int32), finished

    carry = _for_each(seq_first_ref[step], last_seq, seq_body, (jnp.int32(0), jnp.int32(0), jnp.int32(0)))
    _write_out(refs, plan, carry[2], plan.block_q // plan.min_tile_q - 1)  # the rest, and rows of no sequence


def _sequence_ranges(cu_q_lens, plan: PagedPlan):
    """First and last sequence owning a packed row of each grid step (last < first: none)."""
    problem = plan.problem
    starts = jnp.arange(plan.num_q_blocks, dtype=jnp.int32) * plan.block_q
    ends = jnp.minimum(starts + plan.block_q, problem.total_q) - 1
    q_ends = cu_q_lens[1:]
    first = jnp.searchsorted(q_ends, starts, side="right").astype(jnp.int32)
    last = jnp.minimum(jnp.searchsorted(q_ends, ends, side="right"), problem.num_seqs - 1).astype(jnp.int32)
    return first, last


def _cost_estimate(q, problem: PagedProblem) -> pl.CostEstimate:
    """An upper bound for XLA's scheduler: every query against a full page-table row (or its window)."""
    keys = problem.pages_per_seq * problem.page_size
    if problem.sliding_window is not None:
        keys = min(keys, problem.sliding_window)
    itemsize = jnp.dtype(q.dtype).itemsize
    widths = problem.head_dim + problem.v_head_dim  # of a key and its value; of a query row and its output row
    kv_bytes = min(problem.num_seqs * problem.pages_per_seq, problem.num_pages) * problem.page_size * (
        problem.kv_heads * widths * itemsize)
    return pl.CostEstimate(
        flops=int(2 * problem.total_q * problem.q_heads * keys * widths),
        transcendentals=int(problem.total_q * problem.q_heads * keys),
        bytes_accessed=int(problem.total_q * problem.q_heads * widths * itemsize + kv_bytes),
    )


def call(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, cu_q_lens: jax.Array, kv_lens: jax.Array,
         page_table: jax.Array, plan: PagedPlan, sinks: jax.Array | None = None) -> jax.Array:
    """The kernel as `plan` says: q[T, Hq, D] over the cache pages -> [T, Hq, Dv] (inputs of the plan's problem,
    with at least one sequence and one query; assumed valid)."""
    problem = plan.problem
    total_q, _, head_dim = q.shape
    kv_heads, group, v_head_dim = problem.kv_heads, problem.group, problem.v_head_dim
    padded = plan.num_q_blocks * plan.block_q
    step_rows = plan.block_q * group
    # [T, Hq, D] -> [Hkv, T * group, D]: each KV head's rows are (token, query head of its group).
    q_rows = jnp.pad(q, ((0, padded - total_q), (0, 0), (0, 0))).reshape(padded, kv_heads, group, head_dim)
    q_rows = q_rows.transpose(1, 0, 2, 3).reshape(kv_heads, padded * group, head_dim)
    seq_first, seq_last = _sequence_ranges(cu_q_lens.astype(jnp.int32), plan)
    row_spec = pl.BlockSpec((kv_heads, step_rows, head_dim), lambda i, *_: (0, i, 0))
    out_spec = pl.BlockSpec((kv_heads, step_rows, v_head_dim), lambda i, *_: (0, i, 0))
    in_specs = [row_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
    operands = [q_rows, k_cache, v_cache]
    if sinks is not None:
        # Each row's sink, in the rows' (token, head) order: one block serves every step.
        sink_rows = jnp.tile(sinks.astype(jnp.float32).reshape(kv_heads, 1, group), (1, plan.block_q, 1))
        in_specs.append(pl.BlockSpec((kv_heads, step_rows, 1), lambda i, *_: (0, 0, 0)))
        operands.append(sink_rows.reshape(kv_heads, step_rows, 1))
    buffers = []
    for index, (cache, keys_minor) in enumerate(((k_cache, problem.keys_minor), (v_cache, problem.values_minor))):
        cache_dim = cache.shape[3]
        if keys_minor:  # a free view of XLA's default layout of such a cache (`cache_stored_keys_minor`)
            operands[1 + index] = cache.transpose(0, 2, 3, 1)
            buffers.append(pltpu.VMEM((2, kv_heads, cache_dim, plan.block_kv), cache.dtype))
        else:
            buffers.append(pltpu.VMEM((2, plan.chunks_per_block, plan.chunk, kv_heads, cache_dim), cache.dtype))
    out = pl.pallas_call(
        functools.partial(_paged_kernel, problem=problem, plan=plan),
        out_shape=jax.ShapeDtypeStruct((kv_heads, padded * group, v_head_dim), q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(plan.num_q_blocks,),
            in_specs=in_specs,
            out_specs=out_spec,
            scratch_shapes=[
                *buffers, pltpu.SemaphoreType.DMA((2, 2)),
                pltpu.VMEM((kv_heads, step_rows, 1), jnp.float32),
                pltpu.VMEM((kv_heads, step_rows, 1), jnp.float32),
                pltpu.VMEM((kv_heads, step_rows, v_head_dim), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                             vmem_limit_bytes=plan.vmem_limit_bytes),
        cost_estimate=_cost_estimate(q, problem),
    )(cu_q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32), page_table.astype(jnp.int32).reshape(-1),
      seq_first, seq_last, *operands)
    out = out.reshape(kv_heads, padded, group, v_head_dim).transpose(1, 0, 2, 3)
    return out.reshape(padded, kv_heads * group, v_head_dim)[:total_q]


def ragged_varlen_attention(q: jax.Array, k: jax.Array, v: jax.Array, cu_q_lens: jax.Array, cu_k_lens: jax.Array, *,
                            sinks: jax.Array | None = None, scale: float | None = None, causal: bool = True,
                            sliding_window: int | None = None, softcap: float | None = None,
                            max_q_len: int | None = None, config: PagedConfig | None = None,
                            generation: str | TpuGeneration | None = None) -> jax.Array:
    """`ragged_paged_attention` over contiguous (varlen) keys k[total_k, Hkv, D] and values v[total_k, Hkv, Dv],
    sequence s owning rows cu_k_lens[s]:cu_k_lens[s + 1] (as `flash_attn_varlen_func` receives them), read in
    place: the same kernel, the keys one page of total_k rows whose page table names each sequence's first row
    (`contiguous`)."""
    cu_k_lens = cu_k_lens.astype(jnp.int32)
    return ragged_paged_attention(q, k[None], v[None], cu_q_lens, cu_k_lens[1:] - cu_k_lens[:-1], cu_k_lens[:-1, None],
                                  sinks=sinks, scale=scale, causal=causal, sliding_window=sliding_window,
                                  softcap=softcap, max_q_len=max_q_len, config=config, generation=generation,
                                  contiguous=True)


def ragged_paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, cu_q_lens: jax.Array,
                           kv_lens: jax.Array, page_table: jax.Array, *, sinks: jax.Array | None = None,
                           scale: float | None = None, causal: bool = True, sliding_window: int | None = None,
                           softcap: float | None = None, max_q_len: int | None = None,
                           config: PagedConfig | None = None,
                           generation: str | TpuGeneration | None = None, contiguous: bool = False,
                           window_ring: bool = False) -> jax.Array:
    """Attention of packed q[T, Hq, D] over the paged cache k_cache[num_pages, page_size, Hkv, D], v_cache[num_pages,
    page_size, Hkv, Dv] -> [T, Hq, Dv] (layout and semantics: `common/paged.py`).

    cu_q_lens int [S + 1], kv_lens int [S], page_table int [S, pages_per_seq]; sinks [Hq] (a logit per query
    head joining every row's softmax, attending to nothing); max_q_len, if given, bounds every sequence's
    queries (1: decode) and only shapes the tiles. Tiles: `config`, else `tiles.select`'s for `generation`
    (a name or its facts; default this device's, resolved once here). `contiguous`: the cache is one page of
    every sequence's keys, page_table [S, 1] each sequence's first row (`ragged_varlen_attention`). Without a
    query row, a query head, a sequence or a key no kernel runs.

    `window_ring`: each sequence's pages are a ring of sliding_window slots, key j at slot j % sliding_window
    (transformers' `SlidingAttentionCacheAllocator`), for decode rows only (max_q_len 1). A decode row sees every
    live slot of its ring, whatever their order: the call is the windowless one over min(kv_len, window) keys from
    slot 0, so a 128-key window is one 128-key chunk of the ring, where keys kept at their positions put it across
    two (`tiles.WINDOW_CHUNKS`).
    """
    max_kv_len = None
    if window_ring:
        if sliding_window is None or max_q_len != 1 or contiguous:
            raise ValueError("window_ring needs a sliding_window and max_q_len=1 (decode rows over a paged cache), "
                             f"got sliding_window={sliding_window}, max_q_len={max_q_len}, contiguous={contiguous}")
        kv_lens, max_kv_len, sliding_window = jnp.minimum(kv_lens, sliding_window), sliding_window, None
    if 0 in (q.shape[0], q.shape[1], *page_table.shape, *k_cache.shape[:2]):
        return jnp.zeros((*q.shape[:2], v_cache.shape[3]), q.dtype)
    problem = paged_problem(q, k_cache, v_cache, page_table, scale=scale, causal=causal, sliding_window=sliding_window,
                            softcap=softcap, sinks=sinks, max_q_len=max_q_len, contiguous=contiguous,
                            max_kv_len=max_kv_len)
    plan = make(problem, resolve_target(generation), config)
    return call(q, k_cache, v_cache, cu_q_lens, kv_lens, page_table, plan, sinks=sinks)
