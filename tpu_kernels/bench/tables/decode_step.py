"""decode_step.json -> the tables of benchmarks/README.md and README.md: a whole decode step on both paths."""

from __future__ import annotations

PATHS = ("transformers_default", "kernelized")
# Terms under this many ms per step on both paths are summed into one row of the terms table (the JSON has each).
SMALL_MS = 0.1


def _band(values: list[float], digits: int = 1) -> str:
    return f"{values[0]:.{digits}f}-{values[1]:.{digits}f}"


def step(data: dict) -> str:
    """Per model: both paths' modelled ms per step (band), the ratio beside HF's, the kernelized step beside HF's."""
    rows = ["| model, batch 64, v6e-8 | default ms (band) | kernelized ms (band) | ratio (band) | HF's measured ratio "
            "| ratio with an in-place cache | kernelized vs HF's measured step |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for model in data["models"].values():
        totals = {name: model["paths"][name]["total"] for name in PATHS}
        found = model["comparison"]
        versus = found.get("kernelized_vs_hf")
        measured = (f"{versus['modelled_device_ms']:.1f} ms of device time vs {versus['hf_measured_ms']} ms measured"
                    if versus else "not measured by HF")
        rows.append(
            f"| {model['model']['name']} | {totals['transformers_default']['ms']:.1f} "
            f"({_band(totals['transformers_default']['band_ms'])}) | {totals['kernelized']['ms']:.1f} "
            f"({_band(totals['kernelized']['band_ms'])}) | {found['modelled_ratio']:.1f}x "
            f"({_band(found['modelled_ratio_band'])}) | {found['hf_measured_ratio']}x | "
            f"{model['without_cache_append']['ratio']:.1f}x | {measured} |")
    return "\n".join(rows)


def terms(data: dict) -> str:
    """Per model and term: ms per step on each path (blank: not on that path) and how it was priced; the terms
    under `SMALL_MS` on both paths as one row per model."""
    rows = ["| model | term | default ms | kernelized ms | priced by | error |", "| --- | --- | ---: | ---: | --- | --- |"]
    for model in data["models"].values():
        by_name: dict[str, dict] = {}
        for name in PATHS:
            for term in model["paths"][name]["terms"]:
                by_name.setdefault(term["term"], {"row": term})[name] = term["ms_per_step"]
        ordered = sorted(by_name.items(), key=lambda item: -max(item[1].get(p, 0.0) for p in PATHS))
        small = {p: 0.0 for p in PATHS}
        count = 0
        for term_name, found in ordered:
            if max(found.get(p, 0.0) for p in PATHS) < SMALL_MS:
                count += 1
                for p in PATHS:
                    small[p] += found.get(p, 0.0)
                continue
            cells = [f"{found[p]:.2f}" if p in found else "" for p in PATHS]
            row = found["row"]
            rows.append(f"| {model['model']['name']} | {term_name} | {cells[0]} | {cells[1]} | {row['priced_by']} "
                        f"| {row['error_kind']} |")
        if count:
            rows.append(f"| {model['model']['name']} | {count} terms under {SMALL_MS} ms each (norms, router, "
                        f"batched_mm's small ops, embedding) | {small[PATHS[0]]:.2f} | {small[PATHS[1]]:.2f} | "
                        "as listed in the JSON | |")
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
    rows = ["| model | HF's experts kernel per layer µs (grid steps) | kernelized step with it, ms | HF's measured step, ms "
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
    return {"step": step(data), "terms": terms(data), "gaps": gaps(data), "hf-kernel": hf_kernel(data),
            "assumptions": assumptions(data)}
