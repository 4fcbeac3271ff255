"""Compiles and grid replays cached on disk, the compile pool, and the seconds each phase of a run takes.

A compile is cached as the text it leaves (HLO, codegen, cost, memory:
`calibration.CompiledText`) under the lowered module's text and the library
versions only, so a change of the model re-analyses and never recompiles. A
grid replay is cached under the traced jaxpr, its concrete arguments and the
source of the modules that replay (`perf.REPLAY_MODULES`). No key holds this
benchmark's own source or paths.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import threading
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks import perf
from benchmarks.perf import calibration, xla_program
from tpu_kernels.disk_cache import DiskCache, library_versions, source_fingerprint


class Cache(DiskCache):
    """Compiles and replays on disk (module docstring).

    A compile's key is the lowered module's text and the library versions: what the compiler sees. A
    replay's key adds the source of the modules that replay (`perf.REPLAY_MODULES`). Cached compiles and
    replays are re-priced on every run, so a change of the model's pricing or constants never needs a
    compile or a replay again.
    """

    def __init__(self, folder: Path | None):
        super().__init__(folder)
        self.versions = library_versions()
        self.replay_code = source_fingerprint(*perf.REPLAY_MODULES)

    def key(self, kind: str, *parts) -> str:
        digest = hashlib.sha256(f"{kind}|{self.versions}".encode())
        if kind == "replay":
            digest.update(f"|{self.replay_code}".encode())
        for part in parts:
            digest.update(part if isinstance(part, bytes) else str(part).encode())
        return f"{kind}-{digest.hexdigest()[:32]}"


class PhaseClock:
    """Seconds spent per phase of the run (summed over threads), for the run's facts (raw/, untracked)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def __call__(self, phase: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            with self.lock:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started


CLOCK = PhaseClock()


def replay(cache: Cache, fn, args, context=contextlib.nullcontext) -> perf.ProgramReplay:
    """perf's replay of `fn(*args)` (its pallas_calls and XLA ragged dots), cached by its jaxpr and concrete
    arguments."""
    with context(), CLOCK("replay"):
        jaxpr = str(jax.make_jaxpr(fn)(*args))
        concrete = b"".join(np.asarray(a).tobytes() for a in args if not isinstance(a, jax.ShapeDtypeStruct))
        key = cache.key("replay", jaxpr, concrete)
        found = cache.get(key)
        if found is not None:
            return found
        return cache.put(key, perf.replay_program(fn, *args))


def first_line(error: Exception) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[0] if lines else repr(error)


class Compiler:
    """Lowers on the calling thread (cheap, and tokamax's patch is thread-global) and compiles on a pool.

    A compile is stored as `calibration.CompiledText` (or the compiler's refusal) under the lowered text;
    each result is analysed under the current model when it is read.
    """

    def __init__(self, cache: Cache, jobs: int):
        self.cache = cache
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(jobs, 1))

    def submit(self, fn, avals, generation: str, lock=contextlib.nullcontext(), *,
               kind: str, kernel_bodies: bool = True, lower=None) -> concurrent.futures.Future:
        """A future of the `xla_program.CompiledProgram` of `fn` for `generation`, or of {"error": ...}.

        `kind` names what is compiled in the run's seconds by phase (e.g. "ours' quantized layers at decode"),
        so a cold run says which compiles its time went to. `lower` (no arguments, returns the lowered
        program) replaces lowering `fn` at `avals` on one device, for a layer lowered on a mesh of its own.
        """
        try:
            with lock, CLOCK("lower"):
                lowered = lower() if lower is not None else xla_program.lower_program(
                    fn, avals, generation, kernel_bodies=kernel_bodies)
        except Exception as error:  # noqa: BLE001 - a layer that does not lower is a result
            return calibration.resolved({"error": f"lowering failed: {first_line(error)}"})
        with CLOCK("lowered text"):
            key = self.cache.key("compile", generation, lowered.as_text())
        found = self.cache.get(key)
        if found is not None:
            return calibration.resolved(_analysed(found, generation))

        def compile_and_store():
            try:
                bodies = "with kernel bodies" if kernel_bodies else "with empty kernel bodies"
                with (CLOCK("compile (summed over threads)"), CLOCK(f"compile {bodies} (summed over threads)"),
                      CLOCK(f"compile {kind} {bodies} (summed over threads)")):
                    text = calibration.compile_text(lowered)
            except Exception as error:  # noqa: BLE001 - a failed compile (e.g. VMEM OOM) is a result
                text = {"error": first_line(error)}
            return _analysed(self.cache.put(key, text), generation)

        return self.pool.submit(compile_and_store)


def _analysed(text, generation: str):
    if isinstance(text, dict):
        return dict(text)
    with CLOCK("analyse HLO"):
        return text.analyse(generation)
