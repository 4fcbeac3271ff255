"""A repo's card (README.md) as HTML for the web pages: front matter apart, Markdown rendered inert.

Rendered with markdown-it-py (CommonMark, plus GFM tables and strikethrough) with raw
HTML turned off: a `<script>` or an `<img onerror=...>` in a card is text, escaped, never
markup. markdown-it's link check drops `javascript:`, `vbscript:`, `file:` and non-image
`data:` URLs. Relative links and images point at the repo's files at one commit, so a
card's pictures come from the same commit as its text.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

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
