"""mla.py's choice of form per call: the absorbed form (over the latent cache) where its roofline time is lower, the
expanded form (expand_kv once, then flash) elsewhere; and the sparse indexer's keys folded into the mask."""

import pytest
import torch

from tpu_kernels.runtime.hardware import SUPPORTED_GENERATIONS


def _shape(mla, q_len, kv_len, heads=128, batch=8):
    # DeepSeek-V3's widths: nope 128 + rope 64 keys, values 128, latent 512.
    return mla.LatentShape(heads=heads, nope=128, rope=64, v=128, latent=512, batch=batch, q_len=q_len,
                           kv_len=kv_len, itemsize=2)


@pytest.mark.parametrize("generation", SUPPORTED_GENERATIONS)
def test_decode_is_absorbed_and_a_long_prompt_expanded(kernel, generation):
    mla = kernel.mla
    target = mla.resolve_target(generation)
    for q_len, kv_len in ((1, 4096), (1, 32768), (4, 4096)):  # decode and speculative steps
        assert mla.absorbed_is_cheaper(_shape(mla, q_len, kv_len), target), (q_len, kv_len)
    for heads in (16, 128):  # a prompt from an empty cache
        assert not mla.absorbed_is_cheaper(_shape(mla, 8192, 8192, heads), target), heads


def test_the_priced_work_of_each_form(kernel):
    """Expanded: kv_b_proj over every cached token plus attention at nope + rope + v; absorbed: the query and output
    maps per query plus attention at 2L + R; the causal pairs of queries last in the keys."""
    mla = kernel.mla
    target = mla.resolve_target("v6e")
    shape = _shape(mla, q_len=3, kv_len=5, heads=2, batch=1)
    assert shape.visible_pairs == 3 + 4 + 5
    costs = mla.form_costs(shape, target)
    pairs = 2 * 12
    assert costs["expanded"][0] == 2 * 5 * 2 * 512 * 256 + 2 * pairs * (192 + 128)
    assert costs["absorbed"][0] == 2 * 3 * 2 * 512 * 256 + 2 * pairs * (576 + 512)
    # Bytes (bf16), each kernel streaming its keys once at this size: the latent read by either form; per cached token and head the expanded form's kv_b_proj output,
    # its assembled keys (k_nope read, keys written) and the kernel's reads of keys and values; per query and head,
    # q and the output (expanded), or q, the latent-wide query and output written and read, and the output (absorbed).
    cached_latent = 5 * 576
    assert costs["expanded"][1] == 2 * (cached_latent + 5 * 2 * (256 + 320 + 320) + 6 * 320)
    assert costs["absorbed"][1] == 2 * (cached_latent + 6 * (192 + 2 * 576 + 2 * 512 + 128))
    decode = mla.form_costs(_shape(mla, q_len=1, kv_len=4096), target)
    assert decode["absorbed"][1] < decode["expanded"][1] / 10


def test_a_long_prompt_streams_each_kernels_keys_once_per_query_block_that_sees_them(kernel):
    """The flash kernel re-reads the expanded keys and values, and the latent kernel the cache, per query block
    (and block of heads): a causal prompt of 8192 tokens streams each about half as many times as it has query
    blocks, and more than once."""
    mla = kernel.mla
    target = mla.resolve_target("v6e")
    flash, latent = mla._streams(_shape(mla, q_len=8192, kv_len=8192, heads=16, batch=1), target)
    assert flash > 1 and latent > 1
    assert mla._streams(_shape(mla, q_len=1, kv_len=8192, heads=16, batch=1), target) == (1, 1)


def test_more_queries_than_keys_see_only_the_keys_before_them(kernel):
    assert _shape(kernel.mla, q_len=7, kv_len=3).visible_pairs == 1 + 2 + 3


def test_the_indexers_selection_joins_the_mask(kernel):
    mla = kernel.mla
    indices = torch.tensor([[[0, 2], [1, -1], [3, 3]]])  # [B=1, Sq=3, k=2]; -1 selects nothing
    bool_mask = torch.ones(1, 1, 3, 6, dtype=torch.bool)
    bool_mask[..., 2] = False
    selected = mla.with_selected_keys(bool_mask, indices, kv_len=4)
    assert selected.shape == (1, 1, 3, 4)
    assert selected[0, 0].tolist() == [[True, False, False, False], [False, True, False, False],
                                       [False, False, False, True]]
    additive = torch.zeros(1, 1, 3, 4)
    floor = torch.finfo(torch.float32).min
    assert (mla.with_selected_keys(additive, indices, kv_len=4)[0, 0] == floor).sum() == 12 - 4
    # No mask: the queries are the last ones and see keys up to their own position.
    causal = mla.with_selected_keys(None, torch.tensor([[[0, 3]], [[3, 2]]]), kv_len=4)
    assert causal[:, 0, 0].tolist() == [[True, False, False, True], [False, False, True, True]]
