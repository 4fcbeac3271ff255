"""The models' shapes, from their one list: the tagged tables of each kernel's `compile_targets.py`.

The tables are plain literals, read here from the kernel repo's source without importing the kernel: a study's
constants need them before anything is built. attention-tpu's `HEADS` (query heads, KV heads and head_dim by model
and layer kind), `WINDOWS` and `SINKS`; ragged-dot-tpu's `MODELS` (each experts layer's sizes and gate).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

# The lab runs from the checkout, beside the kernel repos.
KERNEL_REPOS = Path(__file__).resolve().parents[2] / "kernel_repos"


def compile_targets_literal(repo: str, package: str, name: str):
    """The value of the literal `name` that kernel repo `repo`'s `compile_targets.py` assigns at its top level."""
    path = KERNEL_REPOS / repo / "torch-ext" / package / "compile_targets.py"
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and any(isinstance(target, ast.Name) and target.id == name
                                                for target in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{path} assigns no {name}")


ATTENTION_HEADS: dict[str, dict[str, int]] = compile_targets_literal("attention-tpu", "attention_tpu", "HEADS")
ATTENTION_WINDOWS: dict[str, int] = compile_targets_literal("attention-tpu", "attention_tpu", "WINDOWS")
ATTENTION_SINKS: tuple[str, ...] = compile_targets_literal("attention-tpu", "attention_tpu", "SINKS")
EXPERTS_MODELS: dict[str, dict] = compile_targets_literal("ragged-dot-tpu", "ragged_dot_tpu", "MODELS")


@dataclasses.dataclass(frozen=True)
class AttentionLayer:
    """A model's attention layer: its heads, its window (None: every key) and whether it takes sinks. The studies'
    shapes extend it (keyword-only fields) and take a model's layer from the tables by its tag (`of_tag`)."""

    q_heads: int
    kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    sinks: bool = False

    @classmethod
    def of_tag(cls, tag: str, **fields):
        """The layer `tag` names in attention-tpu's `HEADS`, with its `WINDOWS` and `SINKS`, and a shape's `fields`."""
        return cls(**ATTENTION_HEADS[tag], sliding_window=ATTENTION_WINDOWS.get(tag), sinks=tag in ATTENTION_SINKS,
                   **fields)
