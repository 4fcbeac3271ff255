"""The size limits, over the whole repo: no module over 600 lines, no function over 80 lines (a table of
shapes is data, not a function: it sits at a module's top level), a README of at most 250 lines, and the lab's
README an index of at most 150 (the studies' pages under benchmarks/results/pages/ carry the rest)."""

import ast
from pathlib import Path

from .conftest import REPO_ROOT

MODULE_LINES = 600
FUNCTION_LINES = 80
FOLDERS = ("tpu_kernels", "benchmarks", "tests", "kernel_repos", "scripts")


def python_files() -> list[Path]:
    return sorted(path for folder in FOLDERS for path in (REPO_ROOT / folder).rglob("*.py")
                  if "__pycache__" not in path.parts)


def over_the_limits(source: str, name: str) -> list[str]:
    """`name`'s module if it has more than MODULE_LINES lines, and each function of it with more than
    FUNCTION_LINES (its decorators, signature and body), as `name[:line]: what`."""
    found = []
    lines = source.count("\n") + (not source.endswith("\n"))
    if lines > MODULE_LINES:
        found.append(f"{name}: {lines} lines")
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
            length = node.end_lineno - start + 1
            if length > FUNCTION_LINES:
                found.append(f"{name}:{node.lineno}: {node.name} has {length} lines")
    return found


def test_no_module_or_function_of_the_repo_is_over_its_limit():
    assert [found for path in python_files()
            for found in over_the_limits(path.read_text(), str(path.relative_to(REPO_ROOT)))] == []


def test_the_limits_are_found_at_one_line_past_them():
    function = "def f():\n" + "    x = 1\n" * (FUNCTION_LINES - 1)
    assert over_the_limits(function, "ok.py") == []
    assert over_the_limits("@decorated\n" + function, "long.py") == [f"long.py:2: f has {FUNCTION_LINES + 1} lines"]
    module = "x = 1\n" * MODULE_LINES
    assert over_the_limits(module, "ok.py") == []
    assert over_the_limits(module + "y = 2", "long.py") == [f"long.py: {MODULE_LINES + 1} lines"]


README_LINES = 250


def test_the_readme_is_at_most_250_lines():
    assert len((REPO_ROOT / "README.md").read_text().splitlines()) <= README_LINES


BENCHMARKS_INDEX_LINES = 150


def test_the_benchmarks_readme_is_an_index_of_at_most_150_lines():
    assert len((REPO_ROOT / "benchmarks" / "README.md").read_text().splitlines()) <= BENCHMARKS_INDEX_LINES
