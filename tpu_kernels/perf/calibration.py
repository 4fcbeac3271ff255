"""The performance model held against real-chip timings: tokamax's autotuning measurements, rebuilt and modelled.

tokamax ships device times measured on TPUs (`tokamax/data/autotuning/<chip>/<op>.json`,
xprof device time, five runs per config). Each entry's key is the exact call
(shapes, dtypes, dimension numbers, group sizes, flags) and its value maps each
config tried to its times. `calibrate` rebuilds every entry it can as the
program tokamax timed (the op's own `_fwd` at that config: Pallas ragged dot,
XLA's `lax.ragged_dot` with its f32 accumulation and cast, flash attention and
its vjp), compiles it ahead of time for the chip, models it with
`xla_program.model_program` (Pallas kernels by `perf`'s grid replay, XLA ops by
their traffic) and compares with the fastest measured run.

Reading the files:
- the chip comes from the folder name (CHIP_FOLDERS) or is given;
- group sizes given as `{num_groups, total_size}` expand as tokamax expands
  them (`generate_group_sizes` at its default seed);
- tokamax 0.0.12's `tpu7x/ragged_dot.json` holds keys whose group sizes object
  is not escaped inside the key string (tokamax's own loader fails on it and
  logs the error); that one defect is repaired, any other unreadable file is
  an error (`CalibrationInputError`);
- an empty file holds no entry; an op with no rebuild here and an entry
  without timings are listed in `skipped` with the reason.

Compiles and grid replays are cached on disk (`AnalysisCache`): a compile by
the call, config, chip, library versions and this module's source; a replay
also by the replay's source (`program_replay.REPLAY_MODULES`). Re-analysing cached HLO is cheap, so a
model change reruns in seconds.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import importlib.metadata
import inspect
import json
import os
import pickle
import re
import statistics
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import chip as chip_constants
from . import program_replay, xla_program
from .program_replay import ProgramReplay
from ..runtime.hardware import tpu_generation

# tokamax's folder names (device kinds, lower snake case) -> our generation names.
CHIP_FOLDERS = {"tpu_v5_lite": "v5e", "tpu_v5": "v5p", "tpu_v5p": "v5p", "tpu_v6_lite": "v6e", "tpu7x": "tpu7x"}
# tokamax op files -> the kind of entry they hold.
KIND_FILES = {
    "pallas_mosaic_tpu_ragged_dot.json": "pallas_ragged_dot",
    "ragged_dot.json": "xla_ragged_dot",
    "pallas_mosaic_tpu_flash_attention.json": "flash_attention",
    "pallas_mosaic_tpu_flash_attention_vjp.json": "flash_attention_vjp",
}
KINDS = tuple(KIND_FILES.values())
DEFAULT_OUT = Path("benchmarks/results/calibration.json")
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tpu-kernels" / "calibration"

# tokamax 0.0.12's tpu7x/ragged_dot.json: `\"group_sizes\":{"num_groups":256,"total_size":131072}` inside a key string.
_UNESCAPED_GROUP_SIZES = re.compile(r'(\\"group_sizes\\":)\{"num_groups":(\d+),"total_size":(\d+)\}')
_ARRAY_TYPE = re.compile(r"^(\w+)\[([\d,]*)\]$")
_DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32, "s32": jnp.int32, "bool": jnp.bool_,
           "s8": jnp.int8, "f8e4m3fn": jnp.float8_e4m3fn}


class CalibrationInputError(ValueError):
    """A timing file that cannot be read (not JSON, even after the one known repair)."""


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One config of one tokamax autotuning entry: the call, the config and its measured device times."""

    chip: str
    kind: str
    source: str  # file the entry came from
    call: dict
    config: dict
    times_ms: tuple[float, ...]

    @property
    def measured_us(self) -> float:
        return 1e3 * min(self.times_ms)

    @property
    def identity(self) -> str:
        """Stable text naming the entry and config (cache keys, the fit/holdout split)."""
        return json.dumps([self.chip, self.kind, self.call, self.config], sort_keys=True)

    @property
    def label(self) -> str:
        return describe_call(self.kind, self.call)


# ----------------------------------------------------------------------------- reading


def chip_of_folder(folder: Path) -> str | None:
    return CHIP_FOLDERS.get(folder.name)


def read_timing_file(path: Path) -> dict:
    """The entries of one tokamax autotuning file ({} when empty); CalibrationInputError if unreadable."""
    try:
        text = path.read_text()
    except OSError as error:
        raise CalibrationInputError(f"{path}: cannot read: {error}") from None
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        repaired = _UNESCAPED_GROUP_SIZES.sub(r'\1{\\"num_groups\\":\2,\\"total_size\\":\3}', text)
        try:
            data = json.loads(repaired)
        except json.JSONDecodeError:
            raise CalibrationInputError(f"{path}: not a tokamax autotuning file (JSON error: {error})") from None
    if not isinstance(data, dict):
        raise CalibrationInputError(f"{path}: not a tokamax autotuning file (top level is not an object)")
    return data


def timing_files(paths: Iterable[Path]) -> list[Path]:
    """JSON files named by `paths`: files as given, folders' *.json, and folders of chip folders."""
    found = []
    for path in map(Path, paths):
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            files = sorted(path.glob("*.json"))
            if files:
                found.extend(files)
            else:
                found.extend(sorted(path.glob("*/*.json")))
        else:
            raise CalibrationInputError(f"{path}: no such file or folder")
    return found


def read_measurements(paths: Iterable[Path], chip: str | None = None) -> tuple[list[Measurement], list[dict]]:
    """Every timed config of the TPU kinds we rebuild, and what was left out (with the reason)."""
    measurements, skipped = [], []
    for path in timing_files(paths):
        file_chip = chip or chip_of_folder(path.parent)
        data = read_timing_file(path)
        if not data:
            continue
        if file_chip is None:
            skipped.append({"file": str(path), "entries": len(data),
                            "reason": f"chip unknown: folder {path.parent.name!r} is not a TPU folder "
                                      f"({', '.join(CHIP_FOLDERS)}); pass --chip"})
            continue
        kind = KIND_FILES.get(path.name)
        if kind is None:
            skipped.append({"file": str(path), "entries": len(data),
                            "reason": f"no rebuild of tokamax op {path.stem!r} (rebuilt: {', '.join(KIND_FILES)})"})
            continue
        for key_text, configs in data.items():
            call = json.loads(key_text)
            timed = [(json.loads(config), result["evaluation_times_ms"])
                     for config, result in (configs or {}).items() if result.get("evaluation_times_ms")]
            if not timed:
                skipped.append({"file": str(path), "call": describe_call(kind, call), "reason": "no timing recorded"})
                continue
            for config, times in timed:
                measurements.append(Measurement(file_chip, kind, str(path), call, config, tuple(map(float, times))))
    return measurements, skipped


def array_type(text: str) -> jax.ShapeDtypeStruct:
    match = _ARRAY_TYPE.match(text)
    if match is None or match.group(1) not in _DTYPES:
        raise ValueError(f"unsupported array type {text!r}")
    return jax.ShapeDtypeStruct(tuple(int(d) for d in match.group(2).split(",") if d), _DTYPES[match.group(1)])


def describe_call(kind: str, call: dict) -> str:
    if kind in ("pallas_ragged_dot", "xla_ragged_dot"):
        dims = call["ragged_dot_dimension_numbers"]["dot_dimension_numbers"]
        sizes = call["group_sizes"]
        groups = sizes["num_groups"] if isinstance(sizes, dict) else len(sizes)
        extra = " +residuals" if call.get("return_residuals") else ""
        return f"{_RAGGED_MODES.get(_dims_key(dims), 'dims ' + json.dumps(dims))} {call['lhs']} x {call['rhs']} G={groups}{extra}"
    mask = call.get("mask") or {}
    flags = [name for name in ("is_causal",) if mask.get(name)]
    flags += ["bool_mask"] if mask.get("bool_mask") else []
    flags += ["bias"] if call.get("bias") else []
    flags += ["+residuals"] if call.get("return_residuals") else []
    return f"q {call['q']} k {call['k']} v {call['v']}" + (" " + " ".join(flags) if flags else "")


# ----------------------------------------------------------------------------- rebuilding the timed programs


def _dims_key(dims) -> str:
    return json.dumps(dims)


# tokamax's three supported ragged dot dimension numbers: forward, the lhs gradient, the rhs gradient.
_RAGGED_MODES = {
    _dims_key([[[1], [1]], [[], []]]): "fwd",
    _dims_key([[[1], [2]], [[], []]]): "dlhs",
    _dims_key([[[0], [0]], [[], []]]): "drhs",
}


@dataclasses.dataclass(frozen=True)
class Rebuilt:
    """A timed call as a JAX program: `fn(*avals)` compiles; `fn(*replay_args)` is what the grid replay runs."""

    fn: Callable
    avals: tuple[jax.ShapeDtypeStruct, ...]
    replay_args: tuple  # avals, with the arguments a grid depends on (group sizes) concrete
    replay_context: Callable  # a context manager factory for the replay


class NotRebuilt(Exception):
    """An entry this module cannot rebuild; the message is the reason."""


def rebuild(measurement: Measurement) -> Rebuilt:
    if measurement.kind in ("pallas_ragged_dot", "xla_ragged_dot"):
        return _rebuild_ragged_dot(measurement)
    if measurement.kind == "flash_attention":
        return _rebuild_flash_attention(measurement)
    if measurement.kind == "flash_attention_vjp":
        return _rebuild_flash_attention_vjp(measurement)
    raise NotRebuilt(f"unknown kind {measurement.kind!r}")


def group_sizes_of(call: dict) -> np.ndarray:
    sizes = call["group_sizes"]
    if isinstance(sizes, dict):
        from tokamax._src.ops.ragged_dot.base import generate_group_sizes

        sizes = generate_group_sizes(m=sizes["total_size"], num_groups=sizes["num_groups"])
    return np.asarray(sizes, np.int32)


def _rebuild_ragged_dot(measurement: Measurement) -> Rebuilt:
    from jax import lax
    from tokamax._src import precision as precision_lib
    from tokamax._src.ops.ragged_dot import base as ragged_base
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tokamax_pallas

    from .tokamax_kernels import grid_as_pallas_call

    call = measurement.call
    dims_json = call["ragged_dot_dimension_numbers"]
    if _dims_key(dims_json["dot_dimension_numbers"]) not in _RAGGED_MODES:
        raise NotRebuilt(f"dimension numbers {dims_json['dot_dimension_numbers']} are none of tokamax's three")
    if call.get("activation") is not None:
        raise NotRebuilt(f"activation {call['activation']!r} is not rebuilt")
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dims_json["dot_dimension_numbers"]
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=((tuple(lhs_contract), tuple(rhs_contract)), (tuple(lhs_batch), tuple(rhs_batch))),
        lhs_ragged_dimensions=tuple(dims_json["lhs_ragged_dimensions"]),
        rhs_group_dimensions=tuple(dims_json["rhs_group_dimensions"]),
    )
    lhs, rhs = array_type(call["lhs"]), array_type(call["rhs"])
    sizes = group_sizes_of(call)
    names = call.get("precision") or ("DEFAULT", "DEFAULT")
    precision = precision_lib.canonicalize_precision(tuple(lax.Precision[name] for name in names))
    preferred = call.get("preferred_element_type")
    preferred = jnp.dtype(preferred) if preferred else None
    return_residuals = bool(call.get("return_residuals"))
    if measurement.kind == "pallas_ragged_dot":
        op = tokamax_pallas.PallasMosaicTpuRaggedDot()
        config = tokamax_pallas.Config(**measurement.config)
        context = grid_as_pallas_call
    else:
        op = ragged_base.RaggedDot()
        config = None
        context = _no_context

    def timed(lhs, rhs, group_sizes):
        out, residuals = op._fwd(  # the timed body, at this config (tokamax's op `bind`s and jits around it)
            lhs, rhs, group_sizes=group_sizes, ragged_dot_dimension_numbers=dims, precision=precision,
            preferred_element_type=preferred, return_residuals=return_residuals, config=config,
        )
        return (out, residuals) if return_residuals else out

    group_aval = jax.ShapeDtypeStruct(sizes.shape, jnp.int32)
    return Rebuilt(timed, (lhs, rhs, group_aval), (lhs, rhs, sizes), context)


def _attention_arguments(call: dict):
    from tokamax._src.ops.attention import base as attention_base

    for name in ("bias", "dropout_mask", "paging_info", "q_indices", "k_indices"):
        if call.get(name) is not None:
            raise NotRebuilt(f"{name} is not rebuilt")
    if call.get("dropout_rate"):
        raise NotRebuilt("dropout is not rebuilt")
    mask = call.get("mask") or {}
    if any(mask.get(name) is not None for name in ("bool_mask", "q_start", "q_end", "k_start", "k_end")):
        raise NotRebuilt("array masks are not rebuilt (causal and full masks are)")
    return {
        "precision": _dot_algorithms(call["precision"]),
        "logits_dtype": jnp.dtype(call["logits_dtype"]),
        "logits_scale": float(call["logits_scale"]),
        "bias": None,
        "logits_soft_cap": call.get("logits_soft_cap"),
        "mask": attention_base.Mask(is_causal=bool(mask.get("is_causal"))),
        "dropout_mask": None,
        "dropout_rate": 0.0,
        "paging_info": None,
        "q_indices": None,
        "k_indices": None,
        "normalize_output": bool(call.get("normalize_output", True)),
    }


def _dot_algorithms(names: Sequence[str]):
    from jax import lax

    return tuple(lax.DotAlgorithmPreset[name] for name in names)


def _rebuild_flash_attention(measurement: Measurement) -> Rebuilt:
    from tokamax._src.ops.attention import pallas_mosaic_tpu as tokamax_attention
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as splash

    call = measurement.call
    arguments = _attention_arguments(call)
    return_residuals = bool(call.get("return_residuals"))
    config = dict(measurement.config)
    for layout in ("q_layout", "k_layout", "v_layout"):
        config[layout] = splash.QKVLayout(config[layout])
    config = tokamax_attention.Config(**config)
    op = tokamax_attention.PallasMosaicTpuFlashAttention()

    def timed(q, k, v):
        out, residuals = op._fwd(q, k, v, return_residuals=return_residuals, config=config, **arguments)
        return (out, residuals) if return_residuals else out

    avals = tuple(array_type(call[name]) for name in ("q", "k", "v"))
    return Rebuilt(timed, avals, avals, _no_context)


def _rebuild_flash_attention_vjp(measurement: Measurement) -> Rebuilt:
    from tokamax._src.ops.attention import pallas_mosaic_tpu_vjp as tokamax_vjp

    call = measurement.call
    arguments = _attention_arguments(call)
    if call.get("return_residuals"):
        raise NotRebuilt("tokamax's vjp refuses return_residuals")
    config = tokamax_vjp.Config(**measurement.config)
    op = tokamax_vjp.PallasMosaicTpuFlashAttentionVjp()

    def timed(max_logits, logsumexp, out, dout, q, k, v):
        grads, _ = op._fwd((max_logits, logsumexp), out, dout, q, k, v, return_residuals=False, config=config,
                           **arguments)
        return grads["q"], grads["k"], grads["v"]

    residuals = [array_type(text) for text in call["residuals"]]
    avals = (*residuals, *(array_type(call[name]) for name in ("out", "dout", "q", "k", "v")))
    return Rebuilt(timed, avals, avals, _no_context)


class _NoContext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _no_context():
    return _NoContext()


# ----------------------------------------------------------------------------- cache


def _versions() -> str:
    found = []
    for name in ("jax", "jaxlib", "tokamax", "libtpu", "torch_tpu"):
        try:
            found.append(f"{name}={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ";".join(found)


def _source_fingerprint(*objects) -> str:
    digest = hashlib.sha256()
    for obj in objects:
        digest.update(inspect.getsource(obj).encode())
    return digest.hexdigest()[:16]


def _rebuild_code() -> tuple:
    """What decides the program a measurement compiles to: the rebuilders and the lowering."""
    return (rebuild, group_sizes_of, array_type, _rebuild_ragged_dot, _attention_arguments, _dot_algorithms,
            _rebuild_flash_attention, _rebuild_flash_attention_vjp, _submit_compile, xla_program.lower_program)


class AnalysisCache:
    """Compiled-program texts and grid replays on disk, keyed by what produced them (module docstring).

    A compile is stored as the optimized HLO, codegen text, cost analysis and memory statistics, so
    `xla_program.analyse_hlo` re-reads it under the current model; a replay as the replay's result objects.
    """

    def __init__(self, folder: Path | None):
        self.folder = Path(folder) if folder is not None else None
        self.versions = _versions()
        self.rebuild_code = _source_fingerprint(*_rebuild_code())
        self.replay_code = _source_fingerprint(*program_replay.REPLAY_MODULES)
        self.hits = self.misses = 0
        self._lock = threading.Lock()
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)

    def key(self, what: str, measurement: Measurement) -> str:
        parts = [what, self.versions, self.rebuild_code, measurement.identity]
        if what == "replay":
            parts.append(self.replay_code)
        return f"{what}-{hashlib.sha256('|'.join(parts).encode()).hexdigest()[:32]}"

    def get(self, key: str):
        if self.folder is None:
            return None
        path = self.folder / f"{key}.pkl"
        with self._lock:
            if not path.is_file():
                self.misses += 1
                return None
            self.hits += 1
        return pickle.loads(path.read_bytes())

    def put(self, key: str, value):
        if self.folder is not None:
            path = self.folder / f"{key}.pkl"
            staging = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            staging.write_bytes(pickle.dumps(value))
            staging.replace(path)
        return value


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


def compile_text(lowered) -> CompiledText:
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
    """The constants the model is priced with (fitted by benchmarks/calibration_fit.py)."""

    grid_step_s: float | None = None  # None: the calibrated value of the entry's generation
    ragged_dot_step_s: float | None = None
    vector_elements_per_cycle: float = chip_constants.VECTOR_ELEMENTS_PER_CYCLE
    transcendental_elements_per_cycle: float = chip_constants.TRANSCENDENTAL_ELEMENTS_PER_CYCLE
    mxu_weight_load_fraction: float = chip_constants.MXU_WEIGHT_LOAD_FRACTION
    hbm_fraction: float = 1.0


@dataclasses.dataclass(frozen=True)
class Analysed:
    """A measurement's compiled program and grid replay (or why there is none), ready to be priced."""

    measurement: Measurement
    program: xla_program.CompiledProgram | None
    replay: ProgramReplay | None
    reason: str | None = None

    def price(self, constants: ModelConstants = ModelConstants()) -> xla_program.ProgramTime:
        with _module_constants(constants):
            return xla_program.model_program(
                self.program, self.replay.pallas_calls, ragged_dots=self.replay.ragged_dots,
                step_overhead_s=constants.grid_step_s, ragged_dot_step_s=constants.ragged_dot_step_s,
                hbm_fraction=constants.hbm_fraction,
            )


_RATES_LOCK = threading.Lock()


# The rates in `chip` that `ModelConstants` overrides for one pricing.
_CHIP_CONSTANTS = {
    "vector_elements_per_cycle": "VECTOR_ELEMENTS_PER_CYCLE",
    "transcendental_elements_per_cycle": "TRANSCENDENTAL_ELEMENTS_PER_CYCLE",
    "mxu_weight_load_fraction": "MXU_WEIGHT_LOAD_FRACTION",
}


@contextlib.contextmanager
def _module_constants(constants: ModelConstants):
    """The rates in `chip` set to `constants`' for one pricing."""
    with _RATES_LOCK:
        saved = {name: getattr(chip_constants, name) for name in _CHIP_CONSTANTS.values()}
        for field, name in _CHIP_CONSTANTS.items():
            setattr(chip_constants, name, getattr(constants, field))
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(chip_constants, name, value)


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


def _submit_compile(pool, cache: AnalysisCache, measurement: Measurement, rebuilt: Rebuilt):
    key = cache.key("compile", measurement)
    found = cache.get(key)
    if found is not None:
        return _done(found)
    try:
        # The kernels' time is the replay's; the compile is for the XLA program around them.
        lowered = xla_program.lower_program(rebuilt.fn, rebuilt.avals, measurement.chip, kernel_bodies=False)
    except Exception as error:  # noqa: BLE001
        return _done(f"lowering failed: {_first_line(error)}")

    def compile_and_store():
        try:
            return cache.put(key, compile_text(lowered))
        except Exception as error:  # noqa: BLE001 - e.g. a config the compiler refuses for this chip
            return f"compile failed: {_first_line(error)}"

    return pool.submit(compile_and_store)


def _done(value) -> concurrent.futures.Future:
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
        "terms_us": {
            "kernels": round(1e6 * kernels.pipelined_time_s, 2) if kernels else 0.0,
            "kernels_hbm": round(1e6 * kernels.hbm_bound_s, 2) if kernels else 0.0,
            "kernels_mxu": round(1e6 * kernels.compute_bound_s, 2) if kernels else 0.0,
            "kernel_steps": kernels.steps if kernels else 0,
            "xla_ragged_dot": round(1e6 * program.ragged_dot_s, 2),
            "xla_ops": round(1e6 * program.xla_s, 2),
            "xla_op_count": program.xla_ops,
        },
    }


def summarize(records: Sequence[dict]) -> dict:
    """Per chip and kind (and split): count, median and 90th percentile of |ratio - 1|, and the worst entry."""
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
        summary.setdefault(chip, {})[kind] = block
    return summary


def _error_stats(records: Sequence[dict]) -> dict:
    errors = sorted(abs(r["ratio"] - 1) for r in records)
    worst = max(records, key=lambda r: abs(r["ratio"] - 1))
    return {
        "count": len(records),
        "median_abs_error": round(statistics.median(errors), 4),
        "p90_abs_error": round(float(np.percentile(errors, 90)), 4),
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
    peak = generation.bf16_flops_per_s * generation.cores_per_device
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
        "what": "the performance model (tpu_kernels.perf + xla_program) against tokamax's measured device times; "
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


def write_report(report: dict, out: Path) -> None:
    """One entry per line: reruns rewrite only what changed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = ["{"]
    keys = list(report)
    for index, key in enumerate(keys):
        comma = "," if index < len(keys) - 1 else ""
        value = report[key]
        if key in ("entries", "skipped"):
            items = [json.dumps(item, sort_keys=True) for item in value]
            body = ",\n".join(f"  {item}" for item in items)
            lines.append(f'"{key}": [\n{body}\n]{comma}' if items else f'"{key}": []{comma}')
        else:
            lines.append(f'"{key}": {json.dumps(value, indent=1, sort_keys=True)}{comma}')
    lines.append("}")
    out.write_text("\n".join(lines) + "\n")


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
