"""experts_forward against transformers' own eager experts of a tiny Qwen3-MoE."""

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

NUM_EXPERTS = 8


def _experts(dtype, hidden_act="silu"):
    config = Qwen3MoeConfig(
        hidden_size=64, moe_intermediate_size=96, num_experts=NUM_EXPERTS, num_experts_per_tok=3, hidden_act=hidden_act
    )
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=0.2)
        experts.down_proj.normal_(std=0.2)
    return experts.to(dtype)


def _routing(tokens, top_k, seed, sentinels=0):
    generator = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator).softmax(-1)
    if sentinels:
        # Expert-parallel sentinels: picks of experts on other ranks, weight 0.
        index.view(-1)[:sentinels] = NUM_EXPERTS
        weights.view(-1)[:sentinels] = 0.0
    return index, weights


@pytest.mark.parametrize("tokens,sentinels", [(1, 0), (13, 0), (13, 5)])
def test_fused_path_matches_eager(kernel, tokens, sentinels):
    experts = _experts(torch.float32)
    assert kernel.experts.fused_path_activation(experts) == "silu"
    hidden = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    index, weights = _routing(tokens, 3, seed=tokens, sentinels=sentinels)
    expected = experts(hidden, index, weights)
    out = kernel.experts_forward(experts, hidden, index, weights)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_composed_path_matches_eager(kernel):
    """A gate the fused path does not know still gives the right answer."""
    experts = _experts(torch.float32, hidden_act="relu")
    assert kernel.experts.fused_path_activation(experts) is None
    hidden = torch.randn(9, 64, generator=torch.Generator().manual_seed(2))
    index, weights = _routing(9, 3, seed=2, sentinels=4)
    experts._is_expert_parallel = True
    torch.testing.assert_close(kernel.experts_forward(experts, hidden, index, weights), experts(hidden, index, weights),
                               rtol=1e-5, atol=1e-5)


def test_bf16_close_to_eager(kernel):
    experts = _experts(torch.bfloat16)
    hidden = torch.randn(11, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    index, weights = _routing(11, 3, seed=4)
    expected = _experts(torch.float32)(hidden.float(), index, weights)
    out = kernel.experts_forward(experts, hidden, index, weights.bfloat16())
    assert out.dtype == torch.bfloat16
    # bf16 weights and activations (8-bit mantissa) against an f32 model: a few % of the output scale.
    assert ((out.float() - expected).abs().max() / expected.abs().max()).item() < 3e-2
