"""The programs TorchTPU's strict eager would compile, counted on a kernelized tiny Qwen3-MoE inside the model's forward
(benchmarks/studies/op_signatures.py): none per decode step or new prompt length in a bucket with the recipe
kernelize installs on a TPU; with a dynamic cache, what each token still adds and whose it is."""

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


def _check_tokens(model, eager, length):
    assert torch.equal(_generate(model, length, 4), eager[length]), length


@pytest.mark.slow
def test_with_a_dynamic_cache_ours_per_token_is_the_pad_of_the_keys_transformers_grew(kernelized):
    """Each token's cache is one key longer: transformers' cat, mask and position ops see new shapes and scalars;
    ours, only the keys, values and mask transformers grew, cut and padded to their bucket: each new signature of
    ours has such a tensor as input (no scalar of ours adds one)."""
    model, _, forwards = kernelized
    _generate(model, 5, 3, cache_implementation="dynamic")
    calls = forwards.during(lambda: _generate(model, 7, 5, cache_implementation="dynamic"))
    decode_steps = calls[3:]  # past the key lengths the first call reached (its prompt padded to 16, 2 decode steps)
    assert len(decode_steps) == 2
    for keys, step in enumerate(decode_steps, start=16 + 3):
        ours = [entry.signature for entry in step if entry.origin == "ours"]
        assert {s.op for s in ours} == {"aten.constant_pad_nd.default", "aten.alias.default"}
        assert all(keys in s.arguments[0][1] for s in ours), ours
        assert by_origin(step)["transformers"] > 0
