"""transformers' generate-time compile, forced on the CPU, over every kernel of a kernelized model: the path a TPU
takes for a static cache (transformers compiles the decode step with `torch.compile(..., backend="tpu",
dynamic=False)`; here `aot_eager`, fullgraph). No graph break, the tokens of the same model uncompiled, and no
recompilation for a new prompt length inside a bucket (the fixed-shape recipe, forced on as on a TPU)."""

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, CompileConfig, Qwen3MoeConfig

from tpu_kernels import kernelize


def _tiny_qwen3_moe_bf16():
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, max_position_embeddings=256, moe_intermediate_size=64,
                            num_experts=8, num_experts_per_tok=2, intermediate_size=96)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 3:  # expert weights start empty: random, never zero
                parameter.normal_(std=0.1)
    model.generation_config.eos_token_id = None
    return model


def _compile_config() -> CompileConfig:
    config = CompileConfig(backend="aot_eager", dynamic=False, fullgraph=True)
    config._compile_all_devices = True  # transformers compiles only on accelerators unless told
    return config


def _kernelized(builds, **options):
    return kernelize(_tiny_qwen3_moe_bf16(), repos={kind: str(builds[repo]) for kind, repo in (
        ("experts", "ragged-dot-tpu"), ("rmsnorm", "rmsnorm-tpu"), ("attention", "attention-tpu"))}, **options)


@pytest.mark.slow
def test_generate_compiles_the_decode_step_over_every_kernel(kernel_builds):
    torch.compiler.reset()
    model = _kernelized(kernel_builds, fixed_shapes=True)
    assert {e.kind for e in model.tpu_kernels_report.entries if e.replaced} == {"experts", "rmsnorm", "attention"}
    counters.clear()
    graphs = []
    for length in (10, 7):
        prompt = torch.randint(1, 128, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            eager = model.generate(prompt, max_new_tokens=3, do_sample=False, disable_compile=True)
            compiled = model.generate(prompt, max_new_tokens=3, do_sample=False, compile_config=_compile_config())
        assert torch.equal(compiled, eager), length
        graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs == [1, 1]  # one decode graph, compiled once, for every prompt of the bucket


@pytest.mark.slow
def test_quantized_experts_trace_into_one_graph(kernel_builds):
    """int8 experts (one byte per weight, the fused kernel's quantized path) under torch.compile(fullgraph=True,
    dynamic=False): the logits of the uncompiled model."""
    model = _kernelized(kernel_builds, quantize_experts="int8")
    assert model.tpu_kernels_report.quantization.quantized
    prompt = torch.randint(1, 128, (1, 9), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True, dynamic=False, backend="aot_eager")(prompt).logits
        assert torch.equal(compiled, model(prompt).logits)
