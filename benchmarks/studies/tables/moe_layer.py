"""moe_layer's JSON -> the headline tables of its study page: ours / best tuned rival / roofline per shape.

moe_layer writes one JSON per run: the default run (v5e, v6e, every shape),
the `--generations v5p tpu7x` run, whose table adds ours with quantized
weights at a few decode shapes, and the v5p prefill run; each has vLLM's
fused kernel per shape (`vllm-fused`).
"""

from __future__ import annotations

from benchmarks.perf.chip import priced_at_of
from benchmarks.studies.calibration_bands import span
from benchmarks.studies.moe_layer.targets import ANCHOR_MIN_PCT_OF_FLOOR, anchor_pct

# The v5p / TPU7x table's shapes, in the moe_layer page's order.
V5P_TPU7X_SHAPES = (
    "qwen3-30b-a3b EP8 router-masking T=256", "qwen3-30b-a3b EP8 dispatch T=256", "qwen3-30b-a3b T=1",
    "qwen3-30b-a3b EP8 router-masking T=1", "gemma-4-26b-a4b EP8 router-masking T=1", "gpt-oss-20b T=1",
    "gpt-oss-20b EP8 dispatch T=1", "deepseek-v3 EP32 dispatch T=1", "gemma-4-26b-a4b T=256", "gpt-oss-20b T=256",
)
# Per generation, the quantized formats the v5p / TPU7x table shows (TPU7x has no int4 MXU).
QUANTIZED = {"v5p": ("int8", "fp8", "int4"), "tpu7x": ("int8", "fp8")}


def headline_cell(shape: dict) -> str:
    """Ours (its p90 calibrated band) / the best tuned rival (which) / the roofline, in us."""
    return (f"{shape['ours_us']:.1f} ({span(shape['ours_band_p90_us'])}) / {shape['best_rival_us']:.1f} ({shape['best_rival']}) "
            f"/ {shape['roofline_us']:.1f}")


def shapes_by_label(data: dict) -> dict[str, dict[str, dict]]:
    """The run's shape lines by label, in the run's order, then by generation."""
    by_label: dict[str, dict[str, dict]] = {}
    for shape in data["shapes"]:
        by_label.setdefault(shape["label"], {})[shape["generation"]] = shape
    return by_label


def headline(data: dict, generations: tuple[str, ...]) -> str:
    """One row per shape, in the run's order, one headline cell per generation."""
    rows = ["| shape | " + " | ".join(generations) + " |", "| --- |" + " --- |" * len(generations)]
    for label, per_generation in shapes_by_label(data).items():
        rows.append(f"| {label} | " + " | ".join(headline_cell(per_generation[g]) for g in generations) + " |")
    return "\n".join(rows)


def headline_and_quantized(data: dict) -> str:
    """The v5p / TPU7x table: per generation the headline cell, then ours with each quantized format, in us."""
    shapes = shapes_by_label(data)
    variants = {(line["generation"], line["label"], line["variant"]): line for line in data["variants"]}
    names = {"v5p": "v5p", "tpu7x": "TPU7x"}
    rows = ["| shape | " + " | ".join(f"{names[g]} | {' / '.join(formats)}" for g, formats in QUANTIZED.items())
            + " |", "| --- |" + " --- | --- |" * len(QUANTIZED)]
    for label in V5P_TPU7X_SHAPES:
        cells = []
        for generation, formats in QUANTIZED.items():
            cells.append(headline_cell(shapes[label][generation]))
            cells.append(" / ".join(f"{variants[generation, label, f'ours_{f}']['us']:.1f}" for f in formats))
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def render_markdown(data: dict) -> dict[str, str]:
    """moe_layer.json's tables by section (its default run models v5e and v6e)."""
    return {"headline": headline(data, ("v5e", "v6e")), "anchor": anchor(data), "anchor-formats": anchor_formats(data),
            "decode-targets": decode_targets(data), "prefill-ceilings": prefill_ceilings(data),
            "rival-wins": rival_wins(data), "hf-257us": hf_257us(data), "vllm-fused": vllm_fused(data)}


def render_v5p_tpu7x_markdown(data: dict) -> dict[str, str]:
    """moe_layer_v5p_tpu7x.json's tables by section."""
    return {"headline-and-quantized": headline_and_quantized(data), "vllm-fused": vllm_fused(data)}


def render_v5p_markdown(data: dict) -> dict[str, str]:
    """moe_layer_v5p.json's (v5p prefill) tables by section; its full table is the run's own moe_layer_v5p.md."""
    return {"vllm-fused": vllm_fused(data)}


def band(figures: dict, key: str = "ours_band_p90_us") -> str:
    return span(figures[key], 1)


def yes_no(value: bool | None) -> str:
    return {True: "yes", False: "no", None: "no target"}[value]


def anchor(data: dict) -> str:
    """The anchor target per EP mode: ours against the floor at the HBM share the JSON was priced at (the floor and
    the share beside it), across its band, beside the best rival."""
    shares = priced_at_of(data)["hbm_fraction"]
    rows = ["| anchor | ours µs (p90 band) | floor µs (bytes at the peak) | HBM share priced | floor / share µs "
            "| ours, % of floor / share | target % | met | met across the band | best tuned rival µs |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |"]
    for name, figures in sorted(data["targets"]["anchor"].items()):
        share, floor = shares[name.split()[-1]], figures["roofline_us"]
        band_high = figures["ours_band_p90_us"][1] if figures["ours_band_p90_us"] else None
        rows.append(f"| {name} | {figures['ours_us']:.1f} ({band(figures)}) | {floor:.1f} | {share:g} "
                    f"| {floor / share:.1f} | {anchor_pct(floor, share, figures['ours_us']):.1f} "
                    f"| {ANCHOR_MIN_PCT_OF_FLOOR:.0f} "
                    f"| {yes_no(anchor_pct(floor, share, figures['ours_us']) >= ANCHOR_MIN_PCT_OF_FLOOR)} "
                    f"| {yes_no(None if band_high is None else anchor_pct(floor, share, band_high) >= ANCHOR_MIN_PCT_OF_FLOOR)} "
                    f"| {figures['best_rival_us']:.1f} ({figures['best_rival']}) |")
    return "\n".join(rows)


def anchor_formats(data: dict) -> str:
    """The anchor's shapes per generation: bf16 over the roofline, and each quantized format's time over bf16's."""
    formats = ("int8", "fp8", "int4")
    rows = ["| anchor shape, gen | bf16 µs | bf16 / roofline | " + " | ".join(f"{f} µs (/ bf16)" for f in formats) + " |",
            "| --- | ---: | ---: |" + " ---: |" * len(formats)]
    for name, figures in sorted(data["targets"]["per_generation_anchor"].items()):
        cells = [f"{figures[f]['us']:.1f} ({figures[f]['over_bf16']:.2f})" for f in formats]
        rows.append(f"| {name} | {figures['ours_us']:.1f} | {figures['ours_over_roofline']:.3f} | "
                    + " | ".join(cells) + " |")
    return "\n".join(rows)


def decode_targets(data: dict) -> str:
    """How many decode rows are within the target's share of the roofline, and every row that is not."""
    targets = data["targets"]
    quantized = targets["quantized"]
    rows = ["| decode target | met |", "| --- | --- |",
            f"| bf16 within {targets['decode_max_over_roofline']}x of the roofline "
            f"| {targets['decode_meets']} of {targets['decode_shapes']} |",
            f"| int8 / fp8 / int4 bytes within {quantized['max_bytes_over_quantized_min']}x of the quantized minimum "
            f"| {quantized['decode_meets']} of {quantized['decode_shapes']} |"]
    misses = [row for row in targets["decode"] if not row["meets"]]
    if misses:
        rows += ["", "| missed: shape | gen | ours / roofline |", "| --- | --- | ---: |"]
        rows += [f"| {row['label']} | {row['generation']} | {row['ours_over_roofline']:.3f} |" for row in misses]
    return "\n".join(rows)


def prefill_ceilings(data: dict) -> str:
    """v5e's compute-bound prefill rows: the share of the MXU peak modelled, and the ceilings that bound it."""
    rows = ["| compute-bound prefill | gen | MXU % of peak | static-chunk ceiling % "
            "| MXU passes and steps ceiling % | MXU work / useful |",
            "| --- | --- | ---: | ---: | ---: | ---: |"]
    for row in data["targets"]["prefill"]:
        rows.append(f"| {row['label']} | {row['generation']} | {row['mxu_utilisation_pct']:.1f} "
                    f"| {row['static_chunk_ceiling_pct']:.1f} | {row['passes_and_steps_ceiling_pct']:.1f} "
                    f"| {row['kernels_mxu_flops_over_useful']:.2f} |")
    return "\n".join(rows)


def rival_wins(data: dict) -> str:
    """Every (shape, generation) where a tuned rival is faster than ours, and the model's term that differs."""
    wins = data["targets"]["rival_wins"]
    if not wins:
        return "No tuned rival is faster than ours at any shape."
    rows = ["| shape | gen | rival | faster by % | why (the model's terms) |", "| --- | --- | --- | ---: | --- |"]
    rows += [f"| {win['label']} | {win['generation']} | {win['rival']} | {win['rival_wins_by_pct']:.1f} | {win['why']} |"
             for win in wins]
    return "\n".join(rows)


FUSED = "vllm_fused_ep_moe"


def fused_cell(line: dict | None, ours: dict | None) -> str:
    """vLLM's fused kernel: its us and ours over it, or why it has no figure."""
    if line is None:
        return "not run"
    if "us" not in line:
        return f"no figure: {line.get('error')}"
    cell = f"{line['us']:.1f} ({ours['us'] / line['us']:.2f})" if ours and "us" in ours else f"{line['us']:.1f}"
    sizes = line["block_sizes"]
    picked = "" if line.get("block_sizes_from") == "searched" else " (vLLM's pick)"
    return cell + f", bt {sizes['bt']}/{sizes['btc']}, bf {sizes['bf']}, bd {sizes['bd1']}/{sizes['bd2']}{picked}"


def vllm_fused(data: dict) -> str:
    """Per shape and generation: vLLM's fused_ep_moe at the block sizes its row was priced at, µs (ours / it), or its
    refusal."""
    variants = {(line["generation"], line["label"], line["variant"]): line for line in data["variants"]}
    if not any(name == FUSED for _, _, name in variants):
        return f"This run did not model {FUSED}."
    generations = list(dict.fromkeys(shape["generation"] for shape in data["shapes"]))  # the run's order
    rows = ["| shape | " + " | ".join(f"{g}: µs (ours / it), blocks" for g in generations) + " |",
            "| --- |" + " --- |" * len(generations)]
    for label in shapes_by_label(data):
        rows.append(f"| {label} | " + " | ".join(
            fused_cell(variants.get((g, label, FUSED)), variants.get((g, label, "ours"))) for g in generations) + " |")
    return "\n".join(rows)


def hf_257us(data: dict) -> str:
    """Hugging Face's measured 257 µs layer against the model of the kernel they ran, at its own default tiles."""
    hf = data["hf_257us"]
    measured = hf["measured_us"]
    rows = [f"| {hf['generation']}, kernels-community's tokamax kernel at tokamax's default tiles | predicted µs "
            "(p90 band) | grid steps x fitted cost = µs | without step cost µs | predicted / measured "
            "| step cost that gives the measured µs | tokamax tuned µs | ours µs |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, shape in sorted(hf["shapes"].items()):
        per_step = shape["grid_step_cost_us"] / shape["grid_steps"]
        rows.append(f"| {name} | {shape['predicted_us']:.0f} ({span(shape['band_p90_us'])}) "
                    f"| {shape['grid_steps']} x {per_step:.2f} = {shape['grid_step_cost_us']:.0f} "
                    f"| {shape['without_step_cost_us']:.1f} | {shape['predicted_us'] / measured:.1f}x "
                    f"| {shape['step_cost_that_gives_measured_us']:.3f} | {shape['tokamax_tuned_us']:.1f} "
                    f"| {shape['ours_us']:.1f} |")
    first = next(iter(sorted(hf["shapes"].items())))[1]
    rows += ["", "| the same layer's two grouped matmuls at other tiles (m, k, n) | grid steps | modelled µs |",
             "| --- | ---: | ---: |"]
    rows += [f"| {tuple(other['tiles'])} | {other['grid_steps']} | {other['grouped_matmuls_alone_us']:.1f} |"
             for other in first["other_tiles"]]
    rows += ["", "| the measured Pallas ragged dot with the largest share of grid-step cost | chip | share | grid steps "
             "| predicted / measured |", "| --- | --- | ---: | ---: | ---: |"]
    rows += [f"| `{entry['call']}` | {chip} | {entry['share']:.2f} | {entry['steps']} | {entry['ratio']:.2f} |"
             for chip, entry in sorted(hf["largest_step_share_in_calibration"].items())]
    return "\n".join(rows)
