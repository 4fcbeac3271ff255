"""The JSON's summary: per step, model and generation the four paths' totals and the copies' share; the notes say
whether the copies dominate, by how much, and what would remove them."""

from __future__ import annotations

from tpu_kernels.runtime.buckets import KEY_BUCKET_LINEAR_UNTIL

from .paths import PATHS
from .steps import GENERATIONS

# Copies above this share of the transformers path's time dominate it.
DOMINANT_SHARE_PCT = 50.0


def _figures(found: dict) -> dict:
    keep = ("total_us", "band_p90_us", "gather_us", "pad_us", "relayout_us", "relayout_missing", "kernel_us",
            "copies_share_pct", "error")
    return {key: found[key] for key in keep if key in found}


def summarise(rows: list[dict]) -> dict:
    table, dominated, ratios = [], [], []
    for row in rows:
        for generation in GENERATIONS:
            paths = row["per_generation"][generation]
            entry = {"model": row["model"], "step": row["step"], "generation": generation,
                     **{name: _figures(paths[name]) for name in PATHS}}
            table.append(entry)
            ours, in_place = paths["transformers_ragged"], paths["ours_in_place"]
            if "total_us" in ours and "total_us" in in_place:
                ratios.append(ours["total_us"] / in_place["total_us"])
                if ours["copies_share_pct"] > DOMINANT_SHARE_PCT:
                    copies = ours["gather_us"] + ours["pad_us"] + ours.get("relayout_us", 0.0)
                    dominated.append(f"{row['model']} | {row['step']} | {generation}: copies "
                                     f"{copies:.0f} us (gather {ours['gather_us']:.0f}, pad {ours['pad_us']:.0f}, "
                                     f"relayout {ours.get('relayout_us', 0.0):.0f}) of {ours['total_us']:.0f} us "
                                     f"({ours['copies_share_pct']:.0f} %), kernel {ours['kernel_us']:.0f} us; in "
                                     f"place {in_place['total_us']:.0f} us")
    return {
        "table": table,
        "copies_dominate": bool(dominated),
        "dominated": dominated,
        "transformers_ragged_over_in_place": {"min": round(min(ratios), 2), "max": round(max(ratios), 2)}
        if ratios else None,
        "notes": notes(dominated),
    }


def notes(dominated: list[str]) -> list[str]:
    found = [f"copies are over {DOMINANT_SHARE_PCT:.0f} % of the transformers path's modelled time in "
             f"{len(dominated)} of the (model, step, generation) cases: " + "; ".join(dominated)] if dominated else []
    return found + [
        "The copies are transformers' gather of every sequence's K and V out of the paged cache (index_select, a "
        "read and a write of every key row, each step and layer) and our pad of that packed copy to its key bucket "
        f"(another read and write of it, past {KEY_BUCKET_LINEAR_UNTIL} rows at most half as many again). What would "
        "remove them: transformers' block-table path on TPU (flash_attn_with_kvcache with the paged cache and a "
        "block table, today CUDA/XPU only), which would hand our ragged paged kernel the pages to read in place (the "
        "ours_in_place path); or, short of it, a kernel entry taking K/V of a fixed capacity with the valid rows "
        "given by cu_seqlens_k, which removes the pad (transformers would still gather). flash_api.py's behaviour "
        "is unchanged by this benchmark.",
        "At head_dim 64 (GPT-OSS) XLA's default layout of the packed K and V, of the paged cache and of the flash "
        "kernel's q and output is not row-major. The ragged kernel reads packed K and V whose rows are a multiple of "
        "128 (flash_api pads them to a key bucket) and a cache over pages of a multiple of 128 tokens "
        "(transformers' pages) in that layout (keys-minor), with no copy; over smaller pages XLA would copy the "
        "whole cache on every call. The flash kernel (the gradient path) reads q, K and V and writes its output in "
        "XLA's layout too (`relayout_us`, perf.argument_layouts, finds no copy). head_dim 128 and up are stored "
        "row-major.",
        "transformers_padded is what a gradient-enabled call runs: every sequence padded to the longest (and, with "
        "a prefill chunk, every sequence's queries to the chunk's), so its copies and kernel grow with the batch "
        "times the longest sequence.",
    ]
