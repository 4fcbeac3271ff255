"""The fixed-shape recipe (tpu_kernels.integration.fixed_shapes) on a plain transformers model: the same tokens as
transformers' own generate, whatever form the call takes."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, Qwen3Config

from tpu_kernels.integration import fixed_shapes


def _tiny_qwen3():
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None
    return model


def _prompt(length, batch=1):
    return torch.randint(1, 96, (batch, length), generator=torch.Generator().manual_seed(length))


@pytest.fixture(scope="module")
def models():
    """The same model twice: transformers' own generate, and with the recipe installed."""
    plain, fixed = _tiny_qwen3(), _tiny_qwen3()
    fixed_shapes.install(fixed, None)
    return plain, fixed


@pytest.mark.parametrize("call", [dict(max_new_tokens=5), dict(max_length=12), dict(max_new_tokens=4, min_length=9),
                                  dict(max_new_tokens=3, return_dict_in_generate=True, output_scores=True)])
def test_tokens_are_those_of_transformers_generate(models, call):
    plain, fixed = models
    ids = _prompt(6, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # the caller's own left padding stays
    with torch.no_grad():
        expected, got = (model.generate(ids, attention_mask=mask, do_sample=False, **call) for model in models)
    if call.get("return_dict_in_generate"):
        assert len(got.scores) == len(expected.scores)
        expected, got = expected.sequences, got.sequences
    assert torch.equal(got, expected)


def test_the_cache_is_static_at_a_key_bucket_unless_the_call_chooses(models):
    _, fixed = models
    with torch.no_grad():
        out = fixed.generate(input_ids=_prompt(5), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
        assert type(out.cache).__name__ == "StaticCache"
        assert out.cache.get_max_length() == 128 and out.sequences.shape == (1, 7)
        dynamic = fixed.generate(_prompt(5), max_new_tokens=2, do_sample=False, cache_implementation="dynamic",
                                 return_dict_in_generate=True)
        assert isinstance(dynamic.cache, DynamicCache)
        # A caller's own cache is continued as it is: no padding, no other cache.
        cache = DynamicCache(config=fixed.config)
        own = fixed.generate(_prompt(5), max_new_tokens=2, do_sample=False, cache=cache)
        assert own.shape == (1, 7) and cache.get_seq_length() == 6


def test_on_by_default_on_a_tpu_only_and_said_in_the_report():
    assert fixed_shapes.wanted(None, "tpu") and not fixed_shapes.wanted(None, "cpu")
    assert fixed_shapes.wanted(True, "cpu") and not fixed_shapes.wanted(False, "tpu")
    model = _tiny_qwen3()
    summary = fixed_shapes.install(model, None)
    fixed_shapes.install(model, None)  # again: transformers' own generate is wrapped, once
    assert model.generate.__wrapped__ == model._tpu_kernels_unwrapped and fixed_shapes.installed(model)
    assert "token buckets" in summary and "static cache at a key bucket" in summary


def test_the_cache_length_is_a_key_bucket_of_what_transformers_would_size():
    config = _tiny_qwen3().generation_config
    assert fixed_shapes._cache_length(config, dict(max_new_tokens=100), 16) == 128
    assert fixed_shapes._cache_length(config, dict(max_new_tokens=114), 16) == 256
    assert fixed_shapes._cache_length(config, dict(max_length=300), 16) == 384
    assert fixed_shapes._cache_length(config, dict(max_new_tokens=2, max_cache_len=600), 16) == 768


def test_generate_runs_attention_forward_in_place_of_the_flash_path(monkeypatch):
    """A model on the flash path runs the kernel's attention_forward while generate runs, and returns to it."""
    model = _tiny_qwen3()
    flash = "org/attention-tpu--abc--id:flash_attn_varlen_func"
    calls = []
    monkeypatch.setattr(model.config, "_attn_implementation_internal", flash)
    monkeypatch.setattr(model, "set_attn_implementation", lambda name, **options: calls.append((name, options)))
    with fixed_shapes._attention_as(model, "tpu_kernels_attention"):
        assert calls == [("tpu_kernels_attention", {})]
    assert calls[1] == (flash, {"allow_all_kernels": True})
    with fixed_shapes._attention_as(model, None):
        assert len(calls) == 2


def test_a_dynamic_cache_asked_for_grows_in_key_buckets_with_transformers_tokens(models):
    """Across a bucket edge (prompt 120 padded to 128, then 3 tokens), asked for by the call and by the generation
    config: the tokens of transformers' own DynamicCache, the layers at the key bucket of what they hold."""
    from tpu_kernels.integration.bucketed_cache import BucketedDynamicCache

    plain, fixed = models
    ids = _prompt(120)
    with torch.no_grad():
        expected = plain.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="dynamic")
        got = fixed.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="dynamic",
                             return_dict_in_generate=True)
        config = fixed.generation_config
        config.cache_implementation = "dynamic"
        try:
            by_config = fixed.generate(ids, max_new_tokens=3, do_sample=False)
        finally:
            config.cache_implementation = None
    assert torch.equal(got.sequences, expected) and torch.equal(by_config, expected)
    assert type(got.cache) is BucketedDynamicCache
    assert [tuple(layer.keys.shape) for layer in got.cache.layers] == [(1, 2, 256, 16)] * 2
    assert [layer.length for layer in got.cache.layers] == [128 + 2] * 2


def test_a_bucketed_layer_crops_and_resets_by_its_lengths():
    from tpu_kernels.integration.bucketed_cache import BucketedLayer

    layer = BucketedLayer()
    keys = torch.randn(1, 2, 130, 4)
    out, _ = layer.update(keys, keys + 1)
    assert out.shape == (1, 2, 256, 4) and torch.equal(out[:, :, :130], keys) and not out[:, :, 130:].any()
    layer.crop(-3)
    assert layer.length == 127 and int(layer.get_seq_length()) == 127 and layer.get_mask_sizes(1) == (128, 0)
    token = torch.randn(1, 2, 1, 4)
    out, values = layer.update(token, token)
    assert torch.equal(out[:, :, 127:128], token) and torch.equal(values[:, :, :127], keys[:, :, :127] + 1)
    with pytest.raises(ValueError, match="negative"):
        layer.crop(2)
    layer.reset()
    assert layer.length == 0 and layer.get_seq_length() == 0 and layer.get_mask_sizes(5) == (128, 0)
