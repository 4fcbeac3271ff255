"""Ids the loader turns into paths of the cache (commit ids, blob ids, branch and tag names, file paths of a
variant), checked first: from the Hub, a lock file or the cache, an id that is not one, or not the one asked
for, is never used. Also the lock file, read as kernels documents it (`kernels lock` writes it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

REGEX_COMMIT_HASH = re.compile(r"[0-9a-f]{40}")

# A part of a branch or tag name that may name a file under the cache's refs/: not empty, not `.`-led
# (so neither `.` nor `..`), no separator or control character.
_REF_NAME_PART = re.compile(r"[A-Za-z0-9_+@-][A-Za-z0-9_.+@-]*")
# A part of a file path inside a variant as the Hub lists it: the same characters, as kernel builds use.
_PATH_PART = _REF_NAME_PART


class UnsafeIdError(ValueError):
    """A commit id, ETag, blob id, path or ref from the Hub, a lock file or the cache that is not one (or not the
    one asked for); it is never used as a path."""


def checked_commit(value: object, source: str, what: str) -> str:
    if isinstance(value, str) and REGEX_COMMIT_HASH.fullmatch(value):
        return value
    raise UnsafeIdError(
        f"{source} gives {what} the commit id {value!r}, which is not one (40 lowercase hex digits). "
        "Refusing to load it: a commit id names a folder of the cache."
    )


def is_ref_name(name: str) -> bool:
    return all(_REF_NAME_PART.fullmatch(part) for part in name.split("/"))


def checked_relative_path(value: object, source: str, what: str) -> str:
    """A relative `a/b/c` path whose every part is a plain name (no `..`, no separator, no control character)."""
    if isinstance(value, str) and value and all(_PATH_PART.fullmatch(part) for part in value.split("/")):
        return value
    raise UnsafeIdError(f"{source} lists {what} as {value!r}, which is not a plain relative path; refusing to load it")


def locked_commit(lockfile: Path, repo_id: str) -> str:
    """The commit `lockfile` (a `kernels.lock` as `kernels lock` writes it) pins for `repo_id`.

    The format kernels documents: a JSON list of `{"dependency": {"repo-id", "version" | "revision"},
    "lock": {"commit"}}`. ValueError if the file is not that, or does not lock `repo_id`.
    """
    try:
        entries = json.loads(Path(lockfile).read_text())
    except ValueError as error:
        raise ValueError(f"{lockfile} is not a kernels lock file (not JSON: {error})") from None
    except RecursionError:
        raise ValueError(f"{lockfile} is not a kernels lock file (it nests too deeply to parse)") from None
    if not isinstance(entries, list):
        raise ValueError(f"{lockfile} is not a kernels lock file (not a list of locks)")
    for entry in entries:
        dependency = entry.get("dependency") if isinstance(entry, dict) else None
        if isinstance(dependency, dict) and dependency.get("repo-id") == repo_id:
            lock = entry.get("lock")
            return checked_commit(lock.get("commit") if isinstance(lock, dict) else None, f"The lock file {lockfile}",
                                  repo_id)
    raise ValueError(f"Kernel `{repo_id}` is not locked in {lockfile}. Lock it with `kernels lock <project>`.")
