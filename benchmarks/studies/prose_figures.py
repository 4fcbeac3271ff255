"""No figure typed into the docs' prose: the check `python -m benchmarks report --check` runs beside the blocks'.

A measured or modelled figure belongs in a generated block (`report`), where
`--check` keeps it equal to the benchmark's JSON. Typed into prose it drifts.
So the prose of every tracked doc (its text outside generated blocks and
fenced code) must hold no figure: a number with a unit of time, a percentage,
a ratio (`1.23x`, `3×`), a bandwidth or throughput, or an amount of memory.

Some such numbers are facts, not measurements: limits and defaults set in
code, hardware constants, targets the issues set, sizes that follow from a
model's dimensions. Each is allowed by the facts list (`FACTS`, JSON in the
checkout): per doc, an exact phrase of its prose and why it is a fact,

    {"README.md": {"take 3 s or more on their own": "the `slow` marker's threshold, a rule"}}

A phrase allows only the figures inside it (whitespace in it matches any run of
whitespace, so it may wrap), so a figure typed later beside it still fails. An
entry whose phrase is no longer in its doc's prose, or holds no figure, fails
too: the list says what the docs hold, no more.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

# The facts list, relative to the checkout's root. A checkout without it allows no figure.
FACTS = "docs/prose_facts.json"

_NUMBER = r"(?<![\w.,])\d+(?:[.,]\d+)*"
_GAP = r"[ \u00a0\u2009\u202f]?"  # none, a space, a no-break or a thin space
_UNITS = "|".join([
    r"[kKMGTP]i?B/s", r"B/s", r"[KMGTP]?FLOP/s", r"[GTP]FLOPS", r"(?:tokens?|tok|requests?|steps?)/s",  # rates
    r"[µμu]s", r"ns", r"ms", r"s", r"secs?", r"seconds?", r"minutes?", r"min",  # time
    r"%", r"percent",  # shares
    r"[KMGT]iB", r"[kKMGT]B",  # memory
])
# A figure: a number and its unit, or a ratio: a number and `x` (no space) or `×`, not followed by a number
# (`8x128`, `64 × 65536` are shapes).
FIGURE = re.compile(rf"{_NUMBER}(?:{_GAP}(?:{_UNITS})(?![\w/])|x(?!\w|\.\d)|{_GAP}×(?!{_GAP}\d))")
_FENCE = re.compile(r"^[ \t]*(?P<fence>`{3,}|~{3,})")


@dataclass(frozen=True)
class Doc:
    """One tracked doc: its path relative to the root, its text, and the spans of its generated blocks."""

    name: str
    text: str
    blocks: tuple[tuple[int, int], ...]


def fenced_code(text: str) -> list[tuple[int, int]]:
    """The spans of `text`'s fenced code blocks, fences included; an unclosed fence runs to the end."""
    spans, opening, position = [], None, 0
    for line in text.splitlines(keepends=True):
        fence = _FENCE.match(line)
        if opening is None and fence:
            opening = (position, fence["fence"])
        elif opening is not None and fence and fence["fence"][0] == opening[1][0] \
                and len(fence["fence"]) >= len(opening[1]) and not line[fence.end():].strip():
            spans.append((opening[0], position + len(line)))
            opening = None
        position += len(line)
    if opening is not None:
        spans.append((opening[0], len(text)))
    return spans


def outside(spans: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether `start`..`end` overlaps none of `spans`."""
    return all(end <= first or start >= last for first, last in spans)


def inside(spans: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether `start`..`end` lies within one of `spans`."""
    return any(first <= start and end <= last for first, last in spans)


def not_prose(doc: Doc) -> list[tuple[int, int]]:
    """The spans of `doc` that are not prose: its generated blocks and its fenced code."""
    return [*doc.blocks, *fenced_code(doc.text)]


def figures(doc: Doc, skipped: list[tuple[int, int]]) -> list[re.Match]:
    """The figures in `doc` outside `skipped`."""
    return [found for found in FIGURE.finditer(doc.text) if outside(skipped, found.start(), found.end())]


def occurrences(doc: Doc, phrase: str, skipped: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The spans of `phrase` in `doc` outside `skipped`, any run of whitespace in it matching any run in the doc."""
    pattern = re.compile(r"\s+".join(re.escape(word) for word in phrase.split()))
    return [found.span() for found in pattern.finditer(doc.text) if outside(skipped, *found.span())]


def doc_problems(doc: Doc, facts: dict[str, str]) -> list[str]:
    """Each figure typed into `doc`'s prose that no fact allows, and each of its facts that allows nothing."""
    skipped = not_prose(doc)
    found = figures(doc, skipped)
    allowed, problems = [], []
    for phrase in facts:
        spans = occurrences(doc, phrase, skipped)
        allowed += spans
        if not spans:
            problems.append(f"{doc.name}: the fact `{phrase}` ({FACTS}) is no longer in its prose: drop or fix it")
        elif not any(inside(spans, figure.start(), figure.end()) for figure in found):
            problems.append(f"{doc.name}: the fact `{phrase}` ({FACTS}) holds no figure: drop it")
    for figure in found:
        if not inside(allowed, figure.start(), figure.end()):
            line = doc.text.count("\n", 0, figure.start()) + 1
            problems.append(f"{doc.name}:{line}: figure `{figure.group()}` typed in prose: include it from a "
                            f"generated block, reword, or allow it as a fact in {FACTS}")
    return problems


def load_facts(root: Path) -> tuple[dict[str, dict[str, str]], list[str]]:
    """The facts list under `root` (empty if absent), and what is wrong with its form."""
    path = root / FACTS
    if not path.is_file():
        return {}, []
    try:
        facts = json.loads(path.read_text())
    except ValueError as error:
        return {}, [f"{FACTS} is not JSON: {error}"]
    if not isinstance(facts, dict) or not all(isinstance(entries, dict) for entries in facts.values()):
        return {}, [f"{FACTS} must map each doc to {{phrase: reason}}"]
    malformed = [f"{FACTS}: {doc}: the fact `{phrase}` gives no reason" for doc, entries in facts.items()
                 for phrase, reason in entries.items() if not isinstance(reason, str) or not reason.strip()]
    return facts, malformed


def problems(root: Path, docs: list[Doc]) -> list[str]:
    """Every figure typed into the prose of `docs` that no fact allows, and every fact that allows none."""
    facts, found = load_facts(root)
    names = {doc.name for doc in docs}
    found += [f"{FACTS}: {name} is not a tracked doc: drop its facts" for name in facts if name not in names]
    for doc in docs:
        found += doc_problems(doc, facts.get(doc.name, {}))
    return found
