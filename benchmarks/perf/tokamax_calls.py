"""tokamax's timed calls: read from its autotuning files, and rebuilt as the JAX programs it timed.

tokamax ships device times measured on TPUs (`tokamax/data/autotuning/<chip>/<op>.json`,
xprof device time, five runs per config). Each entry's key is the exact call
(shapes, dtypes, dimension numbers, group sizes, flags) and its value maps each
config tried to its times; each timed config is a `Measurement`. `rebuild`
makes the program tokamax timed (the op's own `_fwd` at that config: Pallas
ragged dot, XLA's `lax.ragged_dot` with its f32 accumulation and cast, flash
attention and its vjp).

Reading the files:
- the chip comes from the folder name (CHIP_FOLDERS) or is given;
- group sizes given as `{num_groups, total_size}` expand as tokamax expands
  them (`generate_group_sizes` at its default seed);
- tokamax 0.0.12's `tpu7x/ragged_dot.json` holds keys whose group sizes object
  is not escaped inside the key string (tokamax's own loader fails on it and
  logs the error); that one defect is repaired, any other unreadable file is
  an error (`CalibrationInputError`);
- an empty file holds no entry; an op with no rebuild here and an entry
  without timings are listed in `skipped` with the reason;
- a file that is not tokamax's shape is refused whole (`CalibrationInputError`,
  naming the file and entry; `python -m benchmarks calibrate` exits 2 with it): a key or
  config that is not a JSON object, configs or a result that are not objects,
  times that are not positive finite numbers, nesting too deep to parse, a
  negative or huge config value or array dimension, more than MAX_GROUPS groups;
- `precision` is read in both of tokamax's forms: per operand `lax.Precision`
  names (`["DEFAULT", "DEFAULT"]`) or a `DotAlgorithmPreset` name; for attention,
  one per dot, each a preset name or a pair of `lax.Precision` names (newer
  files) mapped to the preset tokamax picks on TPU. An entry whose precision is
  neither is skipped with the reason, as is any entry tokamax's own config
  refuses;
- a Pallas lhs-gradient entry timed by tokamax from 2026-07-14 on (openxla/
  tokamax e919cdc) names its tiles the other way round: that kernel reads
  `tile_n` as the contracting tile and `tile_k` as the output's, where
  tokamax 0.0.12 reads them as named. Such an entry's key carries
  `zero_initialize` (a call field tokamax added the same day, hours before);
  `timed_tiles` swaps the two back for an installed tokamax that reads them
  as named, so the rebuild runs the tiles that were timed (on tokamax's v5p
  files of 2026-07-21 the 25 lhs-gradient timings are then priced at 0.92 to
  1.20 of measured, where 13 were refused as faster than the chip's peak).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

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

# tokamax 0.0.12's tpu7x/ragged_dot.json: `\"group_sizes\":{"num_groups":256,"total_size":131072}` inside a key string.
_UNESCAPED_GROUP_SIZES = re.compile(r'(\\"group_sizes\\":)\{"num_groups":(\d+),"total_size":(\d+)\}')
_ARRAY_TYPE = re.compile(r"^(\w+)\[([\d,]*)\]$")
_DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32, "s32": jnp.int32, "bool": jnp.bool_,
           "s8": jnp.int8, "f8e4m3fn": jnp.float8_e4m3fn}


# Bounds on what a timing file may ask for (tokamax's own files: at most 524,288 groups and rows).
MAX_GROUPS = 1 << 20
MAX_DIMENSION = 1 << 24
MAX_CONFIG_VALUE = 1 << 24


# C0 and C1 control characters and DEL: a terminal acts on them (ESC starts a sequence that can write the
# clipboard, retitle the window or clear the screen; U+009B is a CSI of its own).
_CONTROL_CHARACTERS = re.compile("[\x00-\x1f\x7f-\x9f]")


def escaped(text: str) -> str:
    """`text` with every control character written as a Python escape (`\x1b`): safe to print."""
    return _CONTROL_CHARACTERS.sub(lambda found: repr(found.group())[1:-1], text)


class CalibrationInputError(ValueError):
    """A timing file that cannot be read (not JSON, even after the one known repair), or not in tokamax's shape.
    Its message quotes what a stranger's file holds, escaped (`escaped`)."""

    def __init__(self, message: str):
        super().__init__(escaped(message))


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
    except (OSError, UnicodeDecodeError) as error:
        raise CalibrationInputError(f"{path}: cannot read: {error}") from None
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except RecursionError:
        raise CalibrationInputError(f"{path}: not a tokamax autotuning file (nested too deep to read)") from None
    except ValueError as error:  # a JSON error, or an integer of more digits than Python converts
        repaired = _UNESCAPED_GROUP_SIZES.sub(r'\1{\\"num_groups\\":\2,\\"total_size\\":\3}', text)
        try:
            data = json.loads(repaired)
        except (ValueError, RecursionError):
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
            call, timed = _read_entry(path, kind, key_text, configs)
            if not timed:
                skipped.append({"file": str(path), "call": describe_call(kind, call), "reason": "no timing recorded"})
                continue
            for config, times in timed:
                measurements.append(Measurement(file_chip, kind, str(path), call, config, times))
    return measurements, skipped


def _read_entry(path: Path, kind: str, key_text: str, configs) -> tuple[dict, list[tuple[dict, tuple[float, ...]]]]:
    """One entry of a timing file: its call and its timed configs; CalibrationInputError if not tokamax's shape."""
    def refuse(problem: str):
        shown = key_text if len(key_text) <= 200 else key_text[:200] + "..."
        raise CalibrationInputError(f"{path}: entry {shown!r}: {problem}")

    call = _json_object(key_text, "its key", refuse)
    _check_call(kind, call, refuse)
    try:
        describe_call(kind, call)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
        refuse(f"its call lacks what a {kind} call holds ({type(error).__name__}: {error})")
    if configs is None:
        return call, []
    if not isinstance(configs, dict):
        refuse(f"its configs are a JSON {type(configs).__name__}, not an object of config -> result")
    timed = []
    for config_text, result in configs.items():
        config = _json_object(config_text, f"config {config_text[:80]!r}", refuse)
        for name, value in config.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not 0 <= value <= MAX_CONFIG_VALUE:
                refuse(f"config value {name} = {value} is outside 0..{MAX_CONFIG_VALUE}")
        if not isinstance(result, dict):
            refuse(f"the result of config {config_text[:80]!r} is a JSON {type(result).__name__}, not an object")
        times = result.get("evaluation_times_ms")
        if not times:
            continue
        if not isinstance(times, list) or not all(
                isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0 for t in times):
            refuse(f"evaluation_times_ms of config {config_text[:80]!r} is not a list of positive numbers: "
                   f"{str(times)[:80]}")
        timed.append((config, tuple(float(t) for t in times)))
    return call, timed


def _json_object(text: str, what: str, refuse) -> dict:
    try:
        value = json.loads(text)
    except ValueError as error:  # a JSON error, or an integer of more digits than Python converts
        refuse(f"{what} is not JSON ({str(error)[:200]})")
    except RecursionError:
        refuse(f"{what} is nested too deep to read")
    if not isinstance(value, dict):
        refuse(f"{what} is a JSON {type(value).__name__}, not an object")
    return value


def _check_call(kind: str, call: dict, refuse) -> None:
    """Array dimensions and group counts within bounds (a rebuild allocates the group sizes, a replay walks the grid)."""
    for name, value in call.items():
        if isinstance(value, str) and (match := _ARRAY_TYPE.match(value)):
            digits = [d for d in match.group(2).split(",") if d]
            if any(len(d) > 9 or int(d) > MAX_DIMENSION for d in digits):
                refuse(f"{name} {value[:80]} has a dimension over {MAX_DIMENSION}")
    sizes = call.get("group_sizes")
    if kind not in ("pallas_ragged_dot", "xla_ragged_dot") or sizes is None:
        return
    if isinstance(sizes, dict):
        groups, total = sizes.get("num_groups"), sizes.get("total_size")
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (groups, total)):
            refuse(f"group_sizes {str(sizes)[:80]} lacks integer num_groups and total_size")
        if not (1 <= groups <= MAX_GROUPS and 0 <= total <= MAX_DIMENSION):
            refuse(f"group_sizes asks for {groups} groups of {total} rows in all: at most {MAX_GROUPS} groups and "
                   f"{MAX_DIMENSION} rows")
    elif isinstance(sizes, list):
        if not 1 <= len(sizes) <= MAX_GROUPS:
            refuse(f"group_sizes lists {len(sizes)} groups: 1 to {MAX_GROUPS}")
        if not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_DIMENSION for n in sizes):
            refuse(f"group_sizes holds something other than group sizes 0..{MAX_DIMENSION}")
    else:
        refuse(f"group_sizes is a JSON {type(sizes).__name__}, not a list or {{num_groups, total_size}}")


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


def timed_tiles(measurement: Measurement) -> dict:
    """The config to rebuild a Pallas ragged dot entry with: its own, with `tile_k` and `tile_n` swapped for an
    lhs-gradient entry whose tokamax read them swapped while the installed one reads them as named (module
    docstring)."""
    import inspect

    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tokamax_pallas

    config = dict(measurement.config)
    dims = measurement.call["ragged_dot_dimension_numbers"]["dot_dimension_numbers"]
    if _RAGGED_MODES.get(_dims_key(dims)) != "dlhs" or "zero_initialize" not in measurement.call:
        return config
    installed_swaps = "tiling=(config.tile_m, config.tile_n, config.tile_k)" in inspect.getsource(tokamax_pallas)
    if not installed_swaps and "tile_k" in config and "tile_n" in config:
        config["tile_k"], config["tile_n"] = config["tile_n"], config["tile_k"]
    return config


def _rebuild_ragged_dot(measurement: Measurement) -> Rebuilt:
    from jax import lax
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
    precision = _ragged_dot_precision(call.get("precision"))
    preferred = call.get("preferred_element_type")
    preferred = jnp.dtype(preferred) if preferred else None
    return_residuals = bool(call.get("return_residuals"))
    if measurement.kind == "pallas_ragged_dot":
        op = tokamax_pallas.PallasMosaicTpuRaggedDot()
        config = tokamax_pallas.Config(**timed_tiles(measurement))
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
    dtypes = [array_type(call[name]).dtype for name in ("q", "k", "v")]
    return {
        "precision": _dot_algorithms(call.get("precision"), dtypes),
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


def _ragged_dot_precision(value):
    """tokamax's canonical precision of a ragged dot entry: None (DEFAULT), a pair of `lax.Precision` names,
    or one name (a `DotAlgorithmPreset` or a `lax.Precision`); NotRebuilt for anything else."""
    from jax import lax
    from tokamax._src import precision as precision_lib

    if value is None:
        value = ["DEFAULT", "DEFAULT"]
    if isinstance(value, list) and len(value) == 2 and all(isinstance(name, str) for name in value):
        if all(name in lax.Precision.__members__ for name in value):
            return precision_lib.canonicalize_precision(tuple(lax.Precision[name] for name in value))
    elif isinstance(value, str):
        try:
            return precision_lib.canonicalize_precision(value)
        except ValueError:
            pass
    raise NotRebuilt(f"precision {str(value)[:80]} is none of tokamax's forms (a pair of lax.Precision names, "
                     "or a DotAlgorithmPreset name)")


# The preset tokamax's attention picks on TPU for a dot given as a pair of equal `lax.Precision`s
# (`precision.to_dot_algorithm_preset` with TPU as the backend): bf16 operands always BF16_BF16_F32.
_TPU_PRESETS = {"DEFAULT": "BF16_BF16_F32", "HIGH": "BF16_BF16_F32_X3", "HIGHEST": "BF16_BF16_F32_X6"}


def _dot_algorithms(value, dtypes: Sequence) -> tuple:
    """The two dots' `DotAlgorithmPreset`s (q.k, then p.v) of an attention entry's precision: per dot a preset
    name, or (newer tokamax files) a pair of `lax.Precision` names; NotRebuilt for anything else."""
    from jax import lax

    q, k, v = dtypes
    if not isinstance(value, list) or len(value) != 2:
        raise NotRebuilt(f"precision {str(value)[:80]} is not one precision per dot (two)")
    presets = []
    for item, operands in zip(value, ((q, k), (v, v))):
        if isinstance(item, str) and item in lax.DotAlgorithmPreset.__members__:
            presets.append(lax.DotAlgorithmPreset[item])
        elif (isinstance(item, list) and len(item) == 2 and item[0] == item[1] and item[0] in _TPU_PRESETS
              and all(jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16, jnp.float32) for dtype in operands)):
            bf16 = jnp.result_type(*operands) == jnp.bfloat16
            presets.append(lax.DotAlgorithmPreset["BF16_BF16_F32" if bf16 else _TPU_PRESETS[item[0]]])
        else:
            raise NotRebuilt(f"precision {str(item)[:80]} is neither a DotAlgorithmPreset name nor a pair of equal "
                             "lax.Precision names on bf16, f16 or f32 operands")
    return tuple(presets)


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


# What decides the program a measurement compiles to, besides the lowering: a cache of compiles is keyed by
# their source.
REBUILD_FUNCTIONS = (rebuild, group_sizes_of, array_type, timed_tiles, _rebuild_ragged_dot, _ragged_dot_precision,
                     _attention_arguments, _dot_algorithms, _rebuild_flash_attention, _rebuild_flash_attention_vjp)
