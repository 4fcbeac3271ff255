"""Downloads of one variant into the Hub cache, in the layout huggingface_hub documents and reads
(`blobs/<blob id>`, `snapshots/<commit>/<path>` linking to its blob, `refs/<name>`), so that huggingface_hub,
`kernels` (`kernels cache ls`, offline loads) and this loader share one cache.

Why not `huggingface_hub.snapshot_download`: it names cache files after the ETag and commit id the server
sends (`blobs/<etag>`, `snapshots/<X-Repo-Commit>/`) without checking them, so a lying server could write
outside the cache. Here every name comes from ids checked first (the commit we resolved, the blob ids of
the tree listing), and each file's bytes must hash to the blob id it is stored under before it lands in
the cache: a server that sends other bytes than it lists leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from huggingface_hub import HfApi, get_session, hf_hub_url, hf_raise_for_status
from huggingface_hub.utils import build_hf_headers

from ...folders import make_private_dirs
from ..digest import KernelIntegrityError, blob_name_matches
from .hub_commits import HubFile

_CHUNK = 1 << 20
# One file of a variant is source code or a small data file; this bounds what a lying size can make us write.
_MAX_FILE_BYTES = 1 << 30


def download_variant(api: HfApi, repo: Path, repo_id: str, commit: str, files: list[HubFile]) -> None:
    """Make `repo/snapshots/<commit>/<path>` link to a verified blob for every file listed that has no entry yet.

    A blob already in the cache under its id is not fetched again (blobs are named by content). An entry already
    in the snapshot is left for the digest check to judge (and a refused variant is dropped whole).
    Links are made after every blob is in place, so an interrupted download leaves no half variant.
    """
    blobs = repo / "blobs"
    make_private_dirs(blobs)
    for file in files:
        blob = blobs / file.blob_id
        if not blob.exists():
            _fetch_blob(api, repo_id, commit, file, blob)
    for file in files:
        _link(repo / "snapshots" / commit / file.path, blobs / file.blob_id)


def _fetch_blob(api: HfApi, repo_id: str, commit: str, file: HubFile, blob: Path) -> None:
    """GET the file at `commit` and store it as `blob` if its bytes hash to the listed blob id."""
    if file.size > _MAX_FILE_BYTES:
        raise KernelIntegrityError(
            f"The Hub at {api.endpoint} lists {file.path} of {repo_id} at {file.size} bytes, more than a kernel file "
            f"may have ({_MAX_FILE_BYTES}); refusing to download it", [])
    url = hf_hub_url(repo_id, file.path, repo_type="kernel", revision=commit, endpoint=api.endpoint)
    headers = build_hf_headers(token=api.token, library_name=api.library_name,
                               library_version=api.library_version, user_agent=api.user_agent)
    fd, staging = tempfile.mkstemp(dir=blob.parent, prefix=f".{file.blob_id}.", suffix=".incomplete")
    try:
        with os.fdopen(fd, "wb") as out:
            received = _stream(url, headers, out, limit=file.size)
        data = Path(staging).read_bytes()
        if received != file.size or not blob_name_matches(file.blob_id, data):
            raise KernelIntegrityError(
                f"Refusing {file.path} of {repo_id} at {commit}: the Hub at {api.endpoint} sent {received} bytes that "
                f"are not blob {file.blob_id} ({file.size} bytes), the one it lists for that file. Nothing of it "
                "was kept in the cache.", [])
        os.chmod(staging, 0o644)
        os.replace(staging, blob)
    finally:
        if os.path.lexists(staging):
            os.unlink(staging)


def _stream(url: str, headers: dict, out, *, limit: int) -> int:
    """Write the body of GET `url` to `out`; the bytes received (at most `limit` + 1: more is a lie)."""
    received = 0
    # httpx drops the Authorization header when a redirect leaves the Hub's origin.
    with get_session().stream("GET", url, headers=headers, follow_redirects=True) as response:
        if response.status_code >= 400:
            response.read()  # huggingface_hub's error message quotes the body
        hf_raise_for_status(response)
        for chunk in response.iter_bytes(_CHUNK):
            received += len(chunk)
            if received > limit:
                break
            out.write(chunk)
    return received


def _link(pointer: Path, blob: Path) -> None:
    """`pointer` becomes a relative link to `blob`, made atomically, unless it exists."""
    if os.path.lexists(pointer):
        return
    target = os.path.relpath(blob, pointer.parent)
    make_private_dirs(pointer.parent)
    staging = pointer.parent / f".{pointer.name}.{hashlib.sha256(os.urandom(8)).hexdigest()[:12]}.link"
    os.symlink(target, staging)
    try:
        os.replace(staging, pointer)
    except OSError:
        os.unlink(staging)
        raise
