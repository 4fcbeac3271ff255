"""The problem value of ragged paged attention (`paged/`): one call over a batch of sequences whose queries are packed
and whose keys and values sit in the pages of a paged KV cache.

Layout (transformers' paged cache, `continuous_batching/cache_allocators/full_attention.py`, and flash-attn's
`flash_attn_with_kvcache`):

* q: [total_q, Hq, D], the sequences' queries one after another; sequence s owns rows
  ``cu_q_lens[s]:cu_q_lens[s + 1]``. Rows past ``cu_q_lens[-1]`` belong to no sequence (their output is 0).
* k_cache: [num_pages, page_size, Hkv, D], v_cache: [num_pages, page_size, Hkv, Dv] (Dv = D but for latent
  attention), the output [total_q, Hq, Dv]; page_table: int32 [num_seqs, pages_per_seq]; key j of
  sequence s sits in page ``page_table[s, j // page_size]`` at row ``j % page_size``.
* kv_lens: int32 [num_seqs], the keys of each sequence (its queries included).

Where XLA stores such a cache keys-minor (`cache_stored_keys_minor`: a head_dim that is no multiple of 128 over
pages that are one), the kernel reads it as ``cache.transpose(0, 2, 3, 1)``, [num_pages, Hkv, D, page_size]: a
free view of that layout, in which each page holds K^T (V^T) per KV head (`PagedProblem.keys_minor`,
`values_minor`: each cache on its own, by its head dim). So are contiguous keys at such a head_dim
(`packed_keys_stored_minor`), as [1, Hkv, D, total_k], when total_k is a multiple of 128.

Contiguous (varlen) K/V, as `flash_attn_varlen_func` receives them, are the same problem with `contiguous` set:
k, v [total_k, Hkv, D] are read as one page of total_k rows ([1, total_k, Hkv, D], a free reshape) and the page
table's one column holds each sequence's first row (cu_k_lens[:-1]); key j of sequence s is row
``page_table[s, 0] + j``.

Positions are bottom-right aligned: query i of sequence s (of q_len queries) sits at position
``kv_lens[s] - q_len + i``. Key j is visible to a query at position p when ``j < kv_lens[s]``, ``j <= p``
(causal) and ``j > p - sliding_window`` (window). Softcap, scale and sinks act as in `masking.Attention`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .._hardware import LANES


def cache_stored_keys_minor(page_size: int, head_dim: int) -> bool:
    """Whether XLA's default TPU layout of a cache [num_pages, page_size, Hkv, head_dim] stores, per page and KV
    head, the page's keys minor: minor_to_major {1,3,2,0}, physically [num_pages, Hkv, head_dim, page_size], of
    which ``cache.transpose(0, 2, 3, 1)`` is a free bitcast.

    XLA picks that layout for a jitted function's arguments (and torch-tpu for its device tensors) where head_dim is
    no multiple of 128 lanes and page_size is one. Probed with libtpu's compile-only topologies, bfloat16 on v6e and
    TPU7x for head_dim 32, 64, 80, 96 and 128, 1 to 16 KV heads and pages of 16 to 512 tokens (and spot checks in
    float32, on v5e and v5p, and of 1 to 33 pages): such caches are stored {1,3,2,0}; over pages of 16, 32 or 64
    tokens (thousands of pages) XLA makes the page index minor ({0,3,2,1}), which no kernel reading a page at a time
    can take as a view; a head_dim of 128 (or a multiple) stays row-major. Correctness never depends on this answer:
    where XLA's layout differs from the one the kernel reads, XLA copies the cache into it before every call
    (tests/test_argument_layouts.py checks the rule against the compiler).
    """
    return head_dim % LANES != 0 and page_size % LANES == 0


def cache_copied_whole_per_call(page_size: int, head_dim: int) -> bool:
    """Whether XLA copies a cache [num_pages, page_size, Hkv, head_dim] whole before every call of the kernel: where
    head_dim is no multiple of 128 and neither is page_size, its default layout puts the page index minor
    (`cache_stored_keys_minor`), which the kernel cannot read a page at a time."""
    return head_dim % LANES != 0 and page_size % LANES != 0


def packed_keys_stored_minor(head_dim: int) -> bool:
    """Whether XLA's default TPU layout of packed (varlen) keys or values [total_k, Hkv, head_dim] stores the rows
    minor: minor_to_major {0,2,1}, physically [Hkv, head_dim, total_k], of which ``k.transpose(1, 2, 0)`` is a free
    bitcast. Probed as `cache_stored_keys_minor` (v5e, v5p, v6e and TPU7x; bfloat16 and float32; 128 to 131072 rows,
    a multiple of 128 or not; 1 to 8 KV heads): so wherever head_dim is no multiple of 128; row-major at 128. The
    same caveat: a wrong answer costs XLA's copy, never a wrong result."""
    return head_dim % LANES != 0


@dataclasses.dataclass(frozen=True)
class PagedProblem:
    """The static description of one ragged paged attention call (shapes and options; no tile sizes)."""

    total_q: int  # packed query rows
    num_seqs: int  # rows of the page table
    q_heads: int
    kv_heads: int
    head_dim: int  # of q and k
    v_head_dim: int  # of v and the output
    page_size: int
    num_pages: int  # pages in the cache
    pages_per_seq: int  # columns of the page table
    scale: float
    causal: bool
    sliding_window: int | None
    softcap: float | None
    has_sinks: bool
    dtype: str
    # The most queries any one sequence has, when the caller knows it (1: a decode batch); None: up to total_q.
    max_q_len: int | None = None
    contiguous: bool = False  # one page holding every sequence's keys, from the row the page table names
    # The most keys any sequence has, when the caller knows it (a ring of window slots: the window); None: up to its
    # page table's tokens. Like max_q_len, it only shapes the tiles.
    max_kv_len: int | None = None

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def precision(self) -> jax.lax.Precision | None:
        # float32 inputs multiply at float32 precision; bfloat16 ones in one MXU pass.
        return jax.lax.Precision.HIGHEST if self.dtype == "float32" else None

    def _reads_minor(self, head_dim: int) -> bool:
        if self.contiguous:
            return packed_keys_stored_minor(head_dim) and self.page_size % LANES == 0
        return cache_stored_keys_minor(self.page_size, head_dim)

    @property
    def keys_minor(self) -> bool:
        """Whether the kernel reads the K cache as [num_pages, Hkv, D, page_size] (`cache_stored_keys_minor`): K^T
        chunks of whole lanes. Contiguous keys ([1, Hkv, D, total_k], `packed_keys_stored_minor`) only when total_k
        is a multiple of 128, so that every block, starting on a 128-row tile, lies within the array."""
        return self._reads_minor(self.head_dim)

    @property
    def values_minor(self) -> bool:
        """`keys_minor` of the V cache (its head dim, v_head_dim)."""
        return self._reads_minor(self.v_head_dim)

    @property
    def lane_chunks(self) -> bool:
        """Whether K/V blocks are read in chunks of whole lanes, on lane tiles: where either cache is read
        keys-minor (the other, row-major, is read in the same chunks)."""
        return self.keys_minor or self.values_minor

    @property
    def longest_query(self) -> int:
        return self.total_q if self.max_q_len is None else min(self.max_q_len, self.total_q)

    @classmethod
    def of_shape(cls, *, total_q: int, num_seqs: int, q_heads: int, kv_heads: int, head_dim: int, page_size: int,
                 num_pages: int, pages_per_seq: int, dtype, sliding_window: int | None = None,
                 softcap: float | None = None, has_sinks: bool = False, max_q_len: int | None = None,
                 causal: bool = True, contiguous: bool = False, v_head_dim: int | None = None,
                 max_kv_len: int | None = None) -> PagedProblem:
        """The problem of a call of this shape with the default scale; `v_head_dim` defaults to `head_dim`."""
        return cls(total_q=total_q, num_seqs=num_seqs, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                   v_head_dim=head_dim if v_head_dim is None else v_head_dim, page_size=page_size,
                   num_pages=num_pages, pages_per_seq=pages_per_seq,
                   scale=float(head_dim**-0.5), causal=bool(causal),
                   sliding_window=None if sliding_window is None else int(sliding_window),
                   softcap=None if softcap is None else float(softcap), has_sinks=has_sinks,
                   dtype=jnp.dtype(dtype).name, max_q_len=max_q_len, contiguous=contiguous, max_kv_len=max_kv_len)


def paged_problem(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, page_table: jax.Array, *,
                  scale: float | None = None, causal: bool = True, sliding_window: int | None = None,
                  softcap: float | None = None, sinks: jax.Array | None = None, max_q_len: int | None = None,
                  contiguous: bool = False, max_kv_len: int | None = None) -> PagedProblem:
    """The PagedProblem of one call (inputs assumed valid)."""
    total_q, q_heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_cache.shape
    num_seqs, pages_per_seq = page_table.shape
    return PagedProblem(
        total_q=total_q, num_seqs=num_seqs, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
        v_head_dim=v_cache.shape[3], page_size=page_size, num_pages=num_pages, pages_per_seq=pages_per_seq,
        scale=float(head_dim**-0.5 if scale is None else scale), causal=bool(causal),
        sliding_window=None if sliding_window is None else int(sliding_window),
        softcap=None if softcap is None else float(softcap), has_sinks=sinks is not None,
        dtype=jnp.dtype(q.dtype).name, max_q_len=max_q_len, contiguous=contiguous, max_kv_len=max_kv_len,
    )
