"""Ragged paged attention against the float64 reference, in TPU interpret mode with race detection.

The JAX function runs with small explicit tiles (`paged.tiles.PagedConfig`) so that several grid steps, K/V
blocks of whole pages and of parts of a page, prefetches across sequences and row tiles shared by decode rows
all occur at affordable sizes. Unused cache pages hold NaN: a kernel that reads a page the table does not name,
or a key past a sequence's length, into its result fails here.
"""

import numpy as np
import warnings

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp

import pytest
import torch
from tpu_kernels.runtime.hardware import resolve_target
from tpu_kernels.testing import assert_matches, interpret, no_kernel_if

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
V6E = resolve_target("v6e")


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


def run_paged(kernel, convert, batch, config=None, cores=1, **options):
    to_jax, to_torch = convert
    arrays = [to_jax(x) for x in batch]
    if options.get("sinks") is not None:
        options["sinks"] = to_jax(options["sinks"])
    out = interpret(lambda: kernel.paged.kernel.ragged_paged_attention(*arrays, config=config, **options), cores)
    return to_torch(out)


def check_paged(kernel, convert, batch, config=None, cores=1, **options):
    q = batch[0]
    out = run_paged(kernel, convert, batch, config, cores, **options)
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
def test_two_cores_split_the_steps(kernel, convert):
    """The grid is parallel: on v5p's megacore two TensorCores take its steps, each with its own DMAs and scratch."""
    batch = paged_batch([9, 1, 1, 14, 1], [9, 30, 2, 20, 17], q_heads=4, kv_heads=2, head_dim=64, page_size=8,
                        seed=13)
    check_paged(kernel, convert, batch, config(kernel, 16, 16, 8), cores=2)


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


@pytest.mark.parametrize("page_size, block_kv, window", [
    (128, 256, None),  # blocks of two whole pages
    (128, 128, 50),  # a window shorter than a page
    (128, 256, 200),  # and one longer
    (256, 256, 100),  # blocks starting at the 128-key half of a page holding a window's first key
])
def test_a_head_dim_64_cache_read_keys_minor(kernel, convert, page_size, block_kv, window):
    """Head_dim 64 over pages of a multiple of 128 tokens: the kernel reads the cache as [pages, Hkv, D, page] (XLA's
    default layout of it) in chunks of 128 or more keys. Odd lengths, one-token requests, a sequence without queries,
    a decode row without keys, rows past cu_q_lens[-1], sinks and softcap; the lanes past a sequence's keys (NaN in
    the cache, stale in the buffer) never reach the result."""
    batch = paged_batch([5, 1, 0, 1, 19, 1, 1], [37, 130, 9, 1, 19, 300, 0], q_heads=4, kv_heads=2, head_dim=64,
                        page_size=page_size, seed=page_size + (window or 0), extra_rows=3)
    problem = kernel.common.paged.paged_problem(*(convert[0](x) for x in (batch[0], batch[1], batch[2], batch[5])),
                                                sliding_window=window)
    assert problem.keys_minor
    assert kernel.paged.plan.make(problem, V6E, config=config(kernel, 16, 16, block_kv)).chunk == (
        128 if window else page_size)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(4))
    options = dict(sinks=sinks, sliding_window=window, softcap=4.0)
    out = run_paged(kernel, convert, batch, config(kernel, 16, 16, block_kv), **options)
    expected = kernel.reference.reference_paged_attention(*batch, **options)
    assert_matches(out, expected, TOLERANCE[torch.float32])
    assert out[27].abs().max() == 0 and out[-3:].abs().max() == 0


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


@pytest.mark.slow
@pytest.mark.parametrize("q_heads, kv_heads, dtype", [
    (2, 2, torch.bfloat16),  # a group of 1: 16 decode rows share a 16-row tile
    (4, 2, torch.float32),  # a group of 2: 4 decode rows share an 8-row tile
    (8, 1, torch.bfloat16),  # a group of 8: 2 decode rows share a 16-row tile
    (8, 1, torch.float32),  # a group of 8 in float32: a decode row's 8 rows are a tile of their own
])
def test_decode_rows_in_tiles_of_the_native_rows(kernel, convert, q_heads, kv_heads, dtype):
    """Decode rows (odd key counts, an empty row, one without keys) run tiles of the dtype's native rows, each
    against its own keys, next to a 5-token chunk that runs the 16-token tiles; blocks of 2 pages."""
    kv_lens = [13, 1, 0, 9, 21, 5, 17, 30, 3, 11]
    q_lens = [1, 1, 0, 1, 5, 1, 1, 1, 1, 1]
    batch = paged_batch(q_lens, kv_lens, q_heads=q_heads, kv_heads=kv_heads, head_dim=64, page_size=4, dtype=dtype,
                        seed=q_heads + kv_heads)
    problem = kernel.common.paged.paged_problem(*(convert[0](x) for x in (batch[0], batch[1], batch[2], batch[5])))
    assert kernel.paged.plan.make(problem, V6E, config=config(kernel, 16, 16, 8)).min_tile_q == (
        16 // q_heads * kv_heads if dtype == torch.bfloat16 else 8 // q_heads * kv_heads)
    check_paged(kernel, convert, batch, config(kernel, 16, 16, 8))


@pytest.mark.slow
@pytest.mark.parametrize("window", [5, 20])
def test_window_blocks_start_at_the_chunk_of_the_first_visible_key(kernel, convert, window):
    """32-key pages and blocks under a window: 16-key chunks, a sequence's blocks starting at the chunk its first
    visible key sits in (mid-page), chunks past its keys not fetched, their buffer rows stale (NaN from the previous
    sequence's rows past its keys) and zeroed."""
    batch = paged_batch([1, 1, 1, 2, 1, 1], [70, 37, 50, 64, 18, 33], q_heads=4, kv_heads=2, head_dim=64,
                        page_size=32, seed=window + 20)
    problem = kernel.common.paged.paged_problem(*(convert[0](x) for x in (batch[0], batch[1], batch[2], batch[5])),
                                                sliding_window=window)
    assert kernel.paged.plan.make(problem, V6E, config=config(kernel, 16, 16, 32)).chunk == 16
    check_paged(kernel, convert, batch, config(kernel, 16, 16, 32), sliding_window=window)


def test_decode_tiles_and_window_chunks_selected(kernel):
    """A decode batch of Qwen3-30B-A3B (group 8) in bfloat16 takes 2-token (16-row) tiles and one step of the
    preferred 128 rows (two on v5p's megacore); GPT-OSS's 128-key window 16-key chunks on 16-key pages, and 128-key
    ones on 256-key pages (read keys-minor, in whole lanes), where blocks must be multiples of 128 keys."""
    shape = dict(total_q=64, num_seqs=64, q_heads=32, kv_heads=4, head_dim=128, page_size=256, num_pages=4096,
                 pages_per_seq=32, dtype="bfloat16", max_q_len=1)
    qwen = kernel.PagedProblem.of_shape(**shape)
    assert kernel.paged.tiles.select(qwen, resolve_target("tpu7x")).tile_q == 2
    assert kernel.paged.plan.make(qwen, resolve_target("tpu7x")).num_q_blocks == 1
    assert kernel.paged.plan.make(qwen, resolve_target("v5p")).num_q_blocks == 2
    gpt_oss = kernel.PagedProblem.of_shape(**{**shape, "q_heads": 64, "kv_heads": 8, "head_dim": 64},
                                           sliding_window=128, has_sinks=True)
    assert gpt_oss.keys_minor and kernel.paged.plan.make(gpt_oss, V6E).chunk == 128
    with pytest.raises(ValueError, match="block_kv must be a multiple of 128 where the keys are read keys-minor"):
        kernel.paged.plan.make(gpt_oss, V6E, config=config(kernel, 16, 16, 64))
    small_pages = kernel.PagedProblem.of_shape(**{**shape, "q_heads": 64, "kv_heads": 8, "head_dim": 64,
                                                  "page_size": 16, "pages_per_seq": 512}, sliding_window=128)
    assert not small_pages.keys_minor and kernel.paged.plan.make(small_pages, V6E).chunk == 16
    with pytest.raises(ValueError, match="tile_q must be a positive multiple of 2"):
        kernel.paged.plan.make(qwen, V6E, config=config(kernel, 3, 3, 256))


def test_key_blocks_no_longer_than_the_keys_a_window_lets_a_sequence_see(kernel):
    """A block is computed whole: under GPT-OSS's 128-key window a decode batch takes 256-key blocks (the window
    and the 16-key chunk its first key sits in, in lanes), not the generation's preferred 1024; without a window
    the preferred block stays. Read keys-minor, the window's 128 lanes (a window starting mid-chunk takes two)."""
    shape = dict(total_q=64, num_seqs=64, q_heads=64, kv_heads=8, head_dim=64, page_size=16, num_pages=4096,
                 pages_per_seq=512, dtype="bfloat16", has_sinks=True, max_q_len=1)
    windowed = kernel.PagedProblem.of_shape(**shape, sliding_window=128)
    assert kernel.paged.tiles.select(windowed, V6E).block_kv == 256
    assert kernel.paged.tiles.select(kernel.PagedProblem.of_shape(**shape), V6E).block_kv == 1024
    # A page larger than the window, read keys-minor: a part of a page, of the window's lanes.
    assert kernel.paged.tiles.select(kernel.PagedProblem.of_shape(**{**shape, "page_size": 512, "pages_per_seq": 16},
                                                                  sliding_window=128), V6E).block_kv == 128


@pytest.mark.slow
def test_selected_tiles_under_a_window(kernel, convert):
    """The selected tiles with a window shorter than the block they would take without it."""
    batch = paged_batch([1, 1, 3], [200, 90, 130], q_heads=4, kv_heads=2, head_dim=64, page_size=16, seed=9)
    check_paged(kernel, convert, batch, sliding_window=20)


def varlen_batch(q_lens, kv_lens, *, q_heads, kv_heads, head_dim, seed, nan_rows=0):
    """(q, k, v, cu_q_lens, cu_k_lens): packed queries and packed contiguous keys and values (and `nan_rows` rows of
    NaN past cu_k_lens[-1])."""
    generator = torch.Generator().manual_seed(seed)
    total_k = sum(kv_lens)
    q = torch.randn(sum(q_lens), q_heads, head_dim, generator=generator)
    k, v = (torch.cat([torch.randn(total_k, kv_heads, head_dim, generator=generator),
                       torch.full((nan_rows, kv_heads, head_dim), float("nan"))]) for _ in range(2))
    cumulative = [torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32) for n in (q_lens, kv_lens)]
    return q, k, v, *cumulative


@pytest.mark.slow
@pytest.mark.parametrize("block_kv, options", [(8, dict()), (16, dict(sliding_window=6, sinks=True)), (None, {})])
def test_contiguous_varlen_keys(kernel, convert, block_kv, options):
    """Keys packed as flash_attn_varlen_func gets them, read in place; blocks start mid-row-range, the last ones
    read the array's last rows (47 of them, no multiple of a block) and mask what the previous block held."""
    to_jax, to_torch = convert
    batch = varlen_batch([7, 1, 0, 3, 1], [7, 13, 2, 20, 5], q_heads=4, kv_heads=2, head_dim=64, seed=14)
    if options.pop("sinks", False):
        options["sinks"] = torch.randn(4, generator=torch.Generator().manual_seed(15))
    tiles = None if block_kv is None else config(kernel, 16, 16, block_kv)
    jax_options = {name: to_jax(value) if isinstance(value, torch.Tensor) else value for name, value in options.items()}
    out = interpret(lambda: kernel.paged.kernel.ragged_varlen_attention(*(to_jax(x) for x in batch), config=tiles,
                                                                        **jax_options))
    expected = kernel.reference.reference_varlen_attention(*batch, **options)
    assert_matches(to_torch(out), expected, 1e-5)


@pytest.mark.parametrize("block_kv, window", [(128, None), (256, 100)])
def test_contiguous_head_dim_64_keys_read_keys_minor(kernel, convert, block_kv, window):
    """Packed keys at head_dim 64, their rows a multiple of 128 (flash_attn_varlen_func pads them to a power of two),
    are read as [Hkv, D, total_k] (XLA's default layout of them) a 128-row tile per DMA: a sequence's blocks start at
    the tile of its first visible key, on rows of the sequences before it (masked), tiles past its keys are not
    fetched (their buffer lanes stale), and the rows past cu_k_lens[-1] hold NaN. Sinks and softcap."""
    to_jax, to_torch = convert
    batch = varlen_batch([7, 1, 0, 3, 1, 2], [100, 13, 2, 140, 1, 60], q_heads=4, kv_heads=2, head_dim=64,
                         seed=block_kv, nan_rows=68)
    problem = kernel.common.paged.paged_problem(to_jax(batch[0]), to_jax(batch[1][None]), to_jax(batch[2][None]),
                                                to_jax(batch[4][:-1, None]), contiguous=True)
    assert problem.keys_minor
    options = dict(sinks=torch.randn(4, generator=torch.Generator().manual_seed(15)), softcap=4.0,
                   sliding_window=window)
    jax_options = {name: to_jax(value) if isinstance(value, torch.Tensor) else value for name, value in options.items()}
    out = interpret(lambda: kernel.paged.kernel.ragged_varlen_attention(
        *(to_jax(x) for x in batch), config=config(kernel, 16, 16, block_kv), **jax_options))
    expected = kernel.reference.reference_varlen_attention(*batch, **options)
    assert_matches(to_torch(out), expected, 1e-5)


# The torch face: the op, flash_attn_with_kvcache as transformers calls it, and the errors of bad input.


@pytest.mark.slow
def test_torch_op_matches_reference(kernel):
    batch = paged_batch([5, 1, 0, 1], [12, 7, 3, 1], q_heads=4, kv_heads=2, head_dim=64, page_size=4, seed=7)
    cu_q_lens, kv_lens, page_table = (x.to(torch.int64) for x in batch[3:])
    out = kernel.ragged_paged_attention(*batch[:3], cu_q_lens, kv_lens, page_table, sliding_window=6)
    assert out.shape == batch[0].shape and out.dtype == batch[0].dtype
    assert_matches(out, kernel.reference.reference_paged_attention(*batch, sliding_window=6), 1e-5)


@pytest.mark.slow
def test_torch_varlen_op_matches_reference(kernel):
    q, k, v, cu_q_lens, cu_k_lens = varlen_batch([3, 1, 5], [9, 1, 5], q_heads=8, kv_heads=1, head_dim=128, seed=16)
    out = kernel.ragged_varlen_attention(q, k, v, cu_q_lens.long(), cu_k_lens.long(), softcap=2.0)
    expected = kernel.reference.reference_varlen_attention(q, k, v, cu_q_lens, cu_k_lens, softcap=2.0)
    assert_matches(out, expected, 1e-5)


def test_bad_varlen_input_raises_naming_the_argument(kernel):
    q, k, v, cu_q_lens, cu_k_lens = varlen_batch([3, 1], [4, 1], q_heads=2, kv_heads=1, head_dim=64, seed=17)
    with pytest.raises(ValueError, match="cu_k_lens must be"):
        kernel.ragged_varlen_attention(q, k, v, cu_q_lens, cu_k_lens.float())
    with pytest.raises(ValueError, match="k must be 3-D"):
        kernel.ragged_varlen_attention(q, k[None], v, cu_q_lens, cu_k_lens)
    with pytest.raises(ValueError, match="cu_q_lens must be"):
        kernel.ragged_varlen_attention(q, k, v, cu_q_lens[:2], cu_k_lens)


def _decode_step(*, q_heads=8, kv_heads=2, head_dim=64, page_size=8, dtype=torch.float32, seed=8):
    """What transformers hands flash_attn_with_kvcache in a decode step: q, k, v [B, 1, H, D], the cache, the
    lengths before this step, the block table (unused entries -1)."""
    cache_lengths = [0, 7, 8, 20]
    batch = paged_batch([1] * 4, [n + 1 for n in cache_lengths], q_heads=q_heads, kv_heads=kv_heads,
                        head_dim=head_dim, page_size=page_size, dtype=dtype, seed=seed)
    q, k_cache, v_cache, _, kv_lens, page_table = batch
    generator = torch.Generator().manual_seed(seed + 1)
    k_new = torch.randn(4, 1, kv_heads, head_dim, generator=generator).to(dtype)
    v_new = torch.randn(4, 1, kv_heads, head_dim, generator=generator).to(dtype)
    block_table = torch.cat([page_table, torch.full((4, 2), -1, dtype=torch.int32)], dim=1)
    return (q[:, None], k_cache, v_cache, k_new, v_new, torch.tensor(cache_lengths, dtype=torch.int32),
            block_table, kv_lens)


@pytest.mark.slow
@pytest.mark.parametrize("page_size, options", [
    (8, dict()),
    (128, dict(window_size=(4, 4), softcap=3.0, s_aux=True)),  # head_dim 64 over 128-token pages: read keys-minor
])
def test_flash_attn_with_kvcache_writes_the_cache_and_attends(kernel, page_size, options):
    q, k_cache, v_cache, k_new, v_new, cache_lengths, block_table, kv_lens = _decode_step(page_size=page_size)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(2)) if options.pop("s_aux", False) else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = kernel.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_lengths,
                                             block_table=block_table, causal=True, s_aux=sinks, **options)
    # Over 8-token pages XLA would copy this head_dim-64 cache whole at every call on a TPU: the user is told.
    told = [w for w in caught if "allocate pages of a multiple of 128 tokens" in str(w.message)]
    assert len(told) == (1 if page_size == 8 else 0), [str(w.message) for w in caught]
    for seq, position in enumerate(cache_lengths.tolist()):
        page = block_table[seq, position // page_size]
        assert torch.equal(k_cache[page, position % page_size], k_new[seq, 0])
        assert torch.equal(v_cache[page, position % page_size], v_new[seq, 0])
    window = options.get("window_size", (-1, -1))[0] + 1 or None
    expected = kernel.reference.reference_paged_attention(
        q[:, 0], k_cache, v_cache, torch.arange(5, dtype=torch.int32), kv_lens, block_table, sinks=sinks,
        sliding_window=window, softcap=options.get("softcap"))
    assert out.shape == q.shape
    assert_matches(out[:, 0], expected, 1e-5)


@pytest.mark.slow
def test_flash_attn_with_kvcache_on_a_contiguous_cache(kernel):
    """No block table: k_cache [B_cache, S_max, Hkv, D], rows chosen by cache_batch_idx; a 3-token chunk each.
    The kernel is handed the 6 query rows padded to their bucket of 16, and the 2 sequences padded to 16."""
    generator = torch.Generator().manual_seed(11)
    k_cache, v_cache = (torch.randn(3, 24, 1, 128, generator=generator) for _ in range(2))
    q = torch.randn(2, 3, 2, 128, generator=generator)
    rows, lengths = torch.tensor([2, 0]), torch.tensor([10, 21])
    seen = []

    class RecordingPagedCalls(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if "ragged_paged_attention" in str(func):
                seen.append((args[0].shape[0], args[3].shape[0] - 1))  # q rows, sequences (cu_q_lens)
            return func(*args, **(kwargs or {}))

    with RecordingPagedCalls():
        out = kernel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, cache_batch_idx=rows,
                                             causal=True)
    assert seen == [(16, 16)]
    expected = kernel.reference.reference_paged_attention(
        q.flatten(0, 1), k_cache, v_cache, torch.tensor([0, 3, 6]), lengths, rows[:, None])
    assert_matches(out.flatten(0, 1), expected, 1e-5)


def test_the_parameters_transformers_looks_up_by_name(kernel):
    """transformers passes an option only if the function has a parameter of its flash-attn name (it reads the
    signature): the block table under either name, the lengths, window, softcap, scale and sinks under either."""
    import inspect

    parameters = inspect.signature(kernel.flash_attn_with_kvcache).parameters
    for name in ("block_table", "page_table", "cache_seqlens", "causal", "window_size", "softcap", "softmax_scale",
                 "s_aux", "learnable_sink"):
        assert name in parameters, name


def _valid_call():
    batch = paged_batch([2, 1], [5, 3], q_heads=4, kv_heads=2, head_dim=64, page_size=4, seed=12)
    return dict(zip(("q", "k_cache", "v_cache", "cu_q_lens", "kv_lens", "page_table"), batch))


BAD_PAGED_CALLS = {
    "q-rank": (lambda a: a.update(q=a["q"][None]), ValueError, "q must be 3-D"),
    "cache-shapes": (lambda a: a.update(v_cache=a["v_cache"][:, :2]), ValueError, "k_cache and v_cache"),
    "head-dim": (lambda a: a.update(q=a["q"][..., :32]), ValueError, "head_dim"),
    "unsupported-head-dim": (lambda a: a.update(q=a["q"][..., :36], k_cache=a["k_cache"][..., :36],
                                                v_cache=a["v_cache"][..., :36]), ValueError,
                             "head_dim must be a multiple of 8 from 8 to 576, got 36"),
    "unsupported-value-head-dim": (lambda a: a.update(v_cache=a["v_cache"][..., :36]), ValueError,
                                   "value head_dim must be a multiple of 8"),
    "groups": (lambda a: a.update(q=a["q"][:, :3]), ValueError, "multiple of the number of key/value heads"),
    "dtype": (lambda a: a.update(q=a["q"].half()), TypeError, "q must be float32 or bfloat16"),
    "cache-dtype": (lambda a: a.update(k_cache=a["k_cache"].bfloat16()), TypeError, "share one dtype"),
    "cu_q_lens": (lambda a: a.update(cu_q_lens=a["cu_q_lens"][:2]), ValueError, "cu_q_lens must be"),
    "kv_lens": (lambda a: a.update(kv_lens=a["kv_lens"].float()), ValueError, "kv_lens must be"),
    "page_table": (lambda a: a.update(page_table=a["page_table"][0]), ValueError, "page_table must be 2-D"),
    "sinks": (lambda a: a.update(sinks=torch.zeros(3)), ValueError, "sinks must be"),
    "window": (lambda a: a.update(sliding_window=0), ValueError, "sliding_window"),
    "softcap": (lambda a: a.update(softcap=-1.0), ValueError, "softcap"),
    "max_q_len": (lambda a: a.update(max_q_len=0), ValueError, "max_q_len"),
    "grad": (lambda a: a.update(q=a["q"].requires_grad_()), ValueError, "inference-only"),
}


@pytest.mark.parametrize("case", list(BAD_PAGED_CALLS))
def test_bad_paged_input_raises_naming_the_argument(kernel, case):
    change, error, match = BAD_PAGED_CALLS[case]
    arguments = _valid_call()
    change(arguments)
    with pytest.raises(error, match=match):
        kernel.ragged_paged_attention(**arguments)



def test_pages_of_no_token_give_zeros_without_a_kernel(kernel):
    arguments = _valid_call()
    arguments.update(k_cache=arguments["k_cache"][:, :0], v_cache=arguments["v_cache"][:, :0])
    with no_kernel_if(True):
        out = kernel.ragged_paged_attention(**arguments)
    assert out.shape == arguments["q"].shape and not out.any()

BAD_KVCACHE_CALLS = {
    "rotary": (dict(rotary_cos=torch.ones(1)), "rotary_cos"),
    "leftpad": (dict(cache_leftpad=torch.zeros(4, dtype=torch.int32)), "cache_leftpad"),
    "alibi": (dict(alibi_slopes=torch.ones(8)), "alibi_slopes"),
    "lse": (dict(return_softmax_lse=True), "return_softmax_lse"),
    "splits": (dict(num_splits=4), "num_splits"),
    "batch-index": (dict(cache_batch_idx=torch.arange(4)), "cache_batch_idx"),
    "two-tables": (dict(page_table=torch.zeros(4, 1, dtype=torch.int32)), "block_table or page_table"),
    "two-sinks": (dict(s_aux=torch.zeros(8), learnable_sink=torch.zeros(8)), "s_aux or learnable_sink"),
    "right-window": (dict(causal=False, window_size=(3, 2)), "window_size"),
    "no-lengths": (dict(cache_seqlens=None), "cache_seqlens is required"),
    "k-without-v": (dict(v=None), "k and v together"),
}


@pytest.mark.parametrize("case", list(BAD_KVCACHE_CALLS))
def test_bad_kvcache_input_raises_naming_the_argument(kernel, case):
    q, k_cache, v_cache, k_new, v_new, cache_lengths, block_table, _ = _decode_step()
    arguments = dict(k=k_new, v=v_new, cache_seqlens=cache_lengths, block_table=block_table, causal=True)
    overrides, match = BAD_KVCACHE_CALLS[case]
    arguments.update(overrides)
    with pytest.raises(ValueError, match=match):
        kernel.flash_attn_with_kvcache(q, k_cache, v_cache, **arguments)


def test_cache_seqlens_past_the_capacity_raise_naming_them(kernel):
    """As flash-attn: cached keys plus new ones past a sequence's pages (paged) or row (contiguous) are refused,
    never clamped to the capacity."""
    q, k_cache, v_cache, k_new, v_new, cache_lengths, block_table, _ = _decode_step()
    capacity = block_table.shape[1] * k_cache.shape[1]
    new_key_past_the_last_page = cache_lengths.clone()
    new_key_past_the_last_page[2] = capacity
    longer_than_the_pages = cache_lengths.clone()
    longer_than_the_pages[1] = capacity + 1
    paged = [(new_key_past_the_last_page, dict(k=k_new, v=v_new)), (longer_than_the_pages, {}),
             (torch.tensor([0, -1, 3, 4]), {})]
    for lengths, new_keys in paged:
        with pytest.raises(ValueError, match=rf"cache_seqlens .* capacity of {capacity} keys"):
            kernel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=block_table,
                                           causal=True, **new_keys)
    generator = torch.Generator().manual_seed(13)
    rows_cache = [torch.randn(3, 24, 1, 128, generator=generator) for _ in range(2)]
    chunk = torch.randn(2, 2, 2, 128, generator=generator)
    new_rows = [torch.randn(2, 2, 1, 128, generator=generator) for _ in range(2)]
    contiguous = [(25, {}), (torch.tensor([10, 500]), {}), (23, dict(k=new_rows[0], v=new_rows[1]))]
    for lengths, new_keys in contiguous:
        with pytest.raises(ValueError, match=r"cache_seqlens .* capacity of 24 keys"):
            kernel.flash_attn_with_kvcache(chunk, *rows_cache, cache_seqlens=lengths, causal=True, **new_keys)


def _kernel_equations(kernel, page_size, block_kv, dtype=jnp.bfloat16):
    """Every equation of the paged kernel's body (nested bodies included), traced for 4 sequences of up to 96 keys
    over a cache of Qwen3's heads (4 KV heads, 8 queries each) and `block_kv`-key blocks."""
    config = kernel.paged.tiles.PagedConfig(block_q=32, tile_q=16, block_kv=block_kv, vmem_limit_bytes=32 << 20)
    cache = jax.ShapeDtypeStruct((24, page_size, 4, 128), dtype)
    arrays = (jax.ShapeDtypeStruct((40, 32, 128), dtype), cache, cache, jax.ShapeDtypeStruct((5,), jnp.int32),
              jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((4, 96 // page_size), jnp.int32))
    program = jax.make_jaxpr(lambda *a: kernel.paged.kernel.ragged_paged_attention(*a, config=config, generation="v6e"))(*arrays)
    [body] = [eqn.params["jaxpr"] for eqn in program.eqns if eqn.primitive.name == "pallas_call"]

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            for inner in jax_core.jaxprs_in_params(eqn.params):
                yield from walk(inner)

    return list(walk(body))


def test_the_kernel_body_does_not_grow_with_the_pages_of_a_block(kernel):
    """What Mosaic compiles is one loop over a block's chunks, not a copy per page: a block of 8 pages of 8 keys
    traces to as many equations as a block of one page of 64, and reads each KV head's K and V out of its buffer
    once for both row tile sizes (a decode row's and a chunk's)."""
    one_page, eight_pages = _kernel_equations(kernel, 64, 64), _kernel_equations(kernel, 8, 64)
    assert len(one_page) == len(eight_pages)
    buffer_shape = (2, 8, 8, 4, 128)  # [slot, chunk, key, KV head, head_dim]
    reads = [e for e in eight_pages if e.primitive.name == "get" and e.invars[0].aval.shape == buffer_shape]
    assert len(reads) == 2 * 4
