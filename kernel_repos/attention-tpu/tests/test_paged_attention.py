"""Ragged paged attention against the float64 reference, in TPU interpret mode with race detection.

The JAX function runs with small explicit tiles (`paged.tiles.PagedConfig`) so that several grid steps, K/V
blocks of whole pages and of parts of a page, prefetches across sequences and row tiles shared by decode rows
all occur at affordable sizes. Unused cache pages hold NaN: a kernel that reads a page the table does not name,
or a key past a sequence's length, into its result fails here.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tpu_kernels.testing import assert_matches, interpret

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def paged_batch(q_lens, kv_lens, *, q_heads, kv_heads, head_dim, page_size, dtype=torch.float32, seed=0,
                spare_pages=3):
    """(q, k_cache, v_cache, cu_q_lens, kv_lens, page_table) for sequences of these query and key counts, their
    pages scattered over a cache whose other pages (and the rows past each sequence's keys) hold NaN."""
    generator = torch.Generator().manual_seed(seed)
    pages_needed = [-(-kv // page_size) for kv in kv_lens]
    pages_per_seq = max(1, max(pages_needed, default=1))
    num_pages = sum(pages_needed) + spare_pages
    order = torch.randperm(num_pages, generator=generator)
    k_cache = torch.full((num_pages, page_size, kv_heads, head_dim), float("nan"))
    v_cache = torch.full((num_pages, page_size, kv_heads, head_dim), float("nan"))
    page_table = torch.full((len(kv_lens), pages_per_seq), num_pages - 1, dtype=torch.int32)
    used = 0
    for seq, (kv, pages) in enumerate(zip(kv_lens, pages_needed)):
        for column in range(pages):
            page = int(order[used])
            used += 1
            page_table[seq, column] = page
            rows = min(page_size, kv - column * page_size)
            k_cache[page, :rows] = torch.randn(rows, kv_heads, head_dim, generator=generator)
            v_cache[page, :rows] = torch.randn(rows, kv_heads, head_dim, generator=generator)
    total_q = sum(q_lens)
    q = torch.randn(total_q, q_heads, head_dim, generator=generator)
    cu_q_lens = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    return (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), cu_q_lens,
            torch.tensor(kv_lens, dtype=torch.int32), page_table)


def run_paged(kernel, convert, batch, config=None, **options):
    to_jax, to_torch = convert
    arrays = [to_jax(x) for x in batch]
    if options.get("sinks") is not None:
        options["sinks"] = to_jax(options["sinks"])
    out = interpret(lambda: kernel.paged.kernel.ragged_paged_attention(*arrays, config=config, **options))
    return to_torch(out)


def check_paged(kernel, convert, batch, config=None, **options):
    q = batch[0]
    out = run_paged(kernel, convert, batch, config, **options)
    expected = kernel.reference.reference_paged_attention(*batch, **options)
    assert_matches(out, expected, TOLERANCE[q.dtype])


def config(kernel, block_q, tile_q, block_kv):
    return kernel.paged.tiles.PagedConfig(block_q=block_q, tile_q=tile_q, block_kv=block_kv,
                                          vmem_limit_bytes=32 << 20)


def test_mixed_prefill_and_decode(kernel, convert):
    """A prefill chunk, decode rows, a one-token request, an empty decode row; 3 steps, 2 pages per block."""
    batch = paged_batch([5, 1, 0, 1, 19, 1], [37, 16, 9, 1, 19, 50], q_heads=4, kv_heads=2, head_dim=64,
                        page_size=8)
    check_paged(kernel, convert, batch, config(kernel, 16, 16, 16))
