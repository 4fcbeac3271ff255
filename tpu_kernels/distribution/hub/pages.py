"""The local Hub's web pages: what it holds, browsable without writing code.

    /                                   namespaces and their repos (trusted publishers marked)
    /kernels/{ns}/{name}[/tree/{rev}]   a kernel repo: versions (v<N> branches) with their build
                                        variants and backends, tags, the card, files with sizes and
                                        sha256 digests, history, the snippet that loads it
    /kernels/{ns}/{name}/commit/{id}    one commit: message and the files it changed
    /{ns}/{name}[/tree/{rev}|/commit/{id}]  the same for model repos

Plain server-rendered HTML (Jinja2 templates in templates/, autoescaped: every name, message
and path from a repo is escaped; the card is rendered by card.py with raw HTML off). The
pages carry no script, and their Content-Security-Policy allows none, nor any style but
their own stylesheet, nor images from other sites. Private repos are shown only to
requests carrying the token (a browser sends none: to it they do not exist).

What a view costs beyond the repo's refs and file list is bounded and computed once: a card
per content (card.CardCache); the newest VERSIONS_SHOWN versions with at most VARIANTS_SHOWN
build variants each, a variant's metadata.json parsed once per blob (older versions are listed
by name, tags and other branches up to REFS_SHOWN, the rest in the refs API). A HEAD request
renders nothing.

A page is sent as it is rendered, in pieces of about PAGE_CHUNK_BYTES (the template's output,
the cached card's HTML a piece at a time), so a client that does not read holds at most a piece
and what the connection buffers, never a whole page.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import itertools
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import jinja2
from starlette.responses import HTMLResponse, Response, StreamingResponse

from .card import CardCache
from .blobs import FileEntry
from .commits import Commit
from .errors import HubError
from .names import MAIN_BRANCH, branch_name
from .storage import Storage
from ..versions import VERSION_BRANCH

HISTORY_SHOWN = 100
# Versions shown with their build variants (each read from its metadata.json), newest first; the
# next OLDER_VERSIONS_LISTED are listed by name, and every ref is in /api/<type>s/<id>/refs.
VERSIONS_SHOWN = 10
VARIANTS_SHOWN = 32
OLDER_VERSIONS_LISTED = 200
REFS_SHOWN = 100
METADATA_CACHE_BLOBS = 4096
FILES_SHOWN = 1000
MAX_METADATA_BYTES = 1 << 20
CARD_NAME = "README.md"
PAGE_CHUNK_BYTES = 64 << 10
_URL_PREFIXES = {"kernel": "kernels/", "model": ""}
_API_TYPES = {"kernel": "kernels", "model": "models"}
_TEMPLATES = Path(__file__).with_name("templates")
_STYLESHEET = (_TEMPLATES / "hub.css").read_text()
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; img-src 'self' data:; "
    f"style-src 'sha256-{base64.b64encode(hashlib.sha256(_STYLESHEET.encode()).digest()).decode()}'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
_ENVIRONMENT = jinja2.Environment(
    loader=jinja2.FileSystemLoader(_TEMPLATES),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


def repo_page_path(repo_type: str, repo_id: str) -> str:
    return f"/{_URL_PREFIXES[repo_type]}{repo_id}"


def _chunks(pieces: Iterable[str], size: int = PAGE_CHUNK_BYTES) -> Iterator[bytes]:
    """UTF-8 bytes of the pieces, gathered into chunks of at least `size` bytes (the last one less)."""
    buffer: list[bytes] = []
    filled = 0
    for piece in pieces:
        data = piece.encode()
        buffer.append(data)
        filled += len(data)
        if filled >= size:
            yield b"".join(buffer)
            buffer, filled = [], 0
    if buffer:
        yield b"".join(buffer)


def _short_date(iso: str) -> str:
    return iso[:16].replace("T", " ") + " UTC"


def _size(size: int) -> str:
    if size < 1024:
        return f"{size} B"
    return f"{size / 1024:.1f} KiB" if size < 1024 * 1024 else f"{size / (1024 * 1024):.1f} MiB"


@dataclass(frozen=True)
class CommitView:
    id: str
    title: str
    message: str
    date: str
    author: str
    url: str

    @property
    def short(self) -> str:
        return self.id[:10]


@dataclass(frozen=True)
class VariantView:
    name: str
    backend: str
    digest_files: int | None  # files metadata.json's digest covers; None without a digest


@dataclass(frozen=True)
class VersionView:
    number: int
    branch: str
    url: str
    commit: CommitView
    kernel_version: object
    variants: list[VariantView]
    variants_hidden: int  # build variants beyond VARIANTS_SHOWN

    @property
    def backends(self) -> list[str]:
        return sorted({variant.backend for variant in self.variants})


@dataclass(frozen=True)
class RefView:
    name: str
    url: str
    commit: CommitView
    same_as: list[str]  # version branches at the same commit


@dataclass(frozen=True)
class FileView:
    path: str
    size: str
    sha256: str
    url: str


@dataclass(frozen=True)
class Change:
    kind: str  # added, modified, deleted
    file: FileView


class Pages:
    """Renders the pages from storage; `authenticated` requests also see private repos."""

    def __init__(self, storage: Storage, trusted_orgs: frozenset[str]):
        self.storage = storage
        self.trusted_orgs = trusted_orgs
        self._cards = CardCache()
        self._variants = functools.lru_cache(maxsize=256)(self._read_variants)
        self._metadata = functools.lru_cache(maxsize=METADATA_CACHE_BLOBS)(self._read_metadata)

    # -- responses ------------------------------------------------------------------------------

    def _page(self, template: str, status: int = 200, **context) -> Response:
        """The page, rendered as it is sent (module docstring)."""
        pieces = _ENVIRONMENT.get_template(template).generate(stylesheet=_STYLESHEET, **context)
        return StreamingResponse(_chunks(pieces), status_code=status, headers=_PAGE_HEADERS, media_type="text/html")

    @staticmethod
    def _head() -> Response:
        """The answer to a HEAD of a page that exists: its headers, but for the length of a body not rendered."""
        response = Response(status_code=200, headers=_PAGE_HEADERS, media_type="text/html")
        del response.headers["content-length"]
        return response

    def error(self, error: HubError) -> HTMLResponse:
        html = _ENVIRONMENT.get_template("error.html").render(stylesheet=_STYLESHEET, status_code=error.status,
                                                               message=error.message)
        return HTMLResponse(html, status_code=error.status, headers=_PAGE_HEADERS)

    # -- front page -----------------------------------------------------------------------------

    def front(self, authenticated: bool, head: bool = False) -> Response:
        if head:
            return self._head()
        namespaces: dict[str, list[dict]] = {org: [] for org in self.trusted_orgs}
        for repo_type in ("kernel", "model"):
            for repo_id in sorted(self.storage.repo_ids(repo_type)):
                private = self.storage.is_private(repo_type, repo_id)
                if private and not authenticated:
                    continue
                branches = self.storage.refs(repo_type, repo_id).branches
                versions = sorted((int(match[1]) for name in branches if (match := VERSION_BRANCH.fullmatch(name))),
                                  reverse=True)
                updated = self.storage.last_modified(repo_type, repo_id)
                namespaces.setdefault(repo_id.split("/")[0], []).append({
                    "id": repo_id,
                    "type": repo_type,
                    "url": repo_page_path(repo_type, repo_id),
                    "versions": [f"v{number}" for number in versions],
                    "updated": _short_date(updated),
                    "private": private,
                })
        listing = [{"name": name, "trusted": name in self.trusted_orgs, "repos": repos}
                   for name, repos in sorted(namespaces.items())]
        return self._page("index.html", namespaces=listing)

    # -- repo page ------------------------------------------------------------------------------

    def repo(self, repo_type: str, repo_id: str, base_url: str, revision: str | None = None,
             head: bool = False) -> Response:
        refs = self.storage.refs(repo_type, repo_id)
        if head:
            if revision is not None:
                self.storage.resolve_revision(repo_type, repo_id, revision)
            return self._head()
        page_url = repo_page_path(repo_type, repo_id)
        # (number, branch, commit id) of every version, newest first: only the newest are read.
        version_refs = sorted(((int(match[1]), name, commit_id) for name, commit_id in refs.branches.items()
                               if (match := VERSION_BRANCH.fullmatch(name))), reverse=True)
        versions = [self._version(repo_type, repo_id, *ref) for ref in version_refs[:VERSIONS_SHOWN]]
        branches_at: dict[str, list[str]] = {}
        for _, name, commit_id in version_refs:
            branches_at.setdefault(commit_id, []).append(name)
        tags = [self._ref(repo_type, repo_id, name, commit_id, branches_at)
                for name, commit_id in sorted(refs.tags.items())[:REFS_SHOWN]]
        other_names = sorted(name for name in refs.branches if not VERSION_BRANCH.fullmatch(name))
        other_branches = [self._ref(repo_type, repo_id, name, refs.branches[name], branches_at)
                          for name in other_names[:REFS_SHOWN]]

        chosen = revision is not None
        if revision is None:
            revision = version_refs[0][1] if version_refs else MAIN_BRANCH
        selected = self.storage.resolve_revision(repo_type, repo_id, revision)
        branch = branch_name(revision)
        selected_version = next((number for number, name, _ in version_refs if name == branch), None)
        # The snippet loads what the page shows: a version, else the chosen ref, else the latest version.
        if selected_version is None and version_refs and not chosen:
            selected_version = version_refs[0][0]
        card_commit = selected if CARD_NAME in selected.files else self.storage.resolve_revision(repo_type, repo_id, MAIN_BRANCH)
        card = self._card(repo_type, repo_id, card_commit)
        history = list(itertools.islice(self.storage.history(repo_type, repo_id, selected.id), HISTORY_SHOWN + 1))
        files = sorted(selected.files.items())
        return self._page(
            "repo.html",
            repo_type=repo_type,
            repo_id=repo_id,
            page_url=page_url,
            private=self.storage.is_private(repo_type, repo_id),
            trusted=repo_id.split("/")[0] in self.trusted_orgs,
            versions=versions,
            older_versions=[(name, self._tree_url(repo_type, repo_id, name))
                            for _, name, _ in version_refs[VERSIONS_SHOWN:VERSIONS_SHOWN + OLDER_VERSIONS_LISTED]],
            versions_unlisted=max(0, len(version_refs) - VERSIONS_SHOWN - OLDER_VERSIONS_LISTED),
            tags=tags,
            tags_hidden=max(0, len(refs.tags) - REFS_SHOWN),
            other_branches=other_branches,
            branches_hidden=max(0, len(other_names) - REFS_SHOWN),
            refs_url=f"/api/{_API_TYPES[repo_type]}/{repo_id}/refs",
            revision=revision,
            selected=self._commit_view(repo_type, repo_id, selected),
            card=card,
            files=[self._file(repo_type, repo_id, selected, path, entry) for path, entry in files[:FILES_SHOWN]],
            files_hidden=max(0, len(files) - FILES_SHOWN),
            history=[self._commit_view(repo_type, repo_id, commit) for commit in history[:HISTORY_SHOWN]],
            history_truncated=len(history) > HISTORY_SHOWN,
            snippet=self._snippet(repo_type, repo_id, base_url, selected_version, revision),
        )

    def commit(self, repo_type: str, repo_id: str, commit_id: str, head: bool = False) -> Response:
        commit = self.storage.resolve_revision(repo_type, repo_id, commit_id)
        if head:
            return self._head()
        parent = self.storage.commit(repo_type, repo_id, commit.parent) if commit.parent else None
        before = parent.files if parent else {}
        changes = []
        for path in sorted(set(before) | set(commit.files)):
            old, new = before.get(path), commit.files.get(path)
            if old == new:
                continue
            kind = "added" if old is None else "deleted" if new is None else "modified"
            changes.append(Change(kind, self._file(repo_type, repo_id, parent if new is None else commit, path, new or old)))
        return self._page(
            "commit.html",
            repo_type=repo_type,
            repo_id=repo_id,
            page_url=repo_page_path(repo_type, repo_id),
            commit=self._commit_view(repo_type, repo_id, commit),
            parent=self._commit_view(repo_type, repo_id, parent) if parent else None,
            changes=changes,
        )

    # -- pieces ---------------------------------------------------------------------------------

    def _commit_view(self, repo_type: str, repo_id: str, commit: Commit) -> CommitView:
        return CommitView(commit.id, commit.title, commit.message, _short_date(commit.date), commit.author,
                          f"{repo_page_path(repo_type, repo_id)}/commit/{commit.id}")

    def _file(self, repo_type: str, repo_id: str, commit: Commit, path: str, entry: FileEntry) -> FileView:
        url = f"{repo_page_path(repo_type, repo_id)}/resolve/{commit.id}/{quote(path)}"
        return FileView(path, _size(entry.size), entry.sha256, url)

    @staticmethod
    def _tree_url(repo_type: str, repo_id: str, ref: str) -> str:
        return f"{repo_page_path(repo_type, repo_id)}/tree/{quote(ref, safe='')}"

    def _ref(self, repo_type: str, repo_id: str, name: str, commit_id: str, branches_at: dict) -> RefView:
        commit = self.storage.commit(repo_type, repo_id, commit_id)
        return RefView(name, self._tree_url(repo_type, repo_id, name), self._commit_view(repo_type, repo_id, commit),
                       branches_at.get(commit_id, []))

    def _version(self, repo_type: str, repo_id: str, number: int, branch: str, commit_id: str) -> VersionView:
        commit = self.storage.commit(repo_type, repo_id, commit_id)
        variants, hidden, kernel_versions = self._variants(repo_type, repo_id, commit_id)
        return VersionView(
            number=number,
            branch=branch,
            url=self._tree_url(repo_type, repo_id, branch),
            commit=self._commit_view(repo_type, repo_id, commit),
            kernel_version=kernel_versions,
            variants=variants,
            variants_hidden=hidden,
        )

    def _read_variants(self, repo_type: str, repo_id: str, commit_id: str) -> tuple[list[VariantView], int, str | None]:
        """The first VARIANTS_SHOWN build variants of a commit, how many more it has, and the kernel
        version(s) their metadata.json give."""
        files = self.storage.commit(repo_type, repo_id, commit_id).files
        names = sorted({path.split("/")[1] for path in files if path.startswith("build/") and path.count("/") >= 2})
        variants, kernel_versions = [], set()
        for name in names[:VARIANTS_SHOWN]:
            entry = files.get(f"build/{name}/metadata.json")
            backend, digest_files, kernel_version = self._metadata(entry) if entry else (None, None, None)
            variants.append(VariantView(name, backend or "unknown (no readable metadata.json)", digest_files))
            if kernel_version is not None:
                kernel_versions.add(kernel_version)
        return variants, max(0, len(names) - VARIANTS_SHOWN), ", ".join(map(str, sorted(kernel_versions))) or None

    def _read_metadata(self, entry: FileEntry) -> tuple[str | None, int | None, int | None]:
        """What a page shows of a variant's metadata.json (cached per blob): its backend type, how many
        files its digest covers, its kernel version; None for each it lacks."""
        metadata = self._json(entry)
        if metadata is None:
            return None, None, None
        backend = metadata.get("backend")
        backend_type = backend.get("type") if isinstance(backend, dict) else None
        digest = metadata.get("digest")
        digest_files = digest.get("files") if isinstance(digest, dict) else None
        version = metadata.get("version")
        return (backend_type if isinstance(backend_type, str) else None,
                len(digest_files) if isinstance(digest_files, dict) else None,
                version if isinstance(version, int) else None)

    def _json(self, entry: FileEntry) -> dict | None:
        if entry.size > MAX_METADATA_BYTES:
            return None
        try:
            data = json.loads(self.storage.blob_store.path(entry).read_bytes())
        except (OSError, ValueError, RecursionError):
            return None
        return data if isinstance(data, dict) else None

    def _card(self, repo_type: str, repo_id: str, commit: Commit) -> Iterator[str] | None:
        """The card's HTML in pieces, its relative links pointing at the commit's files; None without a card."""
        entry = commit.files.get(CARD_NAME)
        if entry is None:
            return None
        # At most FILES_URL_CHARS, as the card's bound counts it: a repo id has at most 193 characters.
        files_url = f"{repo_page_path(repo_type, repo_id)}/resolve/{commit.id}/"
        card = self._cards.card(entry.sha256, self.storage.blob_store.path(entry).read_bytes)
        return card.pieces(files_url)

    def _snippet(self, repo_type: str, repo_id: str, base_url: str, version: int | None, revision: str) -> str:
        endpoint = f"# HF_ENDPOINT={base_url} in the environment, before huggingface_hub is imported\n"
        if repo_type == "model":
            return endpoint + f'from huggingface_hub import snapshot_download\nsnapshot_download("{repo_id}", revision="{revision}")'
        selector = f"version={version}" if version is not None else f'revision="{revision}"'
        trust = "" if repo_id.split("/")[0] in self.trusted_orgs else f', trust_remote_code=["{repo_id}"]'
        return endpoint + f'from kernels import get_kernel\nkernel = get_kernel("{repo_id}", {selector}{trust})'
