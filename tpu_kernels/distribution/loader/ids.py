"""Ids the loader turns into paths of the cache (commit ids, branch and tag names), checked first: from the
Hub, a lock file or the cache, an id that is not one, or not the one asked for, is never used."""

from __future__ import annotations

import re

from huggingface_hub.file_download import REGEX_COMMIT_HASH
from kernels._rust import KernelDependency, KernelLocks

# A part of a branch or tag name that may name a file under the cache's refs/: not empty, not `.`-led
# (so neither `.` nor `..`), no separator or control character.
_REF_NAME_PART = re.compile(r"[A-Za-z0-9_+@-][A-Za-z0-9_.+@-]*")


class UnsafeIdError(ValueError):
    """A commit id, ETag or ref from the Hub, a lock file or the cache that is not one (or not the one asked
    for); it is never used as a path."""


def checked_commit(value: object, source: str, what: str) -> str:
    if isinstance(value, str) and REGEX_COMMIT_HASH.fullmatch(value):
        return value
    raise UnsafeIdError(
        f"{source} gives {what} the commit id {value!r}, which is not one (40 lowercase hex digits). "
        "Refusing to load it: a commit id names a folder of the cache."
    )


def locked_commit(locks: KernelLocks, kernel: KernelDependency) -> str:
    lock = locks.get(kernel, None)
    if lock is None:
        raise ValueError(f"Kernel `{kernel.repo_id}` is not locked in the lock file.")
    return checked_commit(lock.commit, "The lock file", kernel.repo_id)


def is_ref_name(name: str) -> bool:
    return all(_REF_NAME_PART.fullmatch(part) for part in name.split("/"))
