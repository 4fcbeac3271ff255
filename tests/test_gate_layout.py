"""kernelize lays GPT-OSS's interleaved gate/up columns out concatenated; the model computes, saves and loads as
before."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tpu_kernels import kernelize
from tpu_kernels.integration import gate_layout
from tpu_kernels.integration.kernelize import experts_modules

from .test_kernelize import _experts_only, _prompt, _tiny_model, ragged_dot_build  # noqa: F401 (fixture)


@pytest.mark.parametrize("axis", [-1, -2])
def test_the_two_layouts_are_each_others_inverse(axis):
    tensor = torch.randn(3, 6, 10) if axis == -1 else torch.randn(3, 10, 6)
    concatenated = gate_layout._concatenated(tensor, axis)
    gate, up = concatenated.chunk(2, dim=axis)
    assert torch.equal(gate, tensor.index_select(axis, torch.arange(0, 10, 2)))
    assert torch.equal(up, tensor.index_select(axis, torch.arange(1, 10, 2)))
    assert torch.equal(gate_layout._interleaved(concatenated, axis), tensor)


@pytest.fixture
def kernelized(ragged_dot_build):  # noqa: F811
    """(eager GPT-OSS, its state_dict and logits before kernelize, the kernelized model)."""
    model = _tiny_model("gpt_oss")
    with torch.no_grad():
        before = {name: value.clone() for name, value in model.state_dict().items()}
        eager_logits = model(_prompt()).logits
    parameters = {name: parameter for name, parameter in model.named_parameters()}
    kernelize(model, repos=_experts_only(ragged_dot_build))
    assert all(parameter is parameters[name] for name, parameter in model.named_parameters())
    return before, eager_logits, model


def test_kernelize_concatenates_and_state_dict_keeps_the_checkpoints_layout(kernelized):
    before, eager_logits, model = kernelized
    names = experts_modules(model)
    assert model.tpu_kernels_report.concatenated_gate_up == names and len(names) == 2
    assert "laid out concatenated in 2 module(s)" in repr(model.tpu_kernels_report)
    experts = dict(model.named_modules())[names[0]]
    assert experts.is_concatenated
    stored = dict(model.named_parameters())[f"{names[0]}.gate_up_proj"]
    original = before[f"{names[0]}.gate_up_proj"]
    assert torch.equal(stored[..., : stored.shape[-1] // 2], original[..., 0::2])  # gate columns first
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], before[name]) for name in before)
    with torch.no_grad():
        assert (model(_prompt()).logits - eager_logits).abs().max().item() <= 1e-4


def test_loading_a_checkpoint_state_dict_lays_it_out_again(kernelized):
    before, eager_logits, model = kernelized
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    model.load_state_dict(before)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    with torch.no_grad():
        assert (model(_prompt()).logits - eager_logits).abs().max().item() <= 1e-4


def test_save_pretrained_writes_a_checkpoint_transformers_loads_as_before(kernelized, tmp_path):
    _, eager_logits, model = kernelized
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (reloaded(_prompt()).logits - eager_logits).abs().max().item() <= 1e-5


def test_transformers_own_implementations_still_compute_the_layer(kernelized):
    """After kernelize the module's own gate reads the concatenated columns: eager and grouped_mm agree."""
    _, eager_logits, model = kernelized
    for implementation in ("eager", "grouped_mm"):
        model.set_experts_implementation(implementation)
        with torch.no_grad():
            assert (model(_prompt()).logits - eager_logits).abs().max().item() <= 1e-4, implementation


def test_quantized_experts_keep_the_checkpoints_layout(ragged_dot_build):  # noqa: F811
    model = _tiny_model("gpt_oss")
    kernelize(model, repos=_experts_only(ragged_dot_build), quantize_experts="int8")
    report = model.tpu_kernels_report
    assert report.concatenated_gate_up == []
    assert set(report.interleaved_gate_up.values()) == {"quantized weights keep the checkpoint's layout"}
    assert not any(dict(model.named_modules())[name].is_concatenated for name in experts_modules(model))


def test_layouts_it_cannot_permute_are_named(ragged_dot_build):  # noqa: F811
    model = _tiny_model("gpt_oss")
    experts = dict(model.named_modules())[experts_modules(model)[0]]
    with torch.no_grad():
        experts.gate_up_proj_bias = torch.nn.Parameter(experts.gate_up_proj_bias[:, :-1].clone())
    assert gate_layout.why_kept_interleaved(experts) == "gate_up_proj_bias has an odd number of gate/up columns"
