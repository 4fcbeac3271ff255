"""kernelize(model) on tiny transformers MoE models built from config: same logits, same tokens."""

import logging

import jax
import pytest
import torch
from kernels import Mode
import transformers
from transformers import AutoModelForCausalLM, GptOssConfig, MixtralConfig, Qwen3MoeConfig

from tpu_kernels import kernelize
from tpu_kernels.distribution.builder import build_kernel_repo
from tpu_kernels.integration.attention import attention_modules, flash_route_refusal, head_dims_refusal
from tpu_kernels.integration.kernelize import KernelSpec, experts_modules

from .conftest import REPO_ROOT
from .loader_support import TRUSTED, publish

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, max_position_embeddings=256)
CONFIGS = {
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                        intermediate_size=96, decoder_sparse_step=1),
    "mixtral": lambda: MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2),
    "gpt_oss": lambda: GptOssConfig(**COMMON, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                                    layer_types=["sliding_attention", "full_attention"], sliding_window=8),
}


SMALL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)
# More layouts, checked on one forward: shared experts beside the routed ones
# (Qwen2-MoE, DeepSeek-V3), non-gated experts in a hybrid model (Nemotron-H),
# and Gemma 4's MoE block.
MORE_CONFIGS = {
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **SMALL, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
        intermediate_size=96),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **SMALL, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=0, intermediate_size=96, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1),
    "nemotron_h": lambda: transformers.NemotronHConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, hybrid_override_pattern="*E", num_attention_heads=4,
        num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, head_dim=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=1,
        ssm_state_size=16),
    "gemma4": lambda: transformers.Gemma4TextConfig(
        **SMALL, intermediate_size=96, enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
        head_dim=64, global_head_dim=64),
}


@pytest.fixture(scope="module")
def ragged_dot_build(tmp_path_factory):
    return build_kernel_repo(REPO_ROOT / "kernel_repos" / "ragged-dot-tpu", tmp_path_factory.mktemp("build"))


@pytest.fixture(scope="module")
def all_builds(tmp_path_factory, ragged_dot_build):
    out = tmp_path_factory.mktemp("all")
    return {
        "experts": str(ragged_dot_build),
        "rmsnorm": str(build_kernel_repo(REPO_ROOT / "kernel_repos" / "rmsnorm-tpu", out)),
        "attention": str(build_kernel_repo(REPO_ROOT / "kernel_repos" / "attention-tpu", out)),
    }


def _experts_only(build):
    return {"experts": str(build), "rmsnorm": None, "attention": None}


def _tiny_model(name, dtype=torch.float32):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config({**CONFIGS, **MORE_CONFIGS}[name](), dtype=dtype).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 3:  # expert weights start empty in some models: make them random, never zero
                parameter.normal_(std=0.1)
    return model


def _prompt(batch=2, length=5):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(7))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_greedy_tokens_match_eager(name, ragged_dot_build):
    model = _tiny_model(name)
    prompt = _prompt()
    # Without a cache every step has a new token count, so a new kernel
    # compilation: one model covers that path, for fewer steps, to keep CI time in check.
    use_cache_options = (True, False) if name == "qwen3_moe" else (True,)
    new_tokens = {True: 16, False: 6}
    with torch.no_grad():
        eager_logits = model(prompt).logits
        eager_tokens = [model.generate(prompt, max_new_tokens=new_tokens[c], do_sample=False, use_cache=c)
                        for c in use_cache_options]
    kernelize(model, repos=_experts_only(ragged_dot_build))
    report = model.tpu_kernels_report
    assert [e.modules for e in report.replaced("experts")] == [tuple(experts_modules(model))]
    assert len(experts_modules(model)) == 2
    with torch.no_grad():
        logits = model(prompt).logits
        tokens = [model.generate(prompt, max_new_tokens=new_tokens[c], do_sample=False, use_cache=c)
                  for c in use_cache_options]
    assert (logits - eager_logits).abs().max().item() <= 1e-4
    for ours, eager, c in zip(tokens, eager_tokens, use_cache_options):
        assert ours.shape[1] == prompt.shape[1] + new_tokens[c]
        assert torch.equal(ours, eager)


@pytest.mark.parametrize("name", sorted(MORE_CONFIGS))
def test_more_experts_layouts_match_eager(name, ragged_dot_build):
    model = _tiny_model(name)
    prompt = _prompt()
    with torch.no_grad():
        eager_logits = model(prompt).logits
        kernelize(model, repos=_experts_only(ragged_dot_build))
        logits = model(prompt).logits
    assert model.tpu_kernels_report.replaced("experts")[0].modules == tuple(experts_modules(model))
    assert (logits - eager_logits).abs().max().item() <= 1e-4


def test_bf16_logits_close_to_eager(ragged_dot_build):
    model = _tiny_model("qwen3_moe", torch.bfloat16)
    prompt = _prompt()
    with torch.no_grad():
        eager = model(prompt).logits.float()
        kernelize(model, repos=_experts_only(ragged_dot_build))
        ours = model(prompt).logits.float()
    # bf16 has an 8-bit mantissa: eager rounds the gate and each matmul output to
    # bf16, the fused path keeps them in f32, so ~1e-2 of the logit scale apart.
    assert ((ours - eager).abs().max() / eager.abs().max()).item() <= 5e-2


@pytest.mark.slow
def test_torch_compile_fullgraph(ragged_dot_build):
    model = _tiny_model("qwen3_moe")
    prompt = _prompt(batch=1, length=4)
    with torch.no_grad():
        eager = model(prompt).logits
        kernelize(model, mode=Mode.INFERENCE | Mode.TORCH_COMPILE, repos=_experts_only(ragged_dot_build))
        compiled = torch.compile(model, fullgraph=True)
        logits = compiled(prompt).logits
    assert (logits - eager).abs().max().item() <= 1e-4


def test_training_mode_replaces_experts(ragged_dot_build):
    model = _tiny_model("qwen3_moe")
    kernelize(model, mode=Mode.TRAINING, repos=_experts_only(ragged_dot_build))
    (entry,) = [e for e in model.tpu_kernels_report.entries if e.kind == "experts"]
    assert entry.replaced and len(entry.modules) == 2
    assert "experts   replaced by" in repr(model.tpu_kernels_report)


def test_training_mode_keeps_original_or_raises(ragged_dot_build, monkeypatch):
    """A kernel that declares no backward keeps the original experts in TRAINING (or raises)."""
    from tpu_kernels.distribution.loader import get_local_kernel

    kernel = get_local_kernel(ragged_dot_build, backend="cpu")
    monkeypatch.setattr(kernel.experts_forward, "has_backward", False)
    model = _tiny_model("qwen3_moe")
    original = model.config._experts_implementation
    kernelize(model, mode=Mode.TRAINING, repos=_experts_only(ragged_dot_build))
    (entry,) = [e for e in model.tpu_kernels_report.entries if e.kind == "experts"]
    assert not entry.replaced and "backward" in entry.reason
    assert model.config._experts_implementation == original
    with pytest.raises(RuntimeError, match="no backward"):
        kernelize(model, mode=Mode.TRAINING, repos=_experts_only(ragged_dot_build), use_fallback=False)


def _eager_then_kernelized(model, builds) -> tuple[torch.Tensor, ...]:
    """(eager logits, eager greedy tokens, the same after `kernelize(model, repos=builds)`) on `_prompt()`."""
    prompt = _prompt()
    with torch.no_grad():
        eager_logits = model(prompt).logits
        eager_tokens = model.generate(prompt, max_new_tokens=8, do_sample=False)
        kernelize(model, repos=builds)
        return eager_logits, eager_tokens, model(prompt).logits, model.generate(prompt, max_new_tokens=8,
                                                                                do_sample=False)


@pytest.mark.slow
def test_all_kinds_replaced_and_tokens_match(all_builds):
    model = _tiny_model("qwen3_moe")
    eager_logits, eager_tokens, logits, tokens = _eager_then_kernelized(model, all_builds)
    report = model.tpu_kernels_report
    assert {e.kind for e in report.entries if e.replaced} == {"experts", "rmsnorm", "attention"}, repr(report)
    # q/k norms and the layer norms: 2 layers x (input, post-attention, q, k) + the final norm.
    assert len(report.replaced("rmsnorm")[0].modules) == 9
    modules = dict(model.named_modules())
    for name in report.replaced("rmsnorm")[0].modules:
        forward = modules[name].forward.__func__
        assert forward.__qualname__ == "RMSNorm.forward" and forward.__module__.startswith("_rmsnorm_tpu_cpu_")
    assert (logits - eager_logits).abs().max().item() <= 1e-4
    assert torch.equal(tokens, eager_tokens)


class _BackendCompiles:
    """jax's backend compiles (XLA programs, the Mosaic kernels inside them on a TPU) counted while `counting`."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count, self.counting = 0, False
        jax.monitoring.register_event_duration_secs_listener(self._record)

    def _record(self, event, duration_secs, **kwargs):
        self.count += self.counting and event == self.EVENT

    def during(self, run):
        before, self.counting = self.count, True
        try:
            result = run()
        finally:
            self.counting = False
        return result, self.count - before


@pytest.mark.slow
def test_generate_compiles_once_per_bucket_with_either_cache(all_builds):
    """Prompt lengths and numbers of new tokens within one bucket compile nothing after a first generate per cache
    kind; the tokens are eager's. Prompts of 5 to 8 tokens share every bucket: rows of 16 for the experts and the
    layer norms, 32 and 16 for the q and k norms (4 and 2 heads), queries of 16 against 128 keys."""
    model = _tiny_model("qwen3_moe")
    compiles = _BackendCompiles()
    runs = {"warm-up dynamic": (5, 3, None), "warm-up static": (5, 3, "static"), "dynamic": (7, 16, None),
            "static": (8, 16, "static")}

    def generate(length, new_tokens, cache):
        options = {} if cache is None else dict(cache_implementation=cache)
        with torch.no_grad():
            return model.generate(_prompt(batch=1, length=length), max_new_tokens=new_tokens, do_sample=False,
                                  **options)

    eager = {name: generate(*run) for name, run in runs.items()}
    kernelize(model, repos=all_builds)
    counted = {}
    for name, run in runs.items():
        tokens, counted[name] = compiles.during(lambda: generate(*run))
        assert torch.equal(tokens, eager[name]), name
    assert counted["warm-up dynamic"] > 0 and counted["warm-up static"] >= 0
    assert (counted["dynamic"], counted["static"]) == (0, 0), counted


@pytest.mark.slow
def test_gemma4_attention_replaced_in_every_layer_and_tokens_match(all_builds):
    """Gemma 4's MoE model: a sliding layer (head_dim 64, window 4) and a global one (head_dim 512, one KV head,
    values from the key projection, attention_k_eq_v) both run the attention kernel; greedy tokens as eager."""
    torch.manual_seed(0)
    config = transformers.Gemma4TextConfig(
        **SMALL, intermediate_size=96, enable_moe_block=True, num_experts=8,
        top_k_experts=2, moe_intermediate_size=32, head_dim=64, global_head_dim=512, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    model = _model_of(config)
    attention = {name: m for name, m in model.named_modules() if name.endswith("self_attn")}
    assert [m.head_dim for m in attention.values()] == [64, 512]
    assert all(m.v_proj is None for m in attention.values() if m.head_dim == 512)
    eager_logits, eager_tokens, logits, tokens = _eager_then_kernelized(model, all_builds)
    (entry,) = model.tpu_kernels_report.replaced("attention")
    assert entry.modules == tuple(attention), repr(model.tpu_kernels_report)
    assert model.config._attn_implementation.startswith("tpu_kernels_")
    assert (logits - eager_logits).abs().max().item() <= 1e-4
    assert torch.equal(tokens, eager_tokens)


def test_norms_alone_go_through_kernels_kernelize(all_builds, caplog):
    """The model's other labelled layers (SiLU, rotary_pos_emb) are not kernels' business here: no warning that
    they have no mapping, and a forward set on one of them (as a parallel plan's wrapper is) stays."""
    model = _tiny_model("qwen3_moe")
    others = [m for m in model.modules() if getattr(type(m), "kernel_layer_name", "RMSNorm") != "RMSNorm"]
    assert others
    wrappers = {}
    for module in others:
        wrappers[module] = module.forward = lambda *args, _forward=module.forward, **kwargs: _forward(*args, **kwargs)
    with caplog.at_level(logging.INFO, logger="kernels"):
        kernelize(model, repos={**all_builds, "experts": None, "attention": None})
    assert len(model.tpu_kernels_report.replaced("rmsnorm")[0].modules) == 9
    assert "No kernel mapping found" not in caplog.text
    assert all(module.forward is wrapper for module, wrapper in wrappers.items())


def _model_of(config):
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 3:  # expert weights start empty in some models: make them random, never zero
                parameter.normal_(std=0.1)
    return model


def _configs_in(model) -> set[int]:
    return {id(value) for module in model.modules() for value in vars(module).values()
            if isinstance(value, transformers.PretrainedConfig)}


def test_kernelize_changes_only_the_model_it_is_given(all_builds):
    """Two models of one config object: kernelizing one leaves the other, the config and later models eager."""
    config = CONFIGS["qwen3_moe"]()
    torch.manual_seed(0)
    model, other = _model_of(config), _model_of(config)
    implementations = (config._experts_implementation, config._attn_implementation)
    assert model.config is other.config is config
    prompt = _prompt()
    with torch.no_grad():
        other_eager = other(prompt).logits
        model_eager = model(prompt).logits
        kernelize(model, repos=all_builds)
        other_after, model_after = other(prompt).logits, model(prompt).logits
    later = _model_of(config)
    # Eager twice on the same inputs: bit for bit; our kernels would round differently.
    assert torch.equal(other_after, other_eager)
    assert (config._experts_implementation, config._attn_implementation) == implementations
    for eager_model in (other, later):
        assert _configs_in(eager_model) == {id(config)}
    report = model.tpu_kernels_report
    assert {e.kind for e in report.entries if e.replaced} == {"experts", "rmsnorm", "attention"}, repr(report)
    assert model.config is not config and id(config) not in _configs_in(model)
    assert model.config._experts_implementation.startswith("tpu_kernels_")
    assert model.config._attn_implementation.startswith("tpu_kernels_")
    assert (model_after - model_eager).abs().max().item() <= 1e-4
    assert report.own_config and "config    the model's own copy" in repr(report)


def test_zero_centred_norms_of_gemma(all_builds):
    """Gemma's norms are not decorated for kernels and compute (1 + weight) * norm(x)."""
    torch.manual_seed(0)
    config = transformers.GemmaConfig(**SMALL, head_dim=64, intermediate_size=96)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(std=0.5)  # zero-initialised norm weights would hide the offset
        eager = model(_prompt()).logits
        kernelize(model, repos={**all_builds, "experts": None, "attention": None})
        ours = model(_prompt()).logits
    (entry,) = model.tpu_kernels_report.replaced("rmsnorm")
    assert len(entry.modules) == 5
    assert all(dict(model.named_modules())[n].forward.__func__.__qualname__ == "RMSNormZeroCentered.forward"
               for n in entry.modules)
    assert (ours - eager).abs().max().item() <= 1e-4


@pytest.mark.parametrize("use_fallback", [False, True])
def test_bad_repo_spec_fails_clearly(use_fallback):
    model = _tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match="org/name@<version>"):
        kernelize(model, repos={"experts": "not-a-spec", "rmsnorm": None, "attention": None}, use_fallback=use_fallback)
    with pytest.raises(ValueError, match="unknown kernel kind"):
        kernelize(model, repos={"mlp": "a/b@1"})


def test_kernels_from_the_hub_and_a_missing_version(hub, client, ragged_dot_build):
    """Default path: kernelize loads `org/name@N` through tpu_kernels.get_kernel from a Hub."""
    publish(hub, ragged_dot_build, repo_id=f"{TRUSTED}/ragged-dot-tpu")
    model = _tiny_model("qwen3_moe")
    prompt = _prompt()
    with torch.no_grad():
        eager = model(prompt).logits
        kernelize(model, repos={"experts": f"{TRUSTED}/ragged-dot-tpu@1", "rmsnorm": None, "attention": None})
        ours = model(prompt).logits
    (entry,) = model.tpu_kernels_report.replaced("experts")
    assert entry.source == f"{TRUSTED}/ragged-dot-tpu@1"
    assert (ours - eager).abs().max().item() <= 1e-4

    # A missing version is an error, not a kernel that cannot serve: no fallback.
    missing = {"experts": f"{TRUSTED}/ragged-dot-tpu@7", "rmsnorm": None, "attention": None}
    for use_fallback in (False, True):
        with pytest.raises(ValueError, match="Version 7 not found, available versions: 1"):
            kernelize(_tiny_model("qwen3_moe"), repos=missing, use_fallback=use_fallback)


def test_the_attention_refusal_names_only_what_the_kernel_cannot_serve():
    from transformers import DeepseekV3Config, Gemma4TextConfig

    gemma4 = AutoModelForCausalLM.from_config(Gemma4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, global_head_dim=512, layer_types=["sliding_attention", "full_attention"],
        sliding_window=8))
    attention = attention_modules(gemma4)
    assert {m.head_dim for m in attention.values()} == {64, 512}
    up_to_256 = lambda key, value: key == value and key <= 256  # noqa: E731
    assert head_dims_refusal(attention, up_to_256) == "head dims (key, value) (512, 512) not served"
    assert head_dims_refusal(attention, lambda key, value: True) is None

    # Latent attention: the flash kernel sees the expanded dims, nope + rope for keys and v for values.
    deepseek = AutoModelForCausalLM.from_config(DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1))
    attention = attention_modules(deepseek)
    assert list(attention) == ["model.layers.0.self_attn"]
    assert head_dims_refusal(attention, up_to_256) == "head dims (key, value) (32, 16) not served"
    assert head_dims_refusal(attention, lambda key, value: True) is None


def test_which_attention_route_kernelize_takes(all_builds, tmp_path):
    """transformers' flash path (and with it generate_batch) for a Hub kernel in inference, for a model that takes a
    flash kernel from the Hub; attention_forward otherwise, for a reason the report gives."""
    from tpu_kernels.distribution.loader import get_local_kernel

    kernel = get_local_kernel(all_builds["attention"], backend="cpu")
    hub = KernelSpec.parse("tpu-kernels/attention-tpu@2")
    local = KernelSpec.parse(all_builds["attention"])
    qwen, gpt_oss = _tiny_model("qwen3_moe"), _tiny_model("gpt_oss")
    assert flash_route_refusal(qwen, hub, kernel, Mode.INFERENCE) is None
    assert "local build folder" in flash_route_refusal(qwen, local, kernel, Mode.INFERENCE)
    assert "TRAINING or TORCH_COMPILE" in flash_route_refusal(qwen, hub, kernel, Mode.TRAINING)
    assert "TRAINING or TORCH_COMPILE" in flash_route_refusal(qwen, hub, kernel, Mode.INFERENCE | Mode.TORCH_COMPILE)
    assert "accepts only the flash kernels" in flash_route_refusal(gpt_oss, hub, kernel, Mode.INFERENCE)
    without_function = type("OldKernel", (), {})()
    assert "no flash_attn_varlen_func" in flash_route_refusal(qwen, hub, without_function, Mode.INFERENCE)
    no_flash = type("NoFlashModel", (), {"_supports_flash_attn": False})()
    assert "NoFlashModel does not support flash attention" in flash_route_refusal(no_flash, hub, kernel, Mode.INFERENCE)

    kernelize(qwen, repos={**all_builds, "experts": None, "rmsnorm": None})
    (entry,) = qwen.tpu_kernels_report.replaced("attention")
    assert entry.note.startswith("through attention_forward: generate_batch unavailable (a local build folder")
    assert "generate_batch unavailable" in repr(qwen.tpu_kernels_report)
