"""mla.json -> one MLA layer's attention per call: every path's modelled µs, the forms' crossover, the rule against
the model's prices."""

from __future__ import annotations

from . import markdown_table

NAMES = {"moonlight-16b-a3b": "Moonlight-16B-A3B / V2-Lite / V3 TP8 (16 heads)",
         "deepseek-v3": "DeepSeek-V3, DP attention (128 heads)", "glm-4.7-flash": "GLM-4.7-Flash (20 heads)"}


def _us(value) -> str:
    return "not priced" if value is None else f"{value:.0f}"


def _band(band) -> str:
    return f" ({band[0]:.0f}-{band[1]:.0f})" if band else ""


def _ratio(value) -> str:
    return "" if value is None else f"{value:.1f}x"


def layer(data: dict) -> str:
    """One row per (model, call, generation)."""
    rows = []
    for line in data["summary"]["rows"]:
        pick = line["model_pick"] or "none"
        expanded = _us(line["expanded_us"]) + (" *" if line["expanded_stand_in"] else "")
        rows.append([NAMES.get(line["model"], line["model"]), line["call"], line["generation"],
                     _us(line["transformers_us"]), _us(line["absorbed_us"]), expanded,
                     f"{pick}: {_us(line['ours_us'])}{_band(line['ours_band_p90_us'])}",
                     line["rule_pick"] or "no rule", _us(line["vllm_us"]), _us(line["vllm_default_us"]),
                     _us(line["floor_us"]), _ratio(line.get("transformers_over_ours")),
                     _ratio(line.get("ours_over_floor"))])
    return markdown_table(["model (heads per chip)", "call", "gen", "transformers", "absorbed", "expanded",
                           "ours: the cheaper (p90 band)", "rule picks", "vLLM MLA v2", "vLLM at its default",
                           "latent floor", "transformers / ours", "ours / floor"],
                          "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|", rows)


def crossover(data: dict) -> str:
    """Per (model, generation): where the cheaper form changes as the queries per sequence grow."""
    rows = []
    for entry in data["summary"]["crossovers"]:
        picks = ", ".join(f"{c['call']}: {c['model_pick']}" for c in entry["calls"])
        rows.append([NAMES.get(entry["model"], entry["model"]), entry["generation"], picks,
                     "; ".join(entry["model_switches"]) or "none", "; ".join(entry["rule_switches"]) or "none"])
    return markdown_table(["model", "gen", "cheaper form per call (by queries per sequence)", "switches (model)",
                           "switches (rule)"], "|---|---|---|---|---|", rows)


def rule(data: dict) -> str:
    summary = data["summary"]
    if not summary["rule_checked"]:
        return f"The kernel's rule was not evaluated: {summary['rule_missing']}."
    found = summary["rule_disagreements"]
    lines = [f"The rule (`absorbed_is_cheaper`) against the model's prices: {summary['rule_checked']} calls checked, "
             f"{len(found)} where it picks the dearer form."]
    if found:
        lines += ["", markdown_table(["model", "call", "gen", "rule picks", "model picks", "rule's pick / best"],
                                     "|---|---|---|---|---|---:|",
                                     [[f["model"], f["call"], f["generation"], f["rule_pick"], f["model_pick"],
                                       f"{f['rule_pick_over_best']:.2f}"] for f in found])]
    return "\n".join(lines)


def _largest(terms: list[dict]) -> str:
    return ", ".join(f"{t['term']} {t['ms_per_step']:.1f}" for t in terms)


def decode_step(data: dict) -> str:
    """The MLA model's whole decode step beside decode_step.json's models (our full kernelized path each)."""
    found = data.get("decode_step")
    if not found:
        return "The whole decode step was not priced (`python -m benchmarks mla --step`)."
    paths = found["paths"]
    rows = [[f"{found['model']} (MLA)", f"{paths['transformers_default']['total']['ms']:.1f}",
             f"{paths['kernelized']['total']['ms']:.1f}", f"{found['ratio']:.1f}x",
             _largest(found["largest"]["transformers_default"]), _largest(found["largest"]["kernelized"])]]
    rows += [[entry["model"], f"{entry['default_ms']:.1f}", f"{entry['kernelized_ms']:.1f}", f"{entry['ratio']:.1f}x",
              _largest(entry["largest_default"]), _largest(entry["largest_kernelized"])] for entry in found["beside"]]
    return markdown_table(["model", "transformers' default, ms per step", "kernelized, ms per step", "ratio",
                           "largest terms, default (ms)", "largest terms, kernelized (ms)"],
                          "|---|---:|---:|---:|---|---|", rows)


def step_terms(data: dict) -> str:
    """Every term of the MLA model's step on both paths."""
    found = data.get("decode_step")
    if not found:
        return "The whole decode step was not priced (`python -m benchmarks mla --step`)."
    rows = []
    for name, path in found["paths"].items():
        for t in path["terms"]:
            rows.append([name, t["term"], f"{t['us_per_call']:.1f}", str(t["per_step"]), f"{t['ms_per_step']:.2f}",
                         t["error_kind"]])
    return markdown_table(["path", "term", "µs per call", "calls per step", "ms per step", "error kind"],
                          "|---|---|---:|---:|---:|---|", rows)


def render_markdown(data: dict) -> dict[str, str]:
    return {"layer": layer(data), "crossover": crossover(data), "rule": rule(data), "decode-step": decode_step(data),
            "step-terms": step_terms(data)}
