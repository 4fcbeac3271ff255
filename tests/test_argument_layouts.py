"""Argument layouts and the copies XLA makes of them: a hand-written module, and the paged attention kernel's
K/V cache compiled for each generation (head_dim 64 over pages of a multiple of 128 tokens and head_dim 128 read as
given, head_dim 64 over 16-token pages copied whole), and its packed (varlen) keys; and the kernel's own rule of
where XLA stores K and V keys-minor (`common.paged`) against the layouts the compiler gives; latent attention's q, k,
v and output of two head dims through the flash kernels, each read as stored."""

import functools

import jax
import jax.numpy as jnp
import pytest

from tpu_kernels.distribution.loader import get_local_kernel
from benchmarks.perf import argument_layouts
from tpu_kernels.runtime.hardware import SUPPORTED_GENERATIONS, tpu_generation

# A cache stored pages-minor, copied row-major through a bitcast; an argument prefetched into VMEM (not a copy
# into another layout); a row-major argument read as given.
HLO = """HloModule handmade

ENTRY %main (cache: bf16[4,128,8,64], ids: s32[16], q: bf16[16,64]) -> bf16[16,64] {
  %cache = bf16[4,128,8,64]{1,3,2,0:T(8,128)(2,1)} parameter(0)
  %ids = s32[16]{0:T(128)} parameter(1)
  %q = bf16[16,64]{1,0:T(8,128)(2,1)} parameter(2)
  %copy-start = (s32[16]{0:T(128)S(1)}, s32[16]{0:T(128)}, u32[]{:S(2)}) copy-start(%ids)
  %copy-done = s32[16]{0:T(128)S(1)} copy-done(%copy-start)
  %bitcast.1 = bf16[4,128,8,64]{1,3,2,0:T(8,128)(2,1)} bitcast(%cache)
  %copy.1 = bf16[4,128,8,64]{3,2,1,0:T(8,128)(2,1)} copy(%bitcast.1)
  ROOT %kernel = bf16[16,64]{1,0:T(8,128)(2,1)} custom-call(%copy.1, %copy-done, %q), custom_call_target="tpu_custom_call"
}
"""


def test_a_copy_into_another_layout_is_charged_to_its_argument_through_bitcasts():
    (cache, ids, q), result_copies = argument_layouts.argument_layouts(HLO)
    cache_bytes = 4 * 128 * 8 * 64 * 2
    assert (cache.number, cache.dims, cache.minor_to_major, cache.row_major) == (0, (4, 128, 8, 64), (1, 3, 2, 0),
                                                                                 False)
    assert cache.copies == (argument_layouts.Copy("copy.1", "copy", (3, 2, 1, 0), "hbm", cache_bytes,
                                                  2 * cache_bytes, 0),)
    assert (cache.copied_bytes, cache.hbm_bytes) == (cache_bytes, 2 * cache_bytes)
    assert (ids.copies, ids.copied_bytes, ids.row_major) == ((), 0, True)
    assert (q.copies, q.copied_bytes, q.row_major) == ((), 0, True)
    assert result_copies == ()
    probe = argument_layouts.LayoutProbe("v6e", (cache, ids, q), result_copies)
    assert (probe.copied_bytes, probe.hbm_bytes) == (cache_bytes, 2 * cache_bytes)
    # Priced as an XLA copy: its HBM bytes at the given share of v6e's peak bandwidth.
    v6e = tpu_generation("v6e")
    assert probe.seconds(hbm_fraction=0.5) == pytest.approx(2 * cache_bytes / (0.5 * v6e.device_hbm_bytes_per_s))


@pytest.fixture(scope="module")
def attention(kernel_builds):
    return get_local_kernel(kernel_builds["attention-tpu"], backend="cpu")


def _paged_call(attention, generation, *, head_dim, kv_heads, page_size, num_pages):
    cache = jax.ShapeDtypeStruct((num_pages, page_size, kv_heads, head_dim), jnp.bfloat16)
    avals = (jax.ShapeDtypeStruct((8, 8 * kv_heads, head_dim), jnp.bfloat16), cache, cache,
             jax.ShapeDtypeStruct((9,), jnp.int32), jax.ShapeDtypeStruct((8,), jnp.int32),
             jax.ShapeDtypeStruct((8, 16), jnp.int32))
    return functools.partial(attention.paged.kernel.ragged_paged_attention, max_q_len=1, generation=generation), avals


@pytest.mark.aot
@pytest.mark.parametrize("generation", SUPPORTED_GENERATIONS)
def test_the_paged_kernel_reads_a_head_dim_64_cache_over_pages_of_128_or_256_as_given(attention, generation):
    """GPT-OSS's cache [pages, 128 or 256, 8, 64] is stored page-rows minor ({1,3,2,0}); the kernel reads it keys-minor,
    a view of that layout: no copy. Over 16-token pages XLA stores the pages minor ({0,3,2,1}), which the kernel
    cannot read a page of: every call copies K and V whole. A 128-wide head is stored row-major: no copy."""
    for page_size in (128, 256):
        fn, avals = _paged_call(attention, generation, head_dim=64, kv_heads=8, page_size=page_size,
                                num_pages=128 * 1024 // page_size)
        found = argument_layouts.probe(fn, avals, generation)
        for number in (1, 2):
            assert found.argument(number).minor_to_major == (1, 3, 2, 0)
            assert not found.argument(number).copies, [copy.describe() for copy in found.argument(number).copies]
    fn, avals = _paged_call(attention, generation, head_dim=64, kv_heads=8, page_size=16, num_pages=8192)
    found = argument_layouts.probe(fn, avals, generation)
    cache_bytes = 8192 * 16 * 8 * 64 * 2  # 128 MiB: too large for XLA to copy into VMEM
    for number in (1, 2):
        assert found.argument(number).minor_to_major == (0, 3, 2, 1)
        assert (found.argument(number).copied_bytes, found.argument(number).hbm_bytes) == (cache_bytes,
                                                                                          2 * cache_bytes)
    fn, avals = _paged_call(attention, generation, head_dim=128, kv_heads=4, page_size=128, num_pages=1024)
    found = argument_layouts.probe(fn, avals, generation)
    assert all(found.argument(number).row_major and not found.argument(number).copies for number in (1, 2))


@pytest.mark.aot
@pytest.mark.parametrize("generation", SUPPORTED_GENERATIONS)
def test_the_varlen_kernel_reads_head_dim_64_keys_of_whole_tiles_as_given(attention, generation):
    """Packed keys and values [total_k, 8, 64] are stored rows-minor ({0,2,1}); the kernel reads them keys-minor, a
    view of that layout, when total_k is a multiple of 128 (flash_attn_varlen_func pads it to a power of two): no
    copy. Other row counts are copied (the kernel's blocks would leave the array)."""
    for total_k, copied in ((8192, False), (8000, True)):
        kv = jax.ShapeDtypeStruct((total_k, 8, 64), jnp.bfloat16)
        avals = (jax.ShapeDtypeStruct((64, 64, 64), jnp.bfloat16), kv, kv, jax.ShapeDtypeStruct((65,), jnp.int32),
                 jax.ShapeDtypeStruct((65,), jnp.int32))
        fn = functools.partial(attention.paged.kernel.ragged_varlen_attention, max_q_len=1, generation=generation)
        found = argument_layouts.probe(fn, avals, generation)
        for number in (1, 2):
            assert found.argument(number).minor_to_major == (0, 2, 1)
            assert bool(found.argument(number).copies) == copied, [c.describe() for c in found.argument(number).copies]


@pytest.mark.aot
@pytest.mark.parametrize("generation", SUPPORTED_GENERATIONS)
def test_a_head_dim_64_cache_of_small_pages_kept_row_major_is_read_with_no_copy(attention, generation):
    """XLA's default layout of [pages, 16, 8, 64] puts the pages minor, which no kernel reading a page's rows can take
    as a view; a caller that keeps the cache row-major (its jit's argument layout pinned) gets no copy."""
    fn, avals = _paged_call(attention, generation, head_dim=64, kv_heads=8, page_size=16, num_pages=8192)
    row_major = (None, (0, 1, 2, 3), (0, 1, 2, 3), None, None, None)
    pinned = argument_layouts.probe(fn, avals, generation, major_to_minor=row_major)
    assert all(pinned.argument(number).row_major and not pinned.argument(number).copies for number in (1, 2))


@pytest.mark.aot
@pytest.mark.parametrize("generation", ["v5e", "tpu7x"])
def test_the_keys_minor_predicate_agrees_with_the_compiler(attention, generation):
    """`cache_stored_keys_minor` against the layout XLA gives a cache argument, [pages, page, Hkv, D] in bfloat16 and
    float32: {1,3,2,0} exactly where it answers True; `packed_keys_stored_minor` against packed keys' ({0,2,1})."""
    shapes = [(64, 8, 16), (64, 8, 128), (64, 1, 256), (64, 4, 512), (128, 8, 128), (256, 2, 256), (64, 8, 64)]
    for (head_dim, kv_heads, page_size), dtype in zip(shapes, [jnp.bfloat16, jnp.float32] * len(shapes)):
        cache = jax.ShapeDtypeStruct((64 * 1024 // page_size, page_size, kv_heads, head_dim), dtype)
        layout = argument_layouts.probe(lambda c: c[:1] * 2, [cache], generation).argument(0).minor_to_major
        keys_minor = attention.common.paged.cache_stored_keys_minor(page_size, head_dim)
        assert (layout == (1, 3, 2, 0)) == keys_minor, (cache, layout)
    for (total_k, kv_heads, head_dim), dtype in zip([(4096, 8, 64), (1000, 1, 64), (4096, 4, 128)],
                                                    [jnp.bfloat16, jnp.float32, jnp.bfloat16]):
        packed = jax.ShapeDtypeStruct((total_k, kv_heads, head_dim), dtype)
        layout = argument_layouts.probe(lambda k: k[:1] * 2, [packed], generation).argument(0).minor_to_major
        assert (layout == (0, 2, 1)) == attention.common.paged.packed_keys_stored_minor(head_dim), (packed, layout)


@pytest.mark.aot
def test_latent_attention_reads_q_k_v_and_the_output_each_as_stored(attention):
    """Latent attention's q and k (192 or 576 wide, stored sequence-minor over these lengths) and v and the output
    (128 or 512, row-major) are each read and written as XLA stores them, through the forward and both backward
    kernels: no copy of any argument or result. One generation: the layout rule is the same on all four
    (kernel_repos/attention-tpu/tests/test_flash_layout.py)."""
    flash_attention = functools.partial(attention.flash.kernel.differentiable_flash_attention, generation="v6e")

    def gradients(q, k, v, d_out):
        def loss(q, k, v):
            return jnp.sum(flash_attention(q, k, v).astype(jnp.float32) * d_out.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    def arrays(*shapes):
        return [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in shapes]

    expanded = arrays((1, 4, 1024, 192), (1, 4, 1024, 192), (1, 4, 1024, 128), (1, 4, 1024, 128))
    absorbed_decode = arrays((8, 16, 1, 576), (8, 1, 2048, 576), (8, 1, 2048, 512))
    for fn, avals in ((gradients, expanded), (flash_attention, absorbed_decode)):
        found = argument_layouts.probe(fn, avals, "v6e")
        assert not found.copies, [copy.describe() for copy in found.copies]
        assert found.argument(1).minor_to_major == (2, 3, 1, 0)  # k, 192 or 576 wide: sequence-minor
        assert found.argument(2).row_major  # v, 128 or 512 wide
