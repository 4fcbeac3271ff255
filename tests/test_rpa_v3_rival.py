"""paged_attention's vLLM rival, RPA v3: its block-size search, and its head_dim 64 kernel under our jax."""

import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from benchmarks.studies.moe_layer import vllm_kernels
from benchmarks.studies.paged_attention import rpa_v3
from benchmarks.studies.paged_attention.shapes import Batch


def _call(*, page_size=128, max_kv=8192, max_q=1, mixed=False, hd64=False):
    return rpa_v3._Call(rpa=None, modules=(), args=[], hd64=hd64, page_size=page_size, max_kv=max_kv, max_q=max_q,
                        total_q=64 + (max_q if mixed else 0), pages_per_seq=-(-max_kv // page_size), mixed=mixed)


@pytest.mark.parametrize("page_size, max_kv", [(16, 8192), (128, 1000), (256, 300)])
def test_every_searched_block_holds_whole_pages_and_whole_compute_slices(page_size, max_kv):
    axes = rpa_v3.search_axes(_call(page_size=page_size, max_kv=max_kv, max_q=1024, mixed=True))
    kv_limit = -(-max_kv // page_size) * page_size
    for (key, positions), values in axes.items():
        assert values and key in ("d_block_sizes", "m_block_sizes")
        splits = rpa_v3.DECODE_CSZ_SPLITS if key == "d_block_sizes" else rpa_v3.CSZ_SPLITS
        for block, piece in values:
            assert block % piece == 0 and block // piece in splits
            if positions == (1, 3):  # keys
                assert block % page_size == 0 and piece % page_size == 0 and block <= kv_limit
            else:  # queries
                assert block <= 1024
    assert set(axes) == {("d_block_sizes", (1, 3)), ("m_block_sizes", (0, 2)), ("m_block_sizes", (1, 3))}


def test_a_decode_batch_searches_its_decode_call_only_and_hd64_its_pages_and_queries():
    assert set(rpa_v3.search_axes(_call())) == {("d_block_sizes", (1, 3))}
    hd64 = rpa_v3.search_axes(_call(hd64=True, max_kv=300))
    assert hd64 == {("num_kv_pages_per_block", ()): [1, 2], ("num_queries_per_block", ()): [8, 16, 32, 64]}


class _Replays:
    def get(self, config, version, generation):
        assert version == rpa_v3.SEARCH_VERSION
        return config


def test_the_search_leaves_a_default_that_overflows_for_the_fastest_configuration_that_fits(monkeypatch):
    # Key blocks of more than 2048 keys overflow; among those that fit, the mixed call's 256 queries and 1024 keys in
    # 512-key slices and the decode call's 512 keys are fastest.
    def time_s(config, batch, model, generation):
        _, decode, _, _ = config["d_block_sizes"]
        queries, block, _, piece = config["m_block_sizes"]
        if max(decode, block) > 2048:
            return math.inf
        return (abs(math.log2(decode / 512)) + abs(math.log2(queries / 256)) + abs(math.log2(block / 1024))
                + (0 if block == 2 * piece else 0.5))

    monkeypatch.setattr(rpa_v3, "_fitting_time_s", time_s)
    start = {"d_block_sizes": [1, 8192, 1, 8192], "m_block_sizes": [256, 4096, 128, 2048]}
    best = rpa_v3.search(_call(max_q=1024, mixed=True), _Replays(), None, None, "v6e", start)
    assert best == {"d_block_sizes": [1, 512, 1, 512], "m_block_sizes": [256, 1024, 256, 512]}


def test_vllms_default_is_run_with_its_query_slice_no_longer_than_its_query_block():
    default = {"d_block_sizes": [1, 4096, 1, 4096], "m_block_sizes": [32, 1024, 64, 512]}
    assert rpa_v3.runnable(_call(), default) == {"d_block_sizes": [1, 4096, 1, 4096],
                                                 "m_block_sizes": [32, 1024, 32, 512]}


def test_the_head_dim_64_kernel_traces_under_our_jax_with_its_reciprocal_stood_in():
    """kernel_hd64 calls pltpu.reciprocal, which jax 0.10.2 lacks; pl.reciprocal (the same Mosaic op) stands in."""
    kernel = rpa_v3.load_rpa_v3(vllm_kernels.DEFAULT_FOLDER, "kernel_hd64")
    assert kernel.pltpu.reciprocal is pl.reciprocal
    modules = [sys.modules[name] for name in rpa_v3.RPA_MODULES["kernel_hd64"]]
    rpa_v3._set_generation(6, "v6e", modules)
    batch = Batch("b", "mixed", (1, 5), (40, 37))
    cache = jax.ShapeDtypeStruct(kernel.get_kv_cache_shape(6, 16, 2, 64, jnp.bfloat16), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((batch.total_q, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch.total_q, 2, 64), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((4,), jnp.float32)
    traced = jax.make_jaxpr(lambda *arrays: kernel.ragged_paged_attention_hd64(
        *arrays, sm_scale=0.125, sliding_window=16, num_kv_pages_per_block=1, num_queries_per_block=8))(
        q, kv, kv, cache, np.asarray(batch.kv_lens, np.int32), np.arange(6, dtype=np.int32),
        np.asarray([0, 1, 6], np.int32), np.asarray([1, 1, 2], np.int32), sinks)
    assert "pallas_call" in str(traced)
