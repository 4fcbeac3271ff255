"""Ahead-of-time compiles of a kernel repo's declared shapes for real TPU generations.

No TPU is needed: libtpu (from torch-tpu) provides compile-only topologies,
and Mosaic compiles the Pallas kernels for them exactly as it would on a TPU
VM, including VMEM limits (an oversized tile fails here as it would there).

A kernel declares its shapes in its own module `compile_targets` (it ships
with the kernel, so a kernel from the Hub can be checked as well):

    def compile_targets(generation) -> list[(label, fn, avals)]

where `avals` are `jax.ShapeDtypeStruct`s of `fn`'s array arguments.

What is compiled is each Pallas kernel a target calls (`pallas_kernels`), as a
program of its own: XLA's work around the kernels (routing, masks, reshapes)
is not the kernels' to check, and compiling it was a fifth of the time. A
kernel's operands keep XLA's default layouts at the call whatever the program
around it (jax's TPU custom call fixes them), so Mosaic compiles the same
kernel either way. A kernel two targets share (the same lowered program) is
compiled once per generation; a target compiled if all of its kernels did.

A compile that succeeded is remembered (`compile_kernel`'s `cache_dir`,
default `cache_root("aot")`: `~/.cache/tpu-kernels/aot` or below XDG_CACHE_HOME) under everything that decides what the
compiler is given and what it does with it: the built variant's content
digest (its metadata.json: every file of the kernel, its compile targets
included), the target's label, generation and argument shapes, this module's
lowering code, the compiler libraries' versions and `LIBTPU_INIT_ARGS`. The
same target is then not compiled again until one of those changes. A failure
is never remembered.

A kernel repo's committed record (`aot_record`, written by `tpu-kernels check
--record`) covers targets under the same fingerprint for every machine that
reads it; the project's tests read it, `tpu-kernels check` never does.
"""

from __future__ import annotations

import concurrent.futures
import functools
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
from jax.extend import core as jax_core

from .aot_record import EMPTY, AotRecord, shapes_text
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
    shapes: str = ""  # the target's argument shapes (aot_record.shapes_text)
    recorded: bool = False  # not compiled: the kernel repo's record covers it (aot_record)
    spot_check: bool = False  # compiled although the record covers it, to check the record


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


def pallas_kernels(fn, avals) -> list[tuple]:
    """Each Pallas call `fn` makes at `avals` as a program of its own: (a function of the call's operands, their
    avals), in the order `fn` makes them; calls under jit, control flow and custom derivatives included."""
    found = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                operands = [jax.ShapeDtypeStruct(var.aval.shape, var.aval.dtype) for var in eqn.invars]
                found.append((functools.partial(eqn.primitive.bind, **eqn.params), operands))
                continue
            for inner in jax_core.jaxprs_in_params(eqn.params):
                visit(inner)

    visit(jax.make_jaxpr(fn)(*avals).jaxpr)
    return found


def compile_for(fn, avals, generation: str):
    """Lower and compile `fn` at `avals` for one TPU generation; returns the compiled executable."""
    return lower_for(fn, avals, generation).compile()


def compile_fingerprint(kernel: ModuleType) -> dict | None:
    """What decides a loaded kernel's compiles besides the target: its variant's content digest, this module's
    lowering, the compiler libraries, libtpu's flags. None for a kernel not loaded from a built variant."""
    metadata = Path(kernel.__file__).parent / "metadata.json"
    try:
        digest = json.loads(metadata.read_text())["digest"]
    except (OSError, ValueError, KeyError):
        return None
    lowering = (inspect.getsource(lower_for) + inspect.getsource(pallas_kernels) + inspect.getsource(topology_device)
                + repr(TOPOLOGIES))
    return {"kernel": hashlib.sha256(json.dumps(digest, sort_keys=True).encode()).hexdigest(),
            "lowering": hashlib.sha256(lowering.encode()).hexdigest(), "compilers": library_versions(),
            "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", "")}


@dataclass(frozen=True)
class _KernelCompile:
    seconds: float
    flops: float | None
    error: str | None


def _first_line(error: Exception) -> str:
    message = str(error).strip().splitlines()
    return message[0] if message else type(error).__name__


def _compile_program(lowered) -> _KernelCompile:
    start = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as error:  # noqa: BLE001 - every failure is a reported result
        return _KernelCompile(time.perf_counter() - start, None, _first_line(error))
    return _KernelCompile(time.perf_counter() - start, (compiled.cost_analysis() or {}).get("flops"), None)


def compile_kernel(kernel: ModuleType, kernel_name: str, generations: list[str], jobs: int | None = None,
                   cache_dir: Path | None = DEFAULT_CACHE, record: AotRecord | None = None) -> list[CompileResult]:
    """Every declared shape's kernels compiled for each generation (module docstring), in declaration order.

    Targets are lowered one after another on this thread and their kernels
    compiled on `jobs` threads (default: one per CPU): Mosaic compiles outside
    the GIL, and compiles are most of the time. A result's seconds are its
    lowering and its kernels' compiles (a shared kernel's in each target that
    calls it), its flops those the kernels declare. A target that compiled
    before with the same inputs (module docstring) is not compiled again: its
    result says `cached`. `cache_dir` None remembers nothing. A target that
    `record` covers is not compiled either (`aot_record`): its result says
    `recorded`; if a spot-checked target disagrees with the record, every
    target is compiled.
    """
    results = _compile_kernel(kernel, kernel_name, generations, jobs, cache_dir, record or EMPTY)
    if any(r.spot_check and not _reproduces(r, record) for r in results):
        return _compile_kernel(kernel, kernel_name, generations, jobs, cache_dir, EMPTY)
    return results


def _reproduces(result: CompileResult, record: AotRecord) -> bool:
    return result.compiled and record.compiled[result.generation][result.label]["flops"] == result.flops


def _compile_kernel(kernel, kernel_name, generations, jobs, cache_dir, record: AotRecord) -> list[CompileResult]:
    targets = load_compile_targets(kernel)
    fingerprint = compile_fingerprint(kernel)
    cache = DiskCache(cache_dir if fingerprint is not None else None)

    def key(label, generation, avals):
        shapes = [(tuple(a.shape), str(a.dtype)) for a in avals]
        text = json.dumps([fingerprint, kernel_name, label, generation, shapes], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def result(label, generation, shapes, spot_check, cache_key, lowering_seconds, compiles):
        kernels = [compile.result() for compile in compiles]
        seconds = lowering_seconds + sum(k.seconds for k in kernels)
        errors = [k.error for k in kernels if k.error is not None]
        if errors:
            return CompileResult(kernel_name, label, generation, False, seconds, None, errors[0], shapes=shapes,
                                 spot_check=spot_check)
        flops = sum(k.flops for k in kernels if k.flops) or None
        cache.put(cache_key, {"flops": flops})
        return CompileResult(kernel_name, label, generation, True, seconds, flops, None, shapes=shapes,
                             spot_check=spot_check)

    pending = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        for generation in generations:
            compiles = {}  # a lowered kernel's digest: its compile, shared by every target that calls it
            declared = targets.compile_targets(generation)
            covered = {label: entry for label, _, avals in declared
                       if (entry := record.entry(fingerprint, generation, label, avals)) is not None}
            spot_check = record.spot_check(generation, list(covered))
            for label, fn, avals in declared:
                shapes = shapes_text(avals)
                if label in covered and label != spot_check:
                    pending.append(CompileResult(kernel_name, label, generation, True, 0.0, covered[label]["flops"],
                                                 None, shapes=shapes, recorded=True))
                    continue
                cache_key = key(label, generation, avals)
                if (remembered := cache.get(cache_key)) is not None:
                    pending.append(CompileResult(kernel_name, label, generation, True, 0.0, remembered["flops"], None,
                                                 cached=True, shapes=shapes, spot_check=label == spot_check))
                    continue
                start = time.perf_counter()
                try:
                    programs = [lower_for(call, operands, generation) for call, operands in pallas_kernels(fn, avals)]
                except Exception as error:  # noqa: BLE001 - every failure is a reported result
                    pending.append(CompileResult(kernel_name, label, generation, False, time.perf_counter() - start,
                                                 None, _first_line(error), shapes=shapes,
                                                 spot_check=label == spot_check))
                    continue
                if not programs:
                    pending.append(CompileResult(kernel_name, label, generation, False, time.perf_counter() - start,
                                                 None, "the target calls no Pallas kernel", shapes=shapes,
                                                 spot_check=label == spot_check))
                    continue
                target_compiles = []
                for program in programs:
                    digest = hashlib.sha256(program.as_text().encode()).hexdigest()
                    if digest not in compiles:
                        compiles[digest] = pool.submit(_compile_program, program)
                    target_compiles.append(compiles[digest])
                pending.append((label, generation, shapes, label == spot_check, cache_key,
                                time.perf_counter() - start, target_compiles))
        return [item if isinstance(item, CompileResult) else result(*item) for item in pending]


def format_table(results: list[CompileResult]) -> str:
    rows = [("kernel", "shape", "gen", "compiled", "seconds", "flops")]
    for r in results:
        rows.append(
            (r.kernel, r.label, r.generation,
             ("yes (recorded)" if r.recorded else "yes (before)" if r.cached else "yes") if r.compiled
             else f"NO: {r.error}", f"{r.seconds:.1f}",
             f"{r.flops:.3g}" if r.flops else "-")
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths)) + "  " + row[-1])
    return "\n".join(lines)
