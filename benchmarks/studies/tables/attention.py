"""attention.json -> attention-tpu's card tables: the forward's bytes and v6e time, the backward per kernel."""

from __future__ import annotations

from benchmarks.studies.calibration_bands import span

# The forward shapes the card shows, by the benchmark's label -> the card's name.
FORWARD_SHAPES = {
    "decode B=8 cache=4096": "decode B=8, cache 4096",
    "decode B=8 cache=32768": "decode B=8, cache 32768",
    "decode B=8 static cache=32768, lengths 1k..32k": "decode B=8, static cache 32768, lengths 1k–32k",
    "prefill B=1 S=4096": "prefill B=1, S=4096, causal",
    "decode B=8 cache=4096 D=64 (gpt-oss-like)": "GPT-OSS-20B: decode B=8, cache 4096",
    "prefill B=1 S=4096 window=128 D=64 (gpt-oss-like)": "GPT-OSS-20B: prefill B=1, S=4096, window 128",
}
# The backward's training shapes, by the benchmark's label -> the card's name (heads and D come from the JSON).
BACKWARD_SETTINGS = {
    "qwen3-30b-a3b B=1 S=8192 causal": "Qwen3-30B-A3B, causal",
    "gemma-4-26b-a4b sliding layer B=1 S=8192 window=1024 D=256": "Gemma-4-26B-A4B sliding layer, window 1024",
    "gpt-oss-20b B=1 S=8192 window=128 sinks D=64": "GPT-OSS-20B, window 128, sinks",
}
BACKWARD_GENERATIONS = ("v5e", "v6e")
# The forward shapes the card shows on every generation.
PER_GENERATION_SHAPES = {
    "decode B=1 cache=4096": "decode B=1, cache 4096",
    "decode B=8 cache=4096": "decode B=8, cache 4096",
    "decode B=8 cache=32768": "decode B=8, cache 32768",
    "prefill B=1 S=4096": "prefill B=1, S=4096, causal",
    "prefill B=1 S=8192": "prefill B=1, S=8192, causal",
    "decode B=8 cache=4096 D=64 (gpt-oss-like)": "GPT-OSS-20B: decode B=8, cache 4096",
    "prefill B=1 S=4096 window=128 D=64 (gpt-oss-like)": "GPT-OSS-20B: prefill B=1, S=4096, window 128",
}
GENERATIONS = ("v5e", "v6e", "v5p", "tpu7x")
# Below this many µs a relayout rounds to 0 µs and is not shown (the benchmark's RELAYOUT_SHOWN_FROM_US): at head_dim
# 128 and up the only copies are the kernel's scalar operands staged into SMEM (nanoseconds).
RELAYOUT_SHOWN_FROM_US = 0.5


def relayout_us(figures: dict, prefix: str = "") -> float:
    """The µs of XLA's relayout copies a figure includes, 0 where none are shown (or the row was not probed)."""
    found = figures.get(f"{prefix}relayout_us") or 0.0
    return found if found >= RELAYOUT_SHOWN_FROM_US else 0.0


def relayout_note(figures: dict) -> str:
    """"; N µs of it XLA's relayout" where the time includes one, else nothing."""
    found = relayout_us(figures)
    return f"; {found:.0f} µs of it XLA's relayout" if found else ""


def by_label(results: list[dict], names: dict[str, str]) -> list[tuple[str, dict]]:
    """(card name, result) for each label in `names`, in the card's order; a label the JSON lacks is a KeyError."""
    found = {result["label"]: result for result in results}
    missing = [label for label in names if label not in found]
    if missing:
        raise KeyError(f"attention.json has no result labelled {', '.join(missing)}")
    return [(name, found[label]) for label, name in names.items()]


def forward(results: list[dict]) -> str:
    """Per shape: HBM bytes over the minimum on v5e and v6e, and v6e's modelled time with its band and roofline,
    and the part of it that is XLA's relayout of the kernel's arguments and result, where there is one."""
    rows = ["| shape | HBM bytes / minimum (v5e, v6e) | modelled v6e time (p90 band) |", "|---|---|---|"]
    for name, result in by_label(results, FORWARD_SHAPES):
        v5e, v6e = result["per_generation"]["v5e"], result["per_generation"]["v6e"]
        # A compute-bound shape's percentage is of the MXU roofline, which the column does not name: say the bound.
        bound = f"{v6e['pct_of_roofline']:.0f}% of the HBM roofline" if v6e["bound"] == "hbm" else "compute-bound"
        rows.append(f"| {name} | {v5e['bytes_ratio']:.3f}, {v6e['bytes_ratio']:.3f} "
                    f"| {v6e['modelled_time_us']:.0f} µs ({span(v6e['band_p90_us'], dash='–')}; {bound}"
                    f"{relayout_note(v6e)}) |")
    return "\n".join(rows)


def per_generation(results: list[dict]) -> str:
    """Per shape and generation: the modelled time, and its share of the roofline with what bounds it (and
    XLA's relayout in it, where there is one)."""
    rows = ["| shape | " + " | ".join(GENERATIONS) + " |", "|---|" + "---|" * len(GENERATIONS)]
    for name, result in by_label(results, PER_GENERATION_SHAPES):
        cells = []
        for generation in GENERATIONS:
            figures = result["per_generation"][generation]
            bound = "HBM" if figures["bound"] == "hbm" else "MXU"
            cells.append(f"{figures['modelled_time_us']:.0f} µs ({figures['pct_of_roofline']:.0f} % of the {bound} "
                         f"roofline{relayout_note(figures)})")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def tiles(kernel: dict) -> str:
    """A backward kernel's tiles as the card writes them: q block, kv block, KV heads per grid step."""
    return f"{kernel['block_q']}, {kernel['block_kv']}, {kernel['kv_heads_per_step']}"


def backward(backward_run: dict) -> str:
    """Per training shape and generation: each kernel's tiles, time and % of its roofline, backward over forward."""
    target = backward_run["summary"]["target_pct_of_roofline_per_kernel"]

    def kernel_cell(kernel: dict) -> str:
        pct = f"{kernel['pipelined_pct_of_roofline']:.0f} %"
        if kernel["pipelined_pct_of_roofline"] >= target:
            pct = f"**{pct}**"  # bold: the kernel meets the target
        return f"{kernel['modelled_pipelined_time_us']:.0f} µs, {pct}"

    def relayout_cell(figures: dict) -> str:
        backward_us, forward_us = relayout_us(figures), relayout_us(figures, "forward_")
        return f" {backward_us:.0f} µs, {forward_us:.0f} µs |" if backward_us or forward_us else " none |"

    shown = by_label(backward_run["results"], BACKWARD_SETTINGS)
    # The relayout column only where some row has a relayout.
    with_relayout = any(relayout_us(figures) or relayout_us(figures, "forward_")
                        for _, result in shown for generation, figures in result["per_generation"].items()
                        if generation in BACKWARD_GENERATIONS)
    rows = ["| shape | gen | tiles (q, kv, KV heads/step) | dq | dk/dv |"
            + (" XLA's relayout (backward, forward) |" if with_relayout else "") + " backward / forward |",
            "|---|---|---|---|---|" + ("---|" if with_relayout else "") + "---|"]
    for name, result in shown:
        shape = f"{name} ({result['q_heads']}/{result['kv_heads']} heads, D={result['head_dim']})"
        for generation in BACKWARD_GENERATIONS:
            figures = result["per_generation"][generation]
            dq, dkv = figures["kernels"]["dq"], figures["kernels"]["dkv"]
            tile_cell = per_kernel(tiles(dq), tiles(dkv))
            shape_cell = f"| {shape} |" if generation == BACKWARD_GENERATIONS[0] else "| |"  # named once per shape
            rows.append(f"{shape_cell} {generation} | {tile_cell} | {kernel_cell(dq)} | {kernel_cell(dkv)} |"
                        + (relayout_cell(figures) if with_relayout else "")
                        + f" {figures['backward_over_forward']:.1f}x |")
    return "\n".join(rows)


def per_kernel(dq: str, dkv: str) -> str:
    """One figure for both backward kernels when they agree, else each named."""
    return dq if dq == dkv else f"{dq} (dq) / {dkv} (dk/dv)"


def backward_mxu_work(backward_run: dict) -> str:
    """Per training shape and generation: the backward kernels' MXU work spent on padding (a head_dim narrower
    than the MXU), and the (query, key) pairs their tiles compute over the visible ones (tiles straddling a mask)."""
    rows = ["| shape | gen | MXU work on padding | computed / visible pairs |", "|---|---|---|---|"]
    for name, result in by_label(backward_run["results"], BACKWARD_SETTINGS):
        for generation in BACKWARD_GENERATIONS:
            kernels = result["per_generation"][generation]["kernels"]
            padding = [f"{100 * (1 - kernels[k]['mxu_padding_efficiency']):.0f} %" for k in ("dq", "dkv")]
            pairs = [f"{kernels[k]['block_flops'] / kernels[k]['necessary_flops']:.2f}x" for k in ("dq", "dkv")]
            shape_cell = f"| {name} |" if generation == BACKWARD_GENERATIONS[0] else "| |"
            rows.append(f"{shape_cell} {generation} | {per_kernel(*padding)} | {per_kernel(*pairs)} |")
    return "\n".join(rows)


def render_markdown(data: dict) -> dict[str, str]:
    """attention.json's tables by section."""
    return {"forward": forward(data["results"]), "per-generation": per_generation(data["results"]),
            "backward": backward(data["backward"]), "backward-mxu-work": backward_mxu_work(data["backward"])}
