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
user, since both caches load compiled machine code. A cache folder the user chose (the variable, the jax
setting or its variable JAX_COMPILATION_CACHE_DIR) is left as it is. Both settings hold for the whole
process, not only for our kernels: a process that uses our kernels compiles on the host, and what else
it compiles is worth keeping as well.

`kernelize` calls it, not the binding that every built kernel carries: a built kernel imports nothing of
this package, and importing a kernel leaves the process's settings alone.

jax's cache does not serve programs compiled for a compile-only topology (`aot.py`): it writes them,
under a key that does not change between processes, but reading one back needs a client of a real TPU
to load it into ("PjRtCompiler must be constructed with a Client", jax 0.10.2), so each process compiles
them again. And a TPU host does not read jax's entries for our kernels at all (torch_tpu compiles them,
above). Warming a TPU host's cache therefore means running the model there, at each bucket.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from .disk_cache import cache_root, private_folder

TORCH_TPU_CACHE_ENV = "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"
JAX_MIN_COMPILE_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
# Below cache_root(): one folder per compiler.
JAX_FOLDER = "jax-compiles"
TORCH_TPU_FOLDER = "torch-tpu-compiles"


@dataclass(frozen=True)
class CompileCaches:
    """Where compiled programs are kept: jax's folder and torch_tpu's (None: not kept, or torch_tpu absent),
    and which of the two `keep_compiled_programs` chose (the others were the user's, left alone)."""

    jax: str | None
    torch_tpu: str | None
    chosen_here: tuple[str, ...]


def keep_compiled_programs() -> CompileCaches:
    """Turn on jax's and torch_tpu's persistent compilation caches below `cache_root()` where the user has
    not chosen a folder (module docstring). UnsafeCacheError if our folder is not this user's alone."""
    import jax

    chosen = []
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(private_folder(cache_root(JAX_FOLDER))))
        if JAX_MIN_COMPILE_TIME_ENV not in os.environ:
            # Our kernels' programs compile in well under jax's default second; every one is worth keeping.
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        chosen.append("jax")
    torch_tpu_folder = None
    if importlib.util.find_spec("torch_tpu") is not None:
        if not os.environ.get(TORCH_TPU_CACHE_ENV):
            os.environ[TORCH_TPU_CACHE_ENV] = str(private_folder(cache_root(TORCH_TPU_FOLDER)))
            chosen.append("torch_tpu")
        torch_tpu_folder = os.environ[TORCH_TPU_CACHE_ENV]
    jax_folder = jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache else None
    return CompileCaches(jax_folder, torch_tpu_folder, tuple(chosen))

