"""paged_attention.json -> attention-tpu's card tables: decode's share of the HBM roofline, the mixed batch's
share of the MXU peak, and the rivals' modelled times."""

from __future__ import annotations

GENERATIONS = ("v5e", "v6e", "tpu7x")
RIVALS = {"jax_paged_attention": "jax paged_attention", "vllm_rpa_v3": "vLLM RPA v3"}
# The page size the per-length and mixed-batch rows use (the benchmark's PLOT_PAGE_SIZE).
RIVAL_PAGE_SIZE = 128


def _relayout(figures: dict) -> str:
    """The part of a time that is XLA's copy of K/V into the kernel's layout, where there is one."""
    found = figures.get("relayout_us")
    return f", {found:.0f} of them XLA's relayout of K/V" if found and found >= 0.5 else ""


def _cell_pct(figures: dict, key: str) -> str:
    bound = "HBM" if figures["bound"] == "hbm" else "compute"
    return f"{figures[key]:.0f} % ({figures['modelled_time_us']:.0f} µs{_relayout(figures)}, {bound})"


def decode(results: list[dict]) -> str:
    """The mixed-length decode batch per model and page size: % of the HBM roofline, time, what bounds it."""
    rows = ["| model | page | " + " | ".join(GENERATIONS) + " |", "|---|---|" + "---|" * len(GENERATIONS)]
    for row in results:
        if row["kind"] == "decode" and row["context"] is None:
            cells = [_cell_pct(row["ours"][g], "pct_of_hbm_roofline_peak") for g in GENERATIONS]
            rows.append(f"| {row['model']} | {row['page_size']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def context(results: list[dict]) -> str:
    """Decode batches at one context length each: % of the HBM roofline per generation."""
    rows = ["| model | context | " + " | ".join(GENERATIONS) + " |", "|---|---|" + "---|" * len(GENERATIONS)]
    for row in results:
        if row["context"] is not None:
            cells = [f"{row['ours'][g]['pct_of_hbm_roofline_peak']:.0f} %" for g in GENERATIONS]
            rows.append(f"| {row['model']} | {row['context']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def mixed(results: list[dict]) -> str:
    """The prefill chunk + decode rows batch: % of the MXU peak (useful FLOPs) and of the HBM roofline."""
    rows = ["| model | " + " | ".join(GENERATIONS) + " |", "|---|" + "---|" * len(GENERATIONS)]
    for row in results:
        if row["kind"] == "mixed":
            cells = [f"{row['ours'][g]['pct_of_mxu_peak']:.0f} % MXU, {row['ours'][g]['pct_of_hbm_roofline_peak']:.0f} "
                     f"% HBM ({row['ours'][g]['modelled_time_us']:.0f} µs{_relayout(row['ours'][g])})"
                     for g in GENERATIONS]
            rows.append(f"| {row['model']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _rival_cell(rival: dict, generation: str) -> str:
    figures = rival.get("per_generation", {}).get(generation)
    if figures is None:
        return "n/a"
    if "error" in figures:
        return "not priced"
    return _time(figures)


def _time(figures: dict) -> str:
    found = figures.get("relayout_us")
    relayout = f" (relayout {found:.0f})" if found and found >= 0.5 else ""
    return f"{figures['modelled_time_us']:.0f}{relayout}"


def _default_cell(rival: dict, generation: str) -> str:
    """RPA v3 at vLLM's default block sizes: its modelled µs, or why not."""
    found = rival.get("per_generation", {}).get(generation, {}).get("vllm_default")
    if found is None:
        return "n/a"
    if "error" in found or "modelled_time_us" not in found:
        return "not priced"
    return f"{found['modelled_time_us']:.0f}"


def rivals(results: list[dict]) -> str:
    """Modelled µs of ours and of each rival (at its best configuration) per generation, at page RIVAL_PAGE_SIZE,
    each with the copies XLA makes of its arguments into its layout ("relayout", where there are any), and vLLM's
    RPA v3 at vLLM's default block sizes. "n/a": the rival cannot run the shape; "not priced": the model could not
    replay it, or its configuration does not fit VMEM (the JSON says why)."""
    names = ["ours", *RIVALS.values(), "vLLM RPA v3 at vLLM's default"]
    rows = ["| model | batch | gen | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(names)]
    for row in results:
        if row["page_size"] != RIVAL_PAGE_SIZE or (row["context"] is not None and row["context"] != 4096):
            continue
        for generation in GENERATIONS:
            ours = _time(row["ours"][generation])
            cells = [ours, *(_rival_cell(row["rivals"][key], generation) for key in RIVALS),
                     _default_cell(row["rivals"]["vllm_rpa_v3"], generation)]
            rows.append(f"| {row['model']} | {row['batch']} | {generation} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def render_markdown(data: dict) -> dict[str, str]:
    """paged_attention.json's tables by section."""
    results = data["results"]
    return {"decode": decode(results), "context": context(results), "mixed": mixed(results),
            "rivals": rivals(results)}
