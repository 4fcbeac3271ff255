"""experts_forward against transformers' own eager experts of a tiny Qwen3-MoE."""

import pytest
import torch
from transformers import GptOssConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
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
    assert kernel.fused_gate(experts) == dict(activation="silu", interleaved=False)
    hidden = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    index, weights = _routing(tokens, 3, seed=tokens, sentinels=sentinels)
    expected = experts(hidden, index, weights)
    out = kernel.experts_forward(experts, hidden, index, weights)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_composed_path_matches_eager(kernel):
    """A gate the fused path does not know still gives the right answer."""
    experts = _experts(torch.float32, hidden_act="relu")
    assert kernel.fused_gate(experts) is None
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


def _gpt_oss_experts():
    config = GptOssConfig(hidden_size=64, intermediate_size=48, num_local_experts=NUM_EXPERTS, num_experts_per_tok=3)
    config._experts_implementation = "eager"
    torch.manual_seed(1)
    experts = GptOssExperts(config)
    with torch.no_grad():
        for parameter in experts.parameters():
            parameter.normal_(std=0.5)  # large enough that the clamp at `limit` is exercised
    return experts


@pytest.mark.slow
@pytest.mark.parametrize("sentinels", [0, 4])
def test_gpt_oss_fused_path_matches_eager(kernel, sentinels):
    """Transposed weights, biases, interleaved gate with GPT-OSS's own clamped SwiGLU."""
    experts = _gpt_oss_experts()
    gate = kernel.fused_gate(experts)
    assert gate == dict(activation="clamped_swiglu", interleaved=True, alpha=experts.alpha, limit=experts.limit)
    hidden = torch.randn(10, 64, generator=torch.Generator().manual_seed(5)) * 4
    index, weights = _routing(10, 3, seed=5, sentinels=sentinels)
    with torch.no_grad():
        gate_up = hidden @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert gate_up.abs().max() > experts.limit, "inputs must reach the clamp"
    eager_index = index.clamp(max=NUM_EXPERTS - 1)  # GPT-OSS's eager forward has no sentinel class
    eager_weights = weights.masked_fill(index == NUM_EXPERTS, 0.0)
    with torch.no_grad():
        expected = experts(hidden, eager_index, eager_weights)
        out = kernel.experts_forward(experts, hidden, index, weights)
        composed = kernel.experts.composed_experts_forward(experts, hidden, index, weights)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(composed, expected, rtol=1e-5, atol=1e-4)


def test_fused_op_refuses_unknown_gate_and_half_biases(kernel):
    experts = _experts(torch.float32)
    args = (torch.randn(2, 64), torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 3), experts.gate_up_proj,
            experts.down_proj)
    with pytest.raises(ValueError, match="activation must be one of"):
        kernel.gated_experts(*args, activation="relu", weights_transposed=False)
    with pytest.raises(ValueError, match="both gate_up_bias and down_bias"):
        kernel.gated_experts(*args, torch.zeros(NUM_EXPERTS, 192), activation="silu", weights_transposed=False)


def test_fused_op_refuses_misshapen_weights_and_routing(kernel):
    experts = _experts(torch.float32)
    hidden, index, weights = torch.randn(2, 64), torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 3)
    gate_up, down = experts.gate_up_proj, experts.down_proj
    calls = [
        (dict(gate_up_proj=gate_up[:, :, :32]), ValueError, r"expected gate_up_proj \[E, 2I, H\] and down_proj"),
        (dict(down_proj=down[:4]), ValueError, "expected gate_up_proj"),
        (dict(down_proj=down.bfloat16()), TypeError, "must share one dtype"),
        (dict(gate_up_bias=torch.zeros(NUM_EXPERTS, 5), down_bias=torch.zeros(NUM_EXPERTS, 64)), ValueError,
         r"gate_up_bias must be \[8, 192\]"),
        (dict(top_k_index=index.float()), TypeError, "top_k_index must have an integer dtype"),
        (dict(top_k_weights=weights[:, :2]), ValueError, "top_k_weights must have top_k_index's shape"),
        (dict(hidden_states=hidden[None]), ValueError, "hidden_states must be 2-D"),
        (dict(hidden_states=hidden.bfloat16()), TypeError, "hidden_states dtype torch.bfloat16 must match"),
    ]
    for change, error, match in calls:
        args = dict(hidden_states=hidden, top_k_index=index, top_k_weights=weights, gate_up_proj=gate_up,
                    down_proj=down)
        args.update(change)
        with pytest.raises(error, match=match):
            kernel.gated_experts(**args, activation="silu", weights_transposed=False)


@pytest.mark.parametrize("hidden_act", ["silu", "relu"])
def test_experts_forward_checks_the_routing_on_both_paths(kernel, hidden_act):
    experts = _experts(torch.float32, hidden_act=hidden_act)
    hidden = torch.randn(4, 64)
    index, weights = _routing(4, 3, seed=6)
    with pytest.raises(TypeError, match="top_k_index must have an integer dtype"):
        kernel.experts_forward(experts, hidden, index.float(), weights)
    with pytest.raises(ValueError, match="top_k_index must be"):
        kernel.experts_forward(experts, hidden, index[:3], weights[:3])


def test_composed_path_reads_no_group_sizes_back(kernel, monkeypatch):
    """The composed path counts its own group sizes: ragged_dot's host-side value check is not run per call."""
    experts = _experts(torch.float32, hidden_act="relu")
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(7))
    index, weights = _routing(5, 3, seed=7)

    def refuse(*args):
        raise AssertionError("group sizes read back inside an experts layer")

    monkeypatch.setattr(kernel.ops, "check_group_sizes", refuse)
    torch.testing.assert_close(kernel.experts_forward(experts, hidden, index, weights), experts(hidden, index, weights),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError, match="read back"):
        kernel.ragged_dot(hidden, torch.randn(2, 64, 32), torch.tensor([5, 0], dtype=torch.int32))



def _padding_case(kernel, monkeypatch, tokens, hidden_act):
    """The experts, inputs and an output gradient; the unpadded call of the op experts_forward runs; and the token
    counts that op is handed once experts_forward runs, recorded."""
    experts = _experts(torch.float32, hidden_act=hidden_act)
    generator = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, 64, generator=generator)
    index, weights = _routing(tokens, 3, seed=tokens)
    d_out = torch.randn(tokens, 64, generator=generator)

    def unpadded_call(hidden, weights):
        if hidden_act == "relu":
            return kernel.experts.composed_experts_forward(experts, hidden, index, weights)
        return kernel.gated_experts(hidden, index, weights, experts.gate_up_proj, experts.down_proj,
                                    activation="silu", weights_transposed=False)

    seen_rows = []
    op_name = "routed_ragged_dot" if hidden_act == "relu" else "gated_experts"
    op = getattr(kernel.ops, op_name)
    return experts, (hidden, index, weights, d_out), unpadded_call, seen_rows, lambda: monkeypatch.setattr(
        kernel.ops, op_name, lambda rows, *args, **kw: seen_rows.append(rows.shape[0]) or op(rows, *args, **kw))


@pytest.mark.parametrize("tokens,bucket,hidden_act", [(1, 16, "silu"), (17, 32, "relu")], ids=["fused", "composed"])
def test_experts_forward_pads_tokens_to_their_bucket_and_keeps_the_result(kernel, monkeypatch, tokens, bucket,
                                                                          hidden_act):
    """The op sees T padded to its bucket (zero rows picking the sentinel); the result is the unpadded call's."""
    experts, (hidden, index, weights, _), unpadded_call, seen_rows, record = _padding_case(
        kernel, monkeypatch, tokens, hidden_act)
    with torch.no_grad():
        expected = unpadded_call(hidden, weights)
        record()
        out = kernel.experts_forward(experts, hidden, index, weights)
    assert set(seen_rows) == {bucket * 3 if hidden_act == "relu" else bucket}
    assert out.shape == (tokens, 64)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("hidden_act", ["silu", "relu"], ids=["fused", "composed"])
def test_padded_experts_forward_gradients_are_the_unpadded_ones(kernel, monkeypatch, hidden_act):
    """Padded rows get a zero cotangent: every gradient is the unpadded call's (one past a bucket edge)."""
    experts, (hidden, index, weights, d_out), unpadded_call, seen_rows, record = _padding_case(
        kernel, monkeypatch, 17, hidden_act)

    def gradients(call):
        leaves = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        call(*leaves).backward(d_out)
        grads = [leaf.grad for leaf in leaves] + [p.grad.clone() for p in experts.parameters()]
        experts.zero_grad()
        return grads

    expected = gradients(unpadded_call)
    record()
    grads = gradients(lambda hidden, weights: kernel.experts_forward(experts, hidden, index, weights))
    assert set(seen_rows) == {32 * 3 if hidden_act == "relu" else 32}
    for grad, expected_grad in zip(grads, expected):
        # The padded call may tile its grouped matmuls differently: float32 sums in another order.
        torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-5)
