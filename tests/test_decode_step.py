"""The decode-step model's pieces: model sizes, the programs against transformers' ops, the step's arithmetic."""

from __future__ import annotations

import math
import types

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from benchmarks.studies.decode_step import models, programs, ranges, step
from benchmarks.studies.decode_step.pricing import term


def test_model_sizes_reproduce_the_published_totals():
    # Model cards: Qwen3-30B-A3B 30.5 B / 3.3 B active; Gemma 4 26B-A4B 25.2 B / 3.8 B active.
    assert models.QWEN3.parameters / 1e9 == pytest.approx(30.5, abs=0.05)
    assert models.QWEN3.active_parameters / 1e9 == pytest.approx(3.35, abs=0.05)
    assert models.GEMMA4.parameters / 1e9 == pytest.approx(25.2, abs=0.05)
    assert models.GEMMA4.active_parameters / 1e9 == pytest.approx(3.8, abs=0.05)
    # Qwen3: 48 layers x K and V x 4 heads x 128 x 2 bytes = 96 KiB per token.
    assert models.QWEN3.kv_cache_bytes_per_token() == 96 * 1024
    # Gemma 4's sliding layers hold at most the window.
    sliding = models.GEMMA4.attention[0]
    assert (sliding.cached_tokens(300), sliding.cached_tokens(5000)) == (300, 1024)


def _transformers_experts(gate_up, down, local_experts):
    """A stand-in `self` for transformers' batched_mm_experts_forward: gated silu experts under EP."""
    from transformers.integrations.moe import _default_apply_gate

    module = types.SimpleNamespace(gate_up_proj=gate_up, down_proj=down, has_gate=True, has_bias=False,
                                   is_transposed=False, _is_expert_parallel=True, num_experts=local_experts,
                                   has_post_expert_norm=False, act_fn=torch.nn.functional.silu)
    module._apply_gate = types.MethodType(_default_apply_gate, module)
    return module


@pytest.mark.slow  # imports transformers' MoE integration
def test_batched_mm_programs_compute_what_transformers_batched_mm_does():
    from transformers.integrations.moe import batched_mm_experts_forward

    tokens, hidden, inter, local = 5, 16, 8, 3
    rng = np.random.default_rng(0)
    hidden_states = rng.standard_normal((tokens, hidden)).astype(np.float32)
    gate_up = rng.standard_normal((local, 2 * inter, hidden)).astype(np.float32)
    down = rng.standard_normal((local, hidden, inter)).astype(np.float32)
    index = np.array([[0, 2], [3, 1], [3, 3], [2, 0], [1, 3]], np.int32)  # 3 = another chip's pick (sentinel)
    weights = np.where(index == local, 0.0, rng.uniform(0.1, 1.0, index.shape)).astype(np.float32)
    expected = batched_mm_experts_forward(_transformers_experts(torch.tensor(gate_up), torch.tensor(down), local),
                                          torch.tensor(hidden_states), torch.tensor(index), torch.tensor(weights))

    rows, ids = programs.picks_prologue(jnp.asarray(hidden_states), jnp.asarray(index), local)
    projected = programs.batched_matvec(programs.gather_weights(jnp.asarray(gate_up), ids), rows)
    down_out = programs.batched_matvec(programs.gather_weights(jnp.asarray(down), ids),
                                       programs.gated(projected, "silu"))
    got = programs.picks_epilogue(down_out, jnp.asarray(weights))
    np.testing.assert_allclose(np.asarray(got), expected.numpy(), rtol=2e-5, atol=2e-5)


def test_sdpa_program_is_softmax_attention_over_grouped_heads():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 6, 1, 8)).astype(np.float32)
    key, value = (rng.standard_normal((2, 3, 7, 8)).astype(np.float32) for _ in range(2))
    got = np.asarray(programs.sdpa(jnp.asarray(q), jnp.asarray(key), jnp.asarray(value)))
    repeated_k, repeated_v = np.repeat(key, 2, axis=1), np.repeat(value, 2, axis=1)
    logits = q @ repeated_k.transpose(0, 1, 3, 2) / math.sqrt(8)
    probabilities = np.exp(logits - logits.max(-1, keepdims=True))
    expected = (probabilities / probabilities.sum(-1, keepdims=True)) @ repeated_v
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_programs_of_a_step_have_the_plan_shapes():
    kind = models.GEMMA4.attention[0]
    qkv, append, o_proj = programs.attention_programs(models.GEMMA4, kind, batch=64, context=4096)
    assert [a.shape for a in append.avals] == [(64, 8, 1023, 256), (64, 8, 1, 256)]
    assert append.per_step == 2 * 25 and qkv.per_step == 25
    gathers = [p for p in programs.batched_mm_programs(models.QWEN3, 64, 16) if "gather" in p.name]
    assert [p.avals[0].shape for p in gathers] == [(16, 1536, 2048), (16, 2048, 768)]
    assert all(p.avals[1].shape == (512,) for p in gathers)  # every pick of 64 tokens x top-8, sentinels too
    norms = {what: (rows, width, count) for what, rows, width, count in programs.norm_shapes(models.QWEN3, 64)}
    assert norms == {"hidden-size norms": (64, 2048, 97), "full q_norm": (2048, 128, 48),
                     "full k_norm": (256, 128, 48)}


def test_collective_term_is_the_all_reduce_formula():
    found = step.collective_term(models.QWEN3, 64)
    # 2 (N-1)/N S / (2 W) with S = 64 x 2048 x 2 bytes, W = 1e11 B/s, + 2 x 4 hops x 1 us.
    assert found["us_per_call"] == pytest.approx(2 * 7 / 8 * 262144 / 2e11 * 1e6 + 8, abs=1e-3)
    assert found["ms_per_step_band"][0] < found["ms_per_step"] < found["ms_per_step_band"][1]
    assert found["per_step"] == 48


def _paths():
    append = term("full attention: KV cache append (K and V)", 300.0, 10, priced_by="p")
    ours = term("experts: ours", 100.0, 10, priced_by="p", band_us=[90.0, 110.0], kind="pallas_ragged_dot")
    terms = {"transformers_default": [term("batched_mm: bmm", 1000.0, 10, priced_by="p"),
                                      term("sdpa", 50.0, 10, priced_by="p"), append],
             "kernelized_experts": [term("sdpa", 50.0, 10, priced_by="p"), ours, append],
             "kernelized": [term("flash", 40.0, 10, priced_by="p"), ours, append]}
    return {name: {"terms": found, "total": step.total(found)} for name, found in terms.items()}


def test_totals_ratios_and_the_cache_sensitivity():
    paths = _paths()
    assert paths["kernelized_experts"]["total"]["ms"] == pytest.approx(4.5)
    assert paths["kernelized_experts"]["total"]["band_ms"] == [pytest.approx(4.4), pytest.approx(4.6)]
    found = step.compare("qwen3-30b-a3b", models.QWEN3, paths, host=None)
    assert found["kernelized_experts"]["modelled_ratio"] == pytest.approx(13.5 / 4.5, abs=0.01)
    assert found["kernelized"]["modelled_ratio"] == pytest.approx(13.5 / 4.4, abs=0.01)
    assert found["batched_mm_share_of_default"] == pytest.approx(10 / 13.5, abs=1e-4)
    # HF's measured step is compared with HF's configuration: the experts kernelized only.
    assert found["kernelized_vs_hf"]["unexplained_ms"] == pytest.approx(56.6 - 4.5)
    assert [r["term"] for r in found["kernelized_experts"]["ratio_terms"]] == ["batched_mm: bmm", "experts: ours"]
    assert step.without_cache_append(paths)["ratio"] == {"kernelized_experts": pytest.approx(10.5 / 1.5, abs=0.01),
                                                         "kernelized": pytest.approx(10.5 / 1.4, abs=0.01)}
    unpriced = [term("x", float("nan"), 1, priced_by="not priced")]
    assert step.total(unpriced)["complete"] is False


def test_eager_host_closes_the_measured_step_and_prices_the_ratio():
    host = {"kernel_calls_per_step": {"rms_norm": 20, "flash_attention": 10, "gated_experts": 10},
            "per_call_min_us": {"rms_norm": 30.0, "flash_attention": 50.0, "gated_experts": 60.0}}
    ops = {"per_step": {"ops": 1000, "rmsnorm": 200, "attention": 30, "experts": 170}}
    eager = step.eager_host(ops, host)
    assert eager["transformers_default"] == {"other_ops": 1000, "kernel_calls": 0, "kernel_calls_host_ms": 0.0}
    assert eager["kernelized_experts"] == {"other_ops": 830, "kernel_calls": 10, "kernel_calls_host_ms": 0.6}
    assert eager["kernelized"] == {"other_ops": 600, "kernel_calls": 40, "kernel_calls_host_ms": 1.7}
    cost = step.implied_op_cost(10.0, 4.5, eager["kernelized_experts"])
    assert cost == {"serial": pytest.approx((10.0 - 4.5 - 0.6) * 1e3 / 830, abs=1e-3),
                    "overlapped": pytest.approx((10.0 - 0.6) * 1e3 / 830, abs=1e-3)}
    at = step.with_host(_paths(), eager, cost)
    assert at["serial"]["ms"]["kernelized_experts"] == pytest.approx(10.0, abs=0.01)
    assert at["overlapped"]["ms"]["kernelized_experts"] == pytest.approx(10.0, abs=0.01)
    assert at["overlapped"]["ms"]["transformers_default"] == pytest.approx(13.5)  # device longer than host
    assert at["serial"]["ratio"]["kernelized_experts"] == pytest.approx((13.5 + 1000 * cost["serial"] / 1e3) / 10.0,
                                                                        abs=0.01)


def test_hf_kernel_check_bounds_the_grid_step_cost():
    kernelized = {"ms": 20.0}
    experts = {"us_per_call": 100.0}
    tokamax = {"label": "l", "us": 1700.0, "grid_steps": 4608, "step_cost_us": 1567.0}
    host = {"kernel_calls_per_step": {"gated_experts": 48}, "per_call_min_us": {"gated_experts": 50.0}}
    found = step.hf_kernel_check("qwen3-30b-a3b", models.QWEN3, kernelized, experts, tokamax, host=host)
    swapped = 20.0 + 48 * 1.6
    assert found["kernelized_step_with_it_ms"] == pytest.approx(swapped)
    assert found["exceeds_measured_step"] is True
    others = swapped - 48 * 1.567
    assert found["grid_step_cost_bound_us"] == pytest.approx((56.6 - others) * 1e3 / (48 * 4608), abs=1e-4)
    assert found["grid_step_cost_bound_with_host_us"] == pytest.approx(
        (56.6 - others - 48 * 50.0 / 1e3) * 1e3 / (48 * 4608), abs=1e-4)
    assert step.hf_kernel_check("gemma-4-26b-a4b", models.GEMMA4, kernelized, experts, None) is None


def test_kernel_calls_and_host_bound_from_binding():
    assert step.kernel_calls(models.QWEN3) == {"rms_norm": 97 + 96, "flash_attention": 48, "gated_experts": 48}
    binding = {"tpu_path_python": {"per_call_us": {k: {"min_us": 10.0} for k in step.HOST_CALL_KINDS}}}
    bound = step.host_lower_bound(models.QWEN3, binding)
    assert bound["ms"] == pytest.approx((193 + 96) * 10.0 / 1e3)
    assert bound["per_call_min_us"] == dict.fromkeys(step.HOST_CALL_KINDS, 10.0)
    assert step.host_lower_bound(models.QWEN3, None) is None


@pytest.mark.slow
def test_host_ops_counts_one_decode_step_and_what_kernelize_replaces():
    from benchmarks.studies.decode_step import host_ops

    found = host_ops.count("qwen3-30b-a3b", {"full_attention": 3})
    layer = found["per_layer"]["full_attention"]
    # Each layer runs its two RMSNorms and q/k norms, attention and the experts in eager ops of their own.
    assert layer["ops"] > layer["rmsnorm"] + layer["attention"] + layer["experts"]
    assert min(layer["rmsnorm"], layer["attention"], layer["experts"]) > 0
    assert found["per_step"]["ops"] == found["per_step_fixed"]["ops"] + 3 * layer["ops"]
    assert found["per_step_fixed"]["experts"] == 0  # the step's own ops (embedding, lm_head) hold no experts


def _range_paths() -> dict:
    """A default path of 100 ms of batched_mm and 10 ms shared; HF's configuration: the shared 10 ms, our experts
    (20 grid steps a layer of 48) and a 0.5 ms all-reduce that no HBM share or step cost moves."""
    shared = term("sdpa", 100.0, 100, priced_by="p")
    reduce = term("all-reduce", 10.0, 50, priced_by="formula", kind=ranges.ICI_KIND)
    experts = term("experts: our fused experts layer (busiest chip)", 60.0, 48, priced_by="p",
                   kind="pallas_ragged_dot", grid_steps=20)
    default = [term("batched_mm: gather", 1000.0, 100, priced_by="p"), shared, reduce]
    return {"transformers_default": {"terms": default}, "kernelized_experts": {"terms": [shared, experts, reduce]}}


def test_ratio_ranges_move_each_unidentified_term_alone_and_all_at_once():
    paths = _range_paths()
    check = {"tokamax_default_us": 1700.0, "tokamax_default_grid_steps": 4608}
    found = ranges.ratio_ranges(paths, check, layers=48, fitted_step_us=0.34, fitted_share=1.0,
                                batched_mm_upper=3.0)

    def step_ms(grid_us, share, experts_us, steps):
        rest = (experts_us - steps * 0.34) / share + steps * grid_us
        return 10.0 / share + 48 * rest / 1e3 + 0.5

    def default_ms(share, scale=1.0):
        return (100.0 * scale + 10.0) / share + 0.5

    ours = found["paths"]["ours"]
    assert ours["step_ms"] == pytest.approx(step_ms(0.34, 1.0, 60.0, 20), abs=0.01)
    assert ours["ratio"] == pytest.approx(default_ms(1.0) / step_ms(0.34, 1.0, 60.0, 20), abs=0.01)
    low_step = default_ms(1.0) / step_ms(0.02, 1.0, 60.0, 20)
    assert ours["ratio_alone"]["grid_step_us"] == [pytest.approx(ours["ratio"], abs=0.01),
                                                   pytest.approx(low_step, abs=0.01)]
    # HF's kernel: the experts term swapped for tokamax's at its default tiles, thousands of near-empty steps.
    hf = found["paths"]["hf_kernel"]
    assert hf["step_ms"] == pytest.approx(step_ms(0.34, 1.0, 1700.0, 4608), abs=0.01)
    assert hf["ratio_alone"]["grid_step_us"][1] == pytest.approx(
        default_ms(1.0) / step_ms(0.02, 1.0, 1700.0, 4608), abs=0.01)
    # A lower share slows every term priced by its bytes, not the step costs or the all-reduce.
    assert hf["ratio_alone"]["hbm_share"][1] == pytest.approx(
        default_ms(0.78) / step_ms(0.34, 0.78, 1700.0, 4608), abs=0.01)
    # batched_mm's multiplier moves the default only.
    assert ours["ratio_alone"]["batched_mm_scale"][1] == pytest.approx(
        default_ms(1.0, 3.0) / step_ms(0.34, 1.0, 60.0, 20), abs=0.01)
    corners = [default_ms(s, m) / step_ms(g, s, 1700.0, 4608)
               for g in (0.02, 0.34) for s in (0.78, 1.0) for m in (1.0, 3.0)]
    assert hf["ratio_all"] == [pytest.approx(min(corners), abs=0.01), pytest.approx(max(corners), abs=0.01)]
    assert found["ranges"]["batched_mm_scale"] == [1.0, 3.0]


def test_batched_mm_multiplier_meets_the_implied_default_step():
    default = _range_paths()["transformers_default"]["terms"]
    scale = ranges.batched_mm_scale_implied(default, implied_default_ms=310.5, fitted_step_us=0.34)
    assert scale == pytest.approx(3.0)
    assert ranges.path_ms(default, grid_step_us=0.34, fitted_step_us=0.34, share_scale=1.0,
                          batched_mm_scale=scale) == pytest.approx(310.5)


def test_ratio_explanation_names_the_cancellation_only_where_ours_lands_near_hfs():
    def result(ours: float, measured: float) -> dict:
        at = {"ratio": 4.0, "ratio_all": [4.0, 40.0],
              "ratio_alone": {"grid_step_us": [4.0, 15.0], "hbm_share": [4.0, 5.0], "batched_mm_scale": [4.0, 12.0]}}
        return {"comparison": {"hf_measured_ratio": measured},
                "ratio_ranges": {"paths": {"ours": {"ratio": ours, "ratio_all": [ours, 50.0]}, "hf_kernel": at}}}

    [near] = ranges.explain(result(19.1, 21.5))
    assert "cancellation" in near and "lands at 0.19 of it" in near
    assert "no term alone brings it there (at most 15.0x); all of them at once can" in near
    [apart] = ranges.explain(result(6.7, 12.8))
    assert "cancellation" not in apart
    assert apart.endswith("HF's measured one, the grid-step cost alone brings it there")
    assert ranges.explain({"comparison": {}}) == []
