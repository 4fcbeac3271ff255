"""hub_server.json -> docs/hub.md's tables: the local Hub server before and after each round of hardening.

The benchmark runs groups of cases (`--group faults`, `attacks`, `cards`, `pages`), each against the code
before a round of hardening (`--label before`) and after it; a row names its group, so a reader
knows which earlier code its "before" is.
"""

from __future__ import annotations

# Section -> rows: (what is measured, group, case, fields of the case's result, joined with " / ").
SECTIONS = {
    "slow-clients-and-memory": [
        ("an anonymous body dripped at 1 B / 1.5 s, `--body-timeout 2`: seconds held / answer", "attacks",
         "slow_body", ["held_s", "outcome"]),
        ("256 connections each sending a 4 MiB body: server RSS growth while held / peak, MiB", "attacks",
         "body_memory", ["rss_growth_while_held_mib", "peak_rss_growth_mib"]),
        ("250 clients not reading a 40 MiB download: server RSS growth after 3 s, MiB", "attacks",
         "response_memory", ["rss_growth_mib"]),
        ("one-file commits of 64 / 256 MiB: server peak RSS growth, MiB", "faults", "commit_memory",
         ["64_mib.server_peak_rss_growth_mib", "256_mib.server_peak_rss_growth_mib"]),
    ],
    "listings": [
        ("8,000 one-file folders: first page / whole recursive walk, s", "attacks", "tree_listing",
         ["8000_folders.page_s", "8000_folders.recursive_walk_s"]),
        ("25,000 one-file folders: first page / whole recursive walk, s (walk stopped at 120 s)", "attacks",
         "tree_listing", ["25000_folders.page_s", "25000_folders.recursive_walk_s"]),
    ],
    "cards": [
        ("a 512 KiB card of `![`: server CPU s, first GET / second GET / HEAD of its page", "attacks", "card",
         ["first_get_cpu_s", "second_get_cpu_s", "head_cpu_s"]),
        ("a 79 KB card of one 50 KiB reference link used 4,000 times: its page, MB", "cards", "card_page",
         ["page_mb"]),
        ("the same: server RSS after one view / with 8 more clients not reading the page, MiB", "cards", "card_page",
         ["rss_after_one_view_mib", "rss_with_8_unread_views_mib"]),
    ],
    "costly-pages": [
        ("a 23 KB card of 16 tables that markdown-it fills in: server CPU s / peak RSS growth MiB of the first "
         "view; CPU s of the second", "pages", "table_card",
         ["first_view.cpu_s", "first_view.peak_rss_growth_mib", "second_view.cpu_s"]),
        ("a 512 KiB card of `![`: server CPU s of its first view / of its view after 40 cards at the per-card "
         "bound were viewed", "pages", "card_eviction", ["first_view_cpu_s", "view_after_cheap_cards_cpu_s"]),
        ("300 version branches, each with its own 0.9 MiB metadata.json: server CPU s of the first / second view "
         "of the repo page", "pages", "versions_page", ["first_view.cpu_s", "second_view.cpu_s"]),
    ],
}
LABELS = ("before", "after")


def field(result: dict, dotted: str) -> str:
    """result["a"]["b"] for "a.b" (a key holding dots is tried whole first); "capped" for a measure
    stopped at its cap (None)."""
    if dotted in result:
        result = result[dotted]
    else:
        for key in dotted.split("."):
            result = result.get(key) if isinstance(result, dict) else None
    return "capped" if result is None else str(result)


def before_and_after(group: dict, case: str, fields: list[str]) -> list[str]:
    """One cell per label: the case's fields in that label's run, joined with " / "."""
    return [" / ".join(field(group[label].get(case, {}), name) for name in fields) for label in LABELS]


def section(data: dict, rows: list[tuple[str, str, str, list[str]]]) -> str:
    lines = ["| measured | group | before | after |", "| --- | --- | --- | --- |"]
    for measure, group, case, fields in rows:
        before, after = before_and_after(data[group], case, fields)
        lines.append(f"| {measure} | {group} | {before} | {after} |")
    return "\n".join(lines)


def render_markdown(data: dict) -> dict[str, str]:
    """hub_server.json's tables by section."""
    return {name: section(data, rows) for name, rows in SECTIONS.items()}
