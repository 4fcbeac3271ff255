"""Every relative link of the tracked docs resolves: the file exists and a `#anchor` names one of its headings, as
GitHub makes them (the README, docs/, the lab's index and study pages, the kernel cards)."""

import re
from pathlib import Path

from benchmarks.studies import report

from .conftest import REPO_ROOT

# A markdown link or image's target, up to an optional title; absolute URLs and mail links are not checked here.
LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(?P<title>.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,}).*?^[ \t]*\1[ \t]*$", re.MULTILINE | re.DOTALL)


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives `text`'s headings: lower case, punctuation but `-` and `_` dropped, spaces as `-`,
    a repeated one numbered from 1."""
    found: dict[str, int] = {}
    for match in HEADING.finditer(FENCE.sub("", text)):
        slug = re.sub(r"[^\w\- ]", "", match["title"].lower()).replace(" ", "-")
        found[slug if slug not in found else f"{slug}-{found[slug]}"] = 0
        found[slug] = found.get(slug, 0) + 1
    return set(found)


def broken_links(root: Path, doc: Path) -> list[str]:
    """`doc`'s relative links (outside fenced code) that name no file under `root`, or no heading of it."""
    broken = []
    for match in LINK.finditer(FENCE.sub("", doc.read_text())):
        target = match["target"]
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        name = f"{doc.relative_to(root)}: {target}"
        if not resolved.exists() or root not in resolved.parents and resolved != root:
            broken.append(f"{name}: no such file")
        elif anchor and (resolved.is_dir() or anchor not in anchors(resolved.read_text())):
            broken.append(f"{name}: no heading with that anchor")
    return broken


def test_every_relative_link_of_the_tracked_docs_resolves():
    assert [found for doc in report.doc_paths(REPO_ROOT) for found in broken_links(REPO_ROOT, doc)] == []


def test_a_link_to_a_missing_file_or_heading_is_found(tmp_path):
    (tmp_path / "pages").mkdir()
    (tmp_path / "pages" / "study.md").write_text("# The `moe_layer` study\n\n## What is modelled\n\n"
                                                 "## What is modelled\n")
    doc = tmp_path / "README.md"
    doc.write_text("[a](pages/study.md#what-is-modelled) [b](pages/study.md#what-is-modelled-1) "
                   "[c](pages/study.md#the-moe_layer-study) ![d](pages/) [e](https://example.com/x.md)\n"
                   "[f](pages/gone.md) [g](pages/study.md#results)\n```\n[h](pages/not-a-link.md)\n```\n")
    assert broken_links(tmp_path, doc) == ["README.md: pages/gone.md: no such file",
                                           "README.md: pages/study.md#results: no heading with that anchor"]
