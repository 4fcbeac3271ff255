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
        if entry not in entries:
            os.environ[_ENVIRONMENT] = ":".join([*entries, entry])
    return name
