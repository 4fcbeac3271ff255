"""int4_granularity.json -> its study page's table: greedy tokens kept per int4 scale granularity."""

from __future__ import annotations

# The models as the study page names them, by the model's name in the JSON (its key up to the description in brackets).
MODELS = {"qwen3_moe": "Qwen3-MoE", "mixtral": "Mixtral", "gpt_oss": "GPT-OSS"}
# The schemes in the page's column order -> its column heading.
SCHEMES = {
    "int8 per channel": "int8",
    "int4 per channel": "int4 per channel",
    "int4 groups of 128": "groups of 128",
    "int4 groups of 64": "of 64",
    "int4 groups of 32": "of 32",
}


def greedy_tokens(data: dict) -> str:
    """Per model, the greedy tokens equal to the float model's under each scheme."""
    models = {key.split(" (")[0]: schemes for key, schemes in data["models"].items()}
    rows = ["| model | " + " | ".join(SCHEMES.values()) + " |", "| --- |" + " ---: |" * len(SCHEMES)]
    for model, name in MODELS.items():
        rows.append(f"| {name} | " + " | ".join(models[model][scheme]["greedy_tokens_equal"] for scheme in SCHEMES)
                    + " |")
    return "\n".join(rows)


def render_markdown(data: dict) -> dict[str, str]:
    """int4_granularity.json's tables by section."""
    return {"greedy-tokens": greedy_tokens(data)}
