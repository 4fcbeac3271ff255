"""quantization_accuracy*.json -> docs/kernelize.md's tables: the quantized experts' error against the float model."""

from __future__ import annotations

from . import markdown_table


def errors(data: dict) -> str:
    """Per model and format: the logits' max / mean abs error, greedy and teacher-forced tokens equal to the float
    model's, and the float model's median gap between its top two logits (how near-tied its choices are)."""
    rows = [[model, scheme, f"{figures['logits_max_abs_error']:.1e} / {figures['logits_mean_abs_error']:.1e}",
             str(figures["greedy_tokens_equal"]), str(figures["teacher_forced_tokens_equal"]),
             f"{figures['reference_median_margin']:.3f}"]
            for model, schemes in data["models"].items() for scheme, figures in schemes.items()]
    return markdown_table(["model", "weights", "logits max / mean abs error", "greedy tokens equal",
                           "teacher-forced tokens equal", "float model's median top-two gap"],
                          "| --- | --- | --- | --- | --- | ---: |", rows)


def render_markdown(data: dict) -> dict[str, str]:
    """A quantization_accuracy run's table by section."""
    return {"errors": errors(data)}
