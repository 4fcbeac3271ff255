"""moe_layer's JSON -> benchmarks/README.md's headline tables: ours / best tuned rival / roofline per shape.

moe_layer writes one JSON per run: the default run (v5e, v6e, every shape)
and the `--generations v5p tpu7x` run, whose table adds ours with quantized
weights at a few decode shapes.
"""

from __future__ import annotations

# The v5p / TPU7x table's shapes, in the README's order.
V5P_TPU7X_SHAPES = (
    "qwen3-30b-a3b EP8 router-masking T=256", "qwen3-30b-a3b EP8 dispatch T=256", "qwen3-30b-a3b T=1",
    "qwen3-30b-a3b EP8 router-masking T=1", "gemma-4-26b-a4b EP8 router-masking T=1", "gpt-oss-20b T=1",
    "gpt-oss-20b EP8 dispatch T=1", "deepseek-v3 EP32 dispatch T=1", "gemma-4-26b-a4b T=256", "gpt-oss-20b T=256",
)
# Per generation, the quantized formats the v5p / TPU7x table shows (TPU7x has no int4 MXU).
QUANTIZED = {"v5p": ("int8", "fp8", "int4"), "tpu7x": ("int8", "fp8")}


def headline_cell(shape: dict) -> str:
    """Ours (its p90 calibrated band) / the best tuned rival (which) / the roofline, in us."""
    low, high = shape["ours_band_p90_us"]
    return (f"{shape['ours_us']:.1f} ({low:.0f}-{high:.0f}) / {shape['best_rival_us']:.1f} ({shape['best_rival']}) "
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
    return {"headline": headline(data, ("v5e", "v6e"))}


def render_v5p_tpu7x_markdown(data: dict) -> dict[str, str]:
    """moe_layer_v5p_tpu7x.json's tables by section."""
    return {"headline-and-quantized": headline_and_quantized(data)}
