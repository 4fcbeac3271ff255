"""The performance model held against real-chip timings: tokamax's autotuning measurements, rebuilt and modelled.

`calibrate` reads every timed config of tokamax's autotuning files and
rebuilds it as the program tokamax timed (`tokamax_calls`), compiles it ahead
of time for the chip, models it with `program_time.model_program` (Pallas
kernels by `program_replay`'s grid replay, XLA ops by their traffic) and
compares with the fastest measured run. The report gives each entry's
predicted / measured ratio and, per chip and kind, the spread of the errors
on the entries that fit the constants and on those held out (`holdout`), and
per regime: each entry is `streaming` (decode-like: its copies, priced by the
model, take longer than its matmuls) or `compute_bound`
(`modelled_time.regime`), since the model's error in one regime
says little about the other.

Compiles and grid replays are cached on disk (`AnalysisCache`): a compile by
the call, config, chip, library versions, libtpu's flags and the source of the
code that rebuilds and lowers it; a replay also by the replay's source
(`program_replay.REPLAY_MODULES` and `tokamax_kernels`). The compiler's
refusal of a program (`CompileRefused`, e.g. over the chip's scoped VMEM) is
cached the same way, so a rerun does not compile it again; a failure of this
host (memory, disk) is not kept. Re-analysing cached HLO is cheap, so a model
change reruns in seconds.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import os
import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from . import modelled_time, program_replay, program_time, tokamax_calls, tokamax_kernels, xla_program
from tpu_kernels.disk_cache import DiskCache, cache_root, library_versions, source_fingerprint
from .chip import FITTED_RATES, ModelRates
from .program_replay import ProgramReplay
from .tokamax_calls import (
    CHIP_FOLDERS,
    KINDS,
    CalibrationInputError,
    Measurement,
    NotRebuilt,
    Rebuilt,
    read_measurements,
    rebuild,
)
from tpu_kernels.runtime.hardware import tpu_generation

DEFAULT_OUT = Path("benchmarks/results/calibration.json")
DEFAULT_CACHE = cache_root("calibration")


# ----------------------------------------------------------------------------- cache


def _rebuild_code() -> tuple:
    """What decides the program a measurement compiles to: the rebuilders and the lowering."""
    return (*tokamax_calls.REBUILD_FUNCTIONS, _lower, xla_program.lower_program)


class AnalysisCache(DiskCache):
    """Compiled-program texts and grid replays on disk, keyed by what produced them (module docstring).

    A compile is stored as the optimized HLO, codegen text, cost analysis and memory statistics, so
    `xla_program.analyse_hlo` re-reads it under the current model; a replay as the replay's result objects.
    """

    def __init__(self, folder: Path | None):
        super().__init__(folder)
        self.versions = library_versions()
        self.rebuild_code = source_fingerprint(*_rebuild_code())
        self.replay_code = source_fingerprint(*program_replay.REPLAY_MODULES, tokamax_kernels)

    def key(self, what: str, measurement: Measurement) -> str:
        # libtpu's flags decide a compile's outcome too (a scoped VMEM limit, say), as in `aot`'s keys.
        parts = [what, self.versions, self.rebuild_code, measurement.identity, os.environ.get("LIBTPU_INIT_ARGS", "")]
        if what == "replay":
            parts.append(self.replay_code)
        return f"{what}-{hashlib.sha256('|'.join(parts).encode()).hexdigest()[:32]}"


@dataclasses.dataclass(frozen=True)
class CompiledText:
    """What a compile leaves for the analysis: `xla_program.analyse_hlo`'s inputs."""

    hlo: str
    codegen: str | None
    cost_analysis: dict
    memory: dict

    def analyse(self, generation: str) -> xla_program.CompiledProgram:
        return xla_program.analyse_hlo(self.hlo, generation, codegen_text=self.codegen,
                                       cost_analysis=self.cost_analysis, memory=self.memory)


@dataclasses.dataclass(frozen=True)
class CompileRefused:
    """The compiler's refusal of a measurement's program, cached like a compile: the same inputs get it again."""

    reason: str


def compile_text(lowered) -> CompiledText:
    """Compiles an `xla_program.lower_program` result with XLA's HLO dump on, keeping what `analyse_hlo` reads.

    Thread-safe: the dump goes to a folder of its own, passed as a compile option.
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="xla_dump_") as dump:
        compiled = lowered.compile({"xla_dump_to": dump, "xla_dump_hlo_as_text": True})
        optimized = xla_program.dumped_module(dump, "after_optimizations.txt")
        codegen = xla_program.dumped_module(dump, "after_codegen.txt", required=False)
        return CompiledText(
            hlo=optimized.read_text(),
            codegen=codegen.read_text() if codegen else None,
            cost_analysis={k: float(v) for k, v in (compiled.cost_analysis() or {}).items()},
            memory=xla_program.memory_stats(compiled),
        )


# ----------------------------------------------------------------------------- modelling


@dataclasses.dataclass(frozen=True)
class ModelConstants:
    """The constants the model is priced with (fitted by `python -m benchmarks calibration_fit`)."""

    grid_step_s: float | None = None  # None: the calibrated value of the entry's generation
    ragged_dot_step_s: float | None = None
    vector_elements_per_cycle: float = FITTED_RATES.vector_elements_per_cycle
    transcendental_elements_per_cycle: float = FITTED_RATES.transcendental_elements_per_cycle
    mxu_weight_load_fraction: float = FITTED_RATES.mxu_weight_load_fraction
    hbm_fraction: float | None = None  # None: the entry's generation's share in `hbm_fractions`
    hbm_fractions: tuple[tuple[str, float], ...] = FITTED_RATES.hbm_fractions  # per generation (chip.ModelRates)

    @property
    def rates(self) -> ModelRates:
        """The MXU, vector and HBM rates among these constants, as the pricing functions take them."""
        return ModelRates(
            mxu_weight_load_fraction=self.mxu_weight_load_fraction,
            vector_elements_per_cycle=self.vector_elements_per_cycle,
            transcendental_elements_per_cycle=self.transcendental_elements_per_cycle,
            hbm_fractions=self.hbm_fractions,
        )


@dataclasses.dataclass(frozen=True)
class Analysed:
    """A measurement's compiled program and grid replay (or why there is none), ready to be priced."""

    measurement: Measurement
    program: xla_program.CompiledProgram | None
    replay: ProgramReplay | None
    reason: str | None = None

    def price(self, constants: ModelConstants = ModelConstants()) -> program_time.ProgramTime:
        return program_time.model_program(
            self.program, self.replay.pallas_calls, ragged_dots=self.replay.ragged_dots,
            step_overhead_s=constants.grid_step_s, ragged_dot_step_s=constants.ragged_dot_step_s,
            hbm_fraction=constants.hbm_fraction, rates=constants.rates,
        )


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return (lines[0] if lines else type(error).__name__)[:300]


def _no_progress(items: Iterable, description: str) -> Iterable:
    del description
    return items


def analyse_measurements(
    measurements: Sequence[Measurement],
    cache: AnalysisCache,
    *,
    jobs: int = 2,
    progress: Callable[[Iterable, str], Iterable] = _no_progress,
) -> list[Analysed]:
    """Rebuild, compile (on `jobs` threads) and replay every measurement, in order."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(jobs, 1))
    pending: list[tuple[Measurement, Any, Any]] = []
    for measurement in progress(measurements, "rebuild and replay"):
        try:
            rebuilt = rebuild(measurement)
        except NotRebuilt as why:
            pending.append((measurement, None, f"not rebuilt: {why}"))
            continue
        except Exception as error:  # noqa: BLE001 - e.g. a config tokamax's own Config refuses: skipped, with why
            pending.append((measurement, None, f"not rebuilt: {_first_line(error)}"))
            continue
        compiled = _submit_compile(pool, cache, measurement, rebuilt)
        replay = _replay(cache, measurement, rebuilt)
        pending.append((measurement, compiled, replay))
    results = []
    for measurement, compiled, replay in progress(pending, "compile"):
        if compiled is None:
            results.append(Analysed(measurement, None, None, replay))
            continue
        text = compiled.result()
        if isinstance(text, str) or isinstance(replay, str):
            results.append(Analysed(measurement, None, None, text if isinstance(text, str) else replay))
            continue
        try:
            analysed = Analysed(measurement, text.analyse(measurement.chip), replay)
            analysed.price()  # an entry the model cannot take is a result, with its reason
        except Exception as error:  # noqa: BLE001
            analysed = Analysed(measurement, None, None, f"not modelled: {_first_line(error)}")
        results.append(analysed)
    pool.shutdown()
    return results


def _lower(measurement: Measurement, rebuilt: Rebuilt):
    # The kernels' time is the replay's; the compile is for the XLA program around them.
    return xla_program.lower_program(rebuilt.fn, rebuilt.avals, measurement.chip, kernel_bodies=False)


def _submit_compile(pool, cache: AnalysisCache, measurement: Measurement, rebuilt: Rebuilt):
    """A future of the measurement's `CompiledText`, or of why there is none (a string)."""
    key = cache.key("compile", measurement)
    found = cache.get(key)
    if found is not None:
        return resolved(f"compile failed: {found.reason}" if isinstance(found, CompileRefused) else found)
    try:
        lowered = _lower(measurement, rebuilt)
    except Exception as error:  # noqa: BLE001
        return resolved(f"lowering failed: {_first_line(error)}")

    def compile_and_store():
        try:
            return cache.put(key, compile_text(lowered))
        except jax.errors.JaxRuntimeError as error:  # the compiler's refusal, e.g. a config over the chip's VMEM
            return f"compile failed: {cache.put(key, CompileRefused(_first_line(error))).reason}"
        except Exception as error:  # noqa: BLE001 - this host's trouble (memory, disk): not kept, tried again
            return f"compile failed: {_first_line(error)}"

    return pool.submit(compile_and_store)


def resolved(value) -> concurrent.futures.Future:
    """A future already holding `value`: what a cache hit or a refusal returns where a compile would be pending."""
    future = concurrent.futures.Future()
    future.set_result(value)
    return future


def _replay(cache: AnalysisCache, measurement: Measurement, rebuilt: Rebuilt):
    key = cache.key("replay", measurement)
    found = cache.get(key)
    if found is not None:
        return found
    try:
        with rebuilt.replay_context():
            calls = program_replay.replay_program(rebuilt.fn, *rebuilt.replay_args)
    except Exception as error:  # noqa: BLE001
        return f"replay failed: {_first_line(error)}"
    return cache.put(key, calls)


# ----------------------------------------------------------------------------- the report


def holdout(measurement: Measurement) -> bool:
    """The fixed split: about half the entries of each chip and kind are held out of any fit (by a hash of the call)."""
    return int(hashlib.sha256(measurement.identity.encode()).hexdigest(), 16) % 2 == 1


def entry_record(analysed: Analysed, constants: ModelConstants) -> dict:
    m = analysed.measurement
    program = analysed.price(constants)
    predicted_us = 1e6 * program.pipelined_time_s
    kernels = program.kernels
    return {
        "kind": m.kind,
        "chip": m.chip,
        "call": m.label,
        "config": m.config,
        "measured_us": round(m.measured_us, 2),
        "split": "holdout" if holdout(m) else "fit",
        "predicted_us": round(predicted_us, 2),
        "ratio": round(predicted_us / m.measured_us, 4),
        "regime": program.regime,
        "terms_us": {
            "kernels": round(1e6 * kernels.pipelined_time_s, 2) if kernels else 0.0,
            "kernels_hbm": round(1e6 * kernels.hbm_bound_s, 2) if kernels else 0.0,
            "kernels_mxu": round(1e6 * kernels.compute_bound_s, 2) if kernels else 0.0,
            "kernel_steps": kernels.steps if kernels else 0,
            "xla_ragged_dot": round(1e6 * program.ragged_dot_s, 2),
            "xla_ops": round(1e6 * program.xla_s, 2),
            "xla_transposes": round(1e6 * program.xla_transpose_s, 2),
            "xla_op_count": program.xla_ops,
        },
    }


def summarize(records: Sequence[dict]) -> dict:
    """Per chip and kind (and split, and regime): count, median and 90th percentile of |ratio - 1|, the signed bias
    (median and mean of ratio - 1: below 0, the model is faster than the chip), and the worst entry. A regime
    (`modelled_time.REGIMES`) without entries on that chip and kind is absent."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for record in records:
        groups.setdefault((record["chip"], record["kind"]), []).append(record)
    summary = {}
    for (chip, kind), members in sorted(groups.items()):
        block = {"all": _error_stats(members)}
        for split in ("fit", "holdout"):
            chosen = [r for r in members if r["split"] == split]
            if chosen:
                block[split] = _error_stats(chosen)
        block["regimes"] = {regime: _error_stats(chosen) for regime in modelled_time.REGIMES
                            if (chosen := [r for r in members if r["regime"] == regime])}
        summary.setdefault(chip, {})[kind] = block
    return summary


def _error_stats(records: Sequence[dict]) -> dict:
    signed = [r["ratio"] - 1 for r in records]
    errors = sorted(abs(error) for error in signed)
    worst = max(records, key=lambda r: abs(r["ratio"] - 1))
    return {
        "count": len(records),
        "median_abs_error": round(statistics.median(errors), 4),
        "p90_abs_error": round(float(np.percentile(errors, 90)), 4),
        "median_signed_error": round(statistics.median(signed), 4),
        "mean_signed_error": round(statistics.fmean(signed), 4),
        "worst": {"call": worst["call"], "config": worst["config"], "ratio": worst["ratio"]},
        "within_2x": sum(1 for r in records if 0.5 <= r["ratio"] <= 2.0),
    }


def analyse(
    paths: Sequence[Path],
    *,
    chip: str | None = None,
    cache_dir: Path | None = DEFAULT_CACHE,
    jobs: int = 2,
    progress: Callable[[Iterable, str], Iterable] = _no_progress,
) -> tuple[list[Analysed], list[dict]]:
    """Every measurement at `paths` analysed, and what was skipped (with the reason)."""
    measurements, skipped = read_measurements(paths, chip)
    analysed = analyse_measurements(measurements, AnalysisCache(cache_dir), jobs=jobs, progress=progress)
    kept = []
    for result in analysed:
        reason = result.reason if result.program is None else inconsistent_with_peak(result)
        if reason is None:
            kept.append(result)
        else:
            skipped.append({"file": result.measurement.source, "call": result.measurement.label,
                            "config": result.measurement.config, "reason": reason})
    return kept, skipped


def inconsistent_with_peak(analysed: Analysed) -> str | None:
    """Why a timing cannot be of the rebuilt inputs, if their kernels' matmuls alone need longer at the bf16 peak.

    tokamax records some group sizes as a count (`{num_groups, total_size}`) and expands them at its default
    seed; where the tiles those group sizes make the kernel visit hold more matmul work than the chip can do
    in the measured time, the measurement ran on other group sizes, and the entry says nothing about the model.
    """
    generation = tpu_generation(analysed.measurement.chip)
    peak = generation.device_bf16_flops_per_s
    flops = sum(dot.flops for call in analysed.replay.pallas_calls for dot in call.dots)
    needed_us = 1e6 * flops / peak
    if needed_us <= analysed.measurement.measured_us:
        return None
    return (f"inconsistent inputs: the kernel's tiles for these group sizes hold {flops / 1e9:.0f} GFLOP of matmuls, "
            f"{needed_us:.0f} us at the chip's bf16 peak, more than the measured {analysed.measurement.measured_us:.0f} "
            "us: the timing was not taken on tokamax's expansion of the recorded group-size count")


def report(analysed: Sequence[Analysed], skipped: Sequence[dict], constants: ModelConstants = ModelConstants()) -> dict:
    """The calibration report (module docstring) of analysed measurements priced with `constants`."""
    records = [entry_record(result, constants) for result in analysed]
    records.sort(key=lambda r: (r["chip"], r["kind"], r["call"], json.dumps(r["config"], sort_keys=True)))
    return {
        "what": "the performance model (benchmarks.perf + xla_program) against tokamax's measured device times; "
                "ratio = predicted / measured (fastest of the recorded runs); predicted = the pipelined figure",
        "constants": dataclasses.asdict(constants),
        "split": "holdout = entries whose sha256 of (chip, kind, call, config) is odd; the rest fit the constants",
        "summary": summarize(records),
        "entries": records,
        "skipped": sorted(skipped, key=lambda s: json.dumps(s, sort_keys=True)),
    }


def calibrate(paths: Sequence[Path], **options) -> dict:
    """`analyse` then `report` at the model's constants."""
    analysed, skipped = analyse(paths, **options)
    return report(analysed, skipped)


def resummarize(path: Path) -> dict:
    """The report at `path` with its summary recomputed from its entries (`summarize`), nothing recompiled: how a
    change to the summary's statistics reaches a committed report."""
    report = json.loads(Path(path).read_text())
    report["summary"] = summarize(report["entries"])
    return report


def write_report(report: dict, out: Path) -> None:
    """One entry per line: reruns rewrite only what changed. Only valid JSON: a number that is not finite (a
    ratio over a timing too small to divide by) is written null, not Infinity."""
    out.parent.mkdir(parents=True, exist_ok=True)
    report = _finite_or_null(report)
    lines = ["{"]
    keys = list(report)
    for index, key in enumerate(keys):
        comma = "," if index < len(keys) - 1 else ""
        value = report[key]
        if key in ("entries", "skipped"):
            items = [json.dumps(item, sort_keys=True, allow_nan=False) for item in value]
            body = ",\n".join(f"  {item}" for item in items)
            lines.append(f'"{key}": [\n{body}\n]{comma}' if items else f'"{key}": []{comma}')
        else:
            lines.append(f'"{key}": {json.dumps(value, indent=1, sort_keys=True, allow_nan=False)}{comma}')
    lines.append("}")
    out.write_text("\n".join(lines) + "\n")


def _finite_or_null(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(item) for item in value]
    return value


def summary_table(report: dict) -> str:
    rows = ["chip    kind                  n   median  p90     worst"]
    for chip, kinds in report["summary"].items():
        for kind, block in kinds.items():
            stats = block["all"]
            rows.append(f"{chip:7} {kind:20} {stats['count']:3}  {stats['median_abs_error']:6.1%}  "
                        f"{stats['p90_abs_error']:6.1%}  {stats['worst']['ratio']:.2f} {stats['worst']['call']}")
    return "\n".join(rows)


__all__ = [
    "CHIP_FOLDERS", "CalibrationInputError", "KINDS", "Measurement", "calibrate", "read_measurements",
    "summary_table", "write_report",
]
