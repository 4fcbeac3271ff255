"""The read endpoints of the local Hub's API: the account and organizations, repo listings, repo info at a
revision, trees, refs, history, and file downloads (resolve)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import quote, urlencode

from starlette.responses import FileResponse, JSONResponse, Response

from .access import USER_NAME
from .commits import Tree
from .errors import NOT_SUPPORTED, HubError
from .names import MAIN_BRANCH, validate_path
from .request import HubRequest
from .storage import Storage

PAGE_SIZE = 1000
MAX_CURSOR_DIGITS = 15
DOWNLOAD_CHUNK_BYTES = 256 << 10
LISTING_SORTS = ("id", "createdAt", "lastModified")
# Files a browser may show inline; every other file is served as application/octet-stream.
_INLINE_TYPES = {
    ".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".gif": "image/gif", ".webp": "image/webp",
    ".svg": "image/svg+xml", ".md": "text/plain; charset=utf-8", ".txt": "text/plain; charset=utf-8",
    ".py": "text/plain; charset=utf-8", ".json": "text/plain; charset=utf-8", ".toml": "text/plain; charset=utf-8",
}
# A repo file opened in a browser runs nothing in this origin (an SVG could hold a script).
_FILE_SECURITY_HEADERS = {"Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; sandbox",
                          "X-Content-Type-Options": "nosniff"}


class RepoReads:
    """Handlers of the GET (and paths-info) endpoints; the caller's access is checked before they run."""

    def __init__(self, storage: Storage, trusted_orgs: frozenset[str]):
        self.storage = storage
        self.trusted_orgs = trusted_orgs

    def whoami(self, request: HubRequest) -> Response:
        return JSONResponse({
            "type": "user",
            "id": USER_NAME,
            "name": USER_NAME,
            "fullname": "tpu-kernels local hub user",
            "isPro": False,
            "orgs": [{"type": "org", "name": org, "fullname": org} for org in sorted(self._organizations(request))],
            "auth": {"type": "access_token", "accessToken": {"displayName": "tpu-kernels hub token", "role": "write"}},
        })

    def agent_harnesses(self, request: HubRequest) -> Response:
        # huggingface_hub's once-a-day telemetry lookup; an empty registry detects no agent.
        return JSONResponse({"standardEnvVars": [], "harnesses": {}})

    def organization(self, request: HubRequest, org: str) -> Response:
        if org not in self._organizations(request):
            raise HubError(404, f"Organization {org} not found")
        counts = self.storage.count_repos(org, include_private=request.authenticated)
        return JSONResponse({
            "name": org,
            "fullname": org,
            "avatarUrl": "",
            "type": "org",
            "isVerified": False,
            "numModels": counts["model"],
            "numKernels": counts["kernel"],
            "numDatasets": 0,
            "numSpaces": 0,
            "trustedKernelPublisher": org in self.trusted_orgs,
        })

    def _organizations(self, request: HubRequest) -> set[str]:
        return (self.storage.namespaces(include_private=request.authenticated) | self.trusted_orgs) - {USER_NAME}

    def auth_check(self, request: HubRequest, repo_type: str, repo_id: str) -> Response:
        # Reaching here means the caller may: the repo is visible to it (and, for /write, it has the token).
        self.storage.existing_repo_dir(repo_type, repo_id)
        return JSONResponse({})

    def list_repos(self, request: HubRequest, repo_type: str) -> Response:
        """Repos of one type visible to the caller, as `HfApi.list_models` reads them; `?author=` is a namespace."""
        query = request.query
        unknown = sorted(set(query) - {"author", "search", "sort", "direction", "limit", "cursor"})
        if unknown:
            raise HubError(400, f"{NOT_SUPPORTED}: the listing parameter(s) {', '.join(unknown)[:200]}: "
                                "it filters by author and search, sorts by id, createdAt or lastModified")
        sort = query.get("sort", "id")
        if sort not in LISTING_SORTS:
            raise HubError(400, f"{NOT_SUPPORTED}: sorting by {sort[:40]!r}: sort by {', '.join(LISTING_SORTS)}")
        limit = query.get("limit")
        if limit is not None and not (limit.isascii() and limit.isdigit() and len(limit) <= MAX_CURSOR_DIGITS):
            raise HubError(400, f"Invalid query parameter 'limit': {limit[:40]!r} is not a non-negative integer")
        author, search = query.get("author"), query.get("search", "").lower()
        items = []
        for repo_id in self.storage.repo_ids(repo_type, "*"):
            if author is not None and repo_id.split("/")[0] != author:
                continue
            if search not in repo_id.lower():
                continue
            if self.storage.is_private(repo_type, repo_id) and not request.authenticated:
                continue
            items.append(self._listed_repo(repo_type, repo_id))
        # As on the Hub: dates newest first unless `direction=1`; ids in order unless `direction=-1`.
        direction = query.get("direction")
        items.sort(key=lambda item: item[sort], reverse=direction == "-1" if direction else sort != "id")
        return self._paginated(request, items[:int(limit) if limit is not None else None], f"/api/{repo_type}s")

    def _listed_repo(self, repo_type: str, repo_id: str) -> dict:
        return {
            "id": repo_id,
            "author": repo_id.split("/")[0],
            "sha": self.storage.refs(repo_type, repo_id).branches[MAIN_BRANCH],
            "private": self.storage.is_private(repo_type, repo_id),
            "createdAt": self.storage.repo_created_at(repo_type, repo_id),
            "lastModified": self.storage.last_modified(repo_type, repo_id),
            "tags": [], "downloads": 0, "likes": 0, "gated": False, "disabled": False,
        }

    def info(self, request: HubRequest, repo_type: str, repo_id: str, revision: str = MAIN_BRANCH) -> Response:
        commit = self.storage.resolve_revision(repo_type, repo_id, revision)
        return JSONResponse({
            "id": repo_id,
            "author": repo_id.split("/")[0],
            "sha": commit.id,
            "lastModified": commit.date,
            "createdAt": self.storage.repo_created_at(repo_type, repo_id),
            "private": self.storage.is_private(repo_type, repo_id),
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": [
                {"rfilename": path, "size": entry.size, "blobId": entry.git_oid}
                for path, entry in sorted(commit.files.items())
            ],
        })

    def tree(self, request: HubRequest, repo_type: str, repo_id: str, revision: str, path: str) -> Response:
        commit = self.storage.resolve_revision(repo_type, repo_id, revision)
        folder = path.strip("/")
        if folder:
            validate_path(folder)
        recursive = request.query.get("recursive", "false").lower() in ("1", "true")
        tree = self.storage.tree(commit)
        base = f"/api/{repo_type}s/{quote(repo_id)}/tree/{quote(revision, safe='')}"
        return self._paginated(request, tree.listing(folder, recursive),
                               base + (f"/{quote(folder, safe='')}" if folder else ""),
                               render=functools.partial(self._tree_item, tree))

    def paths_info(self, request: HubRequest, repo_type: str, repo_id: str, revision: str) -> Response:
        commit = self.storage.resolve_revision(repo_type, repo_id, revision)
        tree = self.storage.tree(commit)
        items = []
        for path in request.form_values("paths"):
            path = path.strip("/")
            if path in commit.files or tree.is_folder(path):
                items.append(self._tree_item(tree, path))
        return JSONResponse(items)

    def refs(self, request: HubRequest, repo_type: str, repo_id: str) -> Response:
        refs = self.storage.refs(repo_type, repo_id)

        def listed(names, kind):
            return [{"name": name, "ref": f"refs/{kind}/{name}", "targetCommit": target}
                    for name, target in sorted(names.items())]

        return JSONResponse({
            "branches": listed(refs.branches, "heads"),
            "tags": listed(refs.tags, "tags"),
            "converts": [],
            "pullRequests": [],
        })

    def commits(self, request: HubRequest, repo_type: str, repo_id: str, revision: str) -> Response:
        items = [
            {
                "id": commit.id,
                "title": commit.title,
                "message": commit.message,
                "date": commit.date,
                "authors": [{"user": commit.author}],
            }
            for commit in self.storage.history(repo_type, repo_id, revision)
        ]
        return self._paginated(request, items, f"/api/{repo_type}s/{quote(repo_id)}/commits/{quote(revision, safe='')}")

    def resolve(self, request: HubRequest, repo_type: str, repo_id: str, revision: str, path: str) -> Response:
        commit = self.storage.resolve_revision(repo_type, repo_id, revision)
        validate_path(path)
        entry = commit.files.get(path)
        if entry is None:
            raise HubError(404, f"Entry not found: {path}", code="EntryNotFound", commit=commit.id)
        blob = self.storage.blob_store.path(entry)
        stat = os.stat(blob)
        if stat.st_size != entry.size:
            raise HubError(500, f"The stored content of {path} does not have its recorded size")
        response = FileResponse(
            blob,
            stat_result=stat,
            media_type=_INLINE_TYPES.get(Path(path).suffix.lower(), "application/octet-stream"),
            headers={
                "X-Repo-Commit": commit.id,
                "ETag": f'"{entry.git_oid}"',
                "Content-Disposition": f"inline; filename*=UTF-8''{quote(Path(path).name)}",
                **_FILE_SECURITY_HEADERS,
            },
        )
        # Each chunk is a hop to a worker thread and back, and what a client that stops reading leaves
        # in memory until its send timeout: 256 KiB ones download as fast as 1 MiB ones (~750 MiB/s
        # here; 64 KiB: ~380) and 250 stalled downloads hold +166 MiB (1 MiB: +418).
        response.chunk_size = DOWNLOAD_CHUNK_BYTES
        return response

    def _paginated(self, request: HubRequest, items: Sequence, base_path: str,
                   render: Callable = lambda item: item) -> Response:
        """Cursor pagination with a `Link: <...>; rel="next"` header, as the Hub does; `render` makes the
        JSON of one item, for the items of the page only."""
        cursor = request.query.get("cursor", "0")
        if not (cursor.isascii() and cursor.isdigit() and len(cursor) <= MAX_CURSOR_DIGITS):
            raise HubError(400, f"Invalid query parameter 'cursor': {cursor[:40]!r} is not a non-negative integer")
        start = int(cursor)
        headers = {}
        if start + PAGE_SIZE < len(items):
            query = dict(request.query)
            query["cursor"] = str(start + PAGE_SIZE)
            headers["Link"] = f'<{request.base_url()}{base_path}?{urlencode(query)}>; rel="next"'
        return JSONResponse([render(item) for item in items[start:start + PAGE_SIZE]], headers=headers)

    @staticmethod
    def _tree_item(tree: Tree, path: str) -> dict:
        entry = tree.entry(path)
        if entry is None:
            return {"type": "directory", "oid": tree.folder_id(path), "size": 0, "path": path}
        return {"type": "file", "oid": entry.git_oid, "size": entry.size, "path": path}
