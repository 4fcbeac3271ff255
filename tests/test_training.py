"""kernelize(model, mode=Mode.TRAINING): a few AdamW steps of tiny models give eager's losses.

Attention (with sinks and sliding windows for GPT-OSS, an explicit padding
mask for Qwen3), RMSNorm and the MoE experts (ragged-dot: GPT-OSS's clamped
SwiGLU with biases, Qwen3-MoE's SiLU gate; the router trains through the
routing weights' gradient) run our kernels forward and backward. Runs eagerly
and under torch.compile(fullgraph=True).
"""

import copy

import pytest
import torch
from kernels import Mode
from transformers import AutoModelForCausalLM, GptOssConfig, Qwen3Config, Qwen3MoeConfig

from tpu_kernels import kernelize

STEPS = 3
TOLERANCE = 1e-4
COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, max_position_embeddings=256)
CONFIGS = {
    # Sinks, a sliding layer (window 8 < 12 tokens) and a full layer, MoE experts with biases.
    "gpt_oss": lambda: GptOssConfig(**COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                    layer_types=["sliding_attention", "full_attention"], sliding_window=8),
    # Dense; q/k norms beside the layer norms.
    "qwen3": lambda: Qwen3Config(**COMMON, intermediate_size=96),
    # MoE in every layer: 6 experts, top-2 of 24 tokens, so some experts get no token in some steps.
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, moe_intermediate_size=40, num_experts=6, num_experts_per_tok=2),
}
# Under torch.compile, where Inductor compiling a whole model is most of the time, one Qwen3-MoE whose first layer
# is dense (Qwen3's MLP) and second MoE stands for both Qwen3 models: our ops get the same calls as in either
# (RMSNorm with the q/k norms, attention with the padding mask, and the experts). GPT-OSS compiles its sliding
# layer alone: sinks, the window, the biased clamped SwiGLU experts (its full layer trains in the eager test).
COMPILED_CONFIGS = {
    "gpt_oss": lambda: GptOssConfig(**{**COMMON, "num_hidden_layers": 1}, intermediate_size=48, num_local_experts=4,
                                    num_experts_per_tok=2, layer_types=["sliding_attention"], sliding_window=8),
    "qwen3_dense_and_moe": lambda: Qwen3MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=40,
                                                  num_experts=6, num_experts_per_tok=2, mlp_only_layers=[0]),
}
MOE = ("gpt_oss", "qwen3_moe", "qwen3_dense_and_moe")


@pytest.fixture(scope="module")
def builds(kernel_builds):
    return {kind: str(kernel_builds[name])
            for kind, name in (("experts", "ragged-dot-tpu"), ("rmsnorm", "rmsnorm-tpu"), ("attention", "attention-tpu"))}


def _model(name, experts_implementation=None, configs=CONFIGS):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(configs[name](), dtype=torch.float32)
    if experts_implementation is not None and name in MOE:
        model.set_experts_implementation(experts_implementation)
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if parameter.dim() == 3 or "sinks" in parameter_name:  # experts and sinks may start empty or zero
                parameter.normal_(std=0.1 if parameter.dim() == 3 else 1.0)
    return model.train()


def _batch(name):
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, 128, (2, 12), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    labels = input_ids.clone()
    if name.startswith("qwen3"):
        # Right padding (fine-tuning batches): the kernel gets transformers' boolean mask.
        attention_mask[1, 9:] = 0
        labels[1, 9:] = -100
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def _losses(model, batch, forward=None):
    forward = model if forward is None else forward
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = forward(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64)


def _kernelized(name, builds, mode, experts_implementation=None, configs=CONFIGS):
    model = kernelize(_model(name, experts_implementation, configs), mode=mode, repos=builds)
    report = model.tpu_kernels_report
    assert report.mode == mode.name.replace("|", " | ")
    replaced = ["experts", "rmsnorm", "attention"] if name in MOE else ["rmsnorm", "attention"]
    assert [e.kind for e in report.entries if e.replaced] == replaced, repr(report)
    assert model.config._attn_implementation.startswith("tpu_kernels_")
    return model


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_training_losses_match_eager(name, builds):
    batch = _batch(name)
    expected = _losses(_model(name), batch)
    model = _kernelized(name, builds, Mode.TRAINING)
    losses = _losses(model, batch)
    assert (losses - expected).abs().max().item() <= TOLERANCE, (losses, expected)
    assert losses[-1] < losses[0]
    if name == "gpt_oss":
        sinks = [p for n, p in model.named_parameters() if n.endswith("sinks")]
        assert len(sinks) == 2  # the sliding layer's and the full layer's
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in sinks)
    if name in MOE:
        # The experts' weights (and GPT-OSS's biases) and the router get gradients from our backward.
        trained = [n for n, p in model.named_parameters()
                   if (".experts." in n or ".router." in n or ".gate." in n) and p.grad is not None
                   and p.grad.abs().sum() > 0]
        expected_names = [n for n, _ in model.named_parameters() if ".experts." in n or ".router." in n or ".gate." in n]
        assert trained == expected_names and any(".experts." in n for n in trained), (trained, expected_names)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COMPILED_CONFIGS))
def test_training_under_torch_compile_fullgraph(name, builds):
    # The eager baseline: transformers' batched_mm experts (its default grouped_mm has data-dependent
    # shapes that fullgraph cannot trace); kernelize replaces them with ours either way.
    batch = _batch(name)
    expected = _losses(_model(name, "batched_mm", COMPILED_CONFIGS), batch)
    model = _kernelized(name, builds, Mode.TRAINING | Mode.TORCH_COMPILE, "batched_mm", COMPILED_CONFIGS)
    if name == "qwen3_dense_and_moe":  # Qwen3's dense layer is there, beside the MoE layer
        assert [hasattr(layer.mlp, "experts") for layer in model.model.layers] == [False, True]
    losses = _losses(model, batch, forward=torch.compile(model, fullgraph=True))
    assert (losses - expected).abs().max().item() <= TOLERANCE, (losses, expected)


def test_attention_dropout_in_training_keeps_the_original(builds):
    model = _model("qwen3")
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    original = copy.copy(model.config._attn_implementation)
    kernelize(model, mode=Mode.TRAINING, repos=builds)
    (entry,) = [e for e in model.tpu_kernels_report.entries if e.kind == "attention"]
    assert not entry.replaced and "attention dropout 0.1" in entry.reason
    assert model.config._attn_implementation == original
