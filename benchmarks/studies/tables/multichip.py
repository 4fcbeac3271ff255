"""multichip.json -> the tables of docs/multichip.md and its study page: ms per decode step per layout."""

from __future__ import annotations

# The layouts in the docs' column order.
LAYOUTS = ("tp", "ep_router", "ep_dispatch")


def step_times(data: dict) -> str:
    """Per batch, each layout's modelled ms per step (its low-high bounds in brackets), the batch's winner bold,
    then what one layer spends in the experts layer and in collectives."""
    entries = {(entry["mode"], entry["batch"]): entry for entry in data["entries"]}
    header = ("| batch | " + " | ".join(f"`{layout}`" for layout in LAYOUTS)
              + " | experts layer us (tp / router / dispatch) | collectives us per layer (tp / router / dispatch) |")
    rule = "| ---: |" + " ---: |" * len(LAYOUTS) + " --- | --- |"
    rows = [header, rule]
    for batch in sorted({batch for _, batch in entries}):
        winner = data["winner_per_batch"][str(batch)]["mode"]
        layouts = [entries[layout, batch] for layout in LAYOUTS]
        cells = []
        for layout, entry in zip(LAYOUTS, layouts):
            ms = entry["per_step_ms"]
            central = f"**{ms['central']:.2f}**" if layout == winner else f"{ms['central']:.2f}"
            cells.append(f"{central} ({ms['low']:.2f}-{ms['high']:.2f})")
        cells.append(" / ".join(f"{entry['experts_layer_us']['central']:.1f}" for entry in layouts))
        cells.append(" / ".join(f"{entry['collectives_us_per_layer']['central']:.1f}" for entry in layouts))
        rows.append(f"| {batch} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def assumptions(data: dict) -> str:
    """The collectives' formulas and the interconnect and host figures they are priced with, with their sources."""
    method = data["method"]
    ici = method["ici"]
    hop, host = ici["hop_latency_us"], method["host_sync_us"]
    rows = ["| assumption | central | low | high |", "| --- | --- | --- | --- |"]
    rows += [f"| {name} | {formula} | | |" for name, formula in sorted(method["formulas"].items())]
    rows += [f"| mesh | {ici['mesh']['rows']}x{ici['mesh']['cols']}, {ici['diameter_hops']} hops across | | |",
             f"| W, one link one way | {ici['link_bytes_per_s_one_way'] / 1e9:.0f} GB/s | | |",
             f"| latency per hop | {hop['central']:g} µs | {hop['low']:g} µs | {hop['high']:g} µs |",
             f"| host sync (`ep_dispatch`) | {host['central']:g} µs | {host['low']:g} µs | {host['high']:g} µs |",
             "", f"Sources: {ici['sources']}.", "", f"Left out: {method['left_out']}."]
    return "\n".join(rows)


FUSED_LAYOUTS = ("vllm_fused_ep_moe", "ep_router", "ep_dispatch")


def fused_cell(layout: dict) -> str:
    if "error" in layout:
        return "refused: " + layout["error"].removeprefix("lowering failed: ")
    us = layout["per_layer_us"]
    return (f"{us['central']:.1f} ({us['low']:.1f}-{us['high']:.1f}) = {layout['layer_us']:.1f} + "
            f"{layout['collectives_us']['central']:.1f}")


def fused_against_ours(data: dict) -> str:
    """Per chip count and batch: vLLM's fused_ep_moe and ours in each EP layout, µs per MoE layer on the busiest
    chip (low-high) = experts layer + collectives, the fastest bold, and the fused kernel's searched blocks."""
    fused = data["fused_ep_moe"]
    rows = ["| chips (mesh) | batch | " + " | ".join(f"`{name}` µs" for name in FUSED_LAYOUTS)
            + " | fused blocks (bt / bf / bd1 / bd2) |", "| ---: | ---: |" + " ---: |" * len(FUSED_LAYOUTS) + " --- |"]
    for entry in fused["entries"]:
        layouts = entry["layouts"]
        cells = [f"**{fused_cell(layouts[name])}**" if name == entry["fastest"] else fused_cell(layouts[name])
                 for name in FUSED_LAYOUTS]
        sizes = layouts["vllm_fused_ep_moe"].get("block_sizes")
        blocks = "/".join(str(sizes[k]) for k in ("bt", "bf", "bd1", "bd2")) if sizes else ""
        rows.append(f"| {entry['chips']} ({fused['meshes'][str(entry['chips'])]}) | {entry['batch']} | "
                    + " | ".join(cells) + f" | {blocks} |")
    return "\n".join(rows)


def render_markdown(data: dict) -> dict[str, str]:
    """multichip.json's tables by section: the step times with each layer's parts, the assumptions, and vLLM's
    fused kernel across chips against ours."""
    return {"step-ms-and-layer-parts": step_times(data),
            "assumptions": assumptions(data),
            "fused-ep-moe-against-ours": fused_against_ours(data)}
