"""Hardening IV of the local Hub (issue 64): cards bounded by what they cost to parse, the card cache weighing
what a render cost, repo pages bounded in versions, and ids folded as the file system folds them.

In this process where an internal bound or memory (tracemalloc) is the point; a real server on loopback
where a client would see the difference.
"""

from __future__ import annotations

import json
import os

import pytest

from tpu_kernels.distribution.hub import card as hub_card
from tpu_kernels.distribution.hub import pages

from .hub_support import (FAST, HEADER, TOKEN, add, commit_body, file_line, http, module_hub, ndjson, run_concurrently,
                          visible_text)

pytestmark = pytest.mark.usefixtures("local_agent_registry")

hub = module_hub(TOKEN, FAST)


def table_card(tables: int, columns: int = 182, rows: int = 362) -> bytes:
    """The attacker's card: tables of one-character rows under a wide header, which markdown-it fills in
    with empty cells (16 tables are 23 KB and 3.2M tokens, 1 GB, 16 s before)."""
    one = "|a" * columns + "\n" + "|-" * columns + "\n" + "a\n" * rows + "\n"
    return (one * tables).encode()


# -- N2-W1: a card's parse is bounded by what it costs -------------------------------------------------


def test_a_card_of_tables_that_fill_in_millions_of_cells_is_cut_by_its_parse_budget(monkeypatch):
    content = table_card(16)
    assert len(content) < 24_000
    parsed = []
    parse_card = hub_card.parse_card
    monkeypatch.setattr(hub_card, "parse_card", lambda *args: parsed.append(parse_card(*args)) or parsed[-1])
    card = hub_card.render_card(content, "/kernels/o/n/resolve/c/")
    (tokens, reason), = parsed
    # Cut by its tokens (about 40 MB of them), or sooner by its CPU seconds on a slow machine.
    assert len(tokens) <= hub_card.MAX_CARD_TOKENS and reason is not None
    assert card.cut and f"parsing it takes {reason}, more than a page spends on a card" in card.html
    assert card.html.count("<table>") == card.html.count("</table>") >= 1  # what was parsed is shown, closed


def test_the_parse_budget_counts_block_and_inline_tokens_and_cpu_seconds():
    tokens, reason = hub_card.parse_card(table_card(2).decode(), max_tokens=5_000)
    assert reason == "more than 5,000 Markdown tokens" and len(tokens) <= 5_000
    prose = "*a* `b` [c](d) " * 2_000  # one paragraph of 10,000 inline tokens
    tokens, reason = hub_card.parse_card(prose, max_tokens=5_000)
    assert reason == "more than 5,000 Markdown tokens" and len(tokens[1].children) <= 5_000
    _, reason = hub_card.parse_card("![" * 20_000, max_seconds=0.01)
    assert reason == "more than 0.01 s of CPU"
    tokens, reason = hub_card.parse_card("| a | b |\n|---|---|\n| 1 | 2 |\n\n> - *x*\n")
    assert reason is None and [token.type for token in tokens][:2] == ["table_open", "thead_open"]


def test_a_cut_or_failed_render_is_remembered_so_a_second_view_costs_nothing(renders, monkeypatch):
    cache = hub_card.CardCache()
    amplified = b"[r]: https://e.com/" + b"x" * 8192 + b"\n\n" + b"[a][r] " * 200  # 1.6 MB of HTML: cut
    first = cache.card("cut", lambda: amplified)
    assert first.cut and cache.card("cut", pytest.fail) is first
    assert len(renders) == 1

    def overflowing(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(hub_card, "render_card", overflowing)
    failed = cache.card("deep", lambda: b"> " * 10)
    assert failed.cut and "could not be rendered" in failed.html
    monkeypatch.setattr(hub_card, "render_card", pytest.fail)
    assert cache.card("deep", lambda: b"") is failed


# -- N2-W3: cheap cards cannot evict an expensive one -------------------------------------------------


def test_many_cheap_cards_do_not_evict_the_card_that_cost_a_render_of_seconds(renders):
    cache = hub_card.CardCache(max_chars=64 << 10)  # a card holds at most 8 KiB of it
    expensive = cache.card("expensive", lambda: b"![" * 4_000)  # ~0.1 s of CPU, cut at 8 KiB
    assert expensive.cut
    for index in range(64):  # 4 times the cache: cards of 4 KiB of HTML, 0.2 ms of CPU each
        cache.card(f"cheap-{index}", lambda index=index: f"```\n{index:04d}{'x' * 3_500}\n```\n".encode())
    assert len(renders) == 65
    assert cache.card("expensive", pytest.fail) is expensive  # evicted after 16 cheap ones before
    again = []
    for index in range(64):
        cache.card(f"cheap-{index}", lambda index=index: again.append(index) or b"# again\n")
    assert len(again) >= 48  # the cache holds at most 16 such cards: the cheap ones went


# -- N2-A1: ids folded as the file system folds them ---------------------------------------------------


def fold_case(hub, repo_type: str, namespace: str) -> str:
    """Simulates a root that folds case (macOS, Windows) for one namespace: its upper-case spelling opens
    the same folder. Returns that spelling."""
    folded = namespace.upper()
    (hub.storage.root / "repos" / repo_type / folded).symlink_to(namespace)
    return folded


def test_a_repo_made_private_under_one_spelling_is_private_under_every_spelling(hub, api):
    api.create_repo("acme/secret2", repo_type="model")
    api.create_commit("acme/secret2", repo_type="model", commit_message="weights", operations=[add("w.bin", b"w")])
    upper = f"{fold_case(hub, 'model', 'acme')}/secret2"
    assert http("GET", f"{hub.url}/api/models/{upper}")[0] == 200  # viewed anonymously while public
    assert http("GET", f"{hub.url}/{upper}")[0] == 200
    api.update_repo_settings("acme/secret2", repo_type="model", private=True)
    api.create_commit("acme/secret2", repo_type="model", commit_message="after",
                      operations=[add("later.bin", b"l")])
    for spelling in ("acme/secret2", upper):
        for path in (f"/api/models/{spelling}", f"/{spelling}", f"/{spelling}/resolve/main/w.bin",
                     f"/{spelling}/resolve/main/later.bin"):
            assert http("GET", hub.url + path)[0] == 404, path
    assert b"secret2" not in http("GET", f"{hub.url}/")[2]
    assert http("GET", f"{hub.url}/api/models/{upper}", token=TOKEN)[0] == 200


def test_concurrent_commits_under_two_spellings_of_one_repo_lose_none(hub, api):
    api.create_repo("race/race", repo_type="kernel")
    spellings = ["race/race", f"{fold_case(hub, 'kernel', 'race')}/race"]

    def commit(index: int) -> None:
        status, answer = commit_body(hub, spellings[index % 2],
                                     ndjson(HEADER, file_line(f"f{index}.txt", os.urandom(8))))
        assert status == 200, answer

    assert run_concurrently(commit, 24) == []
    assert {f"f{index}.txt" for index in range(24)} <= set(api.list_repo_files("race/race", repo_type="kernel"))


# -- N2-W4: a repo page reads the newest versions only, each metadata.json once ------------------------


def test_a_repo_page_reads_the_newest_versions_only_and_each_metadata_blob_once(hub, api, monkeypatch):
    repo_id = "org/many-versions"
    api.create_repo(repo_id, repo_type="kernel")
    metadata = json.dumps({"version": 1, "backend": {"type": "cpu"}, "digest": {"files": {"a.py": "x"}}}).encode()
    api.create_commit(repo_id, repo_type="kernel", commit_message="build",
                      operations=[add("build/torch-cpu/metadata.json", metadata)])
    count = 24  # more than pages.VERSIONS_SHOWN
    for number in range(1, count + 1):  # one commit per version, all holding the same metadata.json
        api.create_commit(repo_id, repo_type="kernel", commit_message=f"v{number}",
                          operations=[add("n.txt", str(number).encode())])
        api.create_branch(repo_id, repo_type="kernel", branch=f"v{number}")
    parsed = []
    read_json = hub._app.pages._json
    monkeypatch.setattr(hub._app.pages, "_json", lambda entry: parsed.append(entry) or read_json(entry))
    status, _, page = http("GET", f"{hub.url}/kernels/{repo_id}")
    assert status == 200 and len(parsed) == 1, len(parsed)  # one per version, every version, before
    text = visible_text(page.decode())
    shown = text[text.index("Versions"):text.index("Older versions")]
    assert f"v{count} (metadata version 1) torch-cpu cpu, sha256 digest of 1 files" in shown
    assert "v14 " not in shown and f"v{count - pages.VERSIONS_SHOWN} " not in shown
    assert f"Older versions: v{count - pages.VERSIONS_SHOWN}, " in text and text.count(", v1.") == 1
    assert f'href="/kernels/{repo_id}/tree/v1"'.encode() in page
    status, _, page = http("GET", f"{hub.url}/kernels/{repo_id}/tree/v3")  # an older version's own page
    assert status == 200 and f'get_kernel("{repo_id}", version=3,' in visible_text(page.decode())
    assert len(parsed) == 1
