"""A bounded fuzz run (hypothesis) of the local Hub's path rules, commit reader, revisions and cards.

Whatever a client sends, the answer is never a 500, the log holds no error (a traceback is
one), nothing stays staged, and no blob is left that no commit references. A revision with
control characters gets a 4xx with printable headers; a card of any text renders within its
bound, with its tags closed, and a card of tables and nesting parses within its token budget. About 50 s in all on a 2-core machine; a failure prints the blob
that replays it (@reproduce_failure).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import unicodedata
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tpu_kernels.distribution.hub import Limits, start_hub
from tpu_kernels.distribution.hub.card import parse_card, render_card
from tpu_kernels.distribution.hub.errors import HubError
from tpu_kernels.distribution.hub.names import name_key, validate_path

from .hub_support import http

TOKEN = "fuzz-" + os.urandom(4).hex()
REPO = "org/fuzzed"
# The card test's own repo: the path fuzzing commits any path to REPO (a folder named README.md, say), which a
# card commit to the same tree would then rightly be refused.
CARD_REPO = "org/fuzzed-card"
ANSWERS = {200, 400, 404, 409, 412, 413}

# Names a file system, git or a terminal treats specially, and their near misses.
SPECIAL_PARTS = [
    ".git", ".GIT", ".gIt", ".git.", ".git ", ".git. .", "GIT~1", "git~2", ".git::$INDEX_ALLOCATION", ".git:x",
    ".g\u200cit", ".g\u0131t", ".github", ".gitignore", "git", "a.git", "..", ".", "", "a", "A", "a.", "a ",
    "caf\u00e9", "cafe\u0301", "README.md", "readme.md", "x\u202ey", "\u2066z", "\ufeff", "\ud800", "\udfff",
    "\x00", "\x1b[31m", "\x7f", "a\\b", "con", "a:b", "~", "\u00df", "SS",
    "README.md::$DATA", "README.md:$DATA", "config.json:evil", "CONFIG~1.JSO", "config~1.jso", "a~1", "AB~12",
    "ABCDEFG~1", "x~1.tar.gz", "~1", "CO1A2B~1.JSO.",
]
PARTS = st.one_of(st.sampled_from(SPECIAL_PARTS), st.text(alphabet="abAB._- ~", min_size=1, max_size=6),
                  st.text(alphabet=st.characters(exclude_categories=()), max_size=10))
PATHS = st.lists(PARTS, min_size=1, max_size=4).map("/".join)
REFUSED_CATEGORIES = {"Cc", "Cf", "Cs", "Zl", "Zp"}


def _looks_like_a_short_name(part: str) -> bool:
    """NTFS 8.3 short name form (CONFIG~1.JSO): a base of at most 8 characters ending in ~ and digits,
    an extension of at most 3; trailing dots and spaces dropped, as Windows drops them."""
    base, _, extension = part.rstrip(". ").partition(".")
    digits = base[base.rfind("~") + 1:] if "~" in base else ""
    return len(base) <= 8 and digits.isascii() and digits.isdigit() and len(extension) <= 3 and "." not in extension


def _file_system_spellings(part: str) -> set[str]:
    """How file systems may read a name: Windows drops trailing dots and spaces and reads `name:x`
    as a stream of `name`; Windows and macOS fold case (NTFS by upper-casing)."""
    stripped = part.split(":", 1)[0].rstrip(". ")
    return {form for name in (part, stripped) for form in (name.upper(), name.casefold(), name.lower())}


@settings(max_examples=3000, deadline=None, database=None)
@given(PATHS)
def test_an_accepted_path_is_never_git_nor_invisible_nor_escaping(path):
    try:
        accepted = validate_path(path)
    except HubError as error:
        assert error.status == 400 and error.message.encode()
        return
    assert accepted == path
    parts = path.split("/")
    assert "" not in parts and "." not in parts and ".." not in parts and "\\" not in path
    assert not {unicodedata.category(char) for char in path} & REFUSED_CATEGORIES
    assert ":" not in path  # no NTFS stream of a file
    for part in parts:
        spellings = _file_system_spellings(part)
        assert ".git" not in spellings and ".GIT" not in spellings
        assert not any(spelling.upper().startswith("GIT~") and spelling[4:].isdigit() for spelling in spellings)
        assert not _looks_like_a_short_name(part)
    name_key(path).encode()


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    limits = Limits(header_timeout=2, idle_timeout=2, body_timeout=2, send_timeout=2)
    with start_hub(tmp_path_factory.mktemp("fuzz") / "hub", token=TOKEN, limits=limits) as running:
        for repo in (REPO, CARD_REPO):
            status, _, _ = http("POST", f"{running.url}/api/repos/create", token=TOKEN, body=json.dumps(
                {"name": repo.split("/")[1], "organization": "org", "type": "kernel"}).encode())
            assert status == 200
        yield running


class _Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture(scope="module")
def errors():
    handler = _Errors()
    logging.getLogger().addHandler(handler)
    yield handler.records
    logging.getLogger().removeHandler(handler)


TEXT = st.text(alphabet=st.characters(exclude_categories=()), max_size=20)
OPERATIONS = st.one_of(
    st.tuples(st.just("file"), PATHS, st.binary(max_size=40)),
    st.tuples(st.sampled_from(["deletedFile", "deletedFolder"]), PATHS),
    st.tuples(st.just("raw"), st.one_of(
        st.binary(max_size=30),
        st.recursive(st.none() | st.booleans() | st.integers() | TEXT,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                     max_leaves=6).map(lambda value: json.dumps(value).encode()))),
)


def _line(operation) -> bytes:
    kind, *rest = operation
    if kind == "raw":
        return rest[0]
    if kind == "file":
        path, content = rest
        return json.dumps({"key": "file", "value": {"path": path, "content": base64.b64encode(content).decode(),
                                                    "encoding": "base64"}}).encode()
    return json.dumps({"key": kind, "value": {"path": rest[0]}}).encode()


def _unreferenced_blobs(root: Path) -> list[str]:
    referenced = {entry["sha256"] for commit_file in root.glob("repos/*/*/*/commits/*.json")
                  for entry in json.loads(commit_file.read_bytes())["files"].values()}
    return [blob.name for blob in root.glob("blobs/*/*") if blob.name not in referenced]


@pytest.mark.slow
@settings(max_examples=1200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(summary=TEXT, description=st.none() | TEXT, operations=st.lists(OPERATIONS, max_size=5),
       cut=st.none() | st.integers(min_value=0, max_value=400), probe=PATHS)
def test_no_commit_body_gets_a_500_an_error_log_or_leaves_a_blob_behind(hub, errors, summary, description,
                                                                         operations, cut, probe):
    header = {"key": "header", "value": {"summary": summary, **({"description": description} if description else {})}}
    body = b"\n".join([json.dumps(header).encode(), *map(_line, operations)]) + b"\n"
    if cut is not None:
        body = body[:cut]
    status, _, answer = http("POST", f"{hub.url}/api/kernels/{REPO}/commit/main", body, token=TOKEN,
                             headers={"Content-Type": "application/x-ndjson"})
    assert status in ANSWERS, answer[:500]
    event(f"commit answered {status}")
    for url in (f"{hub.url}/kernels/{REPO}/resolve/main/{quote(probe, safe='/', errors='surrogatepass')}",
                f"{hub.url}/api/kernels/{REPO}/tree/main/{quote(probe, safe='/', errors='surrogatepass')}"):
        assert http("GET", url)[0] in ANSWERS
    assert errors == []
    root = hub.storage.root
    assert not any((root / "tmp").iterdir())
    assert _unreferenced_blobs(root) == []


# -- revisions with control characters ----------------------------------------------------------------

CONTROL = st.characters(categories=("Cc", "Cf", "Zl", "Zp"))
REVISIONS = st.one_of(
    st.tuples(st.sampled_from(["main", "v1", "refs/heads/main", "", "0" * 40]), CONTROL,
              st.text(max_size=4)).map("".join),
    st.text(alphabet=st.one_of(CONTROL, st.sampled_from("main/v1.-_")), min_size=1, max_size=12)
    .filter(lambda text: any(unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp") for char in text)),
)
REVISION_ROUTES = ["/kernels/{repo}/resolve/{rev}/README.md", "/api/kernels/{repo}/revision/{rev}",
                   "/api/kernels/{repo}/tree/{rev}", "/api/kernels/{repo}/commits/{rev}", "/kernels/{repo}/tree/{rev}"]


@pytest.mark.slow
@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(revision=REVISIONS)
def test_a_revision_with_control_characters_is_a_clean_4xx(hub, errors, revision):
    encoded = quote(revision, safe="", errors="surrogatepass")
    for route in REVISION_ROUTES:
        status, headers, answer = http("GET", hub.url + route.format(repo=REPO, rev=encoded))
        assert 400 <= status < 500, (route, status, answer[:300])
        assert all(" " <= char <= "~" for value in headers.values() for char in value), headers
    status, _, _ = http("POST", f"{hub.url}/api/kernels/{REPO}/commit/{encoded}", b"", token=TOKEN,
                        headers={"Content-Type": "application/x-ndjson"})
    assert 400 <= status < 500
    assert errors == []


# -- cards -----------------------------------------------------------------------------------------

CARD_PIECES = st.sampled_from([
    "[a][r] ", "[a][r]", "![i][r] ", "[r]: ", "[r]: x\n", "\n\n", "- ", "> ", "# ", "| a | b |\n|---|:-:|\n", "*", "**",
    "~~", "`", "```\n", "[", "](", ")", "![", "<script>", "&amp;", "\x00", "\x1b", "\u202e", "\ud800", "---\n",
    "tags: [*t, *t]\n", "x: &t ", "license: ", "http://e.com/", "../", "javascript:", "\\", "    ",
    "|", "|-", "|:-:", "| x |\n", "|-|-|-|\n", "a|b\n", "-|-\n", "1. ", "> > > ", "- - - ", "   - ", "\t",
])
# Tables (a header row, its delimiter, rows short of cells that markdown-it fills in) inside quotes and lists.
TABLES = st.builds(
    lambda columns, rows, cells, nesting: "".join(
        nesting + line + "\n" for line in ["|a" * columns, "|-" * columns, *["|b" * cells] * rows]) + "\n",
    st.integers(min_value=1, max_value=60), st.integers(min_value=0, max_value=80), st.integers(min_value=0, max_value=3),
    st.lists(st.sampled_from(["> ", "- ", "1. ", "  ", "* > "]), max_size=30).map("".join))
NESTED = st.lists(st.one_of(TABLES, CARD_PIECES, st.text(alphabet="|-:> *`[]()!\n ab", max_size=12)),
                  max_size=12).map("".join)
CARDS = st.lists(st.one_of(CARD_PIECES, st.text(max_size=8)), max_size=60).map("".join)
TAGS = ("a", "em", "strong", "s", "code", "p", "ul", "ol", "li", "blockquote", "table", "thead", "tbody", "tr",
        "th", "td", "h1", "h2", "h3", "h4", "h5", "h6", "pre")


class _Balance(HTMLParser):
    """Whether every tag the card renderer opens is closed, in order."""

    def __init__(self):
        super().__init__()
        self.open: list[str] = []
        self.balanced = True

    def handle_starttag(self, tag, attrs):
        if tag in TAGS:
            self.open.append(tag)

    def handle_endtag(self, tag):
        if tag in TAGS:
            self.balanced &= bool(self.open) and self.open.pop() == tag


@settings(max_examples=400, deadline=None, database=None)
@given(card=CARDS, repeat=st.integers(min_value=1, max_value=200), budget=st.integers(min_value=4200, max_value=20_000))
def test_a_card_of_any_text_renders_within_its_bound_with_its_tags_closed(card, repeat, budget):
    content = (card * repeat).encode("utf-8", errors="surrogatepass")[:8 << 10]
    rendered = render_card(content, "/kernels/o/n/resolve/" + "0" * 40 + "/", max_html_chars=budget)
    assert len(rendered.html) <= budget
    assert "\0" not in rendered.html and "<script" not in rendered.html.lower()
    balance = _Balance()
    balance.feed(rendered.html)
    balance.close()
    assert balance.balanced and balance.open == [], rendered.html[-500:]
    event("cut" if rendered.cut else "whole")


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(card=NESTED, repeat=st.integers(min_value=1, max_value=40), max_tokens=st.integers(min_value=1, max_value=3000))
def test_a_card_of_tables_and_nesting_parses_within_its_token_budget(card, repeat, max_tokens):
    body = (card * repeat)[:16 << 10]
    tokens, reason = parse_card(body, max_tokens=max_tokens)
    # Each phase within the budget: the blocks, then all the inline tokens together.
    assert len(tokens) <= max_tokens and sum(len(token.children or ()) for token in tokens) <= max_tokens
    assert reason is None or reason == f"more than {max_tokens:,} Markdown tokens"
    rendered = render_card(body.encode("utf-8", errors="surrogatepass"), "/r/", max_tokens=max_tokens,
                           max_html_chars=8192)
    assert rendered.cut or reason is None  # a card cut by its budget says so (past 4 KiB, by its HTML bound first)
    balance = _Balance()
    balance.feed(rendered.html)
    balance.close()
    assert balance.balanced and balance.open == [], rendered.html[-500:]
    event("cut by its budget" if reason else "parsed whole")


@pytest.mark.slow
@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(card=st.one_of(CARDS, NESTED), repeat=st.integers(min_value=1, max_value=500))
def test_no_card_gets_a_500_or_an_error_log_on_its_page(hub, errors, card, repeat):
    content = (card * repeat).encode("utf-8", errors="surrogatepass")[:32 << 10]
    line = {"key": "file", "value": {"path": "README.md", "content": base64.b64encode(content).decode(),
                                     "encoding": "base64"}}
    body = b"\n".join([json.dumps({"key": "header", "value": {"summary": "card"}}).encode(),
                       json.dumps(line).encode()]) + b"\n"
    status, _, answer = http("POST", f"{hub.url}/api/kernels/{CARD_REPO}/commit/main", body, token=TOKEN,
                             headers={"Content-Type": "application/x-ndjson"})
    assert status == 200, answer[:300]
    status, _, page = http("GET", f"{hub.url}/kernels/{CARD_REPO}/tree/main")
    assert status == 200 and len(page) < (1 << 20) + (64 << 10)
    assert errors == []
