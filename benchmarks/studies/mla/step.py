"""A whole decode step of one MLA MoE model, Moonlight-16B-A3B at batch 64 on a v6e-8, priced as `decode_step`
prices Qwen3-30B-A3B's and Gemma 4 26B-A4B's (same plan, context, cache and pricing), beside their rows.

Plan (decode_step's, `models.PLAN_SOURCE`): experts EP8 with router masking and one all-reduce per MoE layer;
attention (16 heads), norms, router, the shared experts, the first layer's dense MLP, embeddings and lm_head
replicated on every chip. Paths:

- `transformers_default`: batched_mm experts, MLA attention as transformers runs it (kv_b_proj over every cached
  token at every step, the keys assembled, sdpa), RMSNorm in torch ops;
- `kernelized`: our fused experts layer, the absorbed form over the latent cache (W_UK and W_UV matmuls around the
  latent kernel), our RMSNorm kernels;
- on both: q_proj and kv_a_proj_with_mqa, the latent cache's append (DynamicCache concatenates kv_nope and k_rot),
  o_proj, the router, the two shared experts, layer 0's dense MLP, the embedding, lm_head with argmax, and the
  experts' all-reduce.
"""

from __future__ import annotations

import dataclasses

import jax

from benchmarks.perf.collectives import HOP_LATENCY_S, ICI_LINK_BYTES_PER_S, V6E_8, Ici, all_reduce
from benchmarks.studies import moe_layer
from benchmarks.studies.decode_step import programs as step_programs
from benchmarks.studies.decode_step import step as step_totals
from benchmarks.studies.decode_step.models import DecodeModel
from benchmarks.studies.decode_step.pricing import GENERATION, term
from benchmarks.studies.decode_step.programs import Program, spec
from benchmarks.studies.moe_layer.shapes import Model as ExpertsModel

from . import kernels, programs
from .shapes import Call, MODELS_BY_KEY, latent_cache_bytes

ATTENTION = MODELS_BY_KEY["moonlight-16b-a3b"]
LAYERS, MOE_LAYERS = 27, 26
DENSE_INTERMEDIATE, SHARED_INTERMEDIATE = 11264, 2 * 1408
MOONLIGHT = DecodeModel(name="Moonlight-16B-A3B", moe_layer_model="moonlight-16b-a3b", layers=MOE_LAYERS,
                        hidden=2048, vocab=163840, experts=64, top_k=6, expert_intermediate=1408, attention=())
SOURCE = ("moonshotai/Moonlight-16B-A3B config.json (DeepseekV3ForCausalLM): hidden_size 2048, 27 layers "
          "(first_k_dense_replace 1: layer 0 dense of intermediate_size 11264, 26 MoE layers), 16 heads, kv_lora_rank "
          "512, qk_nope 128, qk_rope 64, v_head_dim 128, q_lora_rank null, 64 routed experts top-6 of "
          "moe_intermediate_size 1408 and 2 shared experts, vocab_size 163840, untied embeddings; the router "
          "(sigmoid scores, a correction bias, top-6) is priced as a softmax top-k router of the same bytes")
EXPERTS_SETTING = moe_layer.Setting(ExpertsModel("moonlight-16b-a3b", hidden=2048, intermediate=1408,
                                                 experts=64, top_k=6, activation="silu"), 8, "router-masking")


def gated_mlp(x, gate, up, down):
    return (jax.nn.silu(x @ gate.T) * (x @ up.T)) @ down.T


def per_step(program: Program, count: int) -> Program:
    return dataclasses.replace(program, per_step=count)


def shared_programs(batch: int, context: int) -> list[Program]:
    h, a = MOONLIGHT.hidden, ATTENTION
    return [
        Program("MLA attention: q_proj and kv_a_proj_with_mqa", step_programs.projections,
                (spec(batch, h), spec(a.heads * a.key_dim, h), spec(a.latent_key_dim, h)), LAYERS),
        Program("MLA attention: latent cache append (kv_nope)", step_programs.kv_append,
                (spec(batch, 1, context - 1, a.latent), spec(batch, 1, 1, a.latent)), LAYERS),
        Program("MLA attention: latent cache append (k_rot)", step_programs.kv_append,
                (spec(batch, 1, context - 1, a.rope), spec(batch, 1, 1, a.rope)), LAYERS),
        Program("MLA attention: o_proj", lambda x, w: x @ w.T, (spec(batch, a.heads * a.v), spec(h, a.heads * a.v)),
                LAYERS),
        Program("router: logits, top-k", lambda x, w: step_programs.router(x, w, MOONLIGHT.top_k, False),
                (spec(batch, h), spec(MOONLIGHT.experts, h)), MOE_LAYERS),
        Program("shared experts (2 of 1408, one MLP)", gated_mlp, (spec(batch, h), spec(SHARED_INTERMEDIATE, h),
                                                                    spec(SHARED_INTERMEDIATE, h),
                                                                    spec(h, SHARED_INTERMEDIATE)), MOE_LAYERS),
        Program("layer 0's dense MLP", gated_mlp, (spec(batch, h), spec(DENSE_INTERMEDIATE, h),
                                                   spec(DENSE_INTERMEDIATE, h), spec(h, DENSE_INTERMEDIATE)), 1),
        *step_programs.step_programs(MOONLIGHT, batch),
    ]


def norm_shapes(batch: int) -> list[tuple[str, int, int, int]]:
    """(what, rows, width, per step): two hidden-size norms per layer and the final one; kv_a_layernorm."""
    return [("hidden-size norms", batch, MOONLIGHT.hidden, 2 * LAYERS + 1),
            ("kv_a_layernorm", batch, ATTENTION.latent, LAYERS)]


def default_programs(batch: int, context: int) -> list[Program]:
    call = Call("decode", batch, 1, context)
    attention = [per_step(dataclasses.replace(p, name=f"MLA attention (transformers): {p.name}"), LAYERS)
                 for p in programs.transformers_programs(ATTENTION, call)]
    norms = [Program(f"RMSNorm (XLA): {what} [{rows}, {width}]", step_programs.rms_norm,
                     (spec(rows, width), spec(width)), count) for what, rows, width, count in norm_shapes(batch)]
    local = MOONLIGHT.experts // 8
    return attention + norms + step_programs.batched_mm_programs(MOONLIGHT, batch, local)


def absorbed_programs(batch: int, context: int) -> list[Program]:
    return [per_step(dataclasses.replace(p, name=f"MLA attention (ours): {p.name}"), LAYERS)
            for p in programs.absorbed_programs(ATTENTION, Call("decode", batch, 1, context))]


def collective(batch: int) -> dict:
    size = batch * MOONLIGHT.hidden * 2
    at = {bound: all_reduce("experts all-reduce", size, V6E_8, Ici(ICI_LINK_BYTES_PER_S, hop)).time_s * 1e6
          for bound, hop in HOP_LATENCY_S.items()}
    return term("experts output all-reduce over the 8 chips", at["central"], MOE_LAYERS,
                priced_by="formula: perf.collectives.all_reduce", band_us=[at["low"], at["high"]],
                kind="formula (ICI hop latency band)", bytes=size)


def our_terms(built: dict, batch: int, context: int, cache, compiler) -> list[dict]:
    """Our kernels' terms: the latent kernel, RMSNorm, the fused experts layer."""
    from benchmarks.studies.decode_step.pricing import norm_term

    call = Call("decode", batch, 1, context)
    latent = kernels.latent_kernel(built["attention"], ATTENTION, call, GENERATION, latent_cache_bytes(ATTENTION, call))
    found = [term("MLA attention (ours): latent kernel", latent.get("us", float("nan")), LAYERS,
                  priced_by="grid replay of the latent kernel, v6e", band_us=latent.get("band_p90_us"),
                  kind="flash_attention", **({"error": latent["error"]} if "error" in latent else {}))]
    found += [norm_term(built["rmsnorm"], what, rows, width, count) for what, rows, width, count in norm_shapes(batch)]
    case = moe_layer.make_case(EXPERTS_SETTING, batch)
    row = moe_layer.measure_case(built["experts"], case, cache, compiler, rivals=[], generations=(GENERATION,))()[0]
    ours = row["variants"]["ours"]
    if not moe_layer.modelled(ours):
        return found + [term("experts: our fused experts layer", float("nan"), MOE_LAYERS, priced_by="not priced",
                             error=ours.get("error"))]
    return found + [term("experts: our fused experts layer (busiest chip)", ours["headline_us"], MOE_LAYERS,
                         priced_by=f"moe_layer's model of {moe_layer.LAYER_ENTRY} (EP8 router-masking, T={batch})",
                         band_us=ours["band"]["p90_us"], kind="pallas_ragged_dot", live_picks=row["live_picks"])]


def price(built: dict, batch: int, context: int, pricer, cache, compiler) -> dict:
    """Both paths' terms and totals, and the ratio."""
    shared, default_only = shared_programs(batch, context), default_programs(batch, context)
    absorbed = absorbed_programs(batch, context)
    queued = [(p, pricer.submit(p)) for p in shared + default_only + absorbed]
    priced = {p.name: pricer.finish(p, future) for p, future in queued}
    shared_terms = [priced[p.name] for p in shared] + [collective(batch)]
    paths = {"transformers_default": [priced[p.name] for p in default_only] + shared_terms,
             "kernelized": ([priced[p.name] for p in absorbed] + our_terms(built, batch, context, cache, compiler)
                            + shared_terms)}
    found = {name: {"terms": terms, "total": step_totals.total(terms)} for name, terms in paths.items()}
    ratio = found["transformers_default"]["total"]["ms"] / found["kernelized"]["total"]["ms"]
    attention = {name: sum(t["ms_per_step"] for t in path["terms"] if t["term"].startswith("MLA attention ("))
                 for name, path in found.items()}
    return {"model": MOONLIGHT.name, "source": SOURCE, "generation": GENERATION, "batch": batch, "context": context,
            "plan": "decode_step's plan (benchmarks/studies/decode_step/models.py PLAN_SOURCE): experts EP8 router "
                    "masking, one all-reduce per MoE layer, everything else replicated (16 attention heads per chip)",
            "paths": found, "ratio": ratio, "attention_ms": attention,
            "largest": {name: step_totals.largest(path["terms"]) for name, path in found.items()}}


def beside(decode_step_json: dict | None) -> list[dict]:
    """decode_step.json's models' totals and ratio (our full kernelized path), for the table beside this one."""
    rows = []
    for key, entry in sorted((decode_step_json or {}).get("models", {}).items()):
        paths = entry["paths"]
        rows.append({"model": entry["model"]["name"], "default_ms": paths["transformers_default"]["total"]["ms"],
                     "kernelized_ms": paths["kernelized"]["total"]["ms"],
                     "ratio": paths["transformers_default"]["total"]["ms"] / paths["kernelized"]["total"]["ms"],
                     "largest_default": step_totals.largest(paths["transformers_default"]["terms"]),
                     "largest_kernelized": step_totals.largest(paths["kernelized"]["terms"])})
    return rows
