"""rmsnorm.json -> rmsnorm-tpu's card tables: the kernels' HBM bytes over the minimum, and XLA's relayout copies."""

from __future__ import annotations

# The kernels as the card names them, in its order.
KERNELS = {
    "rms_norm": "RMSNorm",
    "fused_add_rms_norm": "fused add + RMSNorm",
    "rms_norm_backward": "RMSNorm backward",
    "fused_add_rms_norm_backward": "fused add + RMSNorm backward",
}
# The rows the card's roofline column is at, and the generation it is modelled on.
ROOFLINE_ROWS = 8192
ROOFLINE_GENERATION = "v6e"


def worst_ratio(results: list[dict], keep) -> str:
    """The largest HBM bytes / minimum over the results `keep` accepts and every generation; "not run" if none."""
    ratios = [figures["bytes_ratio"] for result in results if keep(result)
              for figures in result["per_generation"].values()]
    return f"{max(ratios):.3f}x" if ratios else "not run"


def traffic(results: list[dict]) -> str:
    """Per kernel: the worst bytes ratio at one row and at 64 rows or more (over every hidden size and generation),
    and the range of v6e's modelled share of the HBM roofline at 8192 rows."""
    rows = [f"| kernel | HBM bytes / minimum, 1 row | at >= 64 rows | {ROOFLINE_GENERATION} % of the HBM roofline "
            f"at {ROOFLINE_ROWS} rows |", "|---|---|---|---|"]
    for kernel, name in KERNELS.items():
        mine = [result for result in results if result["kernel"] == kernel]
        if not mine:
            raise KeyError(f"rmsnorm.json has no result for {kernel}")
        pcts = [result["per_generation"][ROOFLINE_GENERATION]["pct_of_roofline"] for result in mine
                if result["rows"] == ROOFLINE_ROWS]
        low, high = (f"{pct:.0f}" for pct in (min(pcts), max(pcts))) if pcts else ("", "")
        roofline = "not run" if not pcts else f"{low} %" if low == high else f"{low}–{high} %"
        rows.append(f"| {name} | {worst_ratio(mine, lambda r: r['rows'] == 1)} "
                    f"| {worst_ratio(mine, lambda r: r['rows'] >= 64)} | {roofline} |")
    return "\n".join(rows)


def relayouts(layouts: dict) -> str:
    """The rank-3/4 inputs whose compiled v6e program has XLA relayout copies, with the bytes it then moves."""
    rows = ["| shape | dtype | relayout copies | bytes accessed / minimum (v6e compile) |", "|---|---|---|---|"]
    for result in layouts["results"]:
        if result["relayout_copies"]:
            shape = "(" + ", ".join(str(dim) for dim in result["shape"]) + ")"
            rows.append(f"| {shape} | {result['dtype']} | {result['relayout_copies']} "
                        f"| {result['bytes_accessed_over_min']:.1f}x |")
    return "\n".join(rows)


def render_markdown(data: dict) -> dict[str, str]:
    """rmsnorm.json's tables by section."""
    return {"traffic": traffic(data["results"]), "relayouts": relayouts(data["v6e_nd_input_layouts"])}
