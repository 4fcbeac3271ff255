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
                spare_pages=3, extra_rows=0):
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
    total_q = sum(q_lens) + extra_rows  # rows past cu_q_lens[-1] belong to no sequence
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


@pytest.mark.slow
def test_mixed_prefill_and_decode(kernel, convert):
    """A prefill chunk, decode rows, a one-token request, an empty decode row; 3 steps, 2 pages per block."""
    batch = paged_batch([5, 1, 0, 1, 19, 1], [37, 16, 9, 1, 19, 50], q_heads=4, kv_heads=2, head_dim=64,
                        page_size=8)
    check_paged(kernel, convert, batch, config(kernel, 16, 16, 16))


@pytest.mark.slow
def test_a_page_boundary_at_every_offset(kernel, convert):
    """Decode rows whose last key sits at every offset of a page, and 3-token chunks crossing page boundaries."""
    page = 8
    kv_lens = list(range(1, 2 * page + 2)) + [page + offset for offset in range(0, page, 3)]
    q_lens = [1] * (2 * page + 1) + [3] * len(range(0, page, 3))
    batch = paged_batch(q_lens, kv_lens, q_heads=8, kv_heads=2, head_dim=128, page_size=page, seed=1)
    check_paged(kernel, convert, batch, config(kernel, 32, 16, 2 * page))


@pytest.mark.slow
@pytest.mark.parametrize("window", [3, 8, 13])
def test_sliding_windows_shorter_and_longer_than_a_page(kernel, convert, window):
    batch = paged_batch([20, 1, 7, 1], [40, 33, 7, 9], q_heads=4, kv_heads=1, head_dim=64, page_size=8, seed=window)
    check_paged(kernel, convert, batch, config(kernel, 16, 16, 8), sliding_window=window)


@pytest.mark.slow
def test_sinks_softcap_scale_and_empty_rows(kernel, convert):
    """GPT-OSS-style sinks with a window; a decode row with no keys (zero despite its sink), a sequence without
    queries, rows past cu_q_lens[-1]."""
    batch = paged_batch([6, 1, 0, 1, 9], [6, 0, 12, 30, 21], q_heads=6, kv_heads=2, head_dim=64, page_size=4,
                        seed=3, extra_rows=5)
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(4))
    out = run_paged(kernel, convert, batch, config(kernel, 16, 16, 8), sinks=sinks, sliding_window=5, softcap=4.0,
                    scale=0.3)
    expected = kernel.reference.reference_paged_attention(*batch, sinks=sinks, sliding_window=5, softcap=4.0,
                                                          scale=0.3)
    assert_matches(out, expected, TOLERANCE[torch.float32])
    assert out[6].abs().max() == 0 and out[-5:].abs().max() == 0


@pytest.mark.slow
@pytest.mark.parametrize("head_dim, q_heads, kv_heads, dtype, page_size, block_kv", [
    (64, 3, 3, torch.float32, 4, 8),  # MHA; blocks of two pages
    (128, 6, 2, torch.bfloat16, 16, 8),  # a group of 3 (no power of two); blocks of half a page
    (256, 4, 1, torch.bfloat16, 8, 8),
    (512, 4, 2, torch.float32, 16, 16),
])
def test_each_head_dim(kernel, convert, head_dim, q_heads, kv_heads, dtype, page_size, block_kv):
    batch = paged_batch([3, 1, 18], [11, 5, 20], q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                        page_size=page_size, dtype=dtype, seed=head_dim)
    check_paged(kernel, convert, batch, config(kernel, 32, 16, block_kv))


@pytest.mark.slow
def test_not_causal(kernel, convert):
    batch = paged_batch([4, 1, 2], [9, 6, 2], q_heads=4, kv_heads=2, head_dim=64, page_size=4, seed=5)
    check_paged(kernel, convert, batch, config(kernel, 16, 16, 4), causal=False)


@pytest.mark.slow
def test_selected_tiles(kernel, convert):
    """The tiles `paged.tiles.select` picks: a block of many pages, most of them past the sequences' keys."""
    batch = paged_batch([2, 1, 40, 1], [9, 70, 45, 1], q_heads=8, kv_heads=1, head_dim=128, page_size=64, seed=6)
    check_paged(kernel, convert, batch)
