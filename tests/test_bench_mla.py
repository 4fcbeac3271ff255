"""The MLA study's fast pieces: its XLA programs compute what transformers and the absorbed form compute (at tiny
sizes, plain jnp on the CPU), its summary's arithmetic and its tables, vLLM's search space, and the kernel's rule
held against the model's prices at the tracked shapes."""

from __future__ import annotations

import importlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.studies.mla import programs, shapes, summary, vllm_mla
from benchmarks.studies.tables import mla as tables

from .conftest import REPO_ROOT

TINY = shapes.MlaModel("tiny", "tiny", heads=3, latent=16, rope=4, nope=8, v=6, generations=("v6e",), plan="test")


def _absorbed_reference(query, kv_nope, k_rot, weight, model, q_len):
    """The absorbed form written out: q_latent = q_nope W_UK, softmax over latent . q_latent + rope . q_rope (scaled
    by the expanded head dim, as transformers' sdpa scales), values the latent, then W_UV."""
    q_latent = programs.query_to_latent(query, weight, model.nope, model.latent)
    logits = (jnp.einsum("bhql,bsl->bhqs", q_latent, kv_nope[:, 0])
              + jnp.einsum("bhqr,bsr->bhqs", query[..., model.nope:], k_rot[:, 0])) * model.key_dim ** -0.5
    kv_len = kv_nope.shape[2]
    logits = jnp.where(programs.causal_visible(q_len, kv_len), logits, -jnp.inf)
    out_latent = jnp.einsum("bhqs,bsl->bhql", jax.nn.softmax(logits, axis=-1), kv_nope[:, 0])
    return programs.latent_to_values(out_latent, weight, model.nope)


@pytest.mark.slow  # one XLA compile of both forms on the CPU: a few seconds on a loaded host
def test_transformers_programs_and_the_absorbed_form_compute_the_same_attention(q_len=3, kv_len=5):
    call = shapes.Call("prefill" if q_len > 1 else "decode", 2, q_len, kv_len)
    avals = (programs.spec(2, TINY.heads, q_len, TINY.key_dim),
             programs.spec(TINY.heads * (TINY.nope + TINY.v), TINY.latent), programs.spec(2, 1, kv_len, TINY.latent),
             programs.spec(2, 1, kv_len, TINY.rope))
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(aval.shape).astype(np.float32) for aval in avals]
    expand, assemble, attend = programs.transformers_programs(TINY, call)
    contiguous = programs.expanded_programs(TINY, call)[-1]

    @jax.jit  # one compile for the whole comparison (op by op, each jnp op would compile on its own)
    def both(query, weight, kv_nope, k_rot):
        expanded = expand.fn(kv_nope, weight)
        keys = assemble.fn(expanded, k_rot)
        return (attend.fn(query, keys, expanded), _absorbed_reference(query, kv_nope, k_rot, weight, TINY, q_len),
                keys, contiguous.fn(expanded))

    out, expected, keys, values = both(*arrays)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
    assert keys.shape == (2, TINY.heads, kv_len, TINY.key_dim) and values.shape == (2, TINY.heads, kv_len, TINY.v)


def test_every_program_traces_at_its_declared_arguments():
    call = shapes.Call("prefill", 1, 4, 8)
    for program in (programs.transformers_programs(TINY, call) + programs.absorbed_programs(TINY, call)
                    + programs.expanded_programs(TINY, call)):
        jax.eval_shape(program.fn, *program.avals)


def test_calls_and_floor():
    assert shapes.calls(shapes.MODELS_BY_KEY["deepseek-v3"]) == shapes.DECODE[:1]
    assert {call.kind for call in shapes.calls(shapes.MODELS[0])} == {"decode", "prefill"}
    call = shapes.Call("prefill", 2, 3, 5)
    assert call.visible_pairs == 2 * (3 + 4 + 5)
    assert shapes.latent_cache_bytes(TINY, call) == 2 * 5 * (16 + 4) * 2
    assert call.label == "prefill 3 over 2 cached" and shapes.Call("decode", 8, 1, 64).label == "decode B=8 cache=64"


def _row(call: str, q_len: int, absorbed: float, expanded: float, rule: str | None, generation="v6e"):
    pick = "absorbed" if absorbed <= expanded else "expanded"
    row = {"model": "tiny", "call": call, "kind": "prefill", "batch": 1, "q_len": q_len, "kv_len": 4096,
           "generation": generation, "floor": {"us": 10.0},
           "transformers": {"us": 100.0, "terms": []},
           "absorbed": {"us": absorbed, "terms": [], "band_p90_us": [absorbed - 1, absorbed + 1]},
           "expanded": {"us": expanded, "terms": [{"term": "flash kernel", "stand_in": "padded"}],
                        "band_p90_us": None},
           "model_pick": pick, "ours_us": min(absorbed, expanded),
           "rule": {"pick": rule, **({} if rule else {"why": "no rule in this build"})},
           "rule_agrees": None if rule is None else rule == pick}
    return row


def test_summary_finds_the_crossover_and_the_rules_disagreements():
    rows = [_row("a", 1, 20.0, 90.0, "absorbed"), _row("b", 128, 50.0, 60.0, "expanded"),
            _row("c", 4096, 80.0, 40.0, "expanded")]
    found = summary.summarise(rows)
    (cross,) = found["crossovers"]
    assert cross["model_switches"] == ["b -> c"] and cross["rule_switches"] == ["a -> b"]
    (wrong,) = found["rule_disagreements"]
    assert (wrong["call"], wrong["rule_pick_over_best"]) == ("b", 60.0 / 50.0)
    assert found["rule_checked"] == 3 and found["transformers_over_ours_range"] == [100 / 50, 100 / 20]
    line = found["rows"][2]
    assert line["expanded_stand_in"] and line["ours_band_p90_us"] is None and "ours_over_floor" not in line
    decode = summary.table_row({**rows[0], "kind": "decode"})
    assert decode["ours_over_floor"] == 2.0


def test_the_tables_render_every_row_and_say_when_the_rule_is_missing():
    rows = [_row("a", 1, 20.0, 90.0, None), _row("c", 4096, 80.0, 40.0, None)]
    data = {"summary": summary.summarise(rows)}
    rendered = tables.render_markdown(data)
    assert rendered["layer"].count("\n") == 1 + len(rows)
    assert "90 *" in rendered["layer"] and "absorbed: 20 (19-21)" in rendered["layer"]
    assert "no rule in this build" in rendered["rule"]
    assert "a -> c" in rendered["crossover"]


def test_vllm_search_divides_the_batch_and_stays_within_the_sequence():
    decode = vllm_mla.Layout((), True, pages_per_seq=2)
    axes = vllm_mla.search_axes(TINY, shapes.Call("decode", 12, 1, 512), decode)
    assert axes == {"decode_pages": [1, 2], "decode_batch_size": [1, 2, 4]}
    prefill = vllm_mla.search_axes(TINY, shapes.Call("prefill", 1, 64, 4096), vllm_mla.Layout((), False, 16))
    assert prefill == {"mixed_pages": [1, 2, 4, 8], "mixed_queries": [16, 64]}


def test_the_kernels_rule_agrees_with_the_models_prices_at_the_tracked_shapes(kernel_builds):
    """Wherever mla.json priced both forms, the kernel's rule (attention_tpu.mla.absorbed_is_cheaper) picks the form
    the model prices cheaper, or the JSON lists the call among the rule's disagreements (`python -m benchmarks mla
    --resummarize` re-reads the rule into the JSON)."""
    import kernels

    built = kernels.get_local_kernel(kernel_builds["attention-tpu"], backend="cpu")
    rule = importlib.import_module(f"{built.__name__}.mla")
    hardware = importlib.import_module(f"{built.__name__}._hardware")
    data = json.loads((REPO_ROOT / "benchmarks" / "results" / "mla.json").read_text())
    listed = {(d["model"], d["call"], d["generation"]) for d in data["summary"]["rule_disagreements"]}
    checked = 0
    for row in data["results"]:
        if not row.get("model_pick"):
            continue
        model = shapes.MODELS_BY_KEY[row["model"]]
        shape = rule.LatentShape(heads=model.heads, nope=model.nope, rope=model.rope, v=model.v,
                                 latent=model.latent, batch=row["batch"], q_len=row["q_len"], kv_len=row["kv_len"],
                                 itemsize=shapes.ITEMSIZE)
        absorbed = rule.absorbed_is_cheaper(shape, hardware.resolve_target(row["generation"]))
        agrees = ("absorbed" if absorbed else "expanded") == row["model_pick"]
        assert agrees or (row["model"], row["call"], row["generation"]) in listed, row["call"]
        checked += 1
    assert checked


def _path(*terms):
    found = [{"term": name, "us_per_call": ms * 1e3, "per_step": 1, "ms_per_step": ms, "ms_per_step_band": [ms, ms],
              "error_kind": "uncalibrated"} for name, ms in terms]
    return {"terms": found, "total": {"ms": sum(ms for _, ms in terms)}}


def test_the_decode_step_table_sets_the_mla_model_beside_decode_steps_models():
    from benchmarks.studies.mla import step

    qwen = {"model": {"name": "Qwen3-30B-A3B"},
            "paths": {"transformers_default": _path(("a", 30.0), ("b", 10.0)), "kernelized": _path(("c", 4.0))}}
    beside = step.beside({"models": {"qwen3-30b-a3b": qwen}})
    assert beside[0]["ratio"] == 10.0 and beside[0]["largest_default"][0] == {"term": "a", "ms_per_step": 30.0}
    paths = {"transformers_default": _path(("expansion", 50.0)), "kernelized": _path(("latent kernel", 5.0))}
    data = {"decode_step": {"model": "Moonlight-16B-A3B", "paths": paths, "ratio": 10.0, "beside": beside,
                            "largest": {name: step.step_totals.largest(p["terms"]) for name, p in paths.items()}}}
    rendered = tables.render_markdown({"summary": summary.summarise([]), **data})
    assert "Moonlight-16B-A3B (MLA) | 50.0 | 5.0 | 10.0x | expansion 50.0" in rendered["decode-step"]
    assert "| Qwen3-30B-A3B | 40.0 | 4.0 | 10.0x |" in rendered["decode-step"]
    assert rendered["step-terms"].count("\n") == 1 + 2
