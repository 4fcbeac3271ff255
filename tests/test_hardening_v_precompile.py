"""Hardening V (issue 73, PC1-PC2): precompile's sizes are bounded by the model, refused below 1, and its
warm-up prompts computed from the bucket ladders; the command refuses what it cannot run in one line."""

import types

import pytest
from transformers import Qwen3MoeConfig

from tpu_kernels import cli
from tpu_kernels.integration.precompile import precompile, warm_up_prompts
from tpu_kernels.runtime import buckets
from tpu_kernels.runtime.buckets import key_bucket, token_bucket


def config(max_position_embeddings: int = 256) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=max_position_embeddings)


def every_length(max_tokens: int, max_keys: int) -> list[int]:
    """What warm_up_prompts returned when it looked at every prompt length."""
    def both(prompt):
        return key_bucket(prompt), token_bucket(prompt)

    prefills = {p for p in range(1, max_tokens + 1) if p == max_tokens or both(p) != both(p + 1)}
    decodes = {min(bucket, max_keys) - 1 for bucket in buckets.key_buckets(max_keys)} - {0}
    return sorted(prefills | decodes)


@pytest.mark.parametrize("max_tokens, max_keys", [(1, 2), (16, 17), (17, 200), (512, 513), (1000, 5000),
                                                  (4096, 4224), (6000, 6001)])
def test_warm_up_prompts_are_those_a_look_at_every_length_finds(max_tokens, max_keys):
    assert warm_up_prompts(max_tokens, max_keys) == every_length(max_tokens, max_keys)


def test_warm_up_prompts_do_not_look_at_every_length(monkeypatch):
    looks = []
    check_size = buckets._check_size
    monkeypatch.setattr(buckets, "_check_size", lambda n, what: looks.append(n) or check_size(n, what))
    warm_up_prompts(100_000, 100_128)
    assert len(looks) < 2_000, len(looks)  # the bucket ladders (about 200 buckets each), not 100,000 lengths


@pytest.mark.parametrize("max_tokens, max_keys, said", [
    (300, 10 ** 12, "max_position_embeddings \\(256\\)"),
    (10 ** 7, 10 ** 7 + 128, "max_position_embeddings \\(256\\)"),
    (-1, 5, "max_tokens must be a whole number of at least 1"),
    (8, 0, "max_keys must be a whole number of at least 1"),
    (8, 8, "must hold the longest prompt"),
])
def test_precompile_refuses_sizes_the_model_cannot_take_before_running_it(max_tokens, max_keys, said):
    model = types.SimpleNamespace(config=config(256))  # refused before anything runs: no model needed
    with pytest.raises(ValueError, match=said):
        precompile(model, max_tokens=max_tokens, max_keys=max_keys, progress=False)


@pytest.fixture
def config_folder(tmp_path):
    folder = tmp_path / "tiny"
    config(256).save_pretrained(folder)  # no weights: every refusal comes before they would load
    return folder


@pytest.mark.parametrize("args, said", [
    (["{missing}"], "cannot load"),
    (["{model}", "--dtype", "float64"], "invalid choice: 'float64'"),
    (["{model}", "--dtype", "nonsense"], "invalid choice: 'nonsense'"),
    (["{model}", "--max-tokens", "0"], "must be at least 1, got 0"),
    (["{model}", "--max-keys", "-3"], "must be at least 1, got -3"),
    (["{model}", "--max-tokens", "10000000"], "max_position_embeddings (256)"),
    (["{model}", "--max-keys", "1000000000000"], "max_position_embeddings (256)"),
    (["{model}", "--max-batch-tokens", "64"], "--max-batch-tokens and --max-requests-per-batch go together"),
    (["{model}", "--max-requests-per-batch", "0"], "must be at least 1, got 0"),
])
def test_the_command_refuses_in_one_line(config_folder, tmp_path, capsys, args, said):
    argv = [arg.format(missing=tmp_path / "missing", model=config_folder) for arg in args]
    with pytest.raises(SystemExit) as exited:
        cli.main(["precompile", *argv, "--device", "cpu"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and said in err, err
    assert len(err.strip().splitlines()) == 1, err
