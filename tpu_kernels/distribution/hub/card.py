"""A repo's card (README.md) as HTML for the web pages: front matter apart, Markdown rendered inert.

Rendered with markdown-it-py (CommonMark, plus GFM tables and strikethrough) with raw
HTML turned off: a `<script>` or an `<img onerror=...>` in a card is text, escaped, never
markup. markdown-it's link check drops `javascript:`, `vbscript:`, `file:` and non-image
`data:` URLs. Relative links and images point at the repo's files at one commit, so a
card's pictures come from the same commit as its text.

Rendering costs up to ~14 us of CPU per byte of card (measured: a 512 KiB card of `![`
takes 7 s), so `CardCache` renders each card's content once, for every commit that holds it.
"""

from __future__ import annotations

import collections
import posixpath
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import quote, unquote, urlsplit

import yaml
from markdown_it import MarkdownIt

MAX_CARD_BYTES = 512 * 1024
MAX_FRONT_MATTER_CHARS = 64 * 1024
_MARKDOWN = MarkdownIt("commonmark", {"html": False}).enable(["table", "strikethrough"])
# Table cell alignment becomes a class: the pages' CSP admits no style attributes.
_ALIGN_CLASSES = {f"text-align:{side}": f"align-{side}" for side in ("left", "center", "right")}


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
    html: str
    metadata: dict = field(default_factory=dict)


def _body_and_metadata(text: str) -> tuple[str, dict]:
    yaml_text, body = split_front_matter(text)
    if yaml_text is None or len(yaml_text) > MAX_FRONT_MATTER_CHARS:
        return body, {}
    try:
        metadata = yaml.load(yaml_text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (yaml.YAMLError, RecursionError):
        metadata = None
    return body, metadata if isinstance(metadata, dict) else {}


def _repo_path(url: str) -> str | None:
    """The repo file a relative URL in the card names; None for absolute URLs, anchors and escapes."""
    parts = urlsplit(url)
    if parts.scheme or parts.netloc or not parts.path:
        return None
    path = posixpath.normpath(unquote(parts.path).lstrip("/"))
    if path == "." or path.startswith("../") or path == "..":
        return None
    return path


def render_card(content: bytes, file_url: Callable[[str], str]) -> Card:
    """The card's HTML and its front matter; `file_url(path)` is the URL of a repo file."""
    if len(content) > MAX_CARD_BYTES:
        return Card(html=f"<p>The card is {len(content):,} bytes: too large to show here.</p>")
    body, metadata = _body_and_metadata(content.decode("utf-8", errors="replace"))
    tokens = _MARKDOWN.parse(body)
    for token in tokens:
        if token.type in ("th_open", "td_open") and token.attrGet("style") in _ALIGN_CLASSES:
            token.attrs = {"class": _ALIGN_CLASSES[token.attrs["style"]]}
        for child in token.children or ():
            name = {"image": "src", "link_open": "href"}.get(child.type)
            if name is None:
                continue
            path = _repo_path(str(child.attrGet(name)))
            if path is not None:
                child.attrSet(name, file_url(path))
            elif child.type == "link_open":
                child.attrSet("rel", "nofollow noopener noreferrer")
    return Card(html=_MARKDOWN.renderer.render(tokens, _MARKDOWN.options, {}), metadata=metadata)


# Stands for the files' base URL in a cached card: markdown-it turns every NUL of a card into
# U+FFFD, so none appears in its HTML but where this one is put.
_BASE_MARK = "\0"


class CardCache:
    """Cards rendered once per content, whatever the commit: up to `max_chars` of HTML, most
    recently used kept. Requests for a card being rendered wait for that rendering."""

    def __init__(self, max_chars: int = 32 << 20):
        self._max_chars = max_chars
        self._cards: collections.OrderedDict[str, Card] = collections.OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self._rendering: dict[str, threading.Lock] = {}

    def card(self, key: str, content: Callable[[], bytes], files_url: str) -> Card:
        """The card whose content has `key` (its sha256), relative links pointing below `files_url`."""
        card = self._cached(key)
        if card is None:
            with self._lock:
                rendering = self._rendering.setdefault(key, threading.Lock())
            with rendering:
                card = self._cached(key)
                if card is None:
                    card = render_card(content(), lambda path: _BASE_MARK + quote(path))
                    self._keep(key, card)
        return Card(html=card.html.replace(_BASE_MARK, files_url), metadata=card.metadata)

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
