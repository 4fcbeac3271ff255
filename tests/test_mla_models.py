"""tests/mla_models.py: a tiny, seeded, random model for every `expand_kv` architecture of transformers, each
generating from a left-padded prompt with a dynamic and a static cache."""

import re
from pathlib import Path

import pytest
import torch
import transformers

from .mla_models import (MLA_ARCHITECTURES, MLA_ATTENTION_MODULES, MLA_DSA, MLA_NO_CONTINUOUS_BATCHING,
                         MLA_UNBUILDABLE)

PROMPT_LENGTH = 6


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Models this small run several times faster on one intra-op thread than on two that spin against the other
    processes sharing our 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def expand_kv_architectures() -> set[str]:
    """The model folders of the installed transformers whose modeling code defines `expand_kv`."""
    models = Path(transformers.__file__).parent / "models"
    return {path.parent.name for path in models.glob("*/modeling_*.py")
            if re.search(r"^\s+def expand_kv\(", path.read_text(), re.MULTILINE)}


def left_padded_prompt() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of PROMPT_LENGTH tokens; the second starts with two pad tokens (id 0) that its mask hides."""
    input_ids = torch.randint(3, 128, (2, PROMPT_LENGTH), generator=torch.Generator().manual_seed(7))
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, :2] = attention_mask[1, :2] = 0
    return input_ids, attention_mask


def test_every_expand_kv_architecture_has_a_builder_or_a_reason():
    found = expand_kv_architectures()
    assert len(found) >= 18
    assert set(MLA_ARCHITECTURES) == found - set(MLA_UNBUILDABLE)
    assert set(MLA_UNBUILDABLE) <= found and all(MLA_UNBUILDABLE.values())
    assert set(MLA_ATTENTION_MODULES) == set(MLA_ARCHITECTURES) and set(MLA_DSA) <= set(MLA_ARCHITECTURES)


@pytest.mark.parametrize("name", sorted(MLA_ARCHITECTURES))
def test_the_model_is_tiny_seeded_random_and_keeps_its_latent_attention(name):
    model, config = MLA_ARCHITECTURES[name]()
    again, _ = MLA_ARCHITECTURES[name]()
    parameters = dict(model.named_parameters())
    assert not model.training and {p.dtype for p in parameters.values()} == {torch.float32}
    assert all(torch.equal(p, q) for p, q in zip(parameters.values(), again.parameters(), strict=True))
    assert sum(p.numel() for p in parameters.values()) < 300_000
    for parameter_name, parameter in parameters.items():
        assert torch.isfinite(parameter).all(), parameter_name
        assert parameter.ne(0).any() and (parameter.numel() == 1 or parameter.std() > 0), parameter_name
    assert (config.hidden_size, config.vocab_size) == (64, 128)
    assert max(config.bos_token_id, config.eos_token_id, config.pad_token_id) < config.vocab_size
    assert hasattr(config, "index_topk") == (name in MLA_DSA) and getattr(config, "index_topk", 0) < PROMPT_LENGTH
    attention = {module_name: module for module_name, module in model.named_modules() if hasattr(module, "expand_kv")}
    assert tuple(attention) == MLA_ATTENTION_MODULES[name]
    for module in attention.values():  # dots3-note's sliding-window layer has dims of its own
        assert module.num_heads in (2, 4) and module.kv_lora_rank in (16, 32)
        assert module.v_head_dim != module.qk_nope_head_dim + module.qk_rope_head_dim


@pytest.mark.parametrize("name", sorted(MLA_ARCHITECTURES))
def test_greedy_generation_runs_with_a_dynamic_and_a_static_cache(name):
    model, _ = MLA_ARCHITECTURES[name]()
    input_ids, attention_mask = left_padded_prompt()
    tokens = {}
    for cache, cache_class in (("dynamic", transformers.DynamicCache), ("static", transformers.StaticCache)):
        settings = {} if cache == "dynamic" else {"cache_implementation": "static"}
        out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=3, do_sample=False,
                             return_dict_in_generate=True, output_logits=True, **settings)
        assert type(out.past_key_values) is cache_class
        assert out.sequences.shape == (2, PROMPT_LENGTH + 3) and int(out.sequences.max()) < 128
        assert all(torch.isfinite(logits).all() for logits in out.logits)
        tokens[cache] = out.sequences
    assert torch.equal(tokens["dynamic"], tokens["static"])


@pytest.mark.parametrize("name", sorted(MLA_NO_CONTINUOUS_BATCHING))
def test_continuous_batching_refuses_the_dsa_and_hybrid_models(name):
    model, _ = MLA_ARCHITECTURES[name]()
    settings = transformers.GenerationConfig(max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=0)
    with pytest.raises(ValueError, match=f"Invalid layer type: {MLA_NO_CONTINUOUS_BATCHING[name]}$"):
        model.generate_batch([[5, 17, 33]], settings, warmup=False)



@pytest.mark.parametrize("name", MLA_DSA)
def test_the_dsa_indexers_leave_keys_out_of_a_prompt(name):
    model, _ = MLA_ARCHITECTURES[name]()
    input_ids, attention_mask = left_padded_prompt()
    with torch.no_grad():
        sparse = model(input_ids, attention_mask=attention_mask).logits
        indexers = [module for module in model.modules() if hasattr(module, "index_topk")]
        for indexer in indexers:
            indexer.index_topk = 1024
        dense = model(input_ids, attention_mask=attention_mask).logits
    assert indexers and (sparse - dense).abs().max() > 1e-3
