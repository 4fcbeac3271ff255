"""Issue 49's findings 1-8 and 11, each refused or bounded: cards that expand, the card cache, symlinks
in a kernel source, the on-disk caches, NTFS aliases, control characters in a revision, hostile
calibration input, the cache root, and the server's folder modes.

A real server on loopback where a client would see the difference; in this process where memory is
measured (tracemalloc) or an internal bound is the point.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import anyio
import pytest
from huggingface_hub import CommitOperationAdd

from tpu_kernels.distribution.hub import card as hub_card

from .hub_support import module_hub
from .test_hub_hardening import FAST, TOKEN, api, http, repo  # noqa: F401 - api and repo are fixtures

REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("local_agent_registry")

hub = module_hub(TOKEN, FAST)


def add(path: str, content: bytes) -> CommitOperationAdd:
    return CommitOperationAdd(path_in_repo=path, path_or_fileobj=content)


def amplified_card(url_bytes: int, uses: int) -> bytes:
    """A card defining one reference link whose URL is `url_bytes` long and using it `uses` times:
    markdown-it copies the URL into every use."""
    return b"---\nlicense: mit\n---\n# Amplified\n\n[r]: https://example.com/" + b"x" * url_bytes + b"\n\n" + \
        b"[a][r] " * uses + b"\n"


@pytest.fixture
def renders(monkeypatch):
    """One item per card markdown-it parses."""
    counted = []
    parse = hub_card._MARKDOWN.parse

    def counting(*args, **kwargs):
        counted.append(1)
        return parse(*args, **kwargs)

    monkeypatch.setattr(hub_card._MARKDOWN, "parse", counting)
    return counted


# -- 1. a card whose references expand is cut, and says so; a view holds no whole page ---------------


def test_a_card_whose_reference_links_expand_is_cut_on_its_page_and_says_so(hub, api, repo):
    # 8 KiB x 1,000 uses: 8 MB of HTML from an 8 KB card before.
    api.create_commit(repo, repo_type="kernel", commit_message="card",
                      operations=[add("README.md", amplified_card(8 << 10, 1000))])
    status, _, page = http("GET", f"{hub.url}/kernels/{repo}")
    assert status == 200
    card_html = page.split(b'<article class="card">')[1].split(b"</article>")[0]
    assert len(card_html) <= hub_card.MAX_CARD_HTML_CHARS
    assert len(page) < hub_card.MAX_CARD_HTML_CHARS + (64 << 10)
    assert b"The card is cut here" in card_html and b"/README.md\">README.md</a>" in card_html
    assert b"license: mit" in card_html and card_html.count(b"<a ") > 10  # what fits is shown


def test_front_matter_aliases_cannot_repeat_a_tag_without_bound(hub, api, repo):
    tag = "t" * 10_000
    front = f"---\nlicense: mit\nx: &big {tag}\ntags: [{', '.join(['*big'] * 8_000)}]\n---\n# aliases\n"
    assert len(front) < hub_card.MAX_FRONT_MATTER_CHARS + 20
    api.create_commit(repo, repo_type="kernel", commit_message="card", operations=[add("README.md", front.encode())])
    status, _, page = http("GET", f"{hub.url}/kernels/{repo}")
    assert status == 200 and b"aliases</h1>" in page
    assert len(page) < 256 << 10  # 80 MB before


def _drain(response) -> int:
    """Reads a page's whole body a chunk at a time, keeping none; its largest chunk."""
    async def read() -> int:
        largest = 0
        async for chunk in response.body_iterator:
            largest = max(largest, len(chunk))
        return largest

    if hasattr(response, "body_iterator"):
        return anyio.run(read)
    return len(response.body)


def test_a_view_of_a_cached_card_holds_a_bounded_piece_of_the_page_not_the_page(hub, api, repo):
    api.create_commit(repo, repo_type="kernel", commit_message="card",
                      operations=[add("README.md", amplified_card(8 << 10, 1000))])
    pages = hub._app.pages
    _drain(pages.repo("kernel", repo, hub.url))  # renders the card into the cache
    tracemalloc.start()
    try:
        largest = _drain(pages.repo("kernel", repo, hub.url))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Before: the page was built whole (8 MB, three copies of it at the peak).
    assert largest <= 2 * (64 << 10) and peak < 1 << 20, (largest, peak)


# -- 2. the card cache: bounded per card, so one card cannot evict the others -------------------------


def test_a_huge_card_does_not_evict_the_other_cached_cards(hub, api, renders):
    small = []
    for index in range(3):
        repo_id = f"org/small-card-{index}"
        api.create_repo(repo_id, repo_type="kernel")
        api.create_commit(repo_id, repo_type="kernel", commit_message="card",
                          operations=[add("README.md", f"# small {index}\n\n![plot](plot.png)\n".encode())])
        small.append(repo_id)
    api.create_repo("org/huge-card", repo_type="kernel")
    # 48 KiB x 700 uses: 34 MB of HTML before, more than the whole cache (32 MiB).
    api.create_commit("org/huge-card", repo_type="kernel", commit_message="card",
                      operations=[add("README.md", amplified_card(48 << 10, 700))])
    for repo_id in small:
        assert http("GET", f"{hub.url}/kernels/{repo_id}")[0] == 200
    assert len(renders) == 3
    assert http("GET", f"{hub.url}/kernels/org/huge-card")[0] == 200
    assert len(renders) == 4
    for repo_id in small:
        status, _, page = http("GET", f"{hub.url}/kernels/{repo_id}")
        assert status == 200 and b"/plot.png" in page
    assert len(renders) == 4  # each small card still cached: not rendered again


def test_the_card_cache_bounds_each_card_to_a_share_of_the_whole():
    cache = hub_card.CardCache(max_chars=1 << 20)
    assert cache.max_entry_chars <= (1 << 20) // 8
    for index in range(6):
        cache.card(f"small-{index}", lambda index=index: f"# card {index}\n".encode())
    huge = cache.card("huge", lambda: amplified_card(8 << 10, 1000))
    assert huge.cut and len(huge.html) <= cache.max_entry_chars
    rendered = []
    for index in range(6):
        cache.card(f"small-{index}", lambda: rendered.append(1) or b"")
    assert rendered == []
