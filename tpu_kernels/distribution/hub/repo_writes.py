"""The write endpoints of the local Hub's API: creating, deleting, moving and configuring repos, the
README check, preupload and commit, branches and tags. All need the token."""

from __future__ import annotations

import yaml
from starlette.responses import JSONResponse, Response

from .access import USER_NAME
from .card import split_front_matter
from .commit_payload import read_commit_payload
from .errors import NOT_SUPPORTED, HubError
from .limits import Limits
from .names import MAIN_BRANCH, branch_name, validate_path, validate_repo_id, validate_repo_type
from .request import HubRequest, json_field
from .storage import Storage


def _requested_privacy(payload: dict) -> bool | None:
    """The visibility a create or settings request asks for; None if it names none."""
    # huggingface_hub 2.x sends "visibility"; older clients and curl users send "private".
    visibility = json_field(payload, "visibility", (str, type(None)))
    if visibility not in (None, "public", "private"):
        raise HubError(400, f"Invalid field 'visibility': expected 'public' or 'private', got {visibility[:40]!r}")
    private_flag = json_field(payload, "private", (bool, type(None)))
    return visibility == "private" if visibility is not None else private_flag


def _named_repo(payload: dict) -> tuple[str, str]:
    """(repo type, repo id) of a create or delete request: `type`, `organization` (else the user), `name`."""
    repo_type = validate_repo_type(json_field(payload, "type", (str, type(None))) or "model")
    namespace = json_field(payload, "organization", (str, type(None))) or USER_NAME
    repo_id = f"{namespace}/{json_field(payload, 'name', str)}"
    validate_repo_id(repo_id)
    return repo_type, repo_id


def _repo_of(payload: dict, field: str) -> str:
    repo_id = json_field(payload, field, str)
    validate_repo_id(repo_id)
    return repo_id



class RepoWrites:
    """Handlers of the endpoints that change repos; the token is checked before they run."""

    def __init__(self, storage: Storage, limits: Limits):
        self.storage = storage
        self.limits = limits

    def create_repo(self, request: HubRequest) -> Response:
        payload = request.json()
        repo_type, repo_id = _named_repo(payload)
        private = bool(_requested_privacy(payload))
        url = request.repo_url(repo_type, repo_id)
        try:
            self.storage.create_repo(repo_type, repo_id, author=USER_NAME, private=private)
        except HubError as error:
            if error.status == 409:
                return JSONResponse({"error": error.message, "url": url}, status_code=409)
            raise
        return JSONResponse({"url": url, "name": repo_id, "id": repo_id})

    def delete_repo(self, request: HubRequest) -> Response:
        self.storage.delete_repo(*_named_repo(request.json()))
        return JSONResponse({})

    def move_repo(self, request: HubRequest) -> Response:
        payload = request.json()
        repo_type = validate_repo_type(json_field(payload, "type", (str, type(None))) or "model")
        self.storage.move_repo(repo_type, _repo_of(payload, "fromRepo"), _repo_of(payload, "toRepo"))
        return JSONResponse({})

    def update_settings(self, request: HubRequest, repo_type: str, repo_id: str) -> Response:
        payload = request.json()
        unknown = sorted(set(payload) - {"visibility", "private", "gated"})
        if unknown:
            raise HubError(400, f"{NOT_SUPPORTED}: the repo setting(s) {', '.join(unknown)[:200]}: "
                                "only the visibility (private or public) can be set")
        if payload.get("gated", False) is not False:
            raise HubError(400, f"{NOT_SUPPORTED}: gated repos: reads are open, or need the token for a "
                                "private repo; there are no access requests to approve")
        private = _requested_privacy(payload)
        if private is not None:
            self.storage.set_private(repo_type, repo_id, private)
        return JSONResponse({})

    def validate_yaml(self, request: HubRequest) -> Response:
        content = json_field(request.json(), "content", (str, type(None))) or ""
        front_matter, _ = split_front_matter(content)
        if front_matter is None:
            return JSONResponse({"errors": [], "warnings": []})
        if len(front_matter.encode()) > self.limits.max_front_matter_bytes:
            raise HubError(400, f"README front matter larger than {self.limits.max_front_matter_bytes} bytes")
        try:
            metadata = yaml.load(front_matter, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        except (yaml.YAMLError, RecursionError) as error:
            problem = f"Invalid YAML front matter: {error}"[:2000]
            return JSONResponse({"errors": [{"message": problem}], "warnings": []}, status_code=400)
        if metadata is not None and not isinstance(metadata, dict):
            return JSONResponse(
                {"errors": [{"message": "YAML front matter must be a mapping"}], "warnings": []}, status_code=400
            )
        return JSONResponse({"errors": [], "warnings": []})

    @staticmethod
    def _refuse_pull_requests(request: HubRequest) -> None:
        if request.query.get("create_pr", "0") not in ("0", "false", "False", ""):
            raise HubError(400, f"{NOT_SUPPORTED}: pull requests: commit to a branch (a kernel version is branch v<N>)")

    def preupload(self, request: HubRequest, repo_type: str, repo_id: str, revision: str) -> Response:
        self._refuse_pull_requests(request)
        files = json_field(request.json(), "files", list)
        commit = self.storage.resolve_revision(repo_type, repo_id, revision)
        answers = []
        for index, item in enumerate(files):
            if not isinstance(item, dict):
                raise HubError(400, f"Invalid field 'files[{index}]': expected an object")
            path = validate_path(json_field(item, "path", str, where=f"files[{index}]."))
            existing = commit.files.get(path)
            answers.append({
                "path": path,
                "uploadMode": "regular",
                "shouldIgnore": False,
                "oid": existing.git_oid if existing else None,
            })
        return JSONResponse({"files": answers, "commitOid": commit.id})

    def commit(self, request: HubRequest, repo_type: str, repo_id: str, branch: str) -> Response:
        self._refuse_pull_requests(request)
        branch = branch_name(branch)
        # Refused before a byte of the body is read, not after a large upload.
        self.storage.require_branch(repo_type, repo_id, branch)
        payload = read_commit_payload(
            lambda: request.read_chunk_from_thread(self.limits.max_commit_bytes), self.storage.blob_store
        )
        commit = self.storage.commit_operations(
            repo_type,
            repo_id,
            branch,
            additions=payload.additions,
            deletions=payload.deletions,
            title=payload.summary,
            message=payload.description,
            author=USER_NAME,
            parent_commit=payload.parent_commit,
        )
        return JSONResponse({
            "success": True,
            "commitOid": commit.id,
            "commitUrl": f"{request.repo_url(repo_type, repo_id)}/commit/{commit.id}",
            "hookOutput": "",
        })

    def create_branch(self, request: HubRequest, repo_type: str, repo_id: str, branch: str) -> Response:
        starting_point = json_field(request.json(), "startingPoint", (str, type(None))) or MAIN_BRANCH
        self.storage.create_branch(repo_type, repo_id, branch, starting_point)
        return JSONResponse({})

    def delete_branch(self, request: HubRequest, repo_type: str, repo_id: str, branch: str) -> Response:
        self.storage.delete_ref(repo_type, repo_id, "branches", branch)
        return JSONResponse({})

    def create_tag(self, request: HubRequest, repo_type: str, repo_id: str, revision: str) -> Response:
        tag = json_field(request.json(), "tag", str)
        self.storage.create_tag(repo_type, repo_id, tag, revision)
        return JSONResponse({})

    def delete_tag(self, request: HubRequest, repo_type: str, repo_id: str, tag: str) -> Response:
        self.storage.delete_ref(repo_type, repo_id, "tags", tag)
        return JSONResponse({})
