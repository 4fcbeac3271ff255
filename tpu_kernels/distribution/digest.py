"""The digest of a kernel variant: what `tpu-kernels build` writes, and what upload and the loader check.

metadata.json carries `"digest": {"algorithm": "sha256", "files": {path: base64 sha256}}`,
the format `kernels verify` reads (kernels' `Digest.hash_variant` lists the same files for a
build). The check here is stricter than `Digest.validate(Digest.hash_variant(...))`, which
follows no directory link and skips `.pyc` and special files, so that a linked or sourceless
package (`ops/` shadowing `ops.py`) would pass it and run. Here every entry of the variant must
be accounted for, because Python may import any of them:

* every file is listed in the digest, with that digest; `metadata.json` and its signature
  `metadata.json.sigstore` at the top are the only files outside it (neither is imported);
* every folder holds a listed file; `__pycache__` folders are passed over, neither checked nor
  copied (the loader imports from a copy that has none);
* no symbolic link, except, in a Hub cache snapshot, the cache's own link from a file to its
  blob (`blobs/<id>` of the same repo folder);
* in a Hub cache, metadata.json is checked against the id of the blob it links to: the
  cache names each blob after the ETag the Hub sent, which is the file's git blob id (the
  sha256 for LFS files), so metadata.json and code edited together are caught too.

`copy_verified_variant` reads each file once, hashes those bytes and writes the same bytes to a
new folder: what is imported from that copy is exactly what was checked, whatever happens to the
variant afterwards.

Standard library only: builder, publisher and loader share it, and it loads nothing.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..folders import make_private_dirs

ALGORITHM = "sha256"
METADATA_FILE = "metadata.json"
# Beside metadata.json and never imported; kernels' Digest.hash_variant leaves them out too.
UNHASHED_FILES = frozenset({METADATA_FILE, "metadata.json.sigstore"})
BYTECODE_FOLDER = "__pycache__"
_HASHES = {"sha256": hashlib.sha256, "sha512": hashlib.sha512}
_GIT_BLOB_ID = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_NOARCH_VARIANT = re.compile(r"torch-([a-z]+)")


class KernelIntegrityError(RuntimeError):
    """A kernel variant's files do not match the digest of its metadata.json (or it has none)."""

    def __init__(self, message: str, files: list[Path]):
        super().__init__(message)
        self.files = files


def git_blob_id(data: bytes) -> str:
    """The id git (and the Hub, as ETag and `oid`) gives a regular file with these bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_blob_id(value: object) -> bool:
    """Whether `value` is a blob id as the Hub sends it (ETag, `oid`): a git blob id, or a sha256 for LFS files."""
    return isinstance(value, str) and bool(_GIT_BLOB_ID.fullmatch(value) or _SHA256.fullmatch(value))


def blob_name_matches(name: str, data: bytes) -> bool:
    """Whether a cache blob named `name` (the Hub's ETag) holds `data`: git blob id, or sha256 for LFS."""
    if _GIT_BLOB_ID.fullmatch(name):
        return git_blob_id(data) == name
    if _SHA256.fullmatch(name):
        return hashlib.sha256(data).hexdigest() == name
    return False


def backend_mismatch(variant: Path) -> str | None:
    """Why a noarch variant `torch-<backend>` does not hold a build for that backend (its metadata.json names
    another), or None. Such a folder would be loaded as the backend its name says."""
    match = _NOARCH_VARIANT.fullmatch(Path(variant).name)
    if match is None:
        return None
    try:
        backend = json.loads((Path(variant) / METADATA_FILE).read_bytes())["backend"]["type"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        backend = None
    if backend == match.group(1):
        return None
    return f"its metadata.json says backend {backend!r}, not {match.group(1)!r} as the variant's name does"


def digest_field(variant: Path) -> dict:
    """The `digest` field of metadata.json for the files now in `variant` (a folder without links)."""
    scan = _scan(Path(variant), ALGORITHM, blobs=None)
    if scan.problems:
        raise KernelIntegrityError(_describe(f"Cannot digest {variant}", scan.problems), scan.problem_paths(variant))
    return {"algorithm": ALGORITHM, "files": scan.digests}


def verify_variant(
    variant: Path,
    *,
    source: str | None = None,
    blobs: Path | None = None,
    metadata_blob_id: str | None = None,
) -> None:
    """Check a variant folder against its metadata.json; raise KernelIntegrityError naming what differs.

    Args:
        source: where the variant came from, for the message (default: the path).
        blobs: for a variant in a Hub cache snapshot, the repo's `blobs/` folder: files may (and
            metadata.json must) be the cache's links into it, and metadata.json must match the
            blob id it links to. None: a plain folder, where no link is accepted.
        metadata_blob_id: the Hub's blob id (or LFS sha256) of this metadata.json, when the
            caller asked the Hub; metadata.json must link to exactly that blob.
    """
    _check_variant(Path(variant), None, source=source, blobs=blobs, metadata_blob_id=metadata_blob_id)


def copy_verified_variant(
    variant: Path,
    destination: Path,
    *,
    source: str | None = None,
    blobs: Path | None = None,
    metadata_blob_id: str | None = None,
) -> None:
    """`verify_variant`, writing to `destination` (a new folder, mode 0700) exactly the bytes it checked.

    Each file is read once; the bytes hashed are the bytes written, so a file changed in the variant
    during or after the check cannot reach the copy. The copy holds metadata.json and the files of the
    digest, nothing else. On KernelIntegrityError the copy is incomplete: the caller discards it.
    """
    _check_variant(Path(variant), Path(destination), source=source, blobs=blobs, metadata_blob_id=metadata_blob_id)


def _check_variant(
    variant: Path, copy_to: Path | None, *, source: str | None, blobs: Path | None, metadata_blob_id: str | None
) -> None:
    # Absolute, unresolved: the cache's relative links are read against these paths.
    variant = Path(os.path.abspath(variant))
    blobs = Path(os.path.abspath(blobs)) if blobs is not None else None
    where = source or str(variant)
    metadata_path = variant / METADATA_FILE
    if blobs is not None:
        _check_cache_layout(variant, blobs, where)
    metadata_bytes = _read_metadata(metadata_path, where, blobs, metadata_blob_id)
    try:
        digest = json.loads(metadata_bytes).get("digest")
    except (ValueError, AttributeError, RecursionError):
        raise KernelIntegrityError(f"Refusing to import {where}: {metadata_path} is not a JSON object (or nests too "
                                   "deeply to parse)", [metadata_path])
    if digest is None:
        raise KernelIntegrityError(
            f"Refusing to import {where}: {metadata_path} has no digest, so its files cannot be verified. "
            "Build it with `tpu-kernels build` (or kernel-builder), which writes one.",
            [metadata_path],
        )
    algorithm = str(digest.get("algorithm", "")).lower() if isinstance(digest, dict) else ""
    expected = digest.get("files") if isinstance(digest, dict) else None
    if algorithm not in _HASHES or not isinstance(expected, dict):
        raise KernelIntegrityError(
            f"Refusing to import {where}: the digest in {metadata_path} is malformed "
            f"(need an algorithm among {sorted(_HASHES)} and a files mapping)",
            [metadata_path],
        )
    if copy_to is not None:
        copy_to.mkdir(mode=0o700)
        _write_new_file(copy_to / METADATA_FILE, [metadata_bytes])
    scan = _scan(variant, algorithm, blobs, copy_to)
    problems = list(scan.problems)
    for path in sorted(expected.keys() - scan.digests.keys()):
        problems.append((path, "missing"))
    for path in sorted(scan.digests.keys() - expected.keys()):
        problems.append((path, "not in the digest"))
    for path in sorted(scan.digests.keys() & expected.keys()):
        if scan.digests[path] != expected[path]:
            problems.append((path, f"{algorithm} {scan.digests[path]}, the digest says {expected[path]}"))
    listed_folders = {parent.as_posix() for path in expected for parent in Path(path).parents} - {"."}
    for folder in sorted(scan.folders - listed_folders):
        problems.append((folder + "/", "folder holding no file of the digest"))
    if problems:
        problems.sort()
        raise KernelIntegrityError(
            _describe(f"Refusing to import {where}: it does not match the digest in {metadata_path}", problems),
            sorted({variant / path.rstrip("/") for path, _ in problems}),
        )


def _read_metadata(path: Path, where: str, blobs: Path | None, hub_blob_id: str | None) -> bytes:
    """metadata.json's bytes; in a cache, only if they are the blob the Hub named (and sent)."""
    if blobs is None:
        data = _read_regular_file(path)
        if data is None:
            raise KernelIntegrityError(f"Refusing to import {where}: {path} is not a regular file", [path])
        return data
    blob = _cache_link_target(path, blobs)
    data = _read_regular_file(blob) if blob is not None else None
    if data is None:
        raise KernelIntegrityError(
            f"Refusing to import {where}: {path} is not the cache's link to a blob in {blobs}", [path]
        )
    if not blob_name_matches(blob.name, data):
        raise KernelIntegrityError(
            f"Refusing to import {where}: {path} was changed in the cache (its content is not blob {blob.name}, "
            "the id the Hub sent for it)",
            [path],
        )
    if hub_blob_id is not None and blob.name != hub_blob_id:
        raise KernelIntegrityError(
            f"Refusing to import {where}: {path} links to blob {blob.name}, but the Hub serves blob {hub_blob_id} "
            "for it at this commit",
            [path],
        )
    return data


def _check_cache_layout(variant: Path, blobs: Path, where: str) -> None:
    """`variant` lies in the snapshots of the repo folder holding `blobs`, through real folders only.

    A linked folder on the way would make the cache's relative file links resolve elsewhere.
    """
    repo = blobs.parent
    try:
        relative = variant.relative_to(repo)
    except ValueError:
        relative = None
    if relative is None or relative.parts[:1] != ("snapshots",):
        raise KernelIntegrityError(f"Refusing to import {where}: {variant} is not in a snapshot of {repo}", [variant])
    on_the_way = [repo, blobs] + [repo.joinpath(*relative.parts[:depth]) for depth in range(1, len(relative.parts) + 1)]
    linked = [path for path in on_the_way if path.is_symlink()]
    if linked:
        raise KernelIntegrityError(
            f"Refusing to import {where}: the cache folder {linked[0]} is a symbolic link (-> {os.readlink(linked[0])})",
            linked,
        )


def _cache_link_target(link: Path, blobs: Path) -> Path | None:
    """The blob `link` points to if it is a link to a regular file directly in `blobs`, else None."""
    if not link.is_symlink():
        return None
    target = Path(os.path.normpath(link.parent / os.readlink(link)))
    if target.parent != Path(os.path.normpath(blobs)):
        return None
    try:
        mode = target.lstat().st_mode
    except OSError:
        return None
    return target if stat.S_ISREG(mode) else None


@dataclass
class _Scan:
    digests: dict[str, str] = field(default_factory=dict)
    folders: set[str] = field(default_factory=set)
    problems: list[tuple[str, str]] = field(default_factory=list)

    def problem_paths(self, variant: Path) -> list[Path]:
        return sorted({variant / path for path, _ in self.problems})


def _scan(variant: Path, algorithm: str, blobs: Path | None, copy_to: Path | None = None) -> _Scan:
    """Every entry under `variant`, without following links: file digests, folders, and what is not allowed.

    With `copy_to`, every file hashed is written there, under the same relative path, as the bytes hashed.
    """
    scan = _Scan()
    if variant.is_symlink() or not variant.is_dir():
        scan.problems.append((".", "the variant is not a folder (a link, or missing)"))
        return scan
    for folder, entries in _walk(variant):
        for entry in entries:
            relative = entry.relative_to(variant).as_posix()
            mode = entry.lstat().st_mode
            if stat.S_ISDIR(mode):
                if entry.name != BYTECODE_FOLDER:
                    scan.folders.add(relative)
                continue
            if folder == variant and entry.name in UNHASHED_FILES:
                continue
            if stat.S_ISLNK(mode):
                content = _cache_link_target(entry, blobs) if blobs is not None else None
                if content is None:
                    not_a_blob = ", not the cache's link to a blob" if blobs is not None else ""
                    scan.problems.append((relative, f"symbolic link (-> {os.readlink(entry)}){not_a_blob}"))
                    continue
            elif stat.S_ISREG(mode):
                content = entry
            else:
                scan.problems.append((relative, "not a regular file"))
                continue
            digest = _hash_file(content, _HASHES[algorithm](), copy_to / relative if copy_to is not None else None)
            if digest is None:
                scan.problems.append((relative, "changed while being read (no longer a regular file)"))
                continue
            scan.digests[relative] = base64.b64encode(digest).decode()
    return scan


def _open_regular_file(path: Path):
    """`path` opened for reading if it is a regular file (a link is not followed), else None.

    O_NONBLOCK: a FIFO swapped in for the file must not block the open.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return os.fdopen(fd, "rb")


def _read_regular_file(path: Path) -> bytes | None:
    handle = _open_regular_file(path)
    if handle is None:
        return None
    with handle:
        return handle.read()


def _hash_file(path: Path, hasher, copy_to: Path | None) -> bytes | None:
    """The digest of the regular file at `path`, read once; those same bytes written to `copy_to` if given."""
    handle = _open_regular_file(path)
    if handle is None:
        return None
    with handle:
        chunks = iter(lambda: handle.read(1 << 20), b"")
        if copy_to is None:
            for chunk in chunks:
                hasher.update(chunk)
        else:
            make_private_dirs(copy_to.parent)
            _write_new_file(copy_to, chunks, hasher)
    return hasher.digest()


def _write_new_file(path: Path, chunks: Iterable[bytes], hasher=None) -> None:
    """Create `path` (it must not exist, and is not followed if a link) with these bytes, readable by us only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as out:
        for chunk in chunks:
            if hasher is not None:
                hasher.update(chunk)
            out.write(chunk)


def _walk(root: Path) -> Iterable[tuple[Path, list[Path]]]:
    """(folder, its entries) for `root` and every real sub-folder but `__pycache__`; links are not entered."""
    pending = [root]
    while pending:
        folder = pending.pop()
        entries = sorted(Path(entry.path) for entry in os.scandir(folder))
        yield folder, entries
        pending.extend(
            entry for entry in entries
            if entry.name != BYTECODE_FOLDER and stat.S_ISDIR(entry.lstat().st_mode)
        )


def _describe(headline: str, problems: list[tuple[str, str]]) -> str:
    return headline + ":\n" + "\n".join(f"  - {path}: {why}" for path, why in problems)
