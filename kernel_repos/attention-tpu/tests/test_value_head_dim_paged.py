"""Ragged paged attention, varlen keys and flash_attn_with_kvcache where the keys' head dim differs from the values'
(latent attention: 192 and 128 expanded, 576 and 512 absorbed with one KV head for all query heads).

Each cache is read as XLA stores it (`PagedProblem.keys_minor`, `values_minor`): over pages of 128 tokens a K cache
192 or 576 wide keys-minor and a V cache 128 or 512 wide row-major, both in 128-key chunks; 64 wide, keys-minor.
Unused pages, the rows past each sequence's keys and the varlen rows past the last sequence hold NaN. Against the
float64 reference, in TPU interpret mode with race detection.
"""

import numpy as np
import pytest
import torch
from tpu_kernels.runtime.hardware import resolve_target
from tpu_kernels.testing import assert_matches, interpret

V6E = resolve_target("v6e")


def latent_paged_batch(q_lens, kv_lens, *, q_heads, kv_heads, head_dims, page_size, dtype=torch.float32, seed=0):
    """(q, k_cache, v_cache, cu_q_lens, kv_lens, page_table): the sequences' pages scattered over a cache whose other
    pages and rows hold NaN; q and k head_dims[0] wide, v head_dims[1]."""
    head_dim, v_head_dim = head_dims
    generator = torch.Generator().manual_seed(seed)
    pages = [-(-kv // page_size) for kv in kv_lens]
    num_pages = sum(pages) + 2
    order = torch.randperm(num_pages, generator=generator).tolist()
    k_cache = torch.full((num_pages, page_size, kv_heads, head_dim), float("nan"))
    v_cache = torch.full((num_pages, page_size, kv_heads, v_head_dim), float("nan"))
    page_table = torch.full((len(kv_lens), max(pages)), order[-1], dtype=torch.int32)
    for seq, kv in enumerate(kv_lens):
        for column in range(pages[seq]):
            page_table[seq, column] = page = order.pop(0)
            rows = min(page_size, kv - column * page_size)
            k_cache[page, :rows] = torch.randn(rows, kv_heads, head_dim, generator=generator)
            v_cache[page, :rows] = torch.randn(rows, kv_heads, v_head_dim, generator=generator)
    q = torch.randn(sum(q_lens), q_heads, head_dim, generator=generator)
    cu_q_lens = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    return (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), cu_q_lens, torch.tensor(kv_lens, dtype=torch.int32),
            page_table)


def _config(kernel, block_kv):
    return kernel.paged.tiles.PagedConfig(block_q=16, tile_q=16, block_kv=block_kv, vmem_limit_bytes=32 << 20)


# q heads, kv heads, (D, Dv), page size, block_kv, options, (K read keys-minor, V read keys-minor)
PAGED_CASES = {
    "expanded-192-128-window-sinks": (4, 2, (192, 128), 128, 256, dict(sliding_window=50, sinks=True),
                                      (True, False)),
    "absorbed-576-512-mqa-small-pages": (16, 1, (576, 512), 16, 32, dict(softcap=4.0), (False, False)),
    "expanded-96-64": (4, 2, (96, 64), 128, 128, dict(), (True, True)),
    "values-minor-128-64": (2, 1, (128, 64), 128, 128, dict(sliding_window=70), (False, True)),
}


@pytest.mark.parametrize("case", [pytest.param(case, marks=[] if case.startswith("expanded-192") else pytest.mark.slow)
                                  for case in PAGED_CASES])
def test_paged_keys_and_values_of_their_own_widths(kernel, convert, case):
    """A prefill chunk, decode rows (one without keys), a sequence without queries; blocks of whole pages or parts."""
    to_jax, to_torch = convert
    q_heads, kv_heads, head_dims, page_size, block_kv, options, minor = PAGED_CASES[case]
    batch = latent_paged_batch([5, 1, 0, 1, 3], [37, 140, 9, 0, 200], q_heads=q_heads, kv_heads=kv_heads,
                               head_dims=head_dims, page_size=page_size, seed=len(case))
    options = dict(options)
    if options.pop("sinks", False):
        options["sinks"] = torch.randn(q_heads, generator=torch.Generator().manual_seed(3))
    arrays = [to_jax(x) for x in batch]
    problem = kernel.common.paged.paged_problem(*arrays[:3], arrays[5], sliding_window=options.get("sliding_window"))
    assert (problem.keys_minor, problem.values_minor) == minor
    jax_options = {n: to_jax(x) if isinstance(x, torch.Tensor) else x for n, x in options.items()}
    out = interpret(lambda: kernel.paged.kernel.ragged_paged_attention(*arrays, config=_config(kernel, block_kv),
                                                                       **jax_options))
    expected = kernel.reference.reference_paged_attention(*batch, **options)
    assert out.shape == (10, q_heads, head_dims[1])
    assert_matches(to_torch(out), expected, 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("head_dims", [(192, 128), (576, 512)])
def test_contiguous_varlen_keys_and_values_of_their_own_widths(kernel, convert, head_dims):
    """Packed keys as flash_attn_varlen_func gets them, 256 rows (a multiple of 128: K read keys-minor, a 128-row
    tile per DMA, from the tile of a sequence's first key; V row-major in the same tiles), NaN past the last."""
    to_jax, to_torch = convert
    head_dim, v_head_dim = head_dims
    generator = torch.Generator().manual_seed(head_dim)
    q_lens, kv_lens = [7, 1, 0, 3], [100, 13, 2, 70]
    q = torch.randn(sum(q_lens), 4, head_dim, generator=generator)
    k, v = (torch.cat([torch.randn(sum(kv_lens), 1, width, generator=generator),
                       torch.full((256 - sum(kv_lens), 1, width), float("nan"))]) for width in head_dims)
    cu_q, cu_k = (torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32) for n in (q_lens, kv_lens))
    batch = (q, k, v, cu_q, cu_k)
    assert kernel.common.paged.paged_problem(to_jax(q), to_jax(k[None]), to_jax(v[None]), to_jax(cu_k[:-1, None]),
                                             contiguous=True).keys_minor
    out = interpret(lambda: kernel.paged.kernel.ragged_varlen_attention(*(to_jax(x) for x in batch),
                                                                        config=_config(kernel, 128), softcap=3.0))
    expected = kernel.reference.reference_varlen_attention(*batch, softcap=3.0)
    assert_matches(to_torch(out), expected, 1e-5)


def test_flash_attn_with_kvcache_writes_keys_and_values_of_their_own_widths(kernel):
    """A decode step of the absorbed form as flash-attn 3 takes it: new k [B, 1, 1, 576] and v [B, 1, 1, 512]
    written into their caches, 16 query heads over the one KV head -> [B, 1, 16, 512]."""
    batch = latent_paged_batch([1] * 3, [5, 17, 9], q_heads=16, kv_heads=1, head_dims=(576, 512), page_size=8,
                               seed=4)
    q, k_cache, v_cache, _, kv_lens, page_table = batch
    generator = torch.Generator().manual_seed(5)
    k_new, v_new = torch.randn(3, 1, 1, 576, generator=generator), torch.randn(3, 1, 1, 512, generator=generator)
    cache_lengths = kv_lens - 1
    out = kernel.flash_attn_with_kvcache(q[:, None], k_cache, v_cache, k_new, v_new, cache_seqlens=cache_lengths,
                                         block_table=page_table, causal=True)
    for seq, position in enumerate(cache_lengths.tolist()):
        page = page_table[seq, position // 8]
        assert torch.equal(k_cache[page, position % 8], k_new[seq, 0])
        assert torch.equal(v_cache[page, position % 8], v_new[seq, 0])
    expected = kernel.reference.reference_paged_attention(q, k_cache, v_cache, torch.arange(4, dtype=torch.int32),
                                                          kv_lens, page_table)
    assert out.shape == (3, 1, 16, 512)
    assert_matches(out[:, 0], expected, 1e-5)
    with pytest.raises(ValueError, match=r"v must be a torch.float32 tensor of shape \[3, new tokens, 1, 512\]"):
        kernel.flash_attn_with_kvcache(q[:, None], k_cache, v_cache, k_new, k_new, cache_seqlens=cache_lengths,
                                       block_table=page_table, causal=True)


def test_the_caches_differ_in_the_last_dim_only(kernel):
    q, k_cache, v_cache, cu_q_lens, kv_lens, page_table = latent_paged_batch(
        [2, 1], [5, 3], q_heads=4, kv_heads=2, head_dims=(192, 128), page_size=4, seed=6)
    with pytest.raises(ValueError, match="k_cache and v_cache must have the same shape but for the head_dim"):
        kernel.ragged_paged_attention(q, k_cache, v_cache[:, :, :1], cu_q_lens, kv_lens, page_table)
    with pytest.raises(ValueError, match="value head_dim must be a multiple of 8"):
        kernel.ragged_paged_attention(q, k_cache, v_cache[..., :100], cu_q_lens, kv_lens, page_table)
    packed_k, packed_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    with pytest.raises(ValueError, match="k and v must have the same shape but for the head_dim"):
        kernel.flash_attn_varlen_func(q, packed_k, packed_v[:-1], cu_q_lens, torch.tensor([0, 5, 8]), 2, 5)
