"""Decode rows over a paged cache of window rings (`window_ring`: key j at slot j % sliding_window, transformers'
sliding-layer cache) against the float64 reference, in TPU interpret mode with race detection. Slots a ring has not
filled yet, and every page the tables do not name, hold NaN."""

import pytest
import torch
from tpu_kernels.runtime.hardware import resolve_target
from tpu_kernels.testing import assert_matches, interpret

TOLERANCE = 1e-5


def ring_batch(kv_lens, *, window, q_heads, kv_heads, head_dim, page_size, seed):
    """(q, k_cache, v_cache, cu_q_lens, kv_lens, page_table): one decode row per sequence (a sequence of no keys has
    no row), each sequence's ring on pages of its own scattered over the cache, its filled slots random."""
    generator = torch.Generator().manual_seed(seed)
    pages_per_seq = -(-window // page_size)
    num_pages = len(kv_lens) * pages_per_seq + 2
    order = torch.randperm(num_pages, generator=generator)
    k_cache, v_cache = (torch.full((num_pages, page_size, kv_heads, head_dim), float("nan")) for _ in range(2))
    page_table = order[:len(kv_lens) * pages_per_seq].reshape(len(kv_lens), pages_per_seq).to(torch.int32)
    for seq, kv_len in enumerate(kv_lens):
        for slot in range(min(kv_len, window)):
            page, row = int(page_table[seq, slot // page_size]), slot % page_size
            k_cache[page, row] = torch.randn(kv_heads, head_dim, generator=generator)
            v_cache[page, row] = torch.randn(kv_heads, head_dim, generator=generator)
    q_lens = [min(1, kv_len) for kv_len in kv_lens]
    cu_q_lens = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), q_heads, head_dim, generator=generator)
    return q, k_cache, v_cache, cu_q_lens, torch.tensor(kv_lens, dtype=torch.int32), page_table


@pytest.mark.parametrize("window, page_size, block_kv", [
    (128, 128, 128),  # GPT-OSS's window on one 128-key page, read keys-minor: one lane chunk per sequence
    (100, 256, 128),  # a window of no whole lanes, in the first half of a 256-key page
    (20, 8, 16),  # a ring across three 8-key pages, read row-major
])
def test_decode_over_window_rings(kernel, convert, window, page_size, block_kv):
    """Sequences before their ring is full (1 key, one short of the window), at it, one past it and wrapped several
    times (at lengths not a multiple of the window), and one without keys; sinks and softcap."""
    kv_lens = [1, window - 1, window, window + 1, 3 * window + 7, 0]
    batch = ring_batch(kv_lens, window=window, q_heads=4, kv_heads=2, head_dim=64, page_size=page_size,
                       seed=window + page_size)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(1))
    options = dict(sliding_window=window, softcap=5.0)
    to_jax, to_torch = convert
    config = kernel.paged.tiles.PagedConfig(block_q=8, tile_q=8, block_kv=block_kv, vmem_limit_bytes=32 << 20)
    out = to_torch(interpret(lambda: kernel.paged.kernel.ragged_paged_attention(
        *(to_jax(x) for x in batch), sinks=to_jax(sinks), max_q_len=1, window_ring=True, config=config, **options)))
    expected = kernel.reference.reference_paged_attention(*batch, sinks=sinks, window_ring=True, **options)
    assert_matches(out, expected, TOLERANCE)


@pytest.mark.parametrize("page_size", [128, 256])
def test_gpt_oss_decode_takes_blocks_of_its_windows_lanes(kernel, page_size):
    """GPT-OSS-20B's decode batch, over its 128-slot rings, over keys at their positions and over varlen keys,
    takes 128-key blocks of 128-key chunks, not blocks of one lane more (which would compute twice the keys a ring
    or an aligned window holds)."""
    shape = dict(total_q=64, num_seqs=64, q_heads=64, kv_heads=8, head_dim=64, page_size=page_size,
                 num_pages=64, pages_per_seq=1, dtype="bfloat16", has_sinks=True, max_q_len=1)
    problems = [kernel.PagedProblem.of_shape(**shape, max_kv_len=128),
                kernel.PagedProblem.of_shape(**{**shape, "pages_per_seq": 32}, sliding_window=128),
                kernel.PagedProblem.of_shape(**{**shape, "page_size": 8192, "num_pages": 1}, sliding_window=128,
                                             contiguous=True)]
    for problem in problems:
        for generation in ("v5e", "v6e", "tpu7x"):
            plan = kernel.paged.plan.make(problem, resolve_target(generation))
            assert (plan.block_kv, plan.chunk) == (128, 128)


BAD_RING_CALLS = {
    "no-window": (dict(sliding_window=None, max_q_len=1), ValueError, "needs a sliding_window and max_q_len=1"),
    "not-decode": (dict(sliding_window=4, max_q_len=None), ValueError, "needs a sliding_window and max_q_len=1"),
    "past-the-pages": (dict(sliding_window=9, max_q_len=1), ValueError, "within each sequence's pages, which hold 8"),
    "not-a-bool": (dict(sliding_window=4, max_q_len=1, window_ring=1), TypeError, "window_ring must be a bool"),
}


@pytest.mark.parametrize("case", list(BAD_RING_CALLS))
def test_bad_ring_calls_raise_before_any_kernel(kernel, case):
    options, error, match = BAD_RING_CALLS[case]
    batch = ring_batch([3, 6], window=8, q_heads=4, kv_heads=2, head_dim=64, page_size=4, seed=2)
    with pytest.raises(error, match=match):
        kernel.ragged_paged_attention(*batch, **{"window_ring": True, **options})


@pytest.mark.slow
def test_torch_op_over_window_rings(kernel):
    batch = ring_batch([3, 11, 8], window=8, q_heads=4, kv_heads=2, head_dim=64, page_size=4, seed=5)
    out = kernel.ragged_paged_attention(*batch, sliding_window=8, max_q_len=1, window_ring=True)
    expected = kernel.reference.reference_paged_attention(*batch, sliding_window=8, window_ring=True)
    assert_matches(out, expected, TOLERANCE)
