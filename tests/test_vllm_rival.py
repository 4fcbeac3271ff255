"""moe_layer's vLLM rival: its gmm loaded from the pinned tpu-inference wheel, and priced by our model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import perf
from benchmarks.studies.moe_layer import shapes, vllm_kernels
from benchmarks.studies.moe_layer.rivals import RIVALS, rival_layer


@pytest.fixture(scope="module")
def vllm_gmm():
    # Downloaded once (no dependencies) from the package index into the benchmark's wheel cache.
    return vllm_kernels.load_gmm(vllm_kernels.DEFAULT_FOLDER)


def test_a_wheel_other_than_the_pinned_one_is_refused(tmp_path):
    (tmp_path / vllm_kernels.WHEEL_NAME).write_bytes(b"not the wheel")
    with pytest.raises(RuntimeError, match="refusing to run its code"):
        vllm_kernels.wheel(tmp_path)


@pytest.mark.parametrize("sizes", [(100, 0, 120), (0, 0, 256), (1, 7, 0)])
def test_vllm_gmm_matches_a_plain_grouped_matmul(vllm_gmm, sizes):
    lhs = jax.random.normal(jax.random.key(0), (256, 384), jnp.float32)
    rhs = jax.random.normal(jax.random.key(1), (3, 384, 640), jnp.float32)
    out = vllm_gmm(lhs, rhs, jnp.array(sizes, jnp.int32), preferred_element_type=jnp.float32,
                   tiling=(128, 256, 256), interpret=True)
    starts = np.cumsum((0, *sizes))
    for group, (start, stop) in enumerate(zip(starts[:-1], starts[1:])):
        np.testing.assert_allclose(out[start:stop], lhs[start:stop] @ rhs[group], rtol=2e-5, atol=2e-4)


def test_the_vllm_layer_reads_its_weights_as_k_by_n_and_the_model_prices_it(vllm_gmm):
    """Qwen3's weights are stored [E, N, K]; vLLM's layer takes them [E, K, N] as its loader arranges them, and
    its two kernels replay with every grid step the model can price."""
    case = shapes.make_case(shapes.SETTINGS[1], 64)  # Qwen3-30B-A3B EP8 router masking, 64 tokens
    gate_up, down = case.weight_shapes(weights_k_n=True)
    h, i = case.model.hidden, case.model.intermediate
    assert gate_up[1:] == (h, 2 * i) and down[1:] == (i, h)
    layer = rival_layer(RIVALS["vllm_gmm"], case.model, [(128, h, 2 * i), (128, i, h)])
    replayed = perf.replay_program(layer, *case.avals(concrete_index=True, weights_k_n=True))
    assert len(replayed.pallas_calls) == 2
    modelled = perf.roofline(list(replayed.pallas_calls), "v6e")
    assert modelled.fits_vmem and modelled.pipelined_time_s > 0
    assert not any(call.unmodelled_dmas for call in replayed.pallas_calls)


def test_vllm_is_searched_over_k_blocks_its_gmm_keeps():
    """vLLM's gmm takes the whole K unless the K block divides it: GPT-OSS's K = 2880 (not a multiple of 128) is
    searched whole, with N blocks narrow enough to fit v5e's 16 MiB scoped VMEM."""
    from benchmarks.studies.moe_layer.rivals import block_vmem_bytes, candidate_tilings

    for k, n in ((2880, 5760), (2880, 2880), (2048, 1536), (768, 2048)):
        found = candidate_tilings(RIVALS["vllm_gmm"], 8, k, n, ("v5e",))
        assert found and all(k % tk == 0 for _, tk, _ in found), (k, n, found)
        assert all(block_vmem_bytes(tiling) <= 16 << 20 for tiling in found)
