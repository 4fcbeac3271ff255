"""decode_step.json -> the tables of benchmarks/results/pages/decode_step.md: a whole decode step on both paths."""

from __future__ import annotations

PATHS = ("transformers_default", "kernelized_experts", "kernelized")
HF_PATH = "kernelized_experts"
# Terms under this many ms per step on both paths are summed into one row of the terms table (the JSON has each).
SMALL_MS = 0.1


def _band(values: list[float], digits: int = 1) -> str:
    return f"{values[0]:.{digits}f}-{values[1]:.{digits}f}"


def step(data: dict) -> str:
    """Per model: each path's modelled ms per step (band), the ratios beside HF's, HF's measured step."""
    rows = ["| model, batch 64, v6e-8 | default ms | experts kernelized ms (HF's configuration) | all kernelized ms "
            "| ratio, experts kernelized | HF's measured ratio | ratio, all kernelized | ratios with an in-place "
            "cache | HF's measured step |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for model in data["models"].values():
        totals = {name: model["paths"][name]["total"] for name in PATHS}
        found = model["comparison"]
        cells = [f"{totals[name]['ms']:.1f} ({_band(totals[name]['band_ms'])})" for name in PATHS]
        ratios = [f"{found[name]['modelled_ratio']:.1f}x ({_band(found[name]['modelled_ratio_band'])})"
                  for name in PATHS[1:]]
        in_place = " / ".join(f"{model['without_cache_append']['ratio'][name]:.1f}x" for name in PATHS[1:])
        versus = found.get("kernelized_vs_hf")
        measured = f"{versus['hf_measured_ms']} ms" if versus else "not measured"
        rows.append(f"| {model['model']['name']} | {' | '.join(cells)} | {ratios[0]} | {found['hf_measured_ratio']}x "
                    f"| {ratios[1]} | {in_place} | {measured} |")
    return "\n".join(rows)


def terms(data: dict) -> str:
    """Per model and term: ms per step on each path (blank: not on that path) and how it was priced; the terms
    under `SMALL_MS` on every path as one row per model."""
    rows = ["| model | term | default ms | experts kernelized ms | all kernelized ms | priced by | error |",
            "| --- | --- | ---: | ---: | ---: | --- | --- |"]
    for model in data["models"].values():
        by_name: dict[str, dict] = {}
        for name in PATHS:
            for term in model["paths"][name]["terms"]:
                by_name.setdefault(term["term"], {"row": term})[name] = term["ms_per_step"]
        ordered = sorted(by_name.items(), key=lambda item: -max(item[1].get(p, 0.0) for p in PATHS))
        small = dict.fromkeys(PATHS, 0.0)
        count = 0
        for term_name, found in ordered:
            if max(found.get(p, 0.0) for p in PATHS) < SMALL_MS:
                count += 1
                for p in PATHS:
                    small[p] += found.get(p, 0.0)
                continue
            cells = " | ".join(f"{found[p]:.2f}" if p in found else "" for p in PATHS)
            row = found["row"]
            rows.append(f"| {model['model']['name']} | {term_name} | {cells} | {row['priced_by']} | {row['error_kind']} |")
        if count:
            sums = " | ".join(f"{small[p]:.2f}" for p in PATHS)
            rows.append(f"| {model['model']['name']} | {count} terms under {SMALL_MS} ms each (norms, router, "
                        f"batched_mm's small ops, embedding) | {sums} | as listed in the JSON | |")
    return "\n".join(rows)


def host(data: dict) -> str:
    """Per model and path: the eager step's host dispatches, and the steps and ratio at the per-op host cost that
    closes HF's measured step."""
    rows = ["| model | path | eager torch calls + kernel calls per step | step ms, host + device / the longer "
            "| ratio to default, host + device / the longer |", "| --- | --- | ---: | ---: | ---: |"]
    for model in data["models"].values():
        eager = model.get("eager_host")
        if not eager or "with_implied_op_cost" not in eager:
            continue
        at = eager["with_implied_op_cost"]
        for name in PATHS:
            ratio = (f"{at['serial']['ratio'][name]:.1f}x / {at['overlapped']['ratio'][name]:.1f}x"
                     if name in at["serial"]["ratio"] else "")
            rows.append(f"| {model['model']['name']} | {name} | {eager[name]['other_ops']} + {eager[name]['kernel_calls']} "
                        f"| {at['serial']['ms'][name]:.1f} / {at['overlapped']['ms'][name]:.1f} | {ratio} |")
    costs = next((m["eager_host"]["implied_op_cost_us"] for m in data["models"].values()
                  if "implied_op_cost_us" in m.get("eager_host", {})), None)
    if costs:
        rows += ["", f"Host cost per eager op: {costs['serial']} µs (host and device time add up) or "
                     f"{costs['overlapped']} µs (the longer sets the step), each the cost that makes Qwen3-30B-A3B's "
                     "step in HF's configuration equal HF's measurement; kernel calls at binding.json's minimum."]
    return "\n".join(rows)


def gaps(data: dict) -> str:
    """Per model, which term explains each gap between the model and HF's measurements (the JSON's words)."""
    lines = []
    for model in data["models"].values():
        lines.append(f"- **{model['model']['name']}**")
        lines += [f"  - {note}." for note in model["explanation"]]
    return "\n".join(lines)


def hf_kernel(data: dict) -> str:
    """The kernelized step with HF's own experts kernel as moe_layer prices it, against HF's measured step."""
    rows = ["| model | HF's experts kernel per layer µs (grid steps) | HF's configuration with it, device ms | HF's measured step, ms "
            "| grid-step cost the measurement allows, µs (with the kernel calls' host Python spent) |",
            "| --- | ---: | ---: | ---: | --- |"]
    for model in data["models"].values():
        check = model.get("hf_kernel_check")
        if not check or "hf_measured_step_ms" not in check:
            continue
        rows.append(f"| {model['model']['name']} | {check['tokamax_default_us']:.0f} ({check['tokamax_default_grid_steps']})"
                    f" | {check['kernelized_step_with_it_ms']:.1f} | {check['hf_measured_step_ms']} | "
                    f"{check['grid_step_cost_bound_us']} ({check.get('grid_step_cost_bound_with_host_us', '-')}) |")
    return "\n".join(rows)


RANGE_TERMS = {"grid_step_us": "grid step {0}-{1} µs", "hbm_share": "HBM share {0}-{1}",
               "batched_mm_scale": "batched_mm x{0}-{1}"}
KERNEL_ROWS = {"ours": "our fused experts layer", "hf_kernel": "HF's kernel (tokamax at its default tiles)"}


def ratio_ranges(data: dict) -> str:
    """Per model, HF's configuration with our experts kernel and with HF's own beside it: the step, its ratio to the
    default at the fitted constants, and the ratio over each unidentified term alone and over all at once."""
    sample = next((m["ratio_ranges"] for m in data["models"].values() if "ratio_ranges" in m), None)
    if sample is None:
        return "No model has HF's kernel priced at this batch."
    names = list(sample["ranges"])
    heads = [RANGE_TERMS[name].format(*sample["ranges"][name]) for name in names]
    rows = ["| model | experts kernel in HF's configuration | device ms per step (over grid step and HBM share) "
            "| ratio to default | " + " | ".join(f"ratio, {head}" for head in heads)
            + " | ratio, all at once | HF's measured step / ratio |",
            "| --- | --- | ---: | ---: |" + " ---: |" * (len(names) + 2)]
    for model in data["models"].values():
        found = model.get("ratio_ranges")
        if not found:
            continue
        versus = model["comparison"].get("kernelized_vs_hf")
        measured = (f"{versus['hf_measured_ms']} ms / " if versus else "not measured / ") + \
            f"{model['comparison']['hf_measured_ratio']}x"
        for key, label in KERNEL_ROWS.items():
            at = found["paths"][key]
            cells = " | ".join(f"{_band(at['ratio_alone'][name])}x" for name in names)
            rows.append(f"| {model['model']['name']} | {label} | {at['step_ms']:.1f} ({_band(at['step_ms_range'])}) "
                        f"| {at['ratio']:.1f}x | {cells} | {_band(at['ratio_all'])}x | {measured} |")
    rows += ["", f"batched_mm's upper multiplier: {sample['batched_mm_scale_from']}. Every range holds the other "
                 "terms at their fitted values; \"all at once\" takes every corner."]
    return "\n".join(rows)


def fitted(data: dict) -> str:
    """Each assumption, its value, and the measured figure it was fitted to."""
    rows = ["| assumption | value | fitted to |", "| --- | --- | --- |"]
    rows += [f"| {row['assumption']} | {row['value']} | {row['fitted_to']} |" for row in data["method"]["fitted_to"]]
    return "\n".join(rows)


def assumptions(data: dict) -> str:
    """What the step assumes and whence: context, plan, cache, model sizes, errors, what is left out."""
    method = data["method"]
    rows = ["| assumption | value and source |", "| --- | --- |",
            f"| context | {method['context_tokens']} tokens per request: {method['context_source']} |",
            f"| parallel plan | {method['plan']} |",
            f"| KV cache | {method['cache']} |",
            f"| pricing | {method['priced']}; {method['eager']} |",
            f"| calibrated error | {'; '.join(method['errors'].values())}. {method['error_note']} |"]
    for model in data["models"].values():
        facts = model["model"]
        rows.append(f"| {facts['name']} | {facts['parameters_b']} B parameters, {facts['active_parameters_b']} B "
                    f"active: {facts['source']} |")
    rows.append(f"| left out | {method['left_out']} |")
    return "\n".join(rows)


def render_markdown(data: dict) -> dict[str, str]:
    """decode_step.json's tables by section."""
    return {"step": step(data), "terms": terms(data), "host": host(data), "gaps": gaps(data),
            "hf-kernel": hf_kernel(data), "ratio-ranges": ratio_ranges(data), "fitted-to": fitted(data),
            "assumptions": assumptions(data)}
