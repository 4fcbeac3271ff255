"""The transformers-facing entry points hand the kernels bucketed lengths and give the unpadded results.

Each entry point runs on random inputs at the edges of the buckets (one query, a bucket's last size, one past
it) against the flash kernel called on the unpadded shapes, and records the shapes the kernel was handed.
"""

import pytest
import torch


class _Attention(torch.nn.Module):
    is_causal = True


def _random(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def kernel_shapes(kernel, monkeypatch):
    """The (batch, query length, key length) of every call of the flash op, recorded."""
    shapes = []
    op = kernel.ops._flash_attention

    def recording(q, k, *args):
        shapes.append((q.shape[0], q.shape[2], k.shape[2]))
        return op(q, k, *args)

    monkeypatch.setattr(kernel.ops, "_flash_attention", recording)
    return shapes


# batch, q_len, kv_len, the padded triple, and the mask: None (causal prefill or one query) or a random boolean one.
CASES = {
    "prefill-one-past-edges": (1, 17, 17, (1, 32, 128), None),
    "decode-one-past-key-edge": (1, 1, 129, (1, 1, 256), None),
    "masked-chunk-at-edges-3-sequences": (3, 16, 128, (4, 16, 128), "bool"),
}


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case.startswith("prefill") else case
                                  for case in CASES])
def test_attention_forward_pads_to_buckets_and_keeps_the_result(kernel, kernel_shapes, case):
    batch, q_len, kv_len, expected_shapes, mask_kind = CASES[case]
    query = _random(1, batch, 2, q_len, 64)
    key, value = _random(2, batch, 1, kv_len, 64), _random(3, batch, 1, kv_len, 64)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(batch, 1, q_len, kv_len, generator=torch.Generator().manual_seed(4)) > 0.3
        mask[..., -1] = True  # every query sees a key
    causal = mask is None and q_len > 1
    expected = kernel.flash_attention(query, key, value, causal=causal, attention_mask=mask,
                                      q_offset=0 if causal else None).transpose(1, 2)
    kernel_shapes.clear()
    out, weights = kernel.attention_forward(_Attention(), query, key, value, mask)
    assert kernel_shapes == [expected_shapes] and weights is None
    assert out.shape == (batch, q_len, 2, 64)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_padded_attention_forward_gradients_are_the_unpadded_ones(kernel, kernel_shapes):
    """Padded queries and sequences get a zero cotangent and padded keys are never visible: every gradient is the
    unpadded one."""
    tensors = _random(5, 3, 2, 5, 64), _random(6, 3, 1, 5, 64), _random(7, 3, 1, 5, 64)
    sinks, d_out = _random(8, 2), _random(9, 3, 5, 2, 64)

    def gradients(attention):
        leaves = [t.clone().requires_grad_() for t in (*tensors, sinks)]
        torch.autograd.backward(attention(*leaves), d_out)
        return [leaf.grad for leaf in leaves]

    expected = gradients(lambda q, k, v, s: kernel.flash_attention(q, k, v, causal=True, sinks=s).transpose(1, 2))
    kernel_shapes.clear()
    ours = gradients(lambda q, k, v, s: kernel.attention_forward(_Attention(), q, k, v, None, s_aux=s)[0])
    assert kernel_shapes == [(4, 16, 128)]
    for name, grad, expected_grad in zip(("query", "key", "value", "sinks"), ours, expected):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-5, msg=name)


def test_flash_attn_func_pads_to_buckets_and_keeps_bottom_right_causality(kernel, kernel_shapes):
    """flash-attn's layout and alignment: the queries are the last positions of the real keys, not of the padded;
    3 sequences padded to 4."""
    q, k, v = _random(10, 3, 5, 2, 64), _random(11, 3, 17, 1, 64), _random(12, 3, 17, 1, 64)
    expected = kernel.flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                      causal=True).transpose(1, 2)
    kernel_shapes.clear()
    out = kernel.flash_attn_func(q, k, v, causal=True)
    assert kernel_shapes == [(4, 16, 128)]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
