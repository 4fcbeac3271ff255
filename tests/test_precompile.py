"""precompile(model): every bucket a batch-1 generate meets, compiled before the first request."""

import jax
import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, Qwen3MoeConfig

from tpu_kernels import kernelize
from tpu_kernels.integration.precompile import precompile, warm_up_prompts
from tpu_kernels.runtime.buckets import key_bucket, key_buckets, token_bucket


@pytest.mark.parametrize("max_tokens, max_keys", [(20, 64), (700, 1000), (1, 2)])
def test_warm_up_prompts_meet_every_bucket_combination(max_tokens, max_keys):
    prompts = warm_up_prompts(max_tokens, max_keys)

    def buckets(prompt):
        return key_bucket(prompt), token_bucket(prompt)

    assert {buckets(p) for p in range(1, max_tokens + 1)} <= {buckets(p) for p in prompts}
    # The first decode step after each prompt (prompt + 1 keys) reaches every key bucket up to max_keys.
    assert {key_bucket(p + 1) for p in prompts} >= set(key_buckets(max_keys))
    assert max(prompts) < max_keys and len(prompts) == len(set(prompts))


def test_warm_up_prompts_refuse_a_cache_shorter_than_a_prompt_and_its_token():
    with pytest.raises(ValueError, match="max_keys"):
        warm_up_prompts(100, 100)


def _tiny_qwen3_moe():
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                            moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2, intermediate_size=96)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 3:  # expert weights start empty: random, never zero
                parameter.normal_(std=0.1)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _compiles_generating(model, runs, **options) -> list[str]:
    """jax's backend compiles while `model` generates greedily, for each (prompt length, new tokens) of `runs`, from
    the first tokens of one seeded prompt."""
    compiles = []

    def record(event, _secs, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    # No token is the pad id (0): generate would read it as padding and build a mask (another program).
    prompt = torch.randint(1, 128, (1, max(length for length, _ in runs)), generator=torch.Generator().manual_seed(3))
    jax.monitoring.register_event_duration_secs_listener(record)
    try:
        with torch.no_grad():
            for length, new_tokens in runs:
                model.generate(prompt[:, :length], max_new_tokens=new_tokens, do_sample=False, **options)
    finally:
        jax.monitoring.unregister_event_duration_listener(record)
    return compiles


@pytest.mark.slow
def test_after_precompile_generate_compiles_nothing(kernel_builds):
    """A kernelized tiny Qwen3-MoE precompiled for prompts up to 8 tokens and 20 keys: generating from prompts
    of 3 and 8 tokens, up to 20 keys, compiles no program (jax's compile events counted). Each decode step
    against 9 to 20 keys is one more chance for a key length to reach a compile; the key bucket is 128 wide, so
    longer generations would only repeat those shapes."""
    model = kernelize(_tiny_qwen3_moe(), repos={"experts": str(kernel_builds["ragged-dot-tpu"]),
                                                "rmsnorm": str(kernel_builds["rmsnorm-tpu"]),
                                                "attention": str(kernel_builds["attention-tpu"])})
    assert precompile(model, max_tokens=8, max_keys=20, progress=False) == [8, 19]
    assert _compiles_generating(model, ((3, 5), (8, 12))) == []


@pytest.mark.slow
def test_after_precompile_the_fixed_shape_recipe_compiles_nothing_anywhere_in_the_forward(kernel_builds):
    """With the recipe (forced on, as on a TPU): precompiled for prompts up to 20 tokens and 40 keys, it visits the
    token buckets 16 (padded from 15, and filled) and 32 (padded from 20) against one cache of 128 keys; generating
    from prompts of 3, 16 and 20 tokens then compiles no kernel and runs no new op signature in the model's forward
    (the programs TorchTPU's eager would compile)."""
    from tpu_kernels.integration.precompile import fixed_shape_cache
    from benchmarks.studies.op_signatures import OpSignatures

    model = kernelize(_tiny_qwen3_moe(), repos={"experts": str(kernel_builds["ragged-dot-tpu"]),
                                                "rmsnorm": str(kernel_builds["rmsnorm-tpu"]),
                                                "attention": str(kernel_builds["attention-tpu"])}, fixed_shapes=True)
    recorded, forward = OpSignatures(), model.forward

    def recording(*args, **kwargs):
        with recorded:
            return forward(*args, **kwargs)

    model.forward = recording
    assert precompile(model, max_tokens=20, max_keys=40, progress=False) == [15, 16, 20]
    assert fixed_shape_cache(20, 40) == model._previous_max_cache_length == 128
    start = recorded.mark()
    assert _compiles_generating(model, ((3, 3), (16, 2), (20, 4))) == []
    assert recorded.since(start) == []


@pytest.mark.slow
def test_after_precompile_the_compiled_decode_step_compiles_nothing(kernel_builds):
    """transformers' generate-time compile of the decode step (a TPU's path for a static cache), forced on the CPU as
    tests/test_compiled_generate.py does: precompiled with the CompileConfig serving passes, one decode graph is built
    for the recipe's cache; generating from prompts of 3 and 20 tokens then builds no graph and compiles no kernel."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    torch.compiler.reset()
    model = kernelize(_tiny_qwen3_moe(), repos={"experts": str(kernel_builds["ragged-dot-tpu"]),
                                                "rmsnorm": str(kernel_builds["rmsnorm-tpu"]),
                                                "attention": str(kernel_builds["attention-tpu"])}, fixed_shapes=True)
    compile_config = CompileConfig(backend="aot_eager", dynamic=False, fullgraph=True)
    compile_config._compile_all_devices = True  # transformers compiles only on accelerators unless told
    counters.clear()
    assert precompile(model, max_tokens=20, max_keys=40, progress=False, compile_config=compile_config) == [15, 16, 20]
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert _compiles_generating(model, ((3, 3), (20, 4)), compile_config=compile_config) == []
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.slow
def test_after_precompile_gemma3s_transposed_head_norms_compile_nothing(kernel_builds):
    """Gemma 3 normalises q and k on their transposed view [B, heads, tokens, D]: its norms kernelized alone,
    precompiled for prompts up to 20 tokens (two token buckets), compile nothing generating from prompts of 3
    and 20 tokens."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                              num_key_value_heads=1, head_dim=16, intermediate_size=96, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model = kernelize(model, repos={"experts": None, "rmsnorm": str(kernel_builds["rmsnorm-tpu"]), "attention": None})
    assert precompile(model, max_tokens=20, max_keys=21, progress=False) == [16, 20]
    assert _compiles_generating(model, ((3, 2), (20, 2))) == []


def test_the_command_refuses_to_warm_a_machine_without_a_tpu(capsys, monkeypatch):
    from tpu_kernels import cli
    from tpu_kernels.integration import precompile as module

    monkeypatch.setattr(module.glob, "glob", lambda pattern: [], raising=False)
    with pytest.raises(SystemExit) as exited:
        cli.main(["precompile", "some-org/some-model"])
    assert exited.value.code == 2 and "fills no cache a TPU host reads" in capsys.readouterr().err
