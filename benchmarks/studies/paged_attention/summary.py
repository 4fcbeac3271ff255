"""The JSON's summary (targets, rivals faster and why) and the figure (roofline share against context length)."""

from __future__ import annotations

from pathlib import Path

from .shapes import GENERATIONS, ROOFLINE_TARGET_PCT, TARGET_FROM_CONTEXT

RIVALS = ("jax_paged_attention", "vllm_rpa_v3")


# A rival this much faster or more is a material difference; below it, within the model's resolution (the grid
# step cost, the unoverlapped first and last copies) rather than a different cost.
MATERIAL_RATIO = 1.05
TERMS = ("hbm_term_us", "mxu_us", "vector_us", "step_overhead_us")


def _why(ours: dict, rival: dict) -> str:
    """What bounds each, and the model term that differs most between the two priced rows."""
    gaps = {term: ours[term] - rival[term] for term in TERMS}
    term = max(gaps, key=gaps.get)
    return (f"ours {ours['bound']}-bound, rival {rival['bound']}-bound; largest gap {term} "
            f"{ours[term]:.1f} vs {rival[term]:.1f} us")


def _miss(ours: dict) -> dict:
    """A decode point under the target: by how much (the time that would meet it) and what its time is made of."""
    time, overhead = ours["modelled_time_us"], ours["step_overhead_us"]
    relayout = ours.get("relayout_us") or 0.0
    busy = max(ours["hbm_term_us"], ours["mxu_us"], ours["vector_us"])
    target = ours["hbm_roofline_us"] * 100.0 / ROOFLINE_TARGET_PCT
    return {"pct_of_hbm_roofline": round(ours["pct_of_hbm_roofline_peak"], 1), "bound": ours["bound"],
            "hbm_term_us": round(ours["hbm_term_us"], 1), "mxu_us": round(ours["mxu_us"], 1),
            "vector_us": round(ours["vector_us"], 1), "step_overhead_us": round(overhead, 1),
            "modelled_time_us": round(time, 1), "relayout_us": round(relayout, 1),
            "time_for_target_us": round(target, 1), "bytes_over_min": round(ours["bytes_ratio"], 2),
            "why": (f"{ours['bound']}-bound: {time:.1f} us = the slower of copies ({ours['hbm_term_us']:.1f}, "
                    f"{ours['bytes_ratio']:.2f}x the minimum bytes) and "
                    f"compute (MXU {ours['mxu_us']:.1f}, vector {ours['vector_us']:.1f}) + {overhead:.1f} grid steps + "
                    f"{time - busy - overhead - relayout:.1f} not overlapped (first copies, last work, unbalanced "
                    f"phases) + {relayout:.1f} XLA's relayout of K/V before the kernel; "
                    f"the target needs {target:.1f} us")}


def summarise(rows: list[dict]) -> dict:
    misses, faster, decode = [], [], {}
    for row in rows:
        where = f"{row['model']} | {row['batch']} | page {row['page_size']}"
        for generation in GENERATIONS:
            ours = row["ours"][generation]
            if row["kind"] == "decode":
                decode.setdefault(row["model"], {}).setdefault(generation, {})[
                    str(row["context"] or "mixed") + f"@{row['page_size']}"] = round(ours["pct_of_hbm_roofline_peak"], 1)
                if (row["context"] or TARGET_FROM_CONTEXT) >= TARGET_FROM_CONTEXT and \
                        ours["pct_of_hbm_roofline_peak"] < ROOFLINE_TARGET_PCT:
                    misses.append({"where": where, "generation": generation, **_miss(ours)})
            for name in RIVALS:
                rival = row["rivals"][name].get("per_generation", {}).get(generation, {})
                if "modelled_time_us" in rival and rival["modelled_time_us"] < ours["modelled_time_us"]:
                    ratio = ours["modelled_time_us"] / rival["modelled_time_us"]
                    faster.append({"where": where, "generation": generation, "rival": name,
                                   "ours_over_rival": round(ratio, 3), "material": ratio >= MATERIAL_RATIO,
                                   "ours_terms_us": {t: round(ours[t], 1) for t in TERMS},
                                   "rival_terms_us": {t: round(rival[t], 1) for t in TERMS},
                                   "why": _why(ours, rival)})
    return {
        "decode_pct_of_hbm_roofline": decode,
        "meets_decode_target": not misses,
        "decode_target_misses": misses,
        "no_rival_faster": not faster,
        "rivals_materially_faster": sum(1 for f in faster if f["material"]),
        "rivals_faster": faster,
        "note": "pct_of_hbm_roofline = (K/V rows some query sees, read once, + q + out) at the peak HBM bandwidth / "
                "the modelled time (pct_of_hbm_roofline_fitted: at the fitted share, the JSON's hbm_fraction). A miss names the model's terms: hbm_term_us (copies), mxu_us, "
                "vector_us (softmax work); the slower is what bounds the kernel; bytes_over_min, the bytes the kernel "
                "moves over that minimum. At head_dim 64 over pages of a multiple of 128 tokens the cache is read "
                "as XLA stores it, keys minor, where a DMA moves whole 128-key tiles (Mosaic refuses a lane offset "
                "that is no multiple of 128 in HBM): a 128-key window (GPT-OSS) at its keys' positions mostly "
                "straddles two, which no kernel reading that layout avoids. Over window rings (transformers' "
                "sliding-layer pages) or the varlen keys transformers gathers from them, a decode row's window is "
                "one tile. A rival faster by less than "
                f"{MATERIAL_RATIO}x is listed with material false: within the model's resolution.",
    }


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({row["model"] for row in rows})
    fig, axes = plt.subplots(1, len(GENERATIONS), figsize=(5 * len(GENERATIONS), 4.6), sharey=True)
    for ax, generation in zip(axes, GENERATIONS):
        for model in models:
            points = sorted((row["context"], row["ours"][generation]) for row in rows
                            if row["model"] == model and row["context"] is not None)
            if not points:
                continue
            xs = [c for c, _ in points]
            ys = [p["pct_of_hbm_roofline_peak"] for _, p in points]
            line, = ax.plot(xs, ys, marker="o", label=model)
            bands = [p.get("band_p90_us") for _, p in points]
            if all(bands):
                roof = [p["hbm_roofline_us"] for _, p in points]
                # No chip beats its roofline: the band stops at 100 %.
                ax.fill_between(xs, [100 * r / b[1] for r, b in zip(roof, bands)],
                                [min(100.0, 100 * r / b[0]) for r, b in zip(roof, bands)], color=line.get_color(),
                                alpha=0.15)
            for name, marker in zip(RIVALS, ("x", "s")):
                rival = [(row["context"], row["rivals"][name].get("per_generation", {}).get(generation, {}))
                         for row in rows if row["model"] == model and row["context"] is not None]
                rival = [(c, r["pct_of_hbm_roofline_peak"]) for c, r in rival if "pct_of_hbm_roofline_peak" in r]
                if rival:
                    ax.plot(*zip(*sorted(rival)), marker=marker, linestyle=":", color=line.get_color(),
                            label=f"{model}: {name}")
        ax.axhline(ROOFLINE_TARGET_PCT, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{generation}: decode B=64, page 128")
        ax.set_xlabel("context length (tokens)")
    axes[0].set_ylabel("% of HBM roofline (modelled; band: calibrated p90)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
