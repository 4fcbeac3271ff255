"""The programs TorchTPU's strict eager would compile, counted on a kernelized tiny Qwen3-MoE inside the model's forward
(benchmarks/studies/op_signatures.py): none per decode step or new prompt length in a bucket with the recipe
kernelize installs on a TPU; with a dynamic cache, none of ours per token, and what transformers' own ops still add."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from tpu_kernels import kernelize
from benchmarks.studies.op_signatures import OpSignatures, by_origin


def _tiny_qwen3_moe():
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, max_position_embeddings=256, moe_intermediate_size=48,
                            num_experts=8, num_experts_per_tok=2, intermediate_size=96)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 3:  # expert weights start empty: random, never zero
                parameter.normal_(std=0.1)
    model.generation_config.eos_token_id = None
    return model


class _PerForward:
    """The new op signatures of each forward call of `model`, in order."""

    def __init__(self, model):
        self.recorded, self.calls, forward = OpSignatures(), [], model.forward

        def recording(*args, **kwargs):
            start = self.recorded.mark()
            with self.recorded:
                out = forward(*args, **kwargs)
            self.calls.append(self.recorded.since(start))
            return out

        model.forward = recording

    def during(self, run) -> list[list]:
        self.calls = []
        run()
        return self.calls


def _generate(model, length, new_tokens, **options):
    prompt = torch.randint(1, 128, (1, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                              do_sample=False, **options)


@pytest.fixture(scope="module")
def kernelized(kernel_builds):
    """The model's eager tokens for prompts of 5, 7 and 12 tokens, then the model kernelized with the recipe forced
    on (as on a TPU), its forward calls recorded."""
    model = _tiny_qwen3_moe()
    eager = {length: _generate(model, length, 4) for length in (5, 7, 12)}
    kernelize(model, repos={kind: str(kernel_builds[repo]) for kind, repo in (
        ("experts", "ragged-dot-tpu"), ("rmsnorm", "rmsnorm-tpu"), ("attention", "attention-tpu"))},
        fixed_shapes=True)
    return model, eager, _PerForward(model)


@pytest.mark.slow
def test_with_the_recipe_nothing_new_per_decode_step_or_prompt_length_in_a_bucket(kernelized):
    model, eager, forwards = kernelized
    assert "shapes    fixed:" in repr(model.tpu_kernels_report)
    first = forwards.during(lambda: _check_tokens(model, eager, 5))
    assert len(first) == 4 and all(first[:2]) and not any(first[2:]), [by_origin(call) for call in first]
    for length in (7, 12):  # the same token bucket (16) and cache (128 keys): every program seen before
        assert forwards.during(lambda: _check_tokens(model, eager, length)) == [[]] * 4


def _check_tokens(model, eager, length, **options):
    assert torch.equal(_generate(model, length, 4, **options), eager[length]), length


@pytest.mark.slow
def test_with_a_dynamic_cache_nothing_of_ours_per_token_only_transformers_2d_mask(kernelized):
    """A dynamic cache under the recipe grows in key buckets and writes each token in place (bucketed_cache.py): no
    `cat`, no position scalar, and attention gets keys at their bucket (no pad of ours). What transformers still runs
    per token is the 2-D mask generate grows by a column: its cast to bool and its pad to the cache's capacity. The
    tokens are eager attention's."""
    model, eager, forwards = kernelized
    _generate(model, 5, 3, cache_implementation="dynamic")  # masks of 17 and 18 columns after the prompt's 16
    calls = forwards.during(lambda: _check_tokens(model, eager, 12, cache_implementation="dynamic"))
    assert len(calls) == 4 and not [entry for call in calls for entry in call if entry.origin == "ours"]
    assert calls[:3] == [[], [], []]
    last = {(entry.origin, entry.signature.op, entry.where.split(":")[0]) for entry in calls[3]}
    assert last == {("transformers", "aten._to_copy.default", "transformers.masking_utils"),
                    ("transformers", "aten.constant_pad_nd.default", "transformers.masking_utils")}
