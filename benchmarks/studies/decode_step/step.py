"""The step assembled from its priced terms: per-path totals, the ratio, and where the model meets or misses HF's
measurements. Pure arithmetic on term rows (`pricing.term`), so it is tested without compiling anything."""

from __future__ import annotations

import math

from benchmarks.perf.collectives import HOP_LATENCY_S, ICI_LINK_BYTES_PER_S, V6E_8, Ici, all_reduce

from .models import HF_KERNELIZED_STEP_MS, HF_SPEEDUP, PLAN, DecodeModel
from .pricing import term

BYTES_PER_ACTIVATION = 2
DEFAULT = "transformers_default"
# The kernelized path as Hugging Face ran it (the experts only, kernels-community/ragged-dot-tpu), with our
# experts layer; and with every kernel kernelize installs (experts, attention, RMSNorm).
HF_PATH = "kernelized_experts"
KERNELIZED = (HF_PATH, "kernelized")
# The torch calls each kernelized path hands to kernels (host_ops.REPLACED kinds).
REPLACED_BY_PATH = {HF_PATH: ("experts",), "kernelized": ("rmsnorm", "attention", "experts")}
CALL_KIND = {"rms_norm": "rmsnorm", "flash_attention": "attention", "gated_experts": "experts"}
CACHE_APPEND = "KV cache append"
# binding.json's kernel names -> the kernel calls of one decode step (eager: one host call each).
HOST_CALL_KINDS = ("rms_norm", "flash_attention", "gated_experts")


def collective_term(model: DecodeModel, batch: int) -> dict:
    """The experts output's all-reduce per MoE layer (the plan's only collective), at the central hop latency;
    its band at the low and high hop latencies."""
    size = batch * model.hidden * BYTES_PER_ACTIVATION
    at = {bound: all_reduce("experts all-reduce", size, V6E_8, Ici(ICI_LINK_BYTES_PER_S, hop)).time_s * 1e6
          for bound, hop in HOP_LATENCY_S.items()}
    return term("experts output all-reduce over the 8 chips", at["central"], model.layers,
                priced_by="formula: perf.collectives.all_reduce, 2 (N-1)/N S / (2 W) + 2 x diameter hops on the "
                          "2x4 mesh", band_us=[at["low"], at["high"]], kind="formula (ICI hop latency band)",
                bytes=size)


def total(terms: list[dict]) -> dict:
    """ms per step at the central figures and across the terms' bands; unpriced terms make it NaN (not hidden)."""
    central = sum(t["ms_per_step"] for t in terms)
    low = sum(t["ms_per_step_band"][0] for t in terms)
    high = sum(t["ms_per_step_band"][1] for t in terms)
    by_kind: dict[str, float] = {}
    for t in terms:
        by_kind[t["error_kind"]] = by_kind.get(t["error_kind"], 0.0) + t["ms_per_step"]
    return {"ms": round(central, 3), "band_ms": [round(low, 3), round(high, 3)],
            "ms_by_error_kind": {k: round(v, 3) for k, v in sorted(by_kind.items())},
            "complete": not any(math.isnan(t["ms_per_step"]) for t in terms)}


def largest(terms: list[dict], count: int = 3) -> list[dict]:
    ranked = sorted(terms, key=lambda t: -t["ms_per_step"])
    return [{"term": t["term"], "ms_per_step": t["ms_per_step"]} for t in ranked[:count]]


def differing_terms(default: list[dict], kernelized: list[dict]) -> list[dict]:
    """The terms only one path has (what kernelize replaces), with their ms per step: what the ratio rests on."""
    names_default = {t["term"] for t in default}
    names_kernelized = {t["term"] for t in kernelized}
    rows = [{"path": "default", "term": t["term"], "ms_per_step": t["ms_per_step"]}
            for t in default if t["term"] not in names_kernelized]
    rows += [{"path": "kernelized", "term": t["term"], "ms_per_step": t["ms_per_step"]}
             for t in kernelized if t["term"] not in names_default]
    return rows


def host_lower_bound(model: DecodeModel, binding: dict | None) -> dict | None:
    """Host Python of the fully kernelized step's kernel calls in eager mode (binding.json's minimum per call, launch
    stubbed out), a lower bound: every other eager torch op adds its own host cost, not measured here."""
    if not binding:
        return None
    per_call = binding["tpu_path_python"]["per_call_us"]
    calls = kernel_calls(model)
    ms = sum(calls[k] * per_call[k]["min_us"] for k in HOST_CALL_KINDS) / 1e3
    return {"kernel_calls_per_step": calls, "ms": round(ms, 3),
            "per_call_min_us": {k: round(per_call[k]["min_us"], 2) for k in HOST_CALL_KINDS},
            "smallest_call_us": round(min(v["min_us"] for v in per_call.values()), 2),
            "source": "benchmarks/results/binding.json tpu_path_python.per_call_us (min): host Python per call on "
                      "TPU tensors with the launch stubbed out, measured on this project's CPU host"}


def kernel_calls(model: DecodeModel) -> dict[str, int]:
    norms = model.layers * model.hidden_norms_per_layer + 1
    norms += sum(k.layers * (3 if k.v_norm else 2) for k in model.attention)
    return {"rms_norm": norms, "flash_attention": model.layers, "gated_experts": model.layers}


def hf_kernel_check(model_key: str, model: DecodeModel, kernelized: dict, experts: dict,
                    tokamax_default: dict | None, host: dict | None = None) -> dict | None:
    """The kernelized step with HF's experts kernel (tokamax's at its own default tiles, moe_layer's
    `tokamax_default` row at the same case) in place of ours, against HF's measured step.

    If that step alone exceeds the measured one, the model's price of that kernel (its grid-step cost over
    thousands of near-empty steps) cannot be right for the run HF measured: the bound on the step cost below
    is what the measured step allows, with every other term as modelled (and, in the second bound, the kernel
    calls' host Python lower bound spent too)."""
    if tokamax_default is None:
        return None
    measured = HF_KERNELIZED_STEP_MS.get(model_key)
    swapped_ms = kernelized["ms"] + model.layers * (tokamax_default["us"] - experts["us_per_call"]) / 1e3
    found = {"experts_case": tokamax_default["label"], "tokamax_default_us": tokamax_default["us"],
             "tokamax_default_grid_steps": tokamax_default["grid_steps"],
             "tokamax_default_step_cost_us": tokamax_default["step_cost_us"],
             "kernelized_step_with_it_ms": round(swapped_ms, 3)}
    if measured:
        other_ms = swapped_ms - model.layers * tokamax_default["step_cost_us"] / 1e3
        steps = model.layers * tokamax_default["grid_steps"]
        found["hf_measured_step_ms"] = measured
        found["exceeds_measured_step"] = swapped_ms > measured
        found["grid_step_cost_bound_us"] = round(max(measured - other_ms, 0.0) * 1e3 / steps, 4)
        if host:  # the experts' kernel calls only: HF's configuration makes no other
            calls_ms = host["kernel_calls_per_step"]["gated_experts"] * host["per_call_min_us"]["gated_experts"] / 1e3
            found["grid_step_cost_bound_with_host_us"] = round(
                max(measured - other_ms - calls_ms, 0.0) * 1e3 / steps, 4)
    return found


def compare(model_key: str, model: DecodeModel, paths: dict[str, dict], host: dict | None) -> dict:
    """Device times against HF's ratio and (Qwen3) HF's kernelized step, per kernelized path; HF's configuration
    (`HF_PATH`) is the one its figures compare with."""
    default = paths[DEFAULT]["total"]
    hf = HF_SPEEDUP[model_key]
    found = {"hf_measured_ratio": hf, "hf_path": HF_PATH,
             "batched_mm_share_of_default": round(share(paths[DEFAULT]["terms"], "batched_mm"), 4)}
    for name in KERNELIZED:
        kernelized = paths[name]["total"]
        ratio = default["ms"] / kernelized["ms"]
        # The ratio's spread: the default's low against the kernelized high, and the reverse.
        spread = [default["band_ms"][0] / kernelized["band_ms"][1], default["band_ms"][1] / kernelized["band_ms"][0]]
        found[name] = {"modelled_ratio": round(ratio, 2), "modelled_ratio_band": [round(v, 2) for v in spread],
                       "modelled_over_hf_ratio": round(ratio / hf, 3),
                       "ratio_terms": differing_terms(paths[DEFAULT]["terms"], paths[name]["terms"])}
    measured = HF_KERNELIZED_STEP_MS.get(model_key)
    if measured:
        kernelized = paths[HF_PATH]["total"]
        implied_default = measured * hf
        found["kernelized_vs_hf"] = {
            "hf_measured_ms": measured, "modelled_device_ms": kernelized["ms"],
            "modelled_device_band_ms": kernelized["band_ms"], "unexplained_ms": round(measured - kernelized["ms"], 3),
            "hf_implied_default_ms": round(implied_default, 1), "modelled_default_device_ms": default["ms"],
            "default_modelled_over_implied": round(default["ms"] / implied_default, 3)}
    return found


def without_cache_append(paths: dict[str, dict]) -> dict:
    """Every path and the ratios with DynamicCache's concatenation taken out, as an in-place cache update (a
    static cache in a compiled step with donated buffers) would leave them: the cache assumption's weight."""
    totals = {name: total([t for t in path["terms"] if CACHE_APPEND not in t["term"]])["ms"]
              for name, path in paths.items()}
    return {"ms": totals, "ratio": {name: round(totals[DEFAULT] / totals[name], 2) for name in KERNELIZED}}


def share(terms: list[dict], prefix: str) -> float:
    """The share of a path's ms per step in the terms whose name starts with `prefix`."""
    whole = sum(t["ms_per_step"] for t in terms)
    return sum(t["ms_per_step"] for t in terms if t["term"].startswith(prefix)) / whole


def plan_facts(model: DecodeModel) -> dict:
    return {"chips": PLAN.chips, "expert_parallel": PLAN.expert_parallel,
            "local_experts": PLAN.local_experts(model), "collective": PLAN.experts_collective}


def eager_host(ops: dict, host: dict) -> dict:
    """The eager step's host dispatches per path (`host_ops.count`'s per-step counts): the default's torch calls;
    a kernelized path's torch calls outside what it replaces, plus one kernel call per replaced module (whose host
    Python binding.json bounds)."""
    per_step = ops["per_step"]
    calls, per_call_us = host["kernel_calls_per_step"], host["per_call_min_us"]
    found = {"torch_calls_per_step": per_step,
             DEFAULT: {"other_ops": per_step["ops"], "kernel_calls": 0, "kernel_calls_host_ms": 0.0}}
    for name, replaced in REPLACED_BY_PATH.items():
        kept = [k for k in calls if CALL_KIND[k] in replaced]
        found[name] = {"other_ops": per_step["ops"] - sum(per_step[k] for k in replaced),
                       "kernel_calls": sum(calls[k] for k in kept),
                       "kernel_calls_host_ms": round(sum(calls[k] * per_call_us[k] for k in kept) / 1e3, 3)}
    return found


def implied_op_cost(measured_ms: float, device_ms: float, eager_path: dict) -> dict:
    """The host cost per eager op that makes a kernelized step take `measured_ms`: if host and device time add up
    (`serial`), or if the device runs behind the host and the longer sets the step (`overlapped`)."""
    spare = {"serial": measured_ms - device_ms - eager_path["kernel_calls_host_ms"],
             "overlapped": measured_ms - eager_path["kernel_calls_host_ms"]}
    return {how: round(max(ms, 0.0) * 1e3 / eager_path["other_ops"], 3) for how, ms in spare.items()}


def with_host(paths: dict[str, dict], eager: dict, op_cost_us: dict) -> dict:
    """Every path's step and the ratios with the host time at `op_cost_us` per eager op, per way of combining."""
    found = {}
    for how, us in op_cost_us.items():
        def combine(a: float, b: float) -> float:
            return a + b if how == "serial" else max(a, b)

        steps = {name: combine(paths[name]["total"]["ms"],
                               eager[name]["other_ops"] * us / 1e3 + eager[name]["kernel_calls_host_ms"])
                 for name in paths}
        found[how] = {"ms": {name: round(ms, 2) for name, ms in steps.items()},
                      "ratio": {name: round(steps[DEFAULT] / steps[name], 2) for name in KERNELIZED}}
    return found
