"""Names under which plain `kernels` loads a module this loader verified, and nothing else.

transformers loads a flash-attention kernel by name, through `kernels.get_kernel`, and again whenever another
implementation was loaded in between: from kernels' cache (which anyone with the user's rights can rewrite after
our check) or from the Hub (where `UNSTABLE_KERNELS_ALL_LATEST` takes the newest version instead of the pin).
kernels' public way to point a repo id at a folder is LOCAL_KERNELS, which it reads at each call and consults
before the cache and the Hub, whatever UNSTABLE_KERNELS_ALL_LATEST or KERNELS_CACHE say. So a verified module is
served under a repo id of its own, `<repo>--<commit>--<kernel id>`, that LOCAL_KERNELS maps to the variant
folder of the private copy the module was imported from. kernels finds that kernel id already imported and
hands back the very module; and since the Hub refuses every repo id with `--`, a process whose LOCAL_KERNELS
lost the entry gets an error from huggingface_hub before any request, never other code.

The entries are this process's, as the copies they name are: the copies go when it exits, and another user
may then make a folder at the same path in the shared temporary folder. So they are in `os.environ`, which
kernels reads, but not in the environment child processes start with (subprocess, multiprocessing, exec:
the C-level environment keeps only the user's own LOCAL_KERNELS), and a forked child drops them from its copy
of `os.environ`. A child that loads the model by name calls kernelize, or `attention_implementation`, itself.
A child handed a copy of `os.environ` (`subprocess.run(..., env=dict(os.environ))`) does get them: they hold
while this process lives.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import ModuleType

_ENVIRONMENT = "LOCAL_KERNELS"
# kernels splits LOCAL_KERNELS at ":" and each entry at its first "=".
_SEPARATORS = (":", "=")
_LOCK = threading.Lock()
# The entries recorded here, kept from the environment of child processes.
_OURS: set[str] = set()


class NotServableByNameError(ValueError):
    """A module that plain `kernels` cannot be pointed at by name (its copy's path, or no verified copy)."""


def served_name(module: ModuleType, repo_id: str, commit: str | None, variant: Path | None) -> str:
    """The repo id under which `kernels.get_kernel` returns `module`, the one imported from `variant` (a
    verified private copy), recorded in LOCAL_KERNELS for the rest of this process.

    NotServableByNameError if `variant` is None or its path cannot be written in LOCAL_KERNELS.
    """
    if variant is None:
        raise NotServableByNameError(f"{module.__name__} was not imported from a copy this loader verified")
    if any(separator in str(variant) for separator in _SEPARATORS):
        raise NotServableByNameError(
            f"its verified copy {variant} has ':' or '=' in its path, which LOCAL_KERNELS cannot hold (set TMPDIR)")
    name = f"{repo_id}--{commit or 'local'}--{module.__name__.strip('_')}"
    entry = f"{name}={variant}"
    with _LOCK:
        entries = [kept for kept in os.environ.get(_ENVIRONMENT, "").split(":") if kept]
        _OURS.add(entry)
        if entry not in entries:
            os.environ[_ENVIRONMENT] = ":".join([*entries, entry])
        _set_childrens_environment(entries + [entry])
    return name


def _users_entries(entries: list[str]) -> str:
    return ":".join(entry for entry in entries if entry not in _OURS)


def _set_childrens_environment(entries: list[str]) -> None:
    """The C-level environment, which child processes start with, holds the user's entries only."""
    users = _users_entries(entries)
    if users:
        os.putenv(_ENVIRONMENT, users)
    else:
        os.unsetenv(_ENVIRONMENT)


def _forget_in_forked_child() -> None:
    global _LOCK
    _LOCK = threading.Lock()  # another thread of the parent may have held it at the fork
    entries = [kept for kept in os.environ.get(_ENVIRONMENT, "").split(":") if kept]
    if any(entry in _OURS for entry in entries):
        users = _users_entries(entries)
        if users:
            os.environ[_ENVIRONMENT] = users
        else:
            del os.environ[_ENVIRONMENT]
    _OURS.clear()


os.register_at_fork(after_in_child=_forget_in_forked_child)
