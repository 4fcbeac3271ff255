"""mla.py's packed calls, as transformers' continuous batching makes them: every sequence of a step in one row, each
sequence's latent gathered after the one before, its queries the last of its keys; either form gives each sequence's
attention on its own."""

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention


def _packed_call():
    """A tiny DeepSeek-V3 MLA module (4 heads, latent 16, rope 8, nope 16, v 16) and a packed call: a chunk of 3
    queries over 7 keys, a decode step over 5, a prefill of 5, and a padding row past the last sequence."""
    config = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                              q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                              num_hidden_layers=1)
    torch.manual_seed(0)
    module = DeepseekV3Attention(config, layer_idx=0).eval()
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(1, 4, 10, 16 + 8, generator=generator)
    kv_nope = torch.randn(1, 1, 17, 16, generator=generator)
    k_rot = torch.randn(1, 1, 17, 8, generator=generator)
    kwargs = dict(cu_seq_lens_q=torch.tensor([0, 3, 4, 9], dtype=torch.int32),
                  cu_seq_lens_k=torch.tensor([0, 7, 12, 17], dtype=torch.int32), max_length_q=5, max_length_k=7,
                  is_causal=True)
    return module, query, kv_nope, k_rot, kwargs


def _reference(module, query, kv_nope, k_rot, kwargs) -> torch.Tensor:
    """[1, total_q, H, v] in float64: each sequence's queries against its expanded keys, the queries last."""
    key, value = (t.double() for t in type(module).expand_kv(module, kv_nope, k_rot))
    out = torch.zeros(query.shape[2], query.shape[1], value.shape[-1], dtype=torch.float64)
    cu_q, cu_k = kwargs["cu_seq_lens_q"].tolist(), kwargs["cu_seq_lens_k"].tolist()
    for q_start, q_end, k_start, k_end in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        logits = query[0, :, q_start:q_end].double() @ key[0, :, k_start:k_end].transpose(-1, -2) * module.scaling
        positions = torch.arange(k_end - k_start)
        visible = positions[None, :] <= positions[-(q_end - q_start):, None]
        weights = logits.masked_fill(~visible, float("-inf")).softmax(-1)
        out[q_start:q_end] = (weights @ value[0, :, k_start:k_end]).transpose(0, 1)
    return out[None]


@pytest.mark.parametrize("absorbed", [True, False], ids=["absorbed", "expanded"])
def test_a_packed_call_matches_each_sequence_apart_in_either_form(kernel, absorbed, monkeypatch):
    mla = kernel.mla
    monkeypatch.setattr(mla, "absorbed_is_cheaper", lambda shape, target: absorbed)
    forms = []
    for form in ("absorbed", "expanded"):
        function = getattr(mla, f"_{form}_packed")
        monkeypatch.setattr(mla, f"_{form}_packed",
                            lambda *args, _form=form, _function=function: forms.append(_form) or _function(*args))
    module, query, kv_nope, k_rot, kwargs = _packed_call()
    expected = _reference(module, query, kv_nope, k_rot, kwargs)
    mla.serve_latent(module)
    with torch.no_grad():
        out, _ = mla.latent_attention_forward(module, query, kv_nope, k_rot, None, scaling=module.scaling, **kwargs)
    assert forms == ["absorbed" if absorbed else "expanded"]
    assert out.shape == expected.shape
    assert (out.double() - expected).abs().max().item() <= 1e-5
    assert not out[0, 9].any()  # the padding row past the last sequence


def test_a_packed_call_prices_its_sequences_at_the_longest_lengths(kernel, monkeypatch):
    shapes = []
    monkeypatch.setattr(kernel.mla, "absorbed_is_cheaper", lambda shape, target: shapes.append(shape) or True)
    module, query, kv_nope, k_rot, kwargs = _packed_call()
    kernel.mla.serve_latent(module)
    with torch.no_grad():
        kernel.mla.latent_attention_forward(module, query, kv_nope, k_rot, None, scaling=module.scaling, **kwargs)
    (shape,) = shapes
    assert (shape.batch, shape.q_len, shape.kv_len, shape.heads, shape.latent, shape.rope) == (3, 5, 7, 4, 16, 8)
