"""cb_step.json -> the continuous-batching step's table: per model, step and generation each path's modelled µs
per attention layer, and the share of transformers' path that is copies."""

from __future__ import annotations

from . import markdown_table


def _band(found: dict) -> str:
    band = found.get("band_p90_us")
    return f" ({band[0]:.0f}-{band[1]:.0f})" if band else ""


def _total(found: dict) -> str:
    return "not priced" if "total_us" not in found else f"{found['total_us']:.0f}{_band(found)}"


def step(data: dict) -> str:
    """One row per (model, step, generation): transformers' path with our ragged kernel (its gather, pad, XLA's
    relayout of the kernel's arguments and kernel, the copies' share), the same with a gradient, and the kernels reading the pages in place."""
    rows = []
    for entry in data["summary"]["table"]:
        ours, padded = entry["transformers_ragged"], entry["transformers_padded"]
        parts = (f"{ours['gather_us']:.0f} / {ours['pad_us']:.0f} / {ours.get('relayout_us', 0.0):.0f} / "
                 f"{ours['kernel_us']:.0f}"
                 if "total_us" in ours else "")
        share = f"{ours['copies_share_pct']:.0f} %" if "total_us" in ours else ""
        gradient = (f"{padded['total_us']:.0f} ({padded['copies_share_pct']:.0f} %)" if "total_us" in padded
                    else "not priced")
        rows.append([entry["model"], entry["step"], entry["generation"], _total(ours), parts, share, gradient,
                     _total(entry["ours_in_place"]), _total(entry["vllm_rpa_v3_in_place"])])
    return markdown_table(["model", "step", "gen", "transformers + ours, µs (p90 band)",
                           "gather / pad / relayout / kernel, µs", "copies", "with a gradient, µs (copies)",
                           "ours in place, µs", "vLLM RPA v3 in place, µs"],
                          "|---|---|---|---:|---:|---:|---:|---:|---:|", rows)


def render_markdown(data: dict) -> dict[str, str]:
    return {"step": step(data)}
