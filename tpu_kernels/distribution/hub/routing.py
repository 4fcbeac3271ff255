"""URL patterns of the local Hub, matched on percent-decoded path segments.

The path is split on its raw '/' before each segment is decoded, so a revision or
file name holding an encoded slash (%2F) stays one segment, as on the Hub. (An
ASGI server hands applications the decoded path, which loses that boundary:
matching happens here, on the raw path.)

Pattern segments: a literal; `{name}` one segment; `{name+}` the rest, at least
one segment, joined with '/'; `{name*}` the same, possibly empty. A `{name}`
listed in `Route.choices` only matches those words and is replaced by their value.
A route that answers GET answers HEAD too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from urllib.parse import unquote


def path_segments(raw_path: bytes) -> list[str] | None:
    """The decoded segments of a raw request path; None if it is not UTF-8."""
    try:
        return [unquote(segment, errors="strict") for segment in raw_path.decode("ascii").split("/")[1:]]
    except UnicodeDecodeError:
        return None


@dataclass(frozen=True)
class Route:
    """`methods` on `pattern` go to `handler(request, **params)`; `name` is what request stats count;
    a `page` answers errors with an HTML page rather than JSON; only a route that `reads_body` reads
    a request body (any other answers without reading it, and the connection is then closed)."""

    name: str
    methods: frozenset[str]
    pattern: tuple[str, ...]
    handler: Callable
    needs_token: bool = False
    page: bool = False
    reads_body: bool = False
    choices: Mapping[str, Mapping[str, str]] = field(default_factory=lambda: MappingProxyType({}))

    def match(self, segments: list[str]) -> dict[str, str] | None:
        params: dict[str, str] = {}
        for index, part in enumerate(self.pattern):
            if part.startswith("{") and part[-2:] in ("+}", "*}"):
                rest = segments[index:]
                if part.endswith("+}") and (not rest or not rest[0]):
                    return None
                params[part[1:-2]] = "/".join(rest)
                return params
            if index >= len(segments):
                return None
            segment = segments[index]
            if part.startswith("{"):
                name = part[1:-1]
                if name in self.choices:
                    if segment not in self.choices[name]:
                        return None
                    segment = self.choices[name][segment]
                params[name] = segment
            elif part != segment:
                return None
        return params if len(segments) == len(self.pattern) else None


def route(
    name: str, methods: str, path: str, handler: Callable, *, needs_token: bool = False, page: bool = False,
    reads_body: bool = False, choices: Mapping[str, Mapping[str, str]] | None = None,
) -> Route:
    """`route("refs", "GET", "/api/{repo_type}/{namespace}/{name}/refs", handler)`."""
    methods = set(methods.split())
    if "GET" in methods:
        methods.add("HEAD")
    return Route(
        name=name,
        methods=frozenset(methods),
        pattern=tuple(path.strip("/").split("/")),
        handler=handler,
        needs_token=needs_token,
        page=page,
        reads_body=reads_body,
        choices=MappingProxyType(dict(choices or {})),
    )


def find_route(routes: list[Route], method: str, segments: list[str]) -> tuple[Route, dict[str, str]] | None:
    """The first route whose pattern and method match; (route, params) or None."""
    for candidate in routes:
        if method in candidate.methods:
            params = candidate.match(segments)
            if params is not None:
                return candidate, params
    return None
