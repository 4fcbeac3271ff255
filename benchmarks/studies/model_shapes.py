"""The models' shapes, from their one list: the tagged tables of each kernel's `compile_targets.py`.

The tables are plain literals, read here from the kernel repo's source without importing the kernel: a study's
constants need them before anything is built. attention-tpu's `HEADS` (query heads, KV heads and head_dim by model
and layer kind), `WINDOWS` and `SINKS`; ragged-dot-tpu's `MODELS` (each experts layer's sizes and gate).
"""

from __future__ import annotations

import ast
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
