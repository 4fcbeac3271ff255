"""attention_forward registered in transformers: tiny models generate what eager attention generates.

The registration is done here the way `tpu_kernels.integration.kernelize` does it: the
attention function in `AttentionInterface` and the kernel's mask function in
`AttentionMaskInterface` under the same name, then
`model.set_attn_implementation(name)`.
"""

import pytest
import torch
from transformers import AttentionInterface, Gemma2ForCausalLM, GptOssForCausalLM, Qwen3MoeForCausalLM
from transformers.masking_utils import AttentionMaskInterface

from tpu_kernels.testing import tiny_transformers_model

NAME = "tpu_attention"
NEW_TOKENS = 4


class Registration:
    """The registered name, and which mask each call of the kernel's attention_forward received."""

    def __init__(self, attention_forward):
        self.name = NAME
        self.masks = []  # (sliding_window kwarg, None | mask dtype) per call
        self._attention_forward = attention_forward

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        self.masks.append((kwargs.get("sliding_window"), None if attention_mask is None else attention_mask.dtype))
        return self._attention_forward(module, query, key, value, attention_mask, *args, **kwargs)


@pytest.fixture
def registered(kernel):
    previous = {
        interface: interface._global_mapping.get(NAME) for interface in (AttentionInterface, AttentionMaskInterface)
    }
    registration = Registration(kernel.attention_forward)
    AttentionInterface.register(NAME, registration)
    AttentionMaskInterface.register(NAME, kernel.attention_mask)
    yield registration
    for interface, function in previous.items():
        if function is None:
            interface._global_mapping.pop(NAME)
        else:
            interface.register(NAME, function)


# Every model compares the kernel with eager attention; heads of 64 lanes, as real models have.
EAGER = dict(head_dim=64, attn_implementation="eager")
SLIDING_THEN_FULL = dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"])


def _tiny_qwen3_moe():
    # Grouped-query attention with a single key/value head.
    return tiny_transformers_model(
        Qwen3MoeForCausalLM, seed=0, **EAGER, num_attention_heads=8, num_key_value_heads=1,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
    ).eval()


def _tiny_gemma2():
    # Alternating sliding-window (w=6) and full layers, with logit soft-capping.
    return tiny_transformers_model(
        Gemma2ForCausalLM, seed=1, **EAGER, **SLIDING_THEN_FULL, query_pre_attn_scalar=64, attn_logit_softcapping=20.0
    ).eval()


def _tiny_gpt_oss():
    # Attention sinks; a sliding-window layer (w=6) and a full one.
    model = tiny_transformers_model(
        GptOssForCausalLM, seed=2, **EAGER, **SLIDING_THEN_FULL, intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2,
    ).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("sinks") or parameter.dim() == 3:  # sinks and experts may start zero or empty
                parameter.normal_(std=1.0 if name.endswith("sinks") else 0.1)
    return model


def _generate(model, implementation, input_ids, attention_mask, **options):
    """Greedy tokens and the logits of every generated step."""
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
            **options,
        )
    return out.sequences, torch.stack(out.logits)


def _assert_same_generation(out, expected):
    tokens, logits = out
    expected_tokens, expected_logits = expected
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)


def _prompts(lengths, seed):
    """Left-padded random prompts and their padding mask."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(1, 96, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return input_ids, attention_mask


@pytest.mark.slow
@pytest.mark.parametrize("lengths", [(9,), (11, 6)], ids=["unpadded", "left-padded"])
def test_qwen3_moe_generates_like_eager(registered, lengths):
    model = _tiny_qwen3_moe()
    input_ids, attention_mask = _prompts(lengths, seed=len(lengths))
    expected = _generate(model, "eager", input_ids, attention_mask)
    out = _generate(model, registered.name, input_ids, attention_mask)
    assert model.config._attn_implementation == registered.name
    _assert_same_generation(out, expected)
    # Unpadded batches take the mask-free causal path, padded ones the explicit boolean masks.
    expected_mask = None if len(lengths) == 1 else torch.bool
    assert len(registered.masks) == 2 * NEW_TOKENS
    assert {mask for _, mask in registered.masks} == {expected_mask}


def test_static_cache_generates_like_eager(registered):
    """A static cache is longer than the prompt: prefill gets no mask (causal from position 0, keys
    past the prompt unused), decode steps get boolean masks over the whole cache."""
    model = _tiny_qwen3_moe()
    input_ids, attention_mask = _prompts((9,), seed=5)
    expected = _generate(model, "eager", input_ids, attention_mask, cache_implementation="static")
    out = _generate(model, registered.name, input_ids, attention_mask, cache_implementation="static")
    _assert_same_generation(out, expected)
    assert registered.masks[0] == (None, None) and registered.masks[-1] == (None, torch.bool)


@pytest.mark.slow
def test_sliding_window_model_generates_like_eager(registered):
    model = _tiny_gemma2()
    input_ids, attention_mask = _prompts((10,), seed=3)
    expected = _generate(model, "eager", input_ids, attention_mask)
    out = _generate(model, registered.name, input_ids, attention_mask)
    _assert_same_generation(out, expected)
    # The prompt (10) outgrows the window (6): sliding layers get explicit masks, full layers none.
    assert set(registered.masks) == {(6, torch.bool), (None, None)}


@pytest.mark.slow
@pytest.mark.parametrize("lengths", [(10,), (11, 7)], ids=["unpadded", "left-padded"])
def test_gpt_oss_with_sinks_generates_like_eager(registered, lengths):
    model = _tiny_gpt_oss()
    input_ids, attention_mask = _prompts(lengths, seed=6)
    expected = _generate(model, "eager", input_ids, attention_mask)
    out = _generate(model, registered.name, input_ids, attention_mask)
    _assert_same_generation(out, expected)


def test_gpt_oss_gradients_match_eager(registered):
    """Training: the gradients of every parameter, sinks included, are eager attention's."""
    model = _tiny_gpt_oss().train()
    input_ids, attention_mask = _prompts((12, 9), seed=7)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    gradients = {}
    for implementation in ("eager", registered.name):
        model.set_attn_implementation(implementation)
        model.zero_grad()
        model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
        gradients[implementation] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    expected, ours = gradients["eager"], gradients[registered.name]
    assert expected.keys() == ours.keys() and any(n.endswith("sinks") for n in ours)
    for name, grad in ours.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-5, msg=name)


def test_layer_outputs_match_eager(registered):
    """One forward pass, left-padded: the logits of the real tokens agree with eager attention."""
    model = _tiny_gemma2()
    input_ids, attention_mask = _prompts((12, 7), seed=4)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        expected = model(input_ids=input_ids, attention_mask=attention_mask).logits
        model.set_attn_implementation(registered.name)
        out = model(input_ids=input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    torch.testing.assert_close(out[real], expected[real], rtol=1e-4, atol=1e-4)


def test_dropout_in_training_raises(kernel):
    model = _tiny_qwen3_moe()
    attention = model.model.layers[0].self_attn
    attention.train()
    query = torch.randn(1, 8, 3, 64)
    key = torch.randn(1, 1, 3, 64)
    with pytest.raises(ValueError, match="dropout"):
        kernel.attention_forward(attention, query, key, key.clone(), None, dropout=0.1)


@pytest.mark.slow
def test_traces_under_torch_compile(kernel):
    """Both paths (no mask, boolean mask) trace into one graph and give the eager results."""
    module = _tiny_qwen3_moe().model.layers[0].self_attn
    generator = torch.Generator().manual_seed(5)
    query = torch.randn(2, 8, 5, 64, generator=generator)
    key = torch.randn(2, 1, 5, 64, generator=generator)
    value = torch.randn(2, 1, 5, 64, generator=generator)
    mask = torch.rand(2, 1, 5, 5, generator=generator) > 0.3

    def both_paths(query, key, value, mask):
        return (
            kernel.attention_forward(module, query, key, value, None)[0],
            kernel.attention_forward(module, query, key, value, mask)[0],
        )

    compiled = torch.compile(both_paths, fullgraph=True)(query, key, value, mask)
    for out, expected in zip(compiled, both_paths(query, key, value, mask)):
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert kernel.attention_forward.can_torch_compile and kernel.attention_forward.has_backward
