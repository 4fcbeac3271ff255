"""The docs' figure tables, rendered from the benchmarks' JSON: one module per benchmark, named after it.

Each module's `render_markdown(data) -> {section: table}` turns the JSON its
benchmark wrote into markdown tables, one per section; `python -m benchmarks
report` writes them to `benchmarks/results/<benchmark>.md` under `## section`
headings, and the docs include them as generated blocks. They live apart from
the benchmarks because those import jax and torch, and the report (and its
tests) must run without either.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def markdown_table(header: Sequence[str], rule: str, rows: Iterable[Sequence[str]]) -> str:
    """A markdown table: the header's cells, the `rule` line under them as given (it sets each column's alignment),
    and a line of cells per row."""
    return "\n".join([_line(header), rule, *(_line(cells) for cells in rows)])


def _line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"
