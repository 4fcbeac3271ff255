"""quantization_accuracy*.json -> docs/kernelize.md's tables: the quantized experts' error against the float model."""

from __future__ import annotations


def errors(data: dict) -> str:
    """Per model and format: the logits' max / mean abs error, greedy and teacher-forced tokens equal to the float
    model's, and the float model's median gap between its top two logits (how near-tied its choices are)."""
    rows = ["| model | weights | logits max / mean abs error | greedy tokens equal | teacher-forced tokens equal "
            "| float model's median top-two gap |", "| --- | --- | --- | --- | --- | ---: |"]
    for model, schemes in data["models"].items():
        for scheme, figures in schemes.items():
            rows.append(f"| {model} | {scheme} | {figures['logits_max_abs_error']:.1e} / "
                        f"{figures['logits_mean_abs_error']:.1e} | {figures['greedy_tokens_equal']} "
                        f"| {figures['teacher_forced_tokens_equal']} | {figures['reference_median_margin']:.3f} |")
    return "\n".join(rows)


def render_markdown(data: dict) -> dict[str, str]:
    """A quantization_accuracy run's table by section."""
    return {"errors": errors(data)}
