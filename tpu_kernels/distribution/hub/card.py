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

Rendering costs up to ~14 us of CPU per byte of card (measured: a 512 KiB card of `![`
takes 7 s), so `CardCache` renders each card's content once, for every commit that holds it.
The cache is bounded in total and per card (a card is cut at the per-card bound), so one
card cannot evict the others. A page takes a cached card in pieces (`Card.pieces`), the
commit's base URL put in as each piece is sent: a view copies no whole card.
"""

from __future__ import annotations

import collections
import html
import posixpath
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from urllib.parse import quote, unquote, urlsplit

import yaml
from markdown_it import MarkdownIt
from markdown_it.common.utils import escapeHtml

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
# A page sends a card in pieces of about this many characters.
PIECE_CHARS = 64 << 10
_MARKDOWN = MarkdownIt("commonmark", {"html": False}).enable(["table", "strikethrough"])
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

    def cut_here(self, limit: int) -> None:
        self.out.extend(f"</{tag}>" for tag in reversed(self.open_tags))
        self.out.append(
            f'\n<p class="card-cut"><strong>The card is cut here:</strong> its HTML is longer than the '
            f"{limit:,} characters a page shows. Read it whole in "
            f'<a href="{self.base_url}{CARD_FILE}">{CARD_FILE}</a>.</p>\n'
        )


def render_card(content: bytes, base_url: str, *, max_html_chars: int = MAX_CARD_HTML_CHARS,
                base_url_chars: int | None = None) -> Card:
    """The card's HTML and its front matter; relative links and images point below `base_url` (the
    URL of the commit's files, ending in '/').

    The HTML holds at most `max_html_chars` characters once every `base_url` in it is counted as
    `base_url_chars` (default: its length); a card that would be longer is cut, and says so.
    """
    if max_html_chars < _CUT_RESERVE_CHARS:
        raise ValueError(f"max_html_chars {max_html_chars} leaves no room for the notice of a cut card "
                         f"({_CUT_RESERVE_CHARS} characters)")
    if len(content) > MAX_CARD_BYTES:
        return Card(html=f"<p>The card is {len(content):,} bytes: too large to show here.</p>")
    body, metadata = _body_and_metadata(content.decode("utf-8", errors="replace"))
    bounded = _BoundedHTML(max_html_chars, base_url, len(base_url) if base_url_chars is None else base_url_chars)
    whole = bounded.add(_badges(metadata)) and bounded.render(_MARKDOWN.parse(body))
    if not whole:
        bounded.cut_here(max_html_chars)
    return Card(html="".join(bounded.out), metadata=metadata, cut=not whole)


# Stands for the files' base URL in a cached card: markdown-it turns every NUL of a card into
# U+FFFD, and `html.escape` leaves none in a badge, so none appears in its HTML but where this one is put.
_BASE_MARK = "\0"


class CardCache:
    """Cards rendered once per content, whatever the commit: up to `max_chars` of HTML in all, most
    recently used kept, and each card cut at `max_entry_chars` (default: MAX_CARD_HTML_CHARS, at most
    an eighth of the whole), so a card never evicts more than that. Requests for a card being
    rendered wait for that rendering."""

    def __init__(self, max_chars: int = 32 << 20, max_entry_chars: int | None = None):
        self._max_chars = max_chars
        self.max_entry_chars = min(MAX_CARD_HTML_CHARS, max_chars // 8) if max_entry_chars is None else max_entry_chars
        if self.max_entry_chars > max_chars:
            raise ValueError(f"a card's bound ({self.max_entry_chars}) is larger than the cache ({max_chars})")
        self._cards: collections.OrderedDict[str, Card] = collections.OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self._rendering: dict[str, threading.Lock] = {}

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
                    card = render_card(content(), _BASE_MARK, max_html_chars=self.max_entry_chars,
                                       base_url_chars=FILES_URL_CHARS)
                    card = Card(card.html, card.metadata, card.cut, base_mark=_BASE_MARK)
                    self._keep(key, card)
        return card

    def _cached(self, key: str) -> Card | None:
        with self._lock:
            card = self._cards.get(key)
            if card is not None:
                self._cards.move_to_end(key)
            return card

    def _keep(self, key: str, card: Card) -> None:
        with self._lock:
            self._rendering.pop(key, None)
            self._cards[key] = card
            self._chars += len(card.html)
            while self._chars > self._max_chars and len(self._cards) > 1:
                _, dropped = self._cards.popitem(last=False)
                self._chars -= len(dropped.html)
