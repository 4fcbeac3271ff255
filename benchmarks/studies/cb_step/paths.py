"""One step's paths on one layer and generation: their terms added up, the share that is copies, the band."""

from __future__ import annotations

from benchmarks.studies import calibration_bands

# The paths, in the table's order: what runs, and how.
PATHS = {
    "transformers_ragged": "transformers' gather + our bucketing pad + the ragged kernel (flash_attn_varlen_func "
                           "without a gradient)",
    "transformers_padded": "transformers' gather + every sequence padded to one length + the flash kernel "
                           "(flash_attn_varlen_func with a gradient)",
    "ours_in_place": "our ragged paged kernel reading transformers' paged cache in place (a block-table path)",
    "vllm_rpa_v3_in_place": "vLLM tpu-inference's RPA v3 reading its paged cache in place",
}
# The paths whose kernel runs after copies, and the copies (programs' names start with these) they run.
COPY_KINDS = ("gather", "pad", "unpad")


def path(copies: list[dict], kernel: dict, generation: str) -> dict:
    """A path's figures: copies (XLA programs, uncalibrated) + the copies XLA makes of the kernel's arguments into
    its layout in the kernel's own program (`relayout`, uncalibrated) + the kernel (calibrated band in its regime)."""
    if "modelled_time_us" not in kernel:
        return {"error": kernel.get("error", "the kernel is not priced")}
    failed = [term for term in copies if "error" in term]
    if failed:
        return {"error": "; ".join(f"{t['term']}: {t['error']}" for t in failed)}
    gather = sum(t["us"] for t in copies if t["term"].startswith("gather"))
    pad = sum(t["us"] for t in copies if not t["term"].startswith("gather"))
    relayout = kernel.get("relayout_us") or 0.0
    kernel_us = kernel.get("kernel_time_us", kernel["modelled_time_us"])
    total = gather + pad + relayout + kernel_us
    band = None
    if kernel.get("band_regime"):
        found = calibration_bands.band({"flash_attention": kernel_us * 1e-6}, generation, kernel["band_regime"],
                                       uncalibrated_s=(gather + pad + relayout) * 1e-6)
        band = found["p90_us"]
    return {
        "total_us": round(total, 2),
        "band_p90_us": band and [round(band[0], 2), round(band[1], 2)],
        "gather_us": round(gather, 2),
        "pad_us": round(pad, 2),
        "relayout_us": round(relayout, 2),
        **({"relayout_missing": kernel["relayout_missing"]} if "relayout_missing" in kernel else {}),
        "kernel_us": round(kernel_us, 2),
        "copies_share_pct": round(100.0 * (gather + pad + relayout) / total, 1),
        "copies_bytes": sum(t.get("hbm_bytes_per_call", 0) * t["calls"] for t in copies)
                        + (kernel.get("relayout_hbm_bytes") or 0),
        "kernel_hbm_bytes": kernel.get("hbm_bytes"),
        "kernel_bound": kernel.get("bound"),
        "kernel_tiles": kernel.get("tiles") or kernel.get("config"),
        "terms": [{"term": t["term"], "calls": t["calls"], "us": t["us"]} for t in copies]
                 + ([{"term": "relayout: XLA copies the kernel's arguments into its layout", "calls": 1,
                      "us": round(relayout, 2)}] if relayout else [])
                 + [{"term": "kernel", "calls": 1, "us": round(kernel_us, 2)}],
    }
