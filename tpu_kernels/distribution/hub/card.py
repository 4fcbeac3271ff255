"""A repo's card (README.md) as HTML for the web pages: front matter apart, Markdown rendered inert.

Rendered with markdown-it-py (CommonMark, plus GFM tables and strikethrough) with raw
HTML turned off: a `<script>` or an `<img onerror=...>` in a card is text, escaped, never
markup. markdown-it's link check drops `javascript:`, `vbscript:`, `file:` and non-image
`data:` URLs. Relative links and images point at the repo's files at one commit, so a
card's pictures come from the same commit as its text.

A card's HTML is bounded, whatever it holds: markdown-it copies a reference link's URL into
every use of it (a 62 KB card of one 50 KiB URL used 4,000 times is 200 MB of HTML), and
YAML aliases repeat a front matter tag as often. The renderer stops at `MAX_CARD_HTML_CHARS`
(counting each relative link's base URL at its longest, `FILES_URL_CHARS`), closes what is
open and says on the page that the card is cut there, linking to the whole README.md.

A card's parse is bounded too, by what it costs rather than by what it outputs: markdown-it
fills a table's missing cells (a 23 KB card of 16 tables is 3.2M tokens and 1 GB), and a
512 KiB card of `![` takes 7 s of CPU. The parse spends at most `MAX_CARD_TOKENS` tokens on
blocks and as many on inline content, and `MAX_CARD_PARSE_SECONDS` of CPU; past either, the
card is cut where the parse stopped, and says so, as it is past its HTML bound.

`CardCache` renders each card's content once, for every commit that holds it, a failed or
cut render too, and at most `max_renders` at a time. The cache is bounded in total and per
card, and weighs each card by what rendering it cost (GreedyDual-Size): to evict a card,
other renders must first cost the server more CPU than rendering it again would, so cheap
cards cannot evict an expensive one. A page takes a cached card in pieces (`Card.pieces`),
the commit's base URL put in as each piece is sent: a view copies no whole card.
"""

from __future__ import annotations

import heapq
import html
import itertools
import logging
import posixpath
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from urllib.parse import quote, unquote, urlsplit

import yaml
from markdown_it import MarkdownIt
from markdown_it.common.utils import escapeHtml
from markdown_it.rules_block import StateBlock
from markdown_it.rules_core import StateCore
from markdown_it.rules_inline import StateInline
from markdown_it.token import Token

MAX_CARD_BYTES = 512 * 1024
MAX_FRONT_MATTER_CHARS = 64 * 1024
# The most HTML a page shows of one card.
MAX_CARD_HTML_CHARS = 1 << 20
# The longest base URL of a commit's files: "/kernels/" + a 193-character repo id + "/resolve/" + a commit id + "/".
FILES_URL_CHARS = 256
# Room kept for the closing tags and the notice of a cut card (markdown-it nests at most `maxNesting` deep).
_CUT_RESERVE_CHARS = 4096
MAX_BADGES = 32
MAX_BADGE_CHARS = 100
CARD_FILE = "README.md"
# What parsing one card may spend: tokens for its blocks (a table's cells are three each), as many for
# its inline content, and CPU seconds. A 512 KiB card of prose is about 80,000 tokens, and 0.5 s.
MAX_CARD_TOKENS = 1 << 17
MAX_CARD_PARSE_SECONDS = 2.0
# Renders running at once (each may hold what MAX_CARD_TOKENS tokens take: tens of MB).
MAX_CONCURRENT_RENDERS = 2
# What a cached card costs beyond its HTML, in characters: its key, metadata and bookkeeping.
_ENTRY_OVERHEAD_CHARS = 512
# A page sends a card in pieces of about this many characters.
PIECE_CHARS = 64 << 10
_MARKDOWN = MarkdownIt("commonmark", {"html": False}).enable(["table", "strikethrough"])
_BUDGET = "tpu_kernels.parse_budget"  # its key in markdown-it's env
logger = logging.getLogger(__name__)
# Table cell alignment becomes a class: the pages' CSP admits no style attributes.
_ALIGN_CLASSES = {f"text-align:{side}": f"align-{side}" for side in ("left", "center", "right")}
_URL_ATTRIBUTES = {"image": "src", "link_open": "href"}


def split_front_matter(content: str) -> tuple[str | None, str]:
    """(the YAML between a first line '---' and the next line '---', the rest); (None, content)
    without front matter. Linear time."""
    lines = content.split("\n")
    if lines[0].strip() != "---":
        return None, content
    for index in range(1, len(lines)):
        if lines[index].strip() == "---":
            return "\n".join(lines[1:index]), "\n".join(lines[index + 1:])
    return None, content


@dataclass(frozen=True)
class Card:
    """A card's HTML (badges from its front matter, then its text) and its front matter.

    `cut`: the HTML stops short of the card's end (at `MAX_CARD_HTML_CHARS`), and says so.
    """

    html: str
    metadata: dict = field(default_factory=dict)
    cut: bool = False
    base_mark: str | None = None  # where the HTML holds this, the commit's files' base URL goes

    def pieces(self, files_url: str = "", size: int = PIECE_CHARS) -> Iterator[str]:
        """The HTML in pieces of about `size` characters, `files_url` in place of the base mark."""
        text, mark = self.html, self.base_mark
        buffer: list[str] = []
        filled = start = 0
        while start < len(text):
            found = text.find(mark, start) if mark else -1
            end = len(text) if found == -1 else found
            while start < end:
                take = min(end - start, size - filled)
                buffer.append(text[start:start + take])
                filled += take
                start += take
                if filled >= size:
                    yield "".join(buffer)
                    buffer, filled = [], 0
            if found != -1:
                buffer.append(files_url)
                filled += len(files_url)
                start = found + len(mark)
        if buffer:
            yield "".join(buffer)


def _body_and_metadata(text: str) -> tuple[str, dict]:
    yaml_text, body = split_front_matter(text)
    if yaml_text is None or len(yaml_text) > MAX_FRONT_MATTER_CHARS:
        return body, {}
    try:
        metadata = yaml.load(yaml_text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (yaml.YAMLError, RecursionError):
        metadata = None
    return body, metadata if isinstance(metadata, dict) else {}


def _badges(metadata: dict) -> str:
    """The front matter's license and tags as badges: at most MAX_BADGES, each cut at MAX_BADGE_CHARS
    (YAML aliases can repeat one long tag thousands of times in a few bytes)."""
    badges = []
    license_ = metadata.get("license")
    if isinstance(license_, str):
        badges.append(f"license: {license_}")
    tags = metadata.get("tags")
    if isinstance(tags, list):
        badges.extend(tag for tag in tags[:MAX_BADGES] if isinstance(tag, str))
    if not badges:
        return ""
    spans = " ".join(f'<span class="badge">{html.escape(badge[:MAX_BADGE_CHARS].replace(chr(0), chr(0xFFFD)))}</span>'
                     for badge in badges[:MAX_BADGES])
    return f"<p>{spans}</p>\n"


def _repo_path(url: str) -> str | None:
    """The repo file a relative URL in the card names; None for absolute URLs, anchors and escapes."""
    parts = urlsplit(url)
    if parts.scheme or parts.netloc or not parts.path:
        return None
    path = posixpath.normpath(unquote(parts.path).lstrip("/"))
    if path == "." or path.startswith("../") or path == "..":
        return None
    return path


class _Overspent(Exception):
    """A card's parse ran past its budget; the message says which bound."""


class _ParseBudget:
    """What one card's parse may still spend: tokens (counted afresh for the inline phase) and CPU time."""

    def __init__(self, max_tokens: int, max_seconds: float):
        self.max_tokens = max_tokens
        self.max_seconds = max_seconds
        self.deadline = time.thread_time() + max_seconds
        self.tokens = 0
        self.steps = 0
        self.cut_reason: str | None = None

    def spend_token(self) -> None:
        self.tokens += 1
        if self.tokens > self.max_tokens:
            raise _Overspent(f"more than {self.max_tokens:,} Markdown tokens")
        self.step()

    def step(self) -> None:
        """Reads the clock every 256 steps: a step is a token made or a place the parser tries."""
        self.steps += 1
        if not self.steps & 255 and time.thread_time() > self.deadline:
            raise _Overspent(f"more than {self.max_seconds:g} s of CPU")


class _BudgetedTokens(list):
    """The list markdown-it pushes tokens into, each one paid for (markdown-it adds tokens with `append`)."""

    def __init__(self, budget: _ParseBudget):
        super().__init__()
        self.budget = budget

    def append(self, token: Token) -> None:
        self.budget.spend_token()
        super().append(token)


def _budget_block_step(state: StateBlock, start_line: int, end_line: int, silent: bool) -> bool:
    """First of the block rules: pays a step at each block, and matches nothing."""
    state.env[_BUDGET].step()
    return False


def _budget_inline_step(state: StateInline, silent: bool) -> bool:
    """First of the inline rules: pays a step at each place tried (link labels try every place), matches nothing."""
    state.env[_BUDGET].step()
    return False


def _parse_blocks(state: StateCore) -> None:
    """markdown-it's block phase into budgeted tokens; past the budget, the blocks parsed so far."""
    budget: _ParseBudget = state.env[_BUDGET]
    tokens = _BudgetedTokens(budget)
    try:
        state.md.block.parse(state.src, state.md, state.env, tokens)
    except _Overspent as overspent:
        budget.cut_reason = str(overspent)
    state.tokens = list(tokens)


def _parse_inlines(state: StateCore) -> None:
    """markdown-it's inline phase with a budget of its own; past it, the blocks after the one it ran out in go."""
    budget: _ParseBudget = state.env[_BUDGET]
    budget.tokens = 0
    for index, token in enumerate(state.tokens):
        if token.type == "inline":
            children = _BudgetedTokens(budget)
            try:
                state.md.inline.parse(token.content, state.md, state.env, children)
            except _Overspent as overspent:
                budget.cut_reason = budget.cut_reason or str(overspent)
                del state.tokens[index + 1:]
                return
            finally:
                token.children = list(children)


_MARKDOWN.core.ruler.at("block", _parse_blocks)
_MARKDOWN.core.ruler.at("inline", _parse_inlines)
_MARKDOWN.block.ruler.before("table", "budget", _budget_block_step)
_MARKDOWN.inline.ruler.before("text", "budget", _budget_inline_step)


def parse_card(body: str, max_tokens: int = MAX_CARD_TOKENS,
               max_seconds: float = MAX_CARD_PARSE_SECONDS) -> tuple[list[Token], str | None]:
    """markdown-it's tokens of a card's body, within the budget; and why the parse stopped short (None if it did not)."""
    budget = _ParseBudget(max_tokens, max_seconds)
    tokens = _MARKDOWN.parse(body, {_BUDGET: budget})
    return tokens, budget.cut_reason


class _BoundedHTML:
    """markdown-it's renderer, one token at a time, stopping before the HTML passes `budget`
    characters (a base URL counted at `base_url_chars`)."""

    def __init__(self, budget: int, base_url: str, base_url_chars: int):
        self.budget = budget - _CUT_RESERVE_CHARS
        self.base_url = base_url
        self.extra_per_base = max(0, base_url_chars - len(base_url))
        self.out: list[str] = []
        self.used = 0
        self.open_tags: list[str] = []
        self.urls: dict[str, str | None] = {}  # a reference link's URL is one object, used many times

    def cost(self, piece: str) -> int:
        extra = piece.count(self.base_url) * self.extra_per_base if self.extra_per_base else 0
        return len(piece) + extra

    def add(self, piece: str) -> bool:
        cost = self.cost(piece)
        if self.used + cost > self.budget:
            return False
        self.out.append(piece)
        self.used += cost
        return True

    def url(self, url: str) -> str | None:
        if url not in self.urls:
            path = _repo_path(url)
            self.urls[url] = None if path is None else self.base_url + quote(path)
        return self.urls[url]

    def token(self, tokens, index: int) -> bool:
        """Renders tokens[index] (a block token or an inline child); False if it does not fit."""
        token = tokens[index]
        if token.type in ("th_open", "td_open") and token.attrGet("style") in _ALIGN_CLASSES:
            token.attrs = {"class": _ALIGN_CLASSES[token.attrs["style"]]}
        name = _URL_ATTRIBUTES.get(token.type)
        if name is not None:
            rewritten = self.url(str(token.attrGet(name)))
            if rewritten is not None:
                token.attrSet(name, rewritten)
            elif token.type == "link_open":
                token.attrSet("rel", "nofollow noopener noreferrer")
        renderer, options = _MARKDOWN.renderer, _MARKDOWN.options
        rule = renderer.rules.get(token.type)
        piece = rule(tokens, index, options, {}) if rule else renderer.renderToken(tokens, index, options, {})
        if not self.add(piece):
            if token.type == "text":  # as much of a long text as fits
                room = (self.budget - self.used) // 6  # escaping makes at most 6 characters of one
                if room > 0:
                    self.add(escapeHtml(token.content[:room]))
            return False
        if token.nesting and not token.hidden:
            if token.nesting > 0:
                self.open_tags.append(token.tag)
            elif self.open_tags:
                self.open_tags.pop()
        return True

    def render(self, tokens) -> bool:
        """True if every token fitted."""
        for index, token in enumerate(tokens):
            if token.type == "inline":
                for child_index in range(len(token.children or ())):
                    if not self.token(token.children, child_index):
                        return False
            elif not self.token(tokens, index):
                return False
        return True

    def cut_here(self, reason: str) -> None:
        self.out.extend(f"</{tag}>" for tag in reversed(self.open_tags))
        self.out.append(
            f'\n<p class="card-cut"><strong>The card is cut here:</strong> {html.escape(reason)}. Read it whole in '
            f'<a href="{self.base_url}{CARD_FILE}">{CARD_FILE}</a>.</p>\n'
        )


def render_card(content: bytes, base_url: str, *, max_html_chars: int = MAX_CARD_HTML_CHARS,
                base_url_chars: int | None = None, max_tokens: int = MAX_CARD_TOKENS,
                max_parse_seconds: float = MAX_CARD_PARSE_SECONDS) -> Card:
    """The card's HTML and its front matter; relative links and images point below `base_url` (the
    URL of the commit's files, ending in '/').

    The HTML holds at most `max_html_chars` characters once every `base_url` in it is counted as
    `base_url_chars` (default: its length); a card that would be longer is cut, and says so. So is a
    card whose parse would take more than `max_tokens` tokens (per phase) or `max_parse_seconds` of CPU.
    """
    if max_html_chars < _CUT_RESERVE_CHARS:
        raise ValueError(f"max_html_chars {max_html_chars} leaves no room for the notice of a cut card "
                         f"({_CUT_RESERVE_CHARS} characters)")
    if len(content) > MAX_CARD_BYTES:
        return Card(html=f"<p>The card is {len(content):,} bytes: too large to show here.</p>")
    body, metadata = _body_and_metadata(content.decode("utf-8", errors="replace"))
    bounded = _BoundedHTML(max_html_chars, base_url, len(base_url) if base_url_chars is None else base_url_chars)
    tokens, parse_cut = parse_card(body, max_tokens, max_parse_seconds)
    whole = bounded.add(_badges(metadata)) and bounded.render(tokens)
    if not whole:
        bounded.cut_here(f"its HTML is longer than the {max_html_chars:,} characters a page shows")
    elif parse_cut is not None:
        bounded.cut_here(f"parsing it takes {parse_cut}, more than a page spends on a card")
    return Card(html="".join(bounded.out), metadata=metadata, cut=not whole or parse_cut is not None)


# Stands for the files' base URL in a cached card: markdown-it turns every NUL of a card into
# U+FFFD, and `html.escape` leaves none in a badge, so none appears in its HTML but where this one is put.
_BASE_MARK = "\0"


class CardCache:
    """Cards rendered once per content, whatever the commit, failed and cut renders included.

    Up to `max_chars` of HTML in all, each card cut at `max_entry_chars` (default:
    MAX_CARD_HTML_CHARS, at most an eighth of the whole), so a card never evicts more than that.
    Which card goes is GreedyDual-Size's choice: a card's priority is the floor plus the CPU seconds
    its render took per character it holds, the card of least priority goes and its priority becomes
    the floor. A card is evicted only once the cards that came after it have raised the floor to its
    own priority, that is, once renders have cost the server more than rendering it again would:
    cheap cards cannot push out an expensive one. Requests for a card being rendered wait for that
    rendering; at most `max_renders` renders run at once.
    """

    def __init__(self, max_chars: int = 32 << 20, max_entry_chars: int | None = None,
                 max_renders: int = MAX_CONCURRENT_RENDERS):
        self._max_chars = max_chars
        self.max_entry_chars = min(MAX_CARD_HTML_CHARS, max_chars // 8) if max_entry_chars is None else max_entry_chars
        if self.max_entry_chars > max_chars:
            raise ValueError(f"a card's bound ({self.max_entry_chars}) is larger than the cache ({max_chars})")
        self._cards: dict[str, _CachedCard] = {}
        self._queue: list[tuple[float, int, str]] = []  # (priority, order, key); stale rows are skipped
        self._order = itertools.count()
        self._floor = 0.0
        self._chars = 0
        self._lock = threading.Lock()
        self._rendering: dict[str, threading.Lock] = {}
        self._renders = threading.BoundedSemaphore(max_renders)

    def card(self, key: str, content: Callable[[], bytes]) -> Card:
        """The card whose content has `key` (its sha256): its `pieces(files_url)` point relative links
        below `files_url`, which counts as FILES_URL_CHARS at most."""
        card = self._cached(key)
        if card is None:
            with self._lock:
                rendering = self._rendering.setdefault(key, threading.Lock())
            with rendering:
                card = self._cached(key)
                if card is None:
                    data = content()
                    with self._renders:
                        started = time.thread_time()
                        card = self._render(key, data)
                        cost = time.thread_time() - started
                    self._keep(key, card, cost)
        return card

    def _render(self, key: str, content: bytes) -> Card:
        try:
            card = render_card(content, _BASE_MARK, max_html_chars=self.max_entry_chars,
                               base_url_chars=FILES_URL_CHARS)
        except Exception as error:  # remembered: a hostile card must not cost every view again
            logger.warning("card %s could not be rendered: %s: %s", key[:12], type(error).__name__, error)
            return Card(f'<p class="card-cut">This card could not be rendered. Read it in '
                        f'<a href="{_BASE_MARK}{CARD_FILE}">{CARD_FILE}</a>.</p>\n', cut=True, base_mark=_BASE_MARK)
        return Card(card.html, card.metadata, card.cut, base_mark=_BASE_MARK)

    def _cached(self, key: str) -> Card | None:
        with self._lock:
            entry = self._cards.get(key)
            if entry is None:
                return None
            self._prioritise(key, entry)
            return entry.card

    def _prioritise(self, key: str, entry: _CachedCard) -> None:
        entry.priority = self._floor + entry.cost / entry.chars
        heapq.heappush(self._queue, (entry.priority, next(self._order), key))
        if len(self._queue) > 4 * len(self._cards) + 64:  # drop the stale rows hits leave behind
            self._queue = [(item.priority, next(self._order), name) for name, item in self._cards.items()]
            heapq.heapify(self._queue)

    def _keep(self, key: str, card: Card, cost: float) -> None:
        with self._lock:
            self._rendering.pop(key, None)
            entry = self._cards[key] = _CachedCard(card, len(card.html) + _ENTRY_OVERHEAD_CHARS, max(cost, 1e-6))
            self._chars += entry.chars
            while self._chars > self._max_chars and len(self._cards) > 1:  # the new card is not queued yet
                priority, _, name = heapq.heappop(self._queue)
                victim = self._cards.get(name)
                if victim is None or victim.priority != priority:
                    continue
                del self._cards[name]
                self._chars -= victim.chars
                self._floor = priority
            self._prioritise(key, entry)


@dataclass
class _CachedCard:
    card: Card
    chars: int
    cost: float  # CPU seconds its render took
    priority: float = 0.0
