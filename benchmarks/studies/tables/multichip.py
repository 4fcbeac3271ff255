"""multichip.json -> the tables of docs/multichip.md and benchmarks/README.md: ms per decode step per layout."""

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


def render_markdown(data: dict) -> dict[str, str]:
    """multichip.json's tables by section: the step times with each layer's parts, and the assumptions."""
    return {"step-ms-and-layer-parts": step_times(data),
            "assumptions": assumptions(data)}
