"""vLLM tpu-inference's ragged paged attention v3 (RPA v3), loaded from the pinned wheel the way
`moe_layer.vllm_kernels` loads its gmm, priced at its fastest modelled block sizes that fit VMEM, beside vLLM's
default (what vLLM runs).

vLLM's attention_interface runs `kernel_hd64` for head_dim 64 (the only one that takes attention sinks), at its tuned
table's (num_kv_pages_per_block, num_queries_per_block), and `kernel` otherwise, at `get_default_block_sizes` per
case (vLLM passes none unless RPA_V3_*_BLOCK_SIZES is set): (bq_sz, bkv_sz, bq_csz, bkv_csz) for its decode call and
for its mixed call. The search walks those parameters one at a time from vLLM's default (coordinate descent, the
`search_axes`, until a round changes nothing or after SEARCH_ROUNDS), keeping only configurations whose VMEM fits the generation by the
model's own check (`perf.roofline(...).fits_vmem` at the limit vLLM asks for, VMEM_BYTES). Candidates are replayed at
one TPU version (SEARCH_VERSION: the kernels differ by version only in an output's memory space and a mask's integer
width), every generation's search from the first generation's default (so that they share replays), the generation's
own default kept if faster; each generation's chosen configuration and vLLM's default are then replayed at
REPLAY_VERSION.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from benchmarks import perf
from benchmarks.studies.moe_layer import vllm_kernels
from benchmarks.studies.relayouts import relayouts

from .pricing import price, terms
from .shapes import GENERATIONS, Batch, Model, minimum_bytes

DTYPE = jnp.bfloat16
_V3 = "tpu_inference.kernels.ragged_paged_attention.v3"
# Per RPA v3 kernel, its modules in import order.
RPA_MODULES = {"kernel": (f"{_V3}.util", f"{_V3}.kernel"),
               "kernel_hd64": (f"{_V3}.util", f"{_V3}.tuned_block_sizes_hd64", f"{_V3}.kernel_hd64")}
RPA_PACKAGES = ("tpu_inference", "tpu_inference.kernels", "tpu_inference.kernels.ragged_paged_attention", _V3)
# What tpu_inference.utils.get_device_name says on each generation (the hd64 kernel's tuned table is keyed by it).
DEVICE_NAMES = {"v5e": "TPU v5e", "v6e": "TPU v6e", "tpu7x": "TPU v7"}
TPU_VERSION = {"v5e": 5, "v6e": 6, "tpu7x": 7}
# The version each generation's rows are replayed at: v5e's at 6, where the kernel differs only in its masks' integer
# width (int16 from v6, int32 on v5e): the model prices a decode call alike, a mixed call's masks slightly apart
# (Qwen3-30B-A3B's mixed batch at vLLM's default: 1197.1 us replayed at 6 against 1191.9 at 5 on v5e).
REPLAY_VERSION = {"v5e": 6, "v6e": 6, "tpu7x": 7}
ENTRY_POINTS = ("ragged_paged_attention", "ragged_paged_attention_hd64")
# The VMEM limit vLLM's kernel asks for when given none (`pltpu.get_tpu_info().vmem_capacity_bytes`).
VMEM_BYTES = {"v5e": 128 << 20, "v6e": 128 << 20, "tpu7x": 64 << 20}
SEARCH_VERSION = 6
# The searched values (`search_axes`): keys per K/V block (whole pages), query tokens per block (the mixed call), each
# computed in 1 or 2 slices (CSZ_SPLITS); the decode call computes a block whole, as vLLM's default does (the model
# prices a decode block's slices alike: 0.01 % apart on Qwen3's 4096-token decode); K/V pages and queries per block
# (kernel_hd64).
KV_TOKENS = tuple(128 << k for k in range(7))  # 128 .. 8192
CSZ_SPLITS = (1, 2)
DECODE_CSZ_SPLITS = (1,)
Q_TOKENS = (32, 64, 128, 256, 512)
HD64_PAGES = (1, 2, 4, 8, 16, 32, 64)
HD64_QUERIES = (8, 16, 32, 64, 128)
SEARCH_ROUNDS = 2
# jax 0.10.2 names the approximate reciprocal `pl.reciprocal`; kernel_hd64, written for the wheel's jax 0.11.2,
# calls `pltpu.reciprocal`. Both bind the one Mosaic op (tpu.reciprocal); the stand-in names one for the other.
RECIPROCAL_STAND_IN = ("jax 0.10.2 has no pltpu.reciprocal (kernel_hd64.py calls pltpu.reciprocal(l, approx=True); "
                       "the wheel pins jax 0.11.2): pl.reciprocal, the same Mosaic op, stands in for it")


class _StandInLogger(vllm_kernels._StandInLogger):
    def info_once(self, message: str, *args) -> None:
        self.info(message, *args)


def _stand_ins() -> None:
    """The stand-in parent packages, logger and device-name helper the RPA modules import."""
    for name in RPA_PACKAGES:
        package = types.ModuleType(name)
        package.__path__ = []
        package._stand_in = True
        sys.modules.setdefault(name, package)
    logger = sys.modules.setdefault("tpu_inference.logger", types.ModuleType("tpu_inference.logger"))
    logger.init_logger = _StandInLogger
    utils = sys.modules.setdefault("tpu_inference.utils", types.ModuleType("tpu_inference.utils"))
    utils.get_device_name = lambda num_devices=None: DEVICE_NAMES[utils.generation]
    utils.generation = "v6e"


def _pltpu_with_reciprocal() -> types.ModuleType:
    namespace = types.ModuleType(pltpu.__name__)
    namespace.__dict__.update(vars(pltpu))
    namespace.reciprocal = pl.reciprocal
    return namespace


def load_rpa_v3(folder: Path, kernel: str = "kernel"):
    """An RPA v3 kernel module from the pinned wheel (hash-checked), its modules run under their own names."""
    names = RPA_MODULES[kernel]
    if names[-1] in sys.modules:
        return sys.modules[names[-1]]
    if "tpu_inference" in sys.modules and not hasattr(sys.modules["tpu_inference"], "_stand_in"):
        raise RuntimeError("a real tpu_inference package is imported: RPA v3 is loaded from its wheel only")
    with zipfile.ZipFile(vllm_kernels.wheel(folder)) as archive:
        sources = {name: archive.read(name.replace(".", "/") + ".py").decode() for name in names}
    _stand_ins()
    for name in names:
        if name in sys.modules:
            continue
        module = types.ModuleType(name)
        module.__file__ = f"{vllm_kernels.WHEEL_NAME}/{name.replace('.', '/')}.py"
        sys.modules[name] = module
        exec(compile(sources[name], module.__file__, "exec"), module.__dict__)  # noqa: S102 - the pinned wheel
        if "pltpu" in module.__dict__ and not hasattr(pltpu, "reciprocal"):
            module.pltpu = _pltpu_with_reciprocal()
    return sys.modules[names[-1]]


def _set_generation(version: int, generation: str, modules) -> None:
    """RPA asks the device for its TPU version and name: answer `version` and `generation`'s name instead. Its entry
    points are jitted and ask while tracing, so their traces for another answer are dropped."""
    for module in modules:
        if hasattr(module, "get_tpu_version"):
            module.get_tpu_version = lambda version=version: version
        for entry in ENTRY_POINTS:
            if hasattr(module, entry):
                getattr(module, entry).clear_cache()
    sys.modules["tpu_inference.utils"].generation = generation


@dataclasses.dataclass(frozen=True)
class _Call:
    """One batch's RPA v3 call: the kernel module, its arguments and what the block sizes are bounded by."""

    rpa: types.ModuleType
    modules: tuple
    args: list
    hd64: bool
    page_size: int
    max_kv: int
    max_q: int
    total_q: int
    pages_per_seq: int
    mixed: bool

    def attend(self, model: Model, config: dict, generation: str):
        def attend(*arrays):
            options = dict(sm_scale=model.head_dim**-0.5, sliding_window=model.sliding_window,
                           vmem_limit_bytes=VMEM_BYTES[generation])
            if self.hd64:
                return self.rpa.ragged_paged_attention_hd64(
                    *arrays[:8], attention_sink=arrays[8] if model.sinks else None, **options, **config)
            return self.rpa.ragged_paged_attention(*arrays, update_kv_cache=False, **options,
                                                   **{key: tuple(value) for key, value in config.items()})

        return attend


def _call(batch: Batch, model: Model, page_size: int, folder: Path) -> _Call:
    hd64 = model.head_dim == 64
    kernel = "kernel_hd64" if hd64 else "kernel"
    rpa = load_rpa_v3(folder, kernel)
    # RPA orders decode-only sequences first, then the mixed ones; bytes and work do not depend on the order.
    order = sorted(range(len(batch.q_lens)), key=lambda s: batch.q_lens[s] != 1)
    q_lens = [batch.q_lens[s] for s in order]
    kv_lens = np.asarray([batch.kv_lens[s] for s in order], np.int32)
    decode = sum(1 for n in q_lens if n == 1)
    seqs, pages_per_seq = len(q_lens), -(-max(batch.kv_lens) // page_size)
    table = np.arange(seqs * pages_per_seq, dtype=np.int32)
    cache = jax.ShapeDtypeStruct(rpa.get_kv_cache_shape(seqs * pages_per_seq, page_size, model.kv_heads,
                                                        model.head_dim, DTYPE), DTYPE)
    q = jax.ShapeDtypeStruct((batch.total_q, model.q_heads, model.head_dim), DTYPE)
    kv = jax.ShapeDtypeStruct((batch.total_q, model.kv_heads, model.head_dim), DTYPE)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    args = [q, kv, kv, cache, kv_lens, table, cu, np.asarray([decode, decode, seqs], np.int32)]
    if model.sinks:
        args.append(jax.ShapeDtypeStruct((model.q_heads,), jnp.float32))
    return _Call(rpa, tuple(sys.modules[name] for name in RPA_MODULES[kernel]), args, hd64, page_size,
                 pages_per_seq * page_size, max(q_lens), batch.total_q, pages_per_seq, decode < seqs)


def vllm_default(call: _Call, model: Model, generation: str) -> dict:
    """The block sizes vLLM runs on `generation`: kernel_hd64's tuned table, or kernel's default formula per case."""
    _set_generation(TPU_VERSION[generation], generation, call.modules)
    if call.hd64:
        return dict(zip(("num_kv_pages_per_block", "num_queries_per_block"), call.modules[1].get_tuned_block_sizes(
            DTYPE, DTYPE, model.q_heads, model.kv_heads, model.head_dim, call.page_size, call.total_q,
            call.pages_per_seq, model.sliding_window)))
    sizes = {}
    for key, case in (("d_block_sizes", call.rpa.RpaCase.DECODE), ("m_block_sizes", call.rpa.RpaCase.MIXED)):
        found = call.rpa.get_default_block_sizes(DTYPE, DTYPE, model.q_heads, model.kv_heads, model.head_dim,
                                                 call.page_size, call.total_q, len(call.args[4]),
                                                 call.pages_per_seq, case=case)
        sizes[key] = [found["bq_sz"], found["bkv_sz"], found["bq_csz"], found["bkv_csz"]]
    return sizes


def search_axes(call: _Call) -> dict[tuple[str, tuple[int, ...]], list[tuple[int, ...]]]:
    """Per parameter group ((kwarg, the positions it sets in its 4-tuple), or (kwarg, ()) for kernel_hd64's), the
    values tried. A block size and its compute slice move together (a slice divides its block): every block size
    with each of its call's splits into slices."""
    if call.hd64:
        return {("num_kv_pages_per_block", ()): [p for p in HD64_PAGES if p <= call.pages_per_seq],
                ("num_queries_per_block", ()): [q for q in HD64_QUERIES if q <= call.total_q]}
    kv_limit = -(-call.max_kv // call.page_size) * call.page_size
    def kv(splits):
        return [(t, t // split) for t in KV_TOKENS if t % call.page_size == 0 and t <= kv_limit
                for split in splits if (t // split) % call.page_size == 0] or [(call.page_size, call.page_size)]

    axes = {("d_block_sizes", (1, 3)): kv(DECODE_CSZ_SPLITS)}
    if call.mixed:  # the mixed call runs only where a sequence has more than one query
        q = [(t, t // split) for t in Q_TOKENS if t <= call.max_q for split in CSZ_SPLITS]
        axes.update({("m_block_sizes", (0, 2)): q, ("m_block_sizes", (1, 3)): kv(CSZ_SPLITS)})
    return axes


def _with(config: dict, axis: tuple[str, tuple[int, ...]], value) -> dict:
    key, positions = axis
    if not positions:
        return {**config, key: value}
    sizes = list(config[key])
    for position, size in zip(positions, value):
        sizes[position] = size
    return {**config, key: sizes}


def _key(config: dict) -> tuple:
    return tuple((key, tuple(value) if isinstance(value, list) else value) for key, value in sorted(config.items()))


class _Replays:
    """Replays of one call by (TPU version, configuration), each once; a replay that fails is kept as its error."""

    def __init__(self, call: _Call, model: Model):
        self.call, self.model, self.found = call, model, {}

    def get(self, config: dict, version: int, generation: str):
        key = (version, _key(config))
        if key not in self.found:
            _set_generation(version, generation, self.call.modules)
            try:
                calls = perf.model_pallas_traffic(self.call.attend(self.model, config, generation), *self.call.args)
                refused = [note for c in calls for note in c.notes if "could not be replayed" in note]
                self.found[key] = ValueError("; ".join(refused)) if refused else calls
            except Exception as error:  # noqa: BLE001 - a configuration the kernel or the model refuses
                self.found[key] = error
        return self.found[key]


def _fitting_time_s(calls, batch: Batch, model: Model, generation: str) -> float:
    """The modelled time on `generation` at vLLM's VMEM limit there; infinite if the model says it does not fit."""
    if isinstance(calls, Exception):
        return math.inf
    at_limit = [dataclasses.replace(c, vmem_limit_bytes=VMEM_BYTES[generation]) for c in calls]
    modelled = perf.roofline(at_limit, generation, min_bytes=minimum_bytes(batch, model))
    return modelled.pipelined_time_s if modelled.fits_vmem else math.inf


def runnable(call: _Call, config: dict) -> dict:
    """`config` as the kernel runs it: its query compute slice no longer than its query block (what the kernel
    computes with when it picks the sizes itself, and what its check of given sizes requires)."""
    if call.hd64:
        return config
    return {key: [bq, bkv, min(bq_c, bq), bkv_c] for key, (bq, bkv, bq_c, bkv_c) in config.items()}


def search(call: _Call, replays: _Replays, batch: Batch, model: Model, generation: str, start: dict) -> dict:
    """The fastest modelled configuration that fits on `generation`, by coordinate descent from `start`."""
    def time_s(config):
        return _fitting_time_s(replays.get(config, SEARCH_VERSION, generation), batch, model, generation)

    axes = search_axes(call)
    best, best_s = start, time_s(start)
    if best_s == math.inf:  # one parameter at a time cannot leave a start that overflows in two: the smallest can
        smallest = start
        for axis, values in axes.items():
            smallest = _with(smallest, axis, values[0])
        best, best_s = min(((best, best_s), (smallest, time_s(smallest))), key=lambda found: found[1])
    for _ in range(SEARCH_ROUNDS):
        moved = False
        for axis, values in axes.items():
            for value in values:
                candidate = _with(best, axis, value)
                if time_s(candidate) < best_s:
                    best, best_s, moved = candidate, time_s(candidate), True
        if not moved:
            break
    return best


def _priced(calls, batch: Batch, model: Model, generation: str, relayout) -> dict:
    if isinstance(calls, Exception):
        return {"error": f"{type(calls).__name__}: {str(calls).splitlines()[0][:300]}"}
    calls = [dataclasses.replace(c, vmem_limit_bytes=VMEM_BYTES[generation]) for c in calls]
    priced = price(calls, batch, model, generation, relayout, charge_relayout=False)
    if priced["bytes_ratio"] < 1:
        # Fewer bytes than the K/V rows it must read: some of its copies escape the replay.
        return {"error": f"the replay counts {priced['bytes_ratio']:.2f}x the minimum bytes: some of its copies "
                         "are not counted"}
    return {**priced, **terms(calls, generation)}


def rpa_v3(batch: Batch, model: Model, page_size: int, folder: Path) -> dict:
    """Per generation: RPA v3 at its fastest modelled configuration that fits VMEM (`search`), with vLLM's default
    beside it (`vllm_default`: its time, or why it is not priced); without the cache update where the kernel can
    skip it (`kernel`: update_kv_cache=False, as ours does none; kernel_hd64 always writes the new rows)."""
    hd64 = model.head_dim == 64
    if model.sinks and not hd64:
        return {"error": "no attention sinks (only RPA v3's head_dim 64 kernel takes them)"}
    try:
        call = _call(batch, model, page_size, folder)
    except Exception as error:  # noqa: BLE001
        return {"error": f"loading from the wheel: {type(error).__name__}: {error}"}
    replays = _Replays(call, model)
    shared_start = runnable(call, vllm_default(call, model, GENERATIONS[0]))
    out = {}
    for generation in GENERATIONS:
        default = vllm_default(call, model, generation)
        best = min((search(call, replays, batch, model, generation, shared_start), runnable(call, default)),
                   key=lambda config: _fitting_time_s(replays.get(config, SEARCH_VERSION, generation), batch, model,
                                                      generation))
        version = REPLAY_VERSION[generation]
        rows = {"best": {"config": best, **_priced(
            replays.get(best, version, generation), batch, model, generation,
            relayouts(call.attend(model, best, generation), call.args, generation))}}
        # vLLM's default: its time only (the relayout a rival would need is recorded once, on its best row).
        rows["default"] = {"config": default, **_priced(replays.get(runnable(call, default), version, generation),
                                                        batch, model, generation, None)}
        for found in rows.values():
            if not found.get("fits_vmem", True):
                found["error"] = "does not fit VMEM by the model (no searched configuration does)"
        out[generation] = {
            **({"config": best, "error": rows["best"]["error"]} if "error" in rows["best"] else rows["best"]),
            "kernel": "kernel_hd64" if hd64 else "kernel",
            "vllm_default": {key: rows["default"][key] for key in ("config", "modelled_time_us", "fits_vmem", "error")
                             if key in rows["default"]},
        }
        if hd64 and not hasattr(pltpu, "reciprocal"):
            out[generation]["adapted"] = RECIPROCAL_STAND_IN
    return {"per_generation": out, "configs_replayed": len(replays.found),
            "search": {"axes": {f"{key}{list(positions)}" if positions else key: values
                                for (key, positions), values in search_axes(call).items()},
                       "method": "coordinate descent from vLLM's default, fitting configurations only"}}
