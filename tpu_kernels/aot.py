"""Ahead-of-time compiles of a kernel repo's declared shapes for real TPU generations.

No TPU is needed: libtpu (from torch-tpu) provides compile-only topologies,
and Mosaic compiles the Pallas kernels for them exactly as it would on a TPU
VM, including VMEM limits (an oversized tile fails here as it would there).

A kernel declares its shapes in its own module `compile_targets` (it ships
with the kernel, so a kernel from the Hub can be checked as well):

    def compile_targets(generation) -> list[(label, fn, avals)]

where `avals` are `jax.ShapeDtypeStruct`s of `fn`'s array arguments.

A compile that succeeded is remembered (`compile_kernel`'s `cache_dir`,
default `cache_root("aot")`: `~/.cache/tpu-kernels/aot` or below XDG_CACHE_HOME) under everything that decides what the
compiler is given and what it does with it: the built variant's content
digest (its metadata.json: every file of the kernel, its compile targets
included), the target's label, generation and argument shapes, this module's
lowering code, the compiler libraries' versions and `LIBTPU_INIT_ARGS`. The
same target is then not compiled again until one of those changes. A failure
is never remembered.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib
import inspect
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import jax

from .disk_cache import DiskCache, cache_root, library_versions

# Compile-only topology names; libtpu knows "tpu7x:..." but not "v7x:...".
TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:1x1", "v5p": "v5p:2x2x1", "v6e": "v6e:1x1", "tpu7x": "tpu7x:2x2x1"}
DEFAULT_CACHE = cache_root("aot")


@dataclass(frozen=True)
class CompileResult:
    kernel: str
    label: str
    generation: str
    compiled: bool
    seconds: float
    flops: float | None
    error: str | None
    cached: bool = False  # compiled before, with the same inputs (module docstring)


def topology_device(generation: str):
    from jax.experimental import topologies

    # Compile-only use touches no chip; without this, a second process using
    # libtpu (another test run, a benchmark) fails on libtpu's lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

    if generation not in TOPOLOGIES:
        raise ValueError(f"unknown TPU generation {generation!r}; known: {', '.join(TOPOLOGIES)}")
    return topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES[generation]).devices[0]


def load_compile_targets(kernel: ModuleType) -> ModuleType:
    """The loaded kernel's `compile_targets` module."""
    name = f"{kernel.__name__}.compile_targets"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name:
            raise
        raise FileNotFoundError(
            f"{kernel.__name__}: no compile_targets module (it declares the shapes to compile)") from None


def lower_for(fn, avals, generation: str):
    """`fn` traced and lowered at `avals` for one TPU generation (compile it with `.compile()`)."""
    sharding = jax.sharding.SingleDeviceSharding(topology_device(generation))
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in avals]
    return jax.jit(fn).lower(*placed)


def compile_for(fn, avals, generation: str):
    """Lower and compile `fn` at `avals` for one TPU generation; returns the compiled executable."""
    return lower_for(fn, avals, generation).compile()


def _variant_fingerprint(kernel: ModuleType) -> str | None:
    """What decides a loaded kernel's compiles besides the target: its variant's content digest, this module's
    lowering, the compiler libraries, libtpu's flags. None for a kernel not loaded from a built variant."""
    metadata = Path(kernel.__file__).parent / "metadata.json"
    try:
        digest = json.loads(metadata.read_text())["digest"]
    except (OSError, ValueError, KeyError):
        return None
    lowering = inspect.getsource(lower_for) + inspect.getsource(topology_device) + repr(
        TOPOLOGIES)
    return json.dumps([digest, lowering, library_versions(), os.environ.get("LIBTPU_INIT_ARGS", "")], sort_keys=True)


def compile_kernel(kernel: ModuleType, kernel_name: str, generations: list[str], jobs: int | None = None,
                   cache_dir: Path | None = DEFAULT_CACHE) -> list[CompileResult]:
    """Every declared shape compiled for each generation, in declaration order.

    Targets are lowered one after another on this thread and compiled on
    `jobs` threads (default: one per CPU): XLA and Mosaic compile outside the
    GIL, and compiles are most of the time. A target that compiled before
    with the same inputs (module docstring) is not compiled again: its result
    says `cached`. `cache_dir` None remembers nothing.
    """
    targets = load_compile_targets(kernel)
    fingerprint = _variant_fingerprint(kernel)
    cache = DiskCache(cache_dir if fingerprint is not None else None)

    def key(label, generation, avals):
        shapes = [(tuple(a.shape), str(a.dtype)) for a in avals]
        text = json.dumps([fingerprint, kernel_name, label, generation, shapes])
        return hashlib.sha256(text.encode()).hexdigest()

    def failed(label, generation, start, error):
        message = str(error).strip().splitlines()
        return CompileResult(kernel_name, label, generation, False, time.perf_counter() - start, None,
                             message[0] if message else type(error).__name__)

    def compile_lowered(label, generation, lowered, cache_key):
        start = time.perf_counter()
        try:
            compiled = lowered.compile()
        except Exception as error:  # noqa: BLE001 - every failure is a reported result
            return failed(label, generation, start, error)
        flops = (compiled.cost_analysis() or {}).get("flops")
        cache.put(cache_key, {"flops": flops})
        return CompileResult(kernel_name, label, generation, True, time.perf_counter() - start, flops, None)

    pending = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        for generation in generations:
            for label, fn, avals in targets.compile_targets(generation):
                cache_key = key(label, generation, avals)
                if (remembered := cache.get(cache_key)) is not None:
                    pending.append(CompileResult(kernel_name, label, generation, True, 0.0, remembered["flops"], None,
                                                 cached=True))
                    continue
                start = time.perf_counter()
                try:
                    lowered = lower_for(fn, avals, generation)
                except Exception as error:  # noqa: BLE001 - every failure is a reported result
                    pending.append(failed(label, generation, start, error))
                    continue
                pending.append(pool.submit(compile_lowered, label, generation, lowered, cache_key))
        return [item if isinstance(item, CompileResult) else item.result() for item in pending]


def format_table(results: list[CompileResult]) -> str:
    rows = [("kernel", "shape", "gen", "compiled", "seconds", "flops")]
    for r in results:
        rows.append(
            (r.kernel, r.label, r.generation,
             ("yes (before)" if r.cached else "yes") if r.compiled else f"NO: {r.error}", f"{r.seconds:.1f}",
             f"{r.flops:.3g}" if r.flops else "-")
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths)) + "  " + row[-1])
    return "\n".join(lines)
