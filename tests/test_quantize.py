"""kernelize(quantize_experts=...): quantized expert weights, checked against the model with the weights dequantized.

The quantization error itself (quantized against float weights) is measured,
not asserted, by `python -m benchmarks quantization_accuracy`.
"""

import copy
import json
import types

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Qwen3MoeConfig
from transformers.integrations.finegrained_fp8 import Fp8Quantize

from tpu_kernels import kernelize
from tpu_kernels.integration.kernelize import experts_modules
from tpu_kernels.distribution.loader import get_local_kernel
from tpu_kernels.integration.quantize import quantize_fp8, quantize_int4, quantize_int8

from .test_kernelize import CONFIGS, _experts_only, _prompt, _tiny_model, ragged_dot_build  # noqa: F401 - fixture

WEIGHT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}
# Bits per stored weight: the float32 originals take 32.
WEIGHT_BITS = {"int8": 8, "fp8": 8, "int4": 4}


def _transformers_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own FP8 conversion (what saving a model in fine-grained FP8 runs) of one 2-D weight."""
    convert = Fp8Quantize(types.SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=(128, 128))))
    out = convert.convert({"w.weight": weight})
    return out["w.weight"], out["w.weight_scale_inv"]


def test_fp8_is_transformers_arithmetic_and_int8_rounds_to_nearest():
    weight = torch.randn(3, 256, 384, generator=torch.Generator().manual_seed(0)) * 0.05
    weight[1, :128, :128] = 0.0  # an all-zero block keeps scale 1
    q, scale_inv = quantize_fp8(weight)
    for expert in range(3):
        expected_q, expected_scale_inv = _transformers_fp8(weight[expert])
        assert torch.equal(q[expert].view(torch.uint8), expected_q.view(torch.uint8))
        assert torch.equal(scale_inv[expert], expected_scale_inv)
    # Partial blocks (transformers leaves such weights unquantized): the same rule on the blocks' existing part.
    q, scale_inv = quantize_fp8(weight[:, :200, :130])
    assert scale_inv.shape == (3, 2, 2)
    assert q[:, 128:, 128:].float().abs().amax(dim=(1, 2)).eq(448).all()
    q, scale_inv = quantize_int8(weight, out_axis=1)
    assert q.dtype == torch.int8 and scale_inv.shape == (3, 256)
    error = (q.float() * scale_inv.unsqueeze(2) - weight).abs()
    assert bool((error <= scale_inv.unsqueeze(2) / 2 + 1e-9).all())


def test_int4_rounds_to_nearest_and_packs_as_the_kernel_reads(ragged_dot_build):
    kernel = get_local_kernel(ragged_dot_build, backend="cpu")
    weight = torch.randn(3, 192, 136, generator=torch.Generator().manual_seed(0)) * 0.05
    weight[1, 5] = 0.0  # an all-zero output channel keeps scale 1
    packed, scale_inv = quantize_int4(weight, 1, kernel)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 96, 136) and scale_inv.shape == (3, 192)
    q = kernel.reference.unpack_int4(packed, 136, 2)
    assert int(q.abs().max()) == 7 and scale_inv[1, 5] == 1.0
    scale = scale_inv.unsqueeze(2)
    error = (q.float() * scale - weight).abs()
    # Weights inside the clipped range round to nearest; the clipping (a ratio per channel) beats none.
    inside = weight.abs() <= 7.5 * scale
    assert bool((error[inside] <= scale.expand_as(error)[inside] / 2 + 1e-9).all())
    unclipped = weight.abs().amax(dim=2, keepdim=True) / 7
    plain = (torch.round(weight / unclipped).clamp(-7, 7) * unclipped - weight).square().sum(dim=2)
    assert bool((error.square().sum(dim=2)[[0, 2]] <= plain[[0, 2]] + 1e-12).all())
    assert bool((scale_inv[[0, 2]] < unclipped[[0, 2], :, 0]).any())


def _dequantized_copy(model, quantized, kernel):
    """`model` (float) with each experts module's weights set to `quantized`'s, dequantized: the reference."""
    reference = copy.deepcopy(model)
    modules = dict(quantized.named_modules())
    for name in experts_modules(reference):
        module, source = reference.get_submodule(name), modules[name]
        out_axis = 2 if source.is_transposed else 1
        for projection in ("gate_up_proj", "down_proj"):
            weight = kernel.reference.dequantize_reference(getattr(source, projection),
                                                           getattr(source, f"{projection}_scale_inv"), out_axis=out_axis)
            getattr(module, projection).data = weight.float()
    return reference


def _int4_packable_model(name):
    """The tiny model with I = 64: whole 64-row packed blocks along every packed dim (H = 64 too)."""
    config = CONFIGS[name]()
    setattr(config, "moe_intermediate_size" if name == "qwen3_moe" else "intermediate_size", 64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 3:
                parameter.normal_(std=0.1)
    return model


# The two experts layouts: Qwen3-MoE's (Mixtral's experts are the same to the kernel: [E, 2I, H] weights, a SiLU
# gate, no biases, the same sizes here) and GPT-OSS's (transposed, interleaved, biased, clamped).
@pytest.mark.slow
@pytest.mark.parametrize("scheme,name", [(scheme, name) for scheme in ("int8", "fp8", "int4")
                                         for name in ("qwen3_moe", "gpt_oss")])
def test_quantized_model_equals_its_dequantized_reference(name, scheme, ragged_dot_build):
    model = _int4_packable_model(name) if scheme == "int4" else _tiny_model(name)
    float_bytes = sum(getattr(model.get_submodule(n), p).numel() * 4 for n in experts_modules(model)
                      for p in ("gate_up_proj", "down_proj"))
    original = copy.deepcopy(model)
    kernelize(model, repos=_experts_only(ragged_dot_build), quantize_experts=scheme)
    report = model.tpu_kernels_report.quantization
    assert [m.name for m in report.quantized] == experts_modules(model) and not report.kept
    dtype = WEIGHT_DTYPES[scheme]
    for name_ in experts_modules(model):
        module = model.get_submodule(name_)
        assert module.gate_up_proj.dtype == dtype and module.down_proj.dtype == dtype
    assert report.bytes_before == float_bytes
    weights = report.bytes_after - sum(getattr(model.get_submodule(n), f"{p}_scale_inv").numel() * 4
                                       for n in experts_modules(model) for p in ("gate_up_proj", "down_proj"))
    assert weights * 32 == float_bytes * WEIGHT_BITS[scheme]  # one byte (int4: half) per weight, plus the scales
    assert f"to {scheme}" in repr(model.tpu_kernels_report)

    reference = _dequantized_copy(original, model, get_local_kernel(ragged_dot_build, backend="cpu"))
    prompt = _prompt()
    with torch.no_grad():
        logits, expected = model(prompt).logits, reference(prompt).logits
        tokens = model.generate(prompt, max_new_tokens=2, do_sample=False)  # the prefill's token and a decode step's
        expected_tokens = reference.generate(prompt, max_new_tokens=2, do_sample=False)
    assert (logits - expected).abs().max().item() <= 1e-4
    assert torch.equal(tokens, expected_tokens)


@pytest.mark.parametrize("scheme", ["int8", "fp8", "int4"])
def test_quantized_experts_skip_sentinel_picks(scheme, ragged_dot_build):
    """Expert-parallel router masking: picks with id == num_experts cost nothing and add nothing."""
    model = _int4_packable_model("qwen3_moe") if scheme == "int4" else _tiny_model("qwen3_moe")
    kernelize(model, repos=_experts_only(ragged_dot_build), quantize_experts=scheme)
    experts = model.get_submodule(experts_modules(model)[0])
    kernel = get_local_kernel(ragged_dot_build, backend="cpu")
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 64, generator=generator)
    index = torch.randint(0, experts.num_experts, (6, 2), generator=generator)
    weights = torch.rand(6, 2, generator=generator)
    index[::2, 1] = experts.num_experts  # every other token's second pick is another rank's
    weights[::2, 1] = 0.0
    out = kernel.experts_forward(experts, hidden, index, weights)
    layer = [kernel.reference.dequantize_reference(getattr(experts, p), getattr(experts, f"{p}_scale_inv"), out_axis=1)
             for p in ("gate_up_proj", "down_proj")]
    expected = kernel.reference.gated_experts_reference(hidden, index, weights, *layer, activation="silu",
                                                        weights_transposed=False)
    assert ((out.double() - expected).abs().max() / expected.abs().max()).item() <= 1e-5


def test_shared_experts_and_unserved_gates_stay_float(ragged_dot_build):
    model = _tiny_model("qwen2_moe")
    kernelize(model, repos=_experts_only(ragged_dot_build), quantize_experts="int8")
    layer = model.model.layers[0].mlp
    assert layer.experts.gate_up_proj.dtype == torch.int8
    assert all(p.dtype == torch.float32 for p in layer.shared_expert.parameters())
    relu = _tiny_model("qwen3_moe")
    relu.config.hidden_act = "relu"
    for name in experts_modules(relu):
        relu.get_submodule(name).act_fn = torch.nn.ReLU()
    kernelize(relu, repos=_experts_only(ragged_dot_build), quantize_experts="fp8")
    report = relu.tpu_kernels_report.quantization
    assert not report.quantized and set(report.kept) == set(experts_modules(relu))
    assert "not quantized (2 module(s)): a gate the fused experts op does not compute" in repr(relu.tpu_kernels_report)
    assert relu.get_submodule(experts_modules(relu)[0]).gate_up_proj.dtype == torch.float32


def test_unknown_scheme_is_refused():
    with pytest.raises(ValueError, match="quantize_experts must be None, 'int8', 'fp8' or 'int4'"):
        kernelize(torch.nn.Linear(2, 2), quantize_experts="int2")


def test_int4_weights_that_cannot_pack_stay_float(ragged_dot_build):
    """I = 48: gate_up's 2I = 96 rows are not whole 64-row packed blocks; the report says why."""
    model = _tiny_model("qwen3_moe")
    kernelize(model, repos=_experts_only(ragged_dot_build), quantize_experts="int4")
    report = model.tpu_kernels_report.quantization
    assert not report.quantized and set(report.kept) == set(experts_modules(model))
    assert "gate_up_proj: int4 packs blocks of 64 rows" in repr(model.tpu_kernels_report)
    assert model.get_submodule(experts_modules(model)[0]).gate_up_proj.dtype == torch.float32


def test_int4_is_refused_on_tpu7x_before_the_model_changes(monkeypatch, ragged_dot_build):
    monkeypatch.setenv("TPU_KERNELS_GENERATION", "tpu7x")
    model = _int4_packable_model("qwen3_moe")
    with pytest.raises(ValueError, match=r"int4 expert weights are not served on tpu7x: .*quantize_experts=\"fp8\""):
        kernelize(model, repos=_experts_only(ragged_dot_build), quantize_experts="int4")
    assert model.get_submodule(experts_modules(model)[0]).gate_up_proj.dtype == torch.float32
    assert not hasattr(model, "tpu_kernels_report")


def test_training_with_quantized_experts_is_refused():
    from kernels import Mode

    for mode in (Mode.TRAINING, Mode.TRAINING | Mode.TORCH_COMPILE):
        with pytest.raises(ValueError, match="one-byte expert weights serve inference only"):
            kernelize(torch.nn.Linear(2, 2), mode=mode, quantize_experts="int8")


def test_fp8_checkpoint_dequantized_by_transformers_gets_its_fp8_weights_back(tmp_path, ragged_dot_build):
    """Quantize a tiny Qwen3-MoE's experts with transformers' FP8 conversion, save it as a fine-grained FP8
    checkpoint, load it off GPU (transformers dequantizes to bf16), kernelize with fp8: the checkpoint's bytes."""
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=256, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=64, max_position_embeddings=64, moe_intermediate_size=256,
                            num_experts=4, num_experts_per_tok=2, intermediate_size=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path)
    checkpoint = {}
    for key, tensor in load_file(tmp_path / "model.safetensors").items():
        if ".experts." in key:
            q, scale_inv = _transformers_fp8(tensor)
            checkpoint.update({key: q, key.replace(".weight", ".weight_scale_inv"): scale_inv})
        else:
            checkpoint[key] = tensor
    save_file(checkpoint, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config_json = json.loads((tmp_path / "config.json").read_text())
    config_json["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128],
                                          "activation_scheme": "dynamic",
                                          "modules_to_not_convert": ["lm_head", "embed_tokens", "self_attn", "mlp.gate"]}
    (tmp_path / "config.json").write_text(json.dumps(config_json))

    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.bfloat16  # dequantized on load
    kernelize(model, repos=_experts_only(ragged_dot_build), quantize_experts="fp8")

    def stacked(projections, suffix):
        return torch.stack([torch.cat([checkpoint[f"model.layers.0.mlp.experts.{e}.{p}.{suffix}"] for p in projections])
                            for e in range(4)])

    for projection, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        weight = getattr(experts, projection)
        assert weight.dtype == torch.float8_e4m3fn
        assert torch.equal(weight.view(torch.uint8), stacked(parts, "weight").view(torch.uint8))
        assert torch.equal(getattr(experts, f"{projection}_scale_inv"), stacked(parts, "weight_scale_inv"))
