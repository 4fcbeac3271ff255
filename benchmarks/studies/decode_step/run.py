"""`python -m benchmarks decode_step`: price both models' decode step on both paths and write the JSON."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from benchmarks.studies import kernel_repo, moe_layer, require_kernel_repo, result_path
from benchmarks.perf.chip import priced_at
from benchmarks.perf.collectives import HOP_LATENCY_S, ICI_LINK_BYTES_PER_S

from . import host_ops, programs, ranges, step
from .models import HF_KERNELIZED_STEP_MS, HF_SPEEDUP, MODELS, PLAN, PLAN_SOURCE, SOURCES, DecodeModel
from .pricing import GENERATION, XlaPricer, attention_term, bands_used, experts_term, norm_term

DEFAULT_OUT = result_path("decode_step.json")
BATCH = 64
# Assumed: HF's prompt and generation lengths are not in the repo. Tokens in the cache when the step runs.
CONTEXT = 1024


def load_built(repo: Path, build_dir: Path):
    import kernels

    from tpu_kernels.distribution.builder import build_kernel_repo

    return kernels.get_local_kernel(build_kernel_repo(repo, build_dir), backend="cpu")


def price_model(model: DecodeModel, batch: int, context: int, built: dict, pricer: XlaPricer,
                cache, compiler) -> tuple[dict, dict]:
    """Both paths' terms for `model`: (paths, our experts layer's moe_layer row)."""
    local = PLAN.local_experts(model)
    shared = [p for kind in model.attention for p in programs.attention_programs(model, kind, batch, context)]
    shared += programs.moe_programs(model, batch, local) + programs.step_programs(model, batch)
    default_only = [programs.sdpa_program(kind, batch, context) for kind in model.attention]
    default_only += programs.xla_norm_programs(model, batch) + programs.batched_mm_programs(model, batch, local)
    queued = [(p, pricer.submit(p)) for p in shared + default_only]
    priced = {p.name: pricer.finish(p, future) for p, future in queued}
    shared_terms = [priced[p.name] for p in shared] + [step.collective_term(model, batch)]
    experts, experts_row = experts_term(built["experts"], model, batch, cache, compiler)
    ours = [attention_term(built["attention"], kind, batch, context) for kind in model.attention]
    ours += [norm_term(built["rmsnorm"], what, rows, width, count)
             for what, rows, width, count in programs.norm_shapes(model, batch)]
    ours.append(experts)
    default = [priced[p.name] for p in default_only]
    paths = {"transformers_default": default + shared_terms,
             # HF's configuration: the experts kernelized, attention and norms as transformers runs them.
             "kernelized_experts": [t for t in default if not t["term"].startswith("batched_mm")] + [experts]
             + shared_terms,
             "kernelized": ours + shared_terms}
    return {name: {"terms": terms, "total": step.total(terms)} for name, terms in paths.items()}, experts_row


def tokamax_default_row(model: DecodeModel, batch: int, moe_layer_json: dict) -> dict | None:
    """moe_layer.json's row of HF's experts kernel (tokamax at its default tiles) at this step's case on v6e."""
    label = f"{model.moe_layer_model} EP8 router-masking T={batch}"
    return next((v for v in moe_layer_json.get("variants", [])
                 if v.get("label") == label and v.get("generation") == GENERATION
                 and v.get("variant") == "tokamax_default"), None)


def eager_layer_kinds(model: DecodeModel) -> dict[str, int]:
    """transformers' layer types of `model`'s attention kinds, with their layer counts."""
    return {("sliding_attention" if kind.window else "full_attention"): kind.layers for kind in model.attention}


def host_closure(results: dict) -> None:
    """If Qwen3's unexplained time in HF's configuration is host time: the per-op host cost it implies, and every
    model's steps and ratios with that cost on every path (`eager_host.with_implied_op_cost`)."""
    anchor = next((r for r in results.values() if "kernelized_vs_hf" in r["comparison"] and "eager_host" in r), None)
    if anchor is None:
        return
    versus = anchor["comparison"]["kernelized_vs_hf"]
    op_cost = step.implied_op_cost(versus["hf_measured_ms"], versus["modelled_device_ms"],
                                   anchor["eager_host"][step.HF_PATH])
    for result in results.values():
        if "eager_host" in result:
            result["eager_host"]["implied_op_cost_us"] = op_cost
            result["eager_host"]["implied_from"] = (
                f"{anchor['model']['name']}'s measured step in HF's configuration ({step.HF_PATH}): the host cost per "
                "eager op that makes its modelled device time plus host time (serial), or the longer of the two "
                "(overlapped), equal the measurement")
            result["eager_host"]["with_implied_op_cost"] = step.with_host(result["paths"], result["eager_host"],
                                                                          op_cost)


def ratio_closure(results: dict) -> None:
    """Every model's ratio in HF's configuration, ours and HF's kernel, over the terms no timing identifies
    (`ranges`); batched_mm's upper multiplier is the one that closes Qwen3's default step on HF's own figures."""
    from benchmarks.perf import chip, grid_step_s

    anchor = next((r for r in results.values() if "kernelized_vs_hf" in r["comparison"]), None)
    if anchor is None:
        return
    fitted_step_us = grid_step_s(GENERATION) * 1e6
    upper = ranges.batched_mm_scale_implied(anchor["paths"][step.DEFAULT]["terms"],
                                            anchor["comparison"]["kernelized_vs_hf"]["hf_implied_default_ms"],
                                            fitted_step_us)
    for result in results.values():
        check = result.get("hf_kernel_check")
        if check:
            result["ratio_ranges"] = {
                **ranges.ratio_ranges(result["paths"], check, result["model"]["layers"], fitted_step_us,
                                      chip.FITTED_RATES.hbm_fraction(GENERATION), upper),
                "batched_mm_scale_from": f"{anchor['model']['name']}: HF's measured kernelized step times its "
                                         "measured ratio, the default step HF's figures imply"}


def fitted_to() -> list[dict]:
    """Each assumption of the step, its value, and the measured figure it was fitted to (or that nothing was)."""
    from benchmarks.perf import chip, grid_step_s

    shares = json.loads(Path(chip.__file__).with_name("hbm_fractions.json").read_text())
    return [
        {"assumption": "v6e's cost per Pallas grid step", "value": f"{grid_step_s(GENERATION) * 1e6:.2f} us",
         "fitted_to": "tokamax's v5e timings of its Pallas ragged dot (v5e's fit, borrowed: tokamax's v6e timings "
                      "of that kind do not identify it, calibration_fit_v6e.json); HF's v6e figures bound it lower "
                      "(hf-kernel table), so the ratio is given over "
                      f"{ranges.GRID_STEP_RANGE_US[0]}-{ranges.GRID_STEP_RANGE_US[1]} us (ranges)"},
        {"assumption": "share of the peak HBM bandwidth", "value": f"{chip.FITTED_RATES.hbm_fraction(GENERATION):g}",
         "fitted_to": f"{shares['hbm_fraction_note'][GENERATION]}; v5e's: {shares['hbm_fraction_note']['v5e']}; "
                      "given over "
                      f"{ranges.HBM_SHARE_RANGE[0]}-{ranges.HBM_SHARE_RANGE[1]} (ranges)"},
        {"assumption": "batched_mm's gathers and batched matvecs, sdpa, the cache append, every XLA program",
         "value": "bytes at the HBM rate, no fixed cost per op",
         "fitted_to": "no measured figure: no TPU timing of these ops; batched_mm given up to the multiplier that "
                      "meets HF's implied default step (ranges)"},
        {"assumption": "our experts layer's error band", "value": "the Pallas ragged dot's p90, streaming",
         "fitted_to": calibration_describe("pallas_ragged_dot")},
        {"assumption": "our attention's error band", "value": "flash attention's p90, streaming",
         "fitted_to": calibration_describe("flash_attention")},
        {"assumption": "host cost per eager op", "value": "eager_host's implied cost",
         "fitted_to": "HF's measured Qwen3 kernelized step (the one figure it closes: no other check)"},
        {"assumption": "context, parallel plan, KV cache", "value": "as the assumptions table says",
         "fitted_to": "no measured figure: HF's run does not record them"},
        {"assumption": "all-reduce hop latency", "value": f"{HOP_LATENCY_S['low'] * 1e6:g}-{HOP_LATENCY_S['high'] * 1e6:g} us per hop",
         "fitted_to": "no measured figure: benchmarks.perf.collectives' formula"},
    ]


def calibration_describe(kind: str) -> str:
    from benchmarks.studies import calibration_bands

    return calibration_bands.describe(kind, GENERATION, "streaming")


def hf_257us_facts(moe_layer_json: dict) -> dict:
    """moe_layer's figure for HF's measured 257 us layer (its `hf_257us`) and the fitted v6e grid-step cost."""
    from benchmarks.perf import grid_step_s

    shapes = (moe_layer_json.get("hf_257us") or {}).get("shapes", {})
    ratios = [v["predicted_over_measured"] for v in shapes.values()]
    return {"fitted_grid_step_us": round(grid_step_s(GENERATION) * 1e6, 4),
            "hf_257us_predicted_over_measured": min(ratios) if ratios else None}


def method(batch: int, context: int) -> dict:
    return {
        "what": f"one decode step at batch {batch} on a v6e-8 (device time of the busiest chip) on three paths: "
                "transformers 5.25's default (batched_mm experts, sdpa, eager RMSNorm); kernelized_experts, HF's "
                "configuration (kernels-community/ragged-dot-tpu replaces the experts only), with our experts layer; "
                "kernelized, our experts, attention and RMSNorm kernels",
        "generation": GENERATION, "batch": batch,
        "context_tokens": context,
        "context_source": "assumed (a parameter, --context): HF's prompt and generation lengths are not in the repo; "
                          "every request holds this many tokens when the step runs",
        "plan": PLAN_SOURCE,
        "cache": "transformers' DynamicCache (generate's default): each layer's update concatenates the new token "
                 "to the cache, a new tensor (sliding layers keep the last window); the same on both paths",
        "priced": "XLA programs compiled ahead of time for v6e and priced by benchmarks.perf.program_time (no "
                  "fixed cost per op, no calibrated error); our kernels by their benchmarks' replays (experts: "
                  "moe_layer; attention: the attention benchmark; RMSNorm: the rmsnorm benchmark's replay); the "
                  "all-reduce by the formula of benchmarks.perf.collectives",
        "eager": "eager torch runs each op as its own program: batched_mm's weight gathers are priced as their own "
                 "programs (materialised, then read by bmm); small ops on [B, H] rows are grouped into the programs "
                 "listed",
        "errors": bands_used(),
        "error_note": "a path's band sums each term's band: our experts at the Pallas ragged dot's p90 error, our "
                      "attention at flash attention's, the all-reduce at its hop latencies (0.5-2 us); XLA programs "
                      "and RMSNorm carry none (no measurement covers them), so a band says nothing of them",
        "ici": {"link_bytes_per_s_one_way": ICI_LINK_BYTES_PER_S,
                "hop_latency_us": {k: v * 1e6 for k, v in HOP_LATENCY_S.items()}},
        "left_out": "host time of the eager step from the paths' totals (eager_host counts each path's torch ops "
                    "and gives the per-op host cost that closes HF's measured step; no measurement gives it), "
                    "sampling beyond argmax, RoPE, residual adds, reshapes and other "
                    "elementwise ops on [B, H] or [B, heads, D] rows (each under a megabyte), eager repeat_kv's "
                    "copy of the cache, which transformers 5.25 makes before sdpa when a mask is passed (left-padded "
                    "prompts) or the head dim exceeds 256 (Gemma 4's global layers): sdpa is priced with the GQA "
                    "heads broadcast; the fixed cost XLA charges per op",
    }


def explain(result: dict) -> list[str]:
    """Which term explains each gap between the model and HF's measurements, in words from the figures."""
    found, paths = result["comparison"], result["paths"]

    def top(name: str) -> str:
        return ", ".join(f"{t['term']} {t['ms_per_step']:.1f} ms" for t in step.largest(paths[name]["terms"]))

    hf_path, without = found[step.HF_PATH], result["without_cache_append"]
    notes = [
        f"default path {paths[step.DEFAULT]['total']['ms']:.1f} ms of device time: {top(step.DEFAULT)}; batched_mm's "
        f"ops are {100 * found['batched_mm_share_of_default']:.0f} % of it (XLA programs priced by their bytes at "
        "the HBM rate: no measured XLA gather or batched matvec calibrates them)",
        f"HF's configuration, the experts kernelized: {paths[step.HF_PATH]['total']['ms']:.1f} ms: {top(step.HF_PATH)}"
        f"; with our attention and RMSNorm too: {paths['kernelized']['total']['ms']:.1f} ms",
        f"ratio in HF's configuration {hf_path['modelled_ratio']:.1f}x (band {hf_path['modelled_ratio_band'][0]:.1f}-"
        f"{hf_path['modelled_ratio_band'][1]:.1f}) against HF's {found['hf_measured_ratio']}x. It is the default's "
        "batched_mm terms over the kernelized step, diluted by the terms both paths share: above all DynamicCache's "
        "concatenation of the whole cache in every layer, and attention. With an in-place cache update instead the "
        f"model gives {without['ratio'][step.HF_PATH]:.1f}x: the cache HF's generate used (not recorded) moves the "
        "modelled ratio by that much"]
    if "kernelized_vs_hf" in found:
        gap = found["kernelized_vs_hf"]
        notes.append(
            f"HF's measured step, {gap['hf_measured_ms']} ms, against {gap['modelled_device_ms']:.1f} ms of modelled "
            f"device time in its configuration ({gap['modelled_device_band_ms'][0]:.1f}-"
            f"{gap['modelled_device_band_ms'][1]:.1f}): {gap['unexplained_ms']:.1f} ms the device model does not hold. "
            "The term is the eager step's host time, which the device model leaves out (next note)")
        notes.append(
            f"HF's default step implied by its ratio is {gap['hf_implied_default_ms']:.0f} ms, "
            f"{1 / gap['default_modelled_over_implied']:.1f}x the modelled default device time: the term that would "
            "have to carry it is batched_mm's gathers and batched matvecs, priced at the HBM rate by their bytes; "
            "no TPU timing of an XLA gather of whole expert weights checks that rate")
    attention = {name: sum(t["ms_per_step"] for t in paths[name]["terms"]
                           if "softmax attention" in t["term"] or "flash attention" in t["term"])
                 for name in (step.DEFAULT, "kernelized")}
    if attention["kernelized"] > attention[step.DEFAULT]:
        notes.append(
            f"our attention kernel is priced above XLA's softmax attention ({attention['kernelized']:.1f} against "
            f"{attention[step.DEFAULT]:.1f} ms per step): the model prices an XLA op at its bytes alone, with no fixed "
            "or per-step cost (a floor), and our kernel at its calibrated figure with its grid steps' fitted cost; the "
            "difference is that asymmetry, not a measured one")
    eager = result.get("eager_host")
    if eager and "with_implied_op_cost" in eager:
        cost, at = eager["implied_op_cost_us"], eager["with_implied_op_cost"]
        smallest = min(result["host_kernel_calls_lower_bound"]["per_call_min_us"].values())
        notes.append(
            f"eager host dispatches per step (torch calls counted on the CPU, host_ops): {eager[step.DEFAULT]['other_ops']} "
            f"on the default path, {eager[step.HF_PATH]['other_ops']} plus {eager[step.HF_PATH]['kernel_calls']} "
            f"kernel calls in HF's configuration. Were Qwen3's unexplained time host time, an op would cost "
            f"{cost['serial']} us (host and device time adding up) or {cost['overlapped']} us (the longer of the two "
            f"setting the step; the cheapest kernel call binding.json times, RMSNorm's, costs {smallest} us of host "
            "Python). At that cost "
            f"on both paths the ratio in HF's configuration is {at['serial']['ratio'][step.HF_PATH]}x or "
            f"{at['overlapped']['ratio'][step.HF_PATH]}x: host time can explain HF's kernelized step, not its ratio, "
            "which needs the default path far slower than modelled")
    check = result.get("hf_kernel_check")
    if check and check.get("exceeds_measured_step"):
        bound = check.get("grid_step_cost_bound_with_host_us", check["grid_step_cost_bound_us"])
        notes.append(
            f"HF's own experts kernel (tokamax's, at its default tiles) as moe_layer prices it at this case, "
            f"{check['tokamax_default_us']:.0f} us per layer over {check['tokamax_default_grid_steps']} grid steps, "
            f"would make HF's configuration take {check['kernelized_step_with_it_ms']:.1f} ms of device time alone, "
            f"above HF's measured {check['hf_measured_step_ms']} ms. For that measurement one grid step of that kernel "
            f"can cost at most {check['grid_step_cost_bound_us']} us ({bound} us with the kernel calls' host Python "
            f"spent), against the fitted {check['fitted_grid_step_us']} us: the same term, the cost of near-empty grid "
            "steps on v6e, is what puts moe_layer's figure for HF's 257 us layer at "
            f"{check['hf_257us_predicted_over_measured']}x the measurement (unless HF ran other tiles); the step "
            "measurement says that price is too high, but no v6e timing says by how much")
    return notes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="One decode step of Qwen3-30B-A3B and Gemma 4 26B-A4B on v6e-8, "
                                                 "transformers' default path vs kernelized, modelled")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--context", type=int, default=CONTEXT, help="tokens in each request's KV cache")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--repo", type=Path, default=moe_layer.DEFAULT_REPO, help="the ragged-dot kernel repo")
    parser.add_argument("--attention-repo", type=Path, default=kernel_repo("attention-tpu"))
    parser.add_argument("--rmsnorm-repo", type=Path, default=kernel_repo("rmsnorm-tpu"))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=moe_layer.DEFAULT_CACHE)
    parser.add_argument("--no-cache", action="store_true")
    args = parser.parse_args(argv)
    for repo, option in ((args.repo, "--repo"), (args.attention_repo, "--attention-repo"),
                         (args.rmsnorm_repo, "--rmsnorm-repo")):
        require_kernel_repo(repo, option)
    started = time.perf_counter()
    cache_dir = None if args.no_cache else args.cache_dir
    cache = moe_layer.Cache(cache_dir)
    compiler = moe_layer.Compiler(cache, args.jobs)
    pricer = XlaPricer(cache, compiler)
    moe_layer_json = _read_json(moe_layer.DEFAULT_OUT)
    binding = _read_json(result_path("binding.json"))
    results = {}
    with moe_layer.build_folder(cache_dir) as experts_dir, tempfile.TemporaryDirectory() as other_dir:
        built = {"experts": moe_layer.load_kernel(args.repo, experts_dir),
                 "attention": load_built(args.attention_repo, Path(other_dir) / "attention"),
                 "rmsnorm": load_built(args.rmsnorm_repo, Path(other_dir) / "rmsnorm")}
        for key in args.models:
            paths = price_model(MODELS[key], args.batch, args.context, built, pricer, cache, compiler)[0]
            results[key] = model_result(key, paths, args.batch, binding, moe_layer_json or {})
            print(f"{MODELS[key].name}: " + ", ".join(f"{name} {path['total']['ms']:.2f} ms"
                                                      for name, path in paths.items()), flush=True)
    host_closure(results)
    ratio_closure(results)
    for result in results.values():
        result["explanation"] = explain(result) + ranges.explain(result)
    compiler.pool.shutdown()
    report = {"method": {**method(args.batch, args.context), "fitted_to": fitted_to()}, "priced_at": priced_at(),
              "models": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(moe_layer.dump_compact(moe_layer.rounded(report)) + "\n")
    run = {"seconds": round(time.perf_counter() - started, 1), "load_average": os.getloadavg()}
    moe_layer.RAW_DIR.mkdir(parents=True, exist_ok=True)
    (moe_layer.RAW_DIR / f"{args.out.stem}.run.json").write_text(json.dumps(run) + "\n")
    print(f"wrote {args.out} in {run['seconds']:.0f} s")
    return 0



def model_result(key: str, paths: dict, batch: int, binding: dict | None, moe_layer_json: dict) -> dict:
    """One model's entry of the JSON: its sizes and sources, both paths, and the comparisons with HF's figures."""
    model = MODELS[key]
    host = step.host_lower_bound(model, binding)
    experts = next(t for t in paths["kernelized"]["terms"] if t["term"].startswith("experts: our"))
    result = {
        "model": {"name": model.name, "source": SOURCES[key], "layers": model.layers, "hidden": model.hidden,
                  "vocab": model.vocab, "experts": model.experts, "top_k": model.top_k,
                  "expert_intermediate": model.expert_intermediate,
                  "dense_mlp_intermediate": model.dense_mlp_intermediate,
                  "attention": [vars(k) for k in model.attention],
                  "parameters_b": round(model.parameters / 1e9, 2),
                  "active_parameters_b": round(model.active_parameters / 1e9, 2),
                  "kv_cache_kib_per_token": model.kv_cache_bytes_per_token() / 1024},
        "plan": step.plan_facts(model),
        "hf": {"speedup": HF_SPEEDUP[key], "kernelized_step_ms": HF_KERNELIZED_STEP_MS.get(key)},
        "paths": paths,
        "host_kernel_calls_lower_bound": host,
        "without_cache_append": step.without_cache_append(paths),
        "comparison": step.compare(key, model, paths, host),
        "hf_kernel_check": None,
    }
    if batch == BATCH:  # moe_layer.json holds HF's kernel at this batch
        check = step.hf_kernel_check(key, model, paths[step.HF_PATH]["total"], experts,
                                     tokamax_default_row(model, batch, moe_layer_json), host)
        result["hf_kernel_check"] = check and {**check, **hf_257us_facts(moe_layer_json)}
    if host:
        result["eager_host"] = step.eager_host(host_ops.count(key, eager_layer_kinds(model)), host)
    return result


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
