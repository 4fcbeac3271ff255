"""Compiled kernels kept on disk, so a second process on the machine does not compile them again.

A kernel op compiles once per shape (per bucket, `runtime/buckets.py`), on the host: seconds per Mosaic
kernel on a TPU. Two compilers do that work, and each has its own persistent cache:

* On a TPU, the op runs through torch_tpu's `JaxCallable` (what `torch.tpu.pallas.jax_op` registers), which
  exports the JAX function to StableHLO and hands it to torch_tpu's runtime; torch_tpu compiles it (with
  every other program of the process) in its own tiered compilation cache, never through jax's compiler. Its on-disk tier is off unless the variable
  TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT names a folder, which torch_tpu reads once, at its first compile.
* On the CPU, the op runs jitted by jax; jax keeps a compiled program in `jax_compilation_cache_dir` when
  it took at least `jax_persistent_cache_min_compile_time_secs` (1 s by default) to compile, and never a
  program with host callbacks, which a Pallas kernel in TPU interpret mode is made of. The CPU path keeps
  the programs around the kernels (padding, slicing, casts), not the kernels.

`keep_compiled_programs` turns both on, below `cache_root()`, in folders only this user can change (as
every cache of this package: `disk_cache.private_folder`): whoever can write the folder runs code as this
user, since both caches hold compiled machine code that nothing signs. A folder the user chose (the
variable, the jax setting or its variable JAX_COMPILATION_CACHE_DIR) is used where it is, after the same
checks. Both settings hold for the whole process, not only for our kernels: a process that uses our kernels
compiles on the host, and what else it compiles is worth keeping as well.

Folder privacy alone does not cover a folder that was once open to others and closed since (a chmod): what
they put in it meanwhile would still run. So before a process uses a cache, each entry is checked: a regular
file (or, in torch_tpu's folder, a folder), owned by this user, that neither group nor others can write, and
not a link. In our folders and among jax's entries (`<key>-cache`, `<key>-atime`, its `.lockfile`: the only
names jax reads) an entry that fails is removed; in a torch_tpu folder the user named, whose layout is
torch_tpu's own, one that fails refuses the folder (UnsafeCacheError). Under umask 002 jax writes its entries
group-writable: at exit, the entries this user owns in a checked folder lose group and other write, so the
next process keeps them (a process killed first loses its new entries, which are compiled again). Our jax
folder is bounded (`JAX_CACHE_MAX_BYTES`, unless JAX_COMPILATION_CACHE_MAX_SIZE says otherwise): jax evicts
the least recently read entries past it.

`kernelize` calls it, not the binding that every built kernel carries: a built kernel imports nothing of
this package, and importing a kernel leaves the process's settings alone.

jax's cache does not serve programs compiled for a compile-only topology (`aot.py`): it writes them,
under a key that does not change between processes, but reading one back needs a client of a real TPU
to load it into ("PjRtCompiler must be constructed with a Client", jax 0.10.2), so each process compiles
them again. And a TPU host does not read jax's entries for our kernels at all (torch_tpu compiles them,
above). Warming a TPU host's cache therefore means running the model there, at each bucket.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from .disk_cache import UnsafeCacheError, cache_root, private_folder

TORCH_TPU_CACHE_ENV = "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"
JAX_MIN_COMPILE_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
JAX_MAX_SIZE_ENV = "JAX_COMPILATION_CACHE_MAX_SIZE"
# Below cache_root(): one folder per compiler.
JAX_FOLDER = "jax-compiles"
TORCH_TPU_FOLDER = "torch-tpu-compiles"
# Our jax folder's bound. The programs around our kernels are kilobytes to a few megabytes each, a program
# of the user's model up to hundreds: room for thousands, and a bound on the disk an unattended host fills.
JAX_CACHE_MAX_BYTES = 4 << 30
# The names jax 0.10.2's LRUCache reads in its folder: an executable, its last read time, and its lock.
_JAX_ENTRY_SUFFIXES = ("-cache", "-atime")
_JAX_LOCK = ".lockfile"
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
# Folders checked in this process: checked again, they would lose the entries this process wrote since.
_checked: set[Path] = set()


@dataclass(frozen=True)
class CompileCaches:
    """Where compiled programs are kept: jax's folder and torch_tpu's (None: not kept, or torch_tpu absent),
    which of the two `keep_compiled_programs` chose (the others were the user's), and the entries it removed:
    another user could have written them (or, in a bounded jax folder, jax's eviction could not read them)."""

    jax: str | None
    torch_tpu: str | None
    chosen_here: tuple[str, ...]
    removed: tuple[str, ...] = ()


def keep_compiled_programs() -> CompileCaches:
    """Turn on jax's and torch_tpu's persistent compilation caches below `cache_root()` where the user has
    not chosen a folder, and check every cache folder and entry (module docstring). UnsafeCacheError if a
    folder is not this user's alone."""
    import jax

    chosen, removed = [], []
    if jax.config.jax_compilation_cache_dir is None:
        folder = private_folder(cache_root(JAX_FOLDER))
        if JAX_MAX_SIZE_ENV not in os.environ and jax.config.jax_compilation_cache_max_size == -1:
            jax.config.update("jax_compilation_cache_max_size", JAX_CACHE_MAX_BYTES)
        removed += _checked_folder(folder, _remove_unsafe_jax_entries, _jax_entries)
        jax.config.update("jax_compilation_cache_dir", str(folder))
        if JAX_MIN_COMPILE_TIME_ENV not in os.environ:
            # Our kernels' programs compile in well under jax's default second; every one is worth keeping.
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        chosen.append("jax")
    elif jax.config.jax_enable_compilation_cache and _is_local(jax.config.jax_compilation_cache_dir):
        folder = _users_folder(jax.config.jax_compilation_cache_dir, "jax_compilation_cache_dir")
        removed += _checked_folder(folder, _remove_unsafe_jax_entries, _jax_entries)
    torch_tpu_folder = None
    if importlib.util.find_spec("torch_tpu") is not None:
        if not os.environ.get(TORCH_TPU_CACHE_ENV):
            folder = private_folder(cache_root(TORCH_TPU_FOLDER))
            removed += _checked_folder(folder, _remove_unsafe_entries, _every_entry)
            os.environ[TORCH_TPU_CACHE_ENV] = str(folder)
            chosen.append("torch_tpu")
        else:
            folder = _users_folder(os.environ[TORCH_TPU_CACHE_ENV], TORCH_TPU_CACHE_ENV)
            _checked_folder(folder, _refuse_unsafe_entries, _every_entry)
        torch_tpu_folder = os.environ[TORCH_TPU_CACHE_ENV]
    jax_folder = jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache else None
    return CompileCaches(jax_folder, torch_tpu_folder, tuple(chosen), tuple(removed))


def _is_local(path: str) -> bool:
    """Whether jax reads `path` from the local file system (else a remote store, gs:// and the like, which
    these checks cannot see: docs/security.md)."""
    return "://" not in path or path.startswith("file://")


def _users_folder(path: str, setting: str) -> Path:
    """The folder the user named with `setting`, made 0700 if missing; UnsafeCacheError, naming the setting, if
    others can change it."""
    try:
        return private_folder(Path(path.removeprefix("file://")))
    except UnsafeCacheError as error:
        raise UnsafeCacheError(f"{error} (This folder is the one {setting} names.)") from None


def _checked_folder(folder: Path, check, entries) -> list[str]:
    """`check(folder)` once per process; at exit, the `entries(folder)` this user owns lose group and other
    write (module docstring)."""
    if folder in _checked:
        return []
    removed = check(folder)
    _checked.add(folder)
    atexit.register(_close_to_others, folder, entries)
    return removed


def _jax_entries(folder: Path) -> list[Path]:
    return [Path(entry.path) for entry in os.scandir(folder)
            if entry.name == _JAX_LOCK or entry.name.endswith(_JAX_ENTRY_SUFFIXES)]


def _every_entry(folder: Path) -> list[Path]:
    return [Path(root, name) for root, folders, files in os.walk(folder) for name in folders + files]


def _unsafe(info: os.stat_result, *, folder_allowed: bool) -> bool:
    kind_ok = stat.S_ISREG(info.st_mode) or (folder_allowed and stat.S_ISDIR(info.st_mode))
    return not kind_ok or info.st_uid != os.geteuid() or bool(info.st_mode & _WRITABLE_BY_OTHERS)


def _remove(path: Path, folder: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError as error:
        raise UnsafeCacheError(
            f"Refusing the compile cache {folder}: {path} in it may hold another user's program, and cannot be "
            f"removed ({error.strerror}). Remove the folder (it is made again at the next run).") from None


def _remove_unsafe_jax_entries(folder: Path) -> list[str]:
    """Remove jax's entries in `folder` that another user could have written (both files of a key), under
    jax's own lock, checked first (a link there would have jax truncate what it points at). With a bound on
    the size, an executable without its read time goes too: jax's eviction reads every one's (a folder used
    without the bound before holds none), and would fail at every write."""
    import filelock
    import jax

    evicting = jax.config.jax_compilation_cache_max_size != -1
    lock = folder / _JAX_LOCK
    removed = []
    if os.path.lexists(lock) and _unsafe(lock.lstat(), folder_allowed=False):
        _remove(lock, folder)
        removed.append(lock)
    with filelock.FileLock(str(lock), timeout=60):
        keys = {name.removesuffix(suffix) for name in os.listdir(folder) for suffix in _JAX_ENTRY_SUFFIXES
                if name.endswith(suffix)}
        for key in sorted(keys):
            files = [folder / f"{key}{suffix}" for suffix in _JAX_ENTRY_SUFFIXES]
            present = [path for path in files if os.path.lexists(path)]
            if any(_unsafe(path.lstat(), folder_allowed=False) for path in present) or (evicting and len(present) < 2):
                for path in present:
                    _remove(path, folder)
                removed += present
    return [str(path) for path in removed]


def _unsafe_entries(folder: Path) -> list[Path]:
    """Every entry below `folder` that fails the check, outermost first (a failing folder is not entered)."""
    found = []
    for entry in os.scandir(folder):
        path = Path(entry.path)
        if _unsafe(entry.stat(follow_symlinks=False), folder_allowed=True):
            found.append(path)
        elif entry.is_dir(follow_symlinks=False):
            found += _unsafe_entries(path)
    return found


def _remove_unsafe_entries(folder: Path) -> list[str]:
    found = _unsafe_entries(folder)
    for path in found:
        _remove(path, folder)
    return [str(path) for path in found]


def _refuse_unsafe_entries(folder: Path) -> list[str]:
    found = _unsafe_entries(folder)
    if found:
        raise UnsafeCacheError(
            f"Refusing the compile cache {folder} ({TORCH_TPU_CACHE_ENV}): {found[0]} in it is a link, another "
            f"user's, or writable by others ({len(found)} such entries), and may hold another user's program. "
            "Remove the folder (torch_tpu makes it again) or name another.")
    return []


def _close_to_others(folder: Path, entries) -> None:
    """Group and other write taken from the `entries(folder)` this user owns, if `folder` is still private (the
    entries jax wrote under umask 002); links are not followed."""
    if not folder.is_dir():
        return
    try:
        private_folder(folder)
        paths = entries(folder)
    except (UnsafeCacheError, OSError):
        return  # the next process's check judges it
    me = os.geteuid()
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if info.st_uid == me and info.st_mode & _WRITABLE_BY_OTHERS:
                os.fchmod(fd, stat.S_IMODE(info.st_mode) & ~_WRITABLE_BY_OTHERS)
        finally:
            os.close(fd)
