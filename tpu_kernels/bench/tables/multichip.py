"""multichip.json -> docs/multichip.md's table: ms per decode step per layout and batch, the winner in bold."""

from __future__ import annotations

# The layouts in the doc's column order.
LAYOUTS = ("tp", "ep_router", "ep_dispatch")


def step_times(data: dict) -> str:
    """Per batch, each layout's modelled ms per step (its low-high bounds in brackets); the batch's winner bold."""
    steps = {(entry["mode"], entry["batch"]): entry["per_step_ms"] for entry in data["entries"]}
    batches = sorted({batch for _, batch in steps})
    rows = ["| batch | " + " | ".join(f"`{layout}`" for layout in LAYOUTS) + " |",
            "| ---: |" + " ---: |" * len(LAYOUTS)]
    for batch in batches:
        winner = data["winner_per_batch"][str(batch)]["mode"]
        cells = []
        for layout in LAYOUTS:
            ms = steps[layout, batch]
            central = f"**{ms['central']:.2f}**" if layout == winner else f"{ms['central']:.2f}"
            cells.append(f"{central} ({ms['low']:.2f}-{ms['high']:.2f})")
        rows.append(f"| {batch} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def render_markdown(data: dict) -> dict[str, str]:
    """multichip.json's tables by section."""
    return {"step-ms": step_times(data)}
