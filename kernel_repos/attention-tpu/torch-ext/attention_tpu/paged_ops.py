"""The torch op of ragged paged attention (`paged/kernel.py`), over a paged cache or varlen keys, and the one place
its inputs are checked.

Inference only: the kernel has no backward, so the op refuses inputs that would need one.
"""

from __future__ import annotations

import math
import warnings

import jax
import torch

from ._ops import add_op_namespace_prefix, jax_torch_op
from .common.head_dims import head_dims_refusal
from .common.paged import cache_copied_whole_per_call
from .ops import FLOAT_DTYPES, check_tensor, is_integer_dtype
from .paged.kernel import ragged_paged_attention as _jax_ragged_paged_attention


@jax_torch_op(add_op_namespace_prefix("ragged_paged_attention"))
def _ragged_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    sinks: jax.Array | None,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    softcap: float | None,
    max_q_len: int | None,
    contiguous: bool,
    window_ring: bool,
) -> jax.Array:
    """The one op of the kernel, over a paged cache (of window rings: `window_ring`) or (`contiguous`) varlen keys
    as one page."""
    return _jax_ragged_paged_attention(q, k_cache, v_cache, cu_q_lens, kv_lens, page_table, sinks=sinks, scale=scale,
                                       causal=causal, sliding_window=sliding_window, softcap=softcap,
                                       max_q_len=max_q_len, contiguous=contiguous, window_ring=window_ring)


def _check_integer(name: str, value, shape: tuple[int, ...]) -> None:
    check_tensor(name, value, len(shape), str(list(shape)))
    if tuple(value.shape) != shape or not is_integer_dtype(value.dtype):
        raise ValueError(f"{name} must be an integer tensor of shape {shape}, got {value.dtype} {tuple(value.shape)}")


def check_positive_int(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def check_paged_args(q, k_cache, v_cache, cu_q_lens, kv_lens, page_table, *, scale, sliding_window, softcap, sinks,
                     max_q_len) -> None:
    """Types, shapes, dtypes and devices of a ragged paged attention call, in torch terms."""
    check_tensor("q", q, 3, "[total_q, q_heads, head_dim]")
    check_tensor("k_cache", k_cache, 4, "[num_pages, page_size, kv_heads, head_dim]")
    check_tensor("v_cache", v_cache, 4, "[num_pages, page_size, kv_heads, v_head_dim]")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache and v_cache must have the same shape but for the head_dim (the last), got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _, q_heads, head_dim = q.shape
    _, _, kv_heads, kv_head_dim = k_cache.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"q and k_cache must have the same head_dim, got {head_dim} and {kv_head_dim}")
    refusal = head_dims_refusal(head_dim, v_cache.shape[3])
    if refusal:
        raise ValueError(refusal)
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"the number of query heads ({q_heads}) must be a multiple of the number of key/value heads "
                         f"({kv_heads})")
    if q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"q must be float32 or bfloat16, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q, k_cache and v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, "
                        f"{v_cache.dtype}")
    check_tensor("page_table", page_table, 2, "[num_seqs, pages_per_seq]")
    if not is_integer_dtype(page_table.dtype):
        raise ValueError(f"page_table must be an integer tensor, got {page_table.dtype}")
    num_seqs = page_table.shape[0]
    _check_integer("cu_q_lens", cu_q_lens, (num_seqs + 1,))
    _check_integer("kv_lens", kv_lens, (num_seqs,))
    devices = {t.device for t in (q, k_cache, v_cache, cu_q_lens, kv_lens, page_table)}
    if sinks is not None:
        check_tensor("sinks", sinks, 1, f"[{q_heads}]")
        if tuple(sinks.shape) != (q_heads,) or sinks.dtype not in FLOAT_DTYPES:
            raise ValueError(f"sinks must be a float32/bfloat16 tensor of shape ({q_heads},) (one per query head), "
                             f"got {sinks.dtype} {tuple(sinks.shape)}")
        devices.add(sinks.device)
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k_cache, v_cache, sinks)):
        raise ValueError("ragged paged attention is inference-only: q, k_cache, v_cache and sinks must not require "
                         "grad (or run under torch.no_grad())")
    check_positive_int("sliding_window", sliding_window)
    check_positive_int("max_q_len", max_q_len)
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not -math.inf < scale < math.inf):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")


def check_window_ring(window_ring, sliding_window, max_q_len, ring_capacity: int) -> None:
    """A ring of window slots (`window_ring`) holds decode rows' keys only, and must fit the page table's tokens."""
    if not isinstance(window_ring, bool):
        raise TypeError(f"window_ring must be a bool, got {window_ring!r}")
    if not window_ring:
        return
    if sliding_window is None or max_q_len != 1:
        raise ValueError(f"window_ring=True needs a sliding_window and max_q_len=1 (a ring of window slots holds "
                         f"decode rows' keys), got sliding_window={sliding_window!r}, max_q_len={max_q_len!r}")
    if sliding_window > ring_capacity:
        raise ValueError(f"window_ring=True needs a ring of sliding_window={sliding_window} slots within each "
                         f"sequence's pages, which hold {ring_capacity} tokens (pages_per_seq x page_size)")


def ragged_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_q_lens: torch.Tensor,
                           kv_lens: torch.Tensor, page_table: torch.Tensor, *, scale: float | None = None,
                           causal: bool = True, sliding_window: int | None = None, softcap: float | None = None,
                           sinks: torch.Tensor | None = None, max_q_len: int | None = None,
                           window_ring: bool = False) -> torch.Tensor:
    """Attention of packed q[total_q, Hq, D] over a paged KV cache -> [total_q, Hq, Dv] (inference only).

    k_cache [num_pages, page_size, Hkv, D], v_cache [num_pages, page_size, Hkv, Dv] (transformers' paged cache
    layout, read in place; Dv = D but for latent attention);
    page_table int [num_seqs, pages_per_seq] (key j of sequence s in page page_table[s, j // page_size]);
    cu_q_lens int [num_seqs + 1] (sequence s owns q rows cu_q_lens[s]:cu_q_lens[s + 1]; sequences may own none);
    kv_lens int [num_seqs] (keys of each sequence, its new ones included: its queries are its last tokens).
    Causal (default) with bottom-right alignment; sliding_window w: a query sees its last w keys; softcap;
    scale (default D ** -0.5); sinks [Hq]; GQA (Hq a multiple of Hkv); D and Dv each a multiple of 8 up to 576
    (`supports_head_dims`); float32 or bfloat16. max_q_len, if given, must bound every sequence's query count; it
    only shapes the tiles. Rows that see no key and rows past cu_q_lens[-1] come out as zeros.
    window_ring: each sequence's pages are a ring of sliding_window slots, key j at slot j % sliding_window
    (transformers' sliding-layer cache, `SlidingAttentionCacheAllocator`), kv_lens its keys so far; decode rows only
    (max_q_len=1): a 128-key window is then one 128-key read, where keys at their positions straddle two.
    """
    check_paged_args(q, k_cache, v_cache, cu_q_lens, kv_lens, page_table, scale=scale,
                     sliding_window=sliding_window, softcap=softcap, sinks=sinks, max_q_len=max_q_len)
    check_window_ring(window_ring, sliding_window, max_q_len, page_table.shape[1] * k_cache.shape[1])
    page_size = k_cache.shape[1]
    copied = [cache.shape[-1] for cache in (k_cache, v_cache)
              if cache_copied_whole_per_call(page_size, cache.shape[-1])]
    if copied:
        warnings.warn(f"a paged cache of head_dim {copied[0]} over pages of {page_size} tokens is stored by XLA with "
                      "the page index minor on a TPU, so every call copies K and V whole before the kernel reads "
                      "them; allocate pages of a multiple of 128 tokens (transformers' default 256 is one), which "
                      "the kernel reads in place", stacklevel=2)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    # Clamped as int64: torch clamps no unsigned dtype wider than uint8.
    kv_lens = kv_lens.to(torch.int64).clamp(0, page_table.shape[1] * k_cache.shape[1]).to(torch.int32)
    return _ragged_paged_attention(q, k_cache, v_cache, cu_q_lens.to(torch.int32), kv_lens,
                                   page_table.to(torch.int32), sinks, scale, bool(causal), sliding_window,
                                   None if softcap is None else float(softcap), max_q_len, False, window_ring)


def ragged_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q_lens: torch.Tensor,
                            cu_k_lens: torch.Tensor, *, scale: float | None = None, causal: bool = True,
                            sliding_window: int | None = None, softcap: float | None = None,
                            sinks: torch.Tensor | None = None, max_q_len: int | None = None) -> torch.Tensor:
    """`ragged_paged_attention` over contiguous (varlen) keys k[total_k, Hkv, D] and values v[total_k, Hkv, Dv] ->
    [total_q, Hq, Dv], read in place: sequence s owns key rows cu_k_lens[s]:cu_k_lens[s + 1] (non-decreasing,
    within [0, total_k]) and query rows cu_q_lens[s]:cu_q_lens[s + 1], its queries its last positions. Inference
    only."""
    check_tensor("k", k, 3, "[total_k, kv_heads, head_dim]")
    check_tensor("v", v, 3, "[total_k, kv_heads, v_head_dim]")
    check_tensor("cu_k_lens", cu_k_lens, 1, "[num_seqs + 1]")
    num_seqs = cu_k_lens.shape[0] - 1
    if num_seqs < 0 or not is_integer_dtype(cu_k_lens.dtype):
        raise ValueError(f"cu_k_lens must be an integer tensor [num_seqs + 1], got {cu_k_lens.dtype} "
                         f"{tuple(cu_k_lens.shape)}")
    # The paged call on the views the kernel reads: one page of total_k rows, the page table each sequence's first
    # row.
    check_paged_args(q, k[None], v[None], cu_q_lens, cu_k_lens[1:], cu_k_lens[:-1, None], scale=scale,
                     sliding_window=sliding_window, softcap=softcap, sinks=sinks, max_q_len=max_q_len)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    cu_k_lens = cu_k_lens.to(torch.int64).clamp(0, k.shape[0]).to(torch.int32)
    return _ragged_paged_attention(q, k[None], v[None], cu_q_lens.to(torch.int32), cu_k_lens[1:] - cu_k_lens[:-1],
                                   cu_k_lens[:-1, None], sinks, scale, bool(causal), sliding_window,
                                   None if softcap is None else float(softcap), max_q_len, True, False)
