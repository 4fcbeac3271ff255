"""The `kernels` layers on tiny transformers models, and the probe for undecorated norms."""

import types
from pathlib import Path

import jax
import pytest
import torch
from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping
from transformers import Gemma3ForCausalLM, Qwen3_5ForCausalLM, Qwen3MoeForCausalLM
from transformers.models.falcon_mamba.modeling_falcon_mamba import FalconMambaWeightlessRMSNorm
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.llama4.modeling_llama4 import Llama4TextRMSNorm
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm, Qwen3NextRMSNormGated
from transformers.models.t5.modeling_t5 import T5LayerNorm

from tpu_kernels.testing import tiny_transformers_model

LAYER_NAMES = ("RMSNorm", "RMSNormZeroCentered")
# What these tests' models change of tiny_transformers_model's sizes.
SMALL_MODEL = dict(vocab_size=128, intermediate_size=96, head_dim=16)

TINY_MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)


def layer_mapping(kernel) -> dict:
    # The variant folder the fixture's module was imported from: kernels then returns that same module.
    variant = Path(kernel.__file__).parent
    return {name: {"cpu": LocalLayerRepository(repo_path=variant, layer_name=name)} for name in LAYER_NAMES}


def tiny_model(model_class, **config):
    model = tiny_transformers_model(model_class, seed=0, **SMALL_MODEL | config)
    with torch.no_grad():
        # Norm weights start at 1 (or 0 when zero-centred): randomise them so the weight path is tested.
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_()
    return model


def token_ids():
    return torch.randint(0, SMALL_MODEL["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1))


def modules_running(model, layer) -> list[str]:
    return [
        name for name, module in model.named_modules() if getattr(module.forward, "__func__", None) is layer.forward
    ]


def relative_error(actual, expected) -> float:
    return float((actual - expected).detach().abs().max() / expected.detach().abs().max())


def test_kernelize_swaps_every_norm_of_a_tiny_qwen3_moe_for_inference(kernel):
    model = tiny_model(Qwen3MoeForCausalLM, **TINY_MOE).eval()
    with torch.no_grad():
        eager = model(token_ids()).logits
    with use_kernel_mapping(layer_mapping(kernel)):
        kernelize(model, mode=Mode.INFERENCE, device="cpu")
    # Per layer: input, post-attention, q and k norms; plus the final norm.
    assert len(modules_running(model, kernel.layers.RMSNorm)) == 2 * 4 + 1
    with torch.no_grad():
        assert relative_error(model(token_ids()).logits, eager) <= 1e-5


def test_kernelize_for_training_gives_the_eager_gradients(kernel):
    model = tiny_model(Qwen3MoeForCausalLM, num_hidden_layers=1, **TINY_MOE)
    ids = token_ids()

    def loss_and_gradients():
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    eager_loss, eager_grads = loss_and_gradients()
    with use_kernel_mapping(layer_mapping(kernel)):
        kernelize(model, mode=Mode.TRAINING, device="cpu")
    assert len(modules_running(model, kernel.layers.RMSNorm)) == 4 + 1
    loss, grads = loss_and_gradients()
    assert relative_error(loss, eager_loss) <= 1e-5
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        assert relative_error(grad, eager_grads[name]) <= 1e-4, name


def test_kernelize_swaps_the_zero_centred_norms_of_a_tiny_qwen3_5(kernel):
    model = tiny_model(
        Qwen3_5ForCausalLM,
        layer_types=["full_attention", "linear_attention"],
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    ).eval()
    with torch.no_grad():
        eager = model(token_ids()).logits
    with use_kernel_mapping(layer_mapping(kernel)):
        kernelize(model, mode=Mode.INFERENCE, device="cpu")
    # Both layers' input and post-attention norms, the attention layer's q and k norms, the final norm.
    assert len(modules_running(model, kernel.layers.RMSNormZeroCentered)) == 2 * 2 + 2 + 1
    with torch.no_grad():
        assert relative_error(model(token_ids()).logits, eager) <= 1e-5


def bind_matching_layers(model, kernel) -> None:
    """What a kernelize for undecorated norms does: probe each module, swap the matching layer's forward."""
    for module in model.modules():
        layer_name = kernel.layers.matching_layer_name(module)
        if layer_name is not None:
            module.forward = types.MethodType(getattr(kernel.layers, layer_name).forward, module)


def test_probed_layers_replace_the_undecorated_norms_of_a_tiny_gemma3_compiling_once_per_token_bucket(kernel):
    """Gemma 3's norms are not decorated for `kernels`: the probe picks the zero-centred layer for each. Its q and k
    norms run on their transposed view [B, heads, tokens, D] (one key head here): prompts of 3 to 8 tokens at batch
    2 share every norm's bucket, so after the first no prompt compiles a program; the logits are eager's."""
    model = tiny_model(Gemma3ForCausalLM, num_hidden_layers=1, num_key_value_heads=1).eval()
    prompts = torch.randint(0, SMALL_MODEL["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(2))
    lengths = (3, 5, 8)
    with torch.no_grad():
        eager = [model(prompts[:, :length]).logits for length in lengths]
    # What a kernelize for undecorated norms does: probe each module, swap the matching layer's forward.
    for module in model.modules():
        layer_name = kernel.layers.matching_layer_name(module)
        if layer_name is not None:
            module.forward = types.MethodType(getattr(kernel.layers, layer_name).forward, module)
    # The input, post-attention, pre- and post-feedforward norms, the q and k norms, the final norm.
    assert len(modules_running(model, kernel.layers.RMSNormZeroCentered)) == 4 + 2 + 1
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration"
        else None)
    for length, expected in zip(lengths, eager):
        compiled_before = len(compiles)
        with torch.no_grad():
            assert relative_error(model(prompts[:, :length]).logits, expected) <= 1e-5, length
        assert length == lengths[0] or len(compiles) == compiled_before, length


@pytest.mark.parametrize(
    ("make_module", "expected"),
    [
        (lambda: LlamaRMSNorm(48, eps=1e-5), "RMSNorm"),
        (lambda: Qwen3MoeRMSNorm(48), "RMSNorm"),
        (lambda: T5LayerNorm(48), "RMSNorm"),
        (lambda: Llama4TextRMSNorm(48), "RMSNorm"),
        (lambda: Gemma3nRMSNorm(48), "RMSNorm"),
        (lambda: torch.nn.RMSNorm(48, eps=1e-5), "RMSNorm"),
        (lambda: GemmaRMSNorm(48), "RMSNormZeroCentered"),
        (lambda: Gemma3RMSNorm(48), "RMSNormZeroCentered"),
        (lambda: Qwen3NextRMSNorm(48), "RMSNormZeroCentered"),
        (lambda: Qwen3_5RMSNorm(48), "RMSNormZeroCentered"),
        (lambda: Gemma3nRMSNorm(48, with_scale=False), None),  # no weight
        (lambda: FalconMambaWeightlessRMSNorm(48), None),  # has a weight, ignores it
        (lambda: Qwen3NextRMSNormGated(48), None),  # needs a gate
        (lambda: torch.nn.RMSNorm(48), None),  # eps=None: torch picks the dtype's epsilon
        (lambda: torch.nn.LayerNorm(48), None),  # subtracts the mean
        (lambda: torch.nn.Linear(48, 48), None),
    ],
)
def test_matching_layer_name_tells_which_layer_reproduces_a_module(kernel, make_module, expected):
    module = make_module()
    before = {name: t.clone() for name, t in module.state_dict().items()}
    assert kernel.layers.matching_layer_name(module) == expected
    assert all(torch.equal(before[name], t) for name, t in module.state_dict().items())


class NormIgnoringItsEpsilon(LlamaRMSNorm):
    def forward(self, hidden_states):
        variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + 1e-2))


def test_the_probe_checks_the_epsilon_the_module_really_uses(kernel):
    module = LlamaRMSNorm(48, eps=1e-5)
    module.variance_epsilon = 1e-2  # as a config would set it: the probe reads the live value
    assert kernel.layers.matching_layer_name(module) == "RMSNorm"
    assert kernel.layers.matching_layer_name(NormIgnoringItsEpsilon(48, eps=1e-6)) is None


def test_rms_norm_layer_keeps_the_llama_output_dtype(kernel):
    module = LlamaRMSNorm(64)
    with torch.no_grad():
        module.weight.normal_()
    x = torch.randn(5, 64).bfloat16()
    expected = module(x)  # bf16 activations times an f32 weight: f32, as in Llama
    module.forward = types.MethodType(kernel.layers.RMSNorm.forward, module)
    actual = module(x)
    assert actual.dtype == expected.dtype == torch.float32
    assert relative_error(actual, expected) <= 1e-2
