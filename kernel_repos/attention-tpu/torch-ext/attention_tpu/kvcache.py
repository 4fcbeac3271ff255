"""`flash_attn_with_kvcache`: flash-attn 2's function of that name (the one transformers' paged continuous batching
calls, `modeling_flash_attention_utils._flash_attention_forward`), on the ragged paged attention kernel.

transformers reads this function's parameter names (`_process_flash_attention_kwargs`): `block_table` (or
`page_table`), `cache_seqlens`, `softmax_scale`, `causal`, `window_size`, `softcap` and `s_aux` (or
`learnable_sink`) are the ones it hands over. Everything the kernel cannot do raises a ValueError naming the
argument; nothing is ignored.

The kernel is handed the query rows padded to their token bucket (rows past the last sequence, which no sequence
owns) and the sequences to a power of two (empty ones: no queries, no keys), so that a model compiles it a bounded
number of times whatever its prompts and batches (`padding.py`).
"""

from __future__ import annotations

import torch

from ._buckets import token_bucket
from .padding import RAGGED_SEQUENCES_FLOOR, padded, power_of_two, query_length_bound, with_empty_sequences
from .paged_ops import ragged_paged_attention


def _refuse(name: str, value, given: bool, why: str) -> None:
    if given:
        raise ValueError(f"flash_attn_with_kvcache: {name}={value!r} is not supported ({why})")


def _one_of(first_name: str, first, second_name: str, second):
    if first is not None and second is not None:
        raise ValueError(f"flash_attn_with_kvcache: pass {first_name} or {second_name}, not both")
    return first if first is not None else second


def _window(window_size, causal: bool) -> int | None:
    """flash-attn's (left, right) window as the kernel's sliding_window (keys (p - w, p] for a query at p)."""
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in window_size)):
        raise ValueError(f"flash_attn_with_kvcache: window_size must be a pair of ints, got {window_size!r}")
    left, right = window_size
    if not causal and right >= 0:
        raise ValueError(f"flash_attn_with_kvcache: window_size={tuple(window_size)!r} is not supported without "
                         "causal (a window bounded on the right; right must be -1)")
    if left < -1 or right < -1:
        raise ValueError(f"flash_attn_with_kvcache: window_size entries must be >= -1, got {tuple(window_size)!r}")
    return None if left < 0 else left + 1


def _cache_lengths(cache_seqlens, batch: int, device) -> torch.Tensor:
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        return torch.tensor([cache_seqlens] * batch, dtype=torch.int64, device=device)  # data, not a scalar argument
    if not isinstance(cache_seqlens, torch.Tensor) or tuple(cache_seqlens.shape) != (batch,) or (
            cache_seqlens.dtype.is_floating_point or cache_seqlens.dtype == torch.bool):
        raise ValueError(f"flash_attn_with_kvcache: cache_seqlens must be an int or an integer tensor of shape "
                         f"({batch},), got {cache_seqlens!r}")
    return cache_seqlens.to(torch.int64)


def _check_capacity(cache_seqlens, cache_lengths: torch.Tensor, new_len: int, capacity: int) -> None:
    """Each sequence's cached keys plus its new ones fit in its cache (its pages, or its row), as flash-attn
    requires. An int is checked always; a tensor where its values are on the host already (a CPU tensor, outside
    torch.compile): on a TPU, reading them would wait for the device at every call."""
    if not isinstance(cache_seqlens, torch.Tensor):
        lengths = [cache_seqlens]
    elif cache_seqlens.device.type == "cpu" and not torch.compiler.is_compiling():
        lengths = cache_lengths.tolist()
    else:
        return
    if any(length < 0 or length + new_len > capacity for length in lengths):
        raise ValueError(f"flash_attn_with_kvcache: cache_seqlens {lengths} plus {new_len} new keys (k) must fit in "
                         f"the cache's capacity of {capacity} keys per sequence, and cache_seqlens must be >= 0")


def _new_keys(k, v, k_cache, v_cache, batch: int) -> int:
    """How many new keys k, v [B, S_new, Hkv, D or Dv] (each shaped and typed as its cache's rows) bring; 0 for
    none."""
    if (k is None) != (v is None):
        raise ValueError("flash_attn_with_kvcache: pass k and v together, or neither")
    if k is None:
        return 0
    new_tokens = k.shape[1] if isinstance(k, torch.Tensor) else -1
    for name, tensor, cache in (("k", k, k_cache), ("v", v, v_cache)):
        expected = (batch, new_tokens, *cache.shape[2:])
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != expected or tensor.dtype != cache.dtype:
            raise ValueError(f"flash_attn_with_kvcache: {name} must be a {cache.dtype} tensor of shape "
                             f"[{batch}, new tokens, {cache.shape[2]}, {cache.shape[3]}], got "
                             f"{getattr(tensor, 'dtype', None)} {tuple(getattr(tensor, 'shape', ()))}")
    return new_tokens


def _write_new_keys(k_cache, v_cache, k, v, page_table, cache_lengths) -> None:
    """k, v [B, S_new, Hkv, D] into the cache pages at positions cache_lengths[b] + i, in place."""
    page_size = k_cache.shape[1]
    positions = cache_lengths[:, None] + torch.arange(k.shape[1], device=k.device)[None, :]
    pages = torch.gather(page_table.to(torch.int64), 1, positions // page_size)
    rows = positions % page_size
    k_cache.index_put_((pages.flatten(), rows.flatten()), k.flatten(0, 1))
    v_cache.index_put_((pages.flatten(), rows.flatten()), v.flatten(0, 1))


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, page_table=None, s_aux=None,
                            learnable_sink=None):
    """Attention of q[B, Sq, Hq, D] over a KV cache that k[B, S_new, Hkv, D], v[B, S_new, Hkv, Dv] (if given) are
    first written into, in place, at positions cache_seqlens[b] + i -> [B, Sq, Hq, Dv] (flash-attn 2 semantics,
    and flash-attn 3's Dv that may differ from D; inference only).

    Paged cache (block_table or page_table [B, pages_per_seq] given): k_cache [num_pages, page_size, Hkv, D],
    v_cache [..., Dv], read in place, any page size. Otherwise k_cache, v_cache [B_cache, S_max, Hkv, D or Dv] with
    cache_batch_idx [B] (default: row b) choosing each sequence's row. Sequence b attends over cache_seqlens[b]
    + S_new keys (cache_seqlens default: the whole capacity; required with a page table); its queries are its
    last Sq positions (causal is bottom-right aligned). window_size (left, right): a causal query sees its last
    left + 1 keys. softcap 0 means none. s_aux / learnable_sink [Hq]: attention sinks (GPT-OSS).

    Refused with a ValueError naming the argument: cache_seqlens (plus new keys) past a sequence's cache
    capacity or negative (checked where the values are on the host: an int, or a CPU tensor),
    rotary_cos/rotary_sin, cache_leftpad, alibi_slopes, return_softmax_lse=True, num_splits other than 0 or 1,
    cache_batch_idx with a page table, a window bounded on the right without causal. rotary_interleaved only
    qualifies rotary, which is refused.
    """
    _refuse("rotary_cos", rotary_cos, rotary_cos is not None, "apply rotary embeddings to q and k before the call")
    _refuse("rotary_sin", rotary_sin, rotary_sin is not None, "apply rotary embeddings to q and k before the call")
    _refuse("cache_leftpad", cache_leftpad, cache_leftpad is not None, "left-padded caches are not read")
    _refuse("alibi_slopes", alibi_slopes, alibi_slopes is not None, "ALiBi biases are not computed")
    _refuse("return_softmax_lse", return_softmax_lse, bool(return_softmax_lse), "the kernel returns no log-sum-exp")
    if not isinstance(rotary_interleaved, bool):
        raise ValueError(f"flash_attn_with_kvcache: rotary_interleaved must be a bool, got {rotary_interleaved!r}")
    if num_splits not in (0, 1) or isinstance(num_splits, bool):
        raise ValueError(f"flash_attn_with_kvcache: num_splits={num_splits!r} is not supported (0 or 1: the kernel "
                         "does not split keys across programs)")
    table = _one_of("block_table", block_table, "page_table", page_table)
    sinks = _one_of("s_aux", s_aux, "learnable_sink", learnable_sink)
    for name, tensor in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            raise ValueError(f"flash_attn_with_kvcache: {name} must be a 4-D tensor, got "
                             f"{getattr(tensor, 'shape', type(tensor).__name__)}")
    batch, q_len, q_heads, head_dim = q.shape
    new_len = _new_keys(k, v, k_cache, v_cache, batch)
    if table is not None:
        if cache_batch_idx is not None:
            raise ValueError("flash_attn_with_kvcache: cache_batch_idx is not supported with a block_table/page_table")
        if cache_seqlens is None:
            raise ValueError("flash_attn_with_kvcache: cache_seqlens is required with a block_table/page_table")
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[0] != batch:
            raise ValueError(f"flash_attn_with_kvcache: block_table/page_table must be a tensor [{batch}, "
                             f"pages_per_seq], got {getattr(table, 'shape', type(table).__name__)}")
    else:
        # A contiguous cache is a paged one of one page per sequence: row cache_batch_idx[b] (or b).
        rows = torch.arange(batch, device=q.device) if cache_batch_idx is None else cache_batch_idx
        if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != (batch,):
            raise ValueError(f"flash_attn_with_kvcache: cache_batch_idx must be an integer tensor of shape ({batch},)")
        table = rows.to(torch.int32)[:, None]
        if cache_seqlens is None:
            cache_seqlens = k_cache.shape[1] - new_len
    cache_lengths = _cache_lengths(cache_seqlens, batch, q.device)
    _check_capacity(cache_seqlens, cache_lengths, new_len, capacity=table.shape[1] * k_cache.shape[1])
    if k is not None:
        _write_new_keys(k_cache, v_cache, k, v, table, cache_lengths)
    kv_lens = (cache_lengths + new_len).to(torch.int32)
    rows, sequences = batch * q_len, power_of_two(batch, RAGGED_SEQUENCES_FLOOR)
    q_rows = token_bucket(rows) if rows else 0
    cu_q_lens = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * q_len
    out = ragged_paged_attention(
        padded(q.reshape(rows, q_heads, head_dim), 0, q_rows), k_cache, v_cache,
        with_empty_sequences(cu_q_lens, sequences), padded(kv_lens, 0, sequences), padded(table, 0, sequences),
        scale=softmax_scale, causal=causal, sliding_window=_window(window_size, bool(causal)),
        softcap=None if not softcap else softcap, sinks=sinks, max_q_len=query_length_bound(q_len, max(q_rows, 1)),
    )
    return out[:rows].reshape(batch, q_len, q_heads, v_cache.shape[3])
