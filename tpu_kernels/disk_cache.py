"""Compiles and replays kept on disk between runs: what `calibrate`, `check` and the benchmarks share.

A compile of one program for one chip takes seconds to minutes; its analysis inputs and a grid
replay are plain data, so both are pickled under a key of what produced them. The key holds the
library versions (`library_versions`) and, for replays, the replay code's source
(`source_fingerprint`); the caller adds what identifies the program. An entry this code cannot read
back (written by another layout of this package, or cut short) counts as a miss and is computed again.

A pickle runs code when it is read, so an entry is read only if it is this user's: each carries an
HMAC-SHA256 of its key and bytes, under a key of this user's in `cache_root()/cache-hmac.key` (32
random bytes, mode 0600, made on first use). An entry without it (one planted, or written before the
HMAC) is a miss and is never unpickled. A cache folder, or the folder of the HMAC key, that another
user could change (not the user's, or writable by group or others, or below a folder others can
write without the sticky bit) is refused with `UnsafeCacheError`, as the loader refuses such a TMPDIR.

Every cache folder of this package is below `cache_root()`: `$XDG_CACHE_HOME/tpu-kernels`, or
`~/.cache/tpu-kernels` when XDG_CACHE_HOME is unset, empty or relative (the XDG rule).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import importlib.metadata
import inspect
import os
import pickle
import stat
import tempfile
import threading
from pathlib import Path

from .folders import make_private_dirs

# The libraries whose versions decide what a program compiles to.
COMPILER_PACKAGES = ("jax", "jaxlib", "tokamax", "libtpu", "torch_tpu")
HMAC_KEY_FILE = "cache-hmac.key"
_KEY_BYTES = 32
# An entry: this, the HMAC of its key and pickle, the pickle.
_MAGIC = b"tpu-kernels-cache-hmac-sha256\n"
_MAC_BYTES = hashlib.sha256().digest_size


class UnsafeCacheError(RuntimeError):
    """A cache folder (or the HMAC key) another user could change or read: refused, nothing read from it."""


def cache_root(*parts: str) -> Path:
    """The folder of this package's caches (module docstring), or `parts` below it; read at each call."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
    return root.joinpath("tpu-kernels", *parts)


def library_versions() -> str:
    found = []
    for name in COMPILER_PACKAGES:
        try:
            found.append(f"{name}={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ";".join(found)


def source_fingerprint(*objects) -> str:
    """A short hash of the source of modules, classes or functions."""
    digest = hashlib.sha256()
    for obj in objects:
        digest.update(inspect.getsource(obj).encode())
    return digest.hexdigest()[:16]


def private_folder(folder: Path) -> Path:
    """`folder`, made (0700) if missing, resolved; UnsafeCacheError unless only this user can change it
    and no folder above it lets another user rename or replace it."""
    make_private_dirs(folder)
    real = Path(folder).resolve()
    me = os.geteuid()
    info = real.stat()
    if info.st_uid != me or stat.S_IMODE(info.st_mode) & 0o022:
        raise UnsafeCacheError(
            f"Refusing the cache folder {real}: other users can change it (mode {stat.S_IMODE(info.st_mode):o}, "
            f"owner {info.st_uid}), and what it holds would run as this user. Remove it (rm -r {real}; it is "
            f"made again, closed to other users, at the next run: a chmod would keep what others put in it), or "
            f"use another folder.")
    for parent in real.parents:
        info = parent.stat()
        if info.st_uid not in (0, me) or (info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX):
            raise UnsafeCacheError(
                f"Refusing the cache folder {real}: {parent} above it can be changed by other users (mode "
                f"{stat.S_IMODE(info.st_mode):o}, owner {info.st_uid}), who could replace the cache. Use a "
                f"folder whose parents only this user (or root) can write.")
    return real


_keys: dict[Path, bytes] = {}
_keys_lock = threading.Lock()


def hmac_key() -> bytes:
    """This user's key for the caches' HMACs (`cache_root()/cache-hmac.key`), made on first use."""
    path = private_folder(cache_root()) / HMAC_KEY_FILE
    with _keys_lock:
        if path not in _keys:
            _keys[path] = _read_key(path) if os.path.lexists(path) else _make_key(path)
        return _keys[path]


def _read_key(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as error:
        raise UnsafeCacheError(f"Refusing the cache key {path}: cannot open it without following a link "
                               f"({error.strerror}). Remove it: a new one is made.") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) & 0o077:
            raise UnsafeCacheError(
                f"Refusing the cache key {path}: it must be a file of this user's that only this user can read "
                f"(mode {stat.S_IMODE(info.st_mode):o}, owner {info.st_uid}). Remove it: a new one is made, "
                "and the entries it signed are computed again.")
        key = handle.read(_KEY_BYTES + 1)
    if len(key) != _KEY_BYTES:
        raise UnsafeCacheError(f"Refusing the cache key {path}: it holds {len(key)} bytes, not {_KEY_BYTES}. "
                               "Remove it: a new one is made.")
    return key


def _make_key(path: Path) -> bytes:
    """A new random key at `path`, written whole before it appears there; a racing process's key wins if first."""
    fd, staging = tempfile.mkstemp(dir=path.parent, prefix=".cache-hmac-")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(os.urandom(_KEY_BYTES))
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(staging, path)
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: created exclusively, then written
            with contextlib.suppress(FileExistsError), os.fdopen(
                    os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as handle:
                handle.write(Path(staging).read_bytes())
    finally:
        os.unlink(staging)
    return _read_key(path)


class DiskCache:
    """Pickled values in a folder (None: nothing is kept), each authenticated by this user's HMAC key, with
    hit and miss counts; safe across threads. UnsafeCacheError if the folder is not private (module docstring)."""

    def __init__(self, folder: Path | None):
        self.folder = private_folder(folder) if folder is not None else None
        self._key = hmac_key() if folder is not None else b""
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    def is_empty(self) -> bool:
        """Whether the cache holds no entry (always, without a folder): a run starting so is a cold one."""
        return self.folder is None or not any(self.folder.glob("*.pkl"))

    def _mac(self, key: str, payload: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\0" + payload, hashlib.sha256).digest()

    def get(self, key: str):
        """The value stored under `key`, or None (also for an entry without this user's HMAC: never unpickled)."""
        if self.folder is None:
            return None
        value = None
        try:
            data = (self.folder / f"{key}.pkl").read_bytes()
        except OSError:
            data = b""
        mac, payload = data[len(_MAGIC):len(_MAGIC) + _MAC_BYTES], data[len(_MAGIC) + _MAC_BYTES:]
        if data.startswith(_MAGIC) and hmac.compare_digest(mac, self._mac(key, payload)):
            try:
                value = pickle.loads(payload)
            except (EOFError, pickle.UnpicklingError, ImportError, AttributeError):
                value = None
        with self._lock:
            if value is None:
                self.misses += 1
            else:
                self.hits += 1
        return value

    def put(self, key: str, value):
        """Stores `value` under `key` (atomically: readers see the old entry or the whole new one); returns it."""
        if self.folder is not None:
            path = self.folder / f"{key}.pkl"
            payload = pickle.dumps(value)
            staging = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            staging.write_bytes(_MAGIC + self._mac(key, payload) + payload)
            staging.replace(path)
        return value
