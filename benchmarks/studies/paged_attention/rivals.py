"""The rivals, replayed and priced like ours: jax's Pallas `paged_attention` (decode only) and vLLM tpu-inference's
ragged paged attention v3 (RPA v3), loaded from the pinned wheel the way `moe_layer.vllm_kernels` loads its gmm.

A rival that cannot run a shape (an option it lacks) or that the model cannot replay gets a row with the reason.
"""

from __future__ import annotations

import sys
import types
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import perf
from benchmarks.studies.moe_layer import vllm_kernels

from benchmarks.studies.relayouts import relayouts

from .pricing import price, terms
from .shapes import GENERATIONS, Batch, Model

DTYPE = jnp.bfloat16
# jax's paged_attention: tokens per compute block tried (pages_per_compute_block = tokens / page size).
JAX_BLOCK_TOKENS = (512, 1024, 2048)
_V3 = "tpu_inference.kernels.ragged_paged_attention.v3"
# Per RPA v3 kernel (vLLM runs the head_dim 64 one for head_dim 64), its modules in import order.
RPA_MODULES = {"kernel": (f"{_V3}.util", f"{_V3}.kernel"),
               "kernel_hd64": (f"{_V3}.util", f"{_V3}.tuned_block_sizes_hd64", f"{_V3}.kernel_hd64")}
RPA_PACKAGES = ("tpu_inference", "tpu_inference.kernels", "tpu_inference.kernels.ragged_paged_attention", _V3)
# What tpu_inference.utils.get_device_name says on each generation (the hd64 kernel's tuned table is keyed by it).
DEVICE_NAMES = {"v5e": "TPU v5e", "v6e": "TPU v6e", "tpu7x": "TPU v7"}
TPU_VERSION = {"v5e": 5, "v6e": 6, "tpu7x": 7}
VMEM_BYTES = {"v5e": 128 << 20, "v6e": 128 << 20, "tpu7x": 64 << 20}


def _tables(batch: Batch, page_size: int):
    seqs = len(batch.q_lens)
    pages_per_seq = -(-max(batch.kv_lens) // page_size)
    table = np.arange(seqs * pages_per_seq, dtype=np.int32).reshape(seqs, pages_per_seq)
    return seqs * pages_per_seq, pages_per_seq, table


def jax_paged_attention(batch: Batch, model: Model, page_size: int) -> dict:
    """jax's kernel at the fastest modelled pages_per_compute_block, per generation."""
    if batch.kind != "decode":
        return {"error": "decode only (one query per sequence)"}
    if model.sliding_window is not None or model.sinks:
        return {"error": "no sliding window and no attention sinks"}
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    q = jax.ShapeDtypeStruct((len(batch.q_lens), model.q_heads, model.head_dim), DTYPE)
    lengths = np.asarray(batch.kv_lens, np.int32)
    tried, errors = {}, {}
    for tokens in JAX_BLOCK_TOKENS:
        per_block = max(1, tokens // page_size)
        # Its page table's width must be a multiple of the block's pages: padded with pages of their own.
        _, pages_per_seq, _ = _tables(batch, page_size)
        pages_per_seq = -(-pages_per_seq // per_block) * per_block
        num_pages = len(batch.q_lens) * pages_per_seq
        table = np.arange(num_pages, dtype=np.int32).reshape(len(batch.q_lens), pages_per_seq)
        pages = jax.ShapeDtypeStruct((model.kv_heads, num_pages, page_size, model.head_dim), DTYPE)

        def attend(q, k, v, lengths, table, per_block=per_block):
            return paged_attention(q, k, v, lengths, table, pages_per_compute_block=per_block)

        try:
            tried[per_block] = (perf.model_pallas_traffic(attend, q, pages, pages, lengths, table), attend,
                                (q, pages, pages, lengths, table))
        except Exception as error:  # noqa: BLE001 - recorded per configuration
            errors[per_block] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    if not tried:
        return {"error": "; ".join(f"pages_per_compute_block={k}: {v}" for k, v in errors.items())}
    out = {}
    for generation in GENERATIONS:
        priced = {k: price(calls, batch, model, generation, relayouts(attend, inputs, generation),
                           charge_relayout=False)
                  for k, (calls, attend, inputs) in tried.items()}
        best = min(priced, key=lambda k: priced[k]["modelled_time_us"])
        out[generation] = {"config": {"pages_per_compute_block": best}, **priced[best],
                           **terms(tried[best][0], generation)}
    return {"per_generation": out, "configs_tried": sorted(tried), "config_errors": errors}


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
    return sys.modules[names[-1]]


def _set_generation(generation: str, modules) -> None:
    """RPA asks the device for its TPU version and name: answer for `generation` instead."""
    version = TPU_VERSION[generation]
    for module in modules:
        if hasattr(module, "get_tpu_version"):
            module.get_tpu_version = lambda version=version: version
    sys.modules["tpu_inference.utils"].generation = generation


def rpa_v3(batch: Batch, model: Model, page_size: int, folder: Path) -> dict:
    """RPA v3 as vLLM's attention_interface calls it: for head_dim 64 its kernel_hd64 (sinks supported) at its tuned
    table's block sizes, else its kernel at `get_default_block_sizes` (vLLM passes none unless RPA_V3_*_BLOCK_SIZES
    is set); without the cache update, which our kernel does not do either (update_kv_cache=False)."""
    hd64 = model.head_dim == 64
    if model.sinks and not hd64:
        return {"error": "no attention sinks (only RPA v3's head_dim 64 kernel takes them)"}
    try:
        rpa = load_rpa_v3(folder, "kernel_hd64" if hd64 else "kernel")
    except Exception as error:  # noqa: BLE001
        return {"error": f"loading from the wheel: {type(error).__name__}: {error}"}
    # RPA orders decode-only sequences first, then the mixed ones; bytes and work do not depend on the order.
    order = sorted(range(len(batch.q_lens)), key=lambda s: batch.q_lens[s] != 1)
    q_lens = [batch.q_lens[s] for s in order]
    kv_lens = np.asarray([batch.kv_lens[s] for s in order], np.int32)
    decode = sum(1 for n in q_lens if n == 1)
    num_pages, pages_per_seq, table = _tables(batch, page_size)
    cache = jax.ShapeDtypeStruct(rpa.get_kv_cache_shape(num_pages, page_size, model.kv_heads, model.head_dim, DTYPE),
                                 DTYPE)
    q = jax.ShapeDtypeStruct((batch.total_q, model.q_heads, model.head_dim), DTYPE)
    kv = jax.ShapeDtypeStruct((batch.total_q, model.kv_heads, model.head_dim), DTYPE)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    distribution = np.asarray([decode, decode, len(q_lens)], np.int32)
    args = [q, kv, kv, cache, kv_lens, table.reshape(-1), cu, distribution]
    if model.sinks:
        args.append(jax.ShapeDtypeStruct((model.q_heads,), jnp.float32))
    modules = [sys.modules[name] for name in RPA_MODULES["kernel_hd64" if hd64 else "kernel"]]
    out, replays = {}, {}
    for generation in GENERATIONS:
        _set_generation(generation, modules)
        if hd64:
            sizes = dict(zip(("num_kv_pages_per_block", "num_queries_per_block"), modules[1].get_tuned_block_sizes(
                DTYPE, DTYPE, model.q_heads, model.kv_heads, model.head_dim, page_size, batch.total_q,
                pages_per_seq, model.sliding_window)))
        else:
            case = rpa.RpaCase.DECODE if batch.kind == "decode" else rpa.RpaCase.MIXED
            sizes = rpa.get_default_block_sizes(DTYPE, DTYPE, model.q_heads, model.kv_heads, model.head_dim,
                                                page_size, batch.total_q, len(q_lens), pages_per_seq, case=case)

        def attend(*arrays, generation=generation):
            options = dict(sm_scale=model.head_dim**-0.5, sliding_window=model.sliding_window,
                           vmem_limit_bytes=VMEM_BYTES[generation])
            if hd64:
                return rpa.ragged_paged_attention_hd64(*arrays[:8], attention_sink=arrays[8] if model.sinks else None,
                                                       **options, **sizes)
            return rpa.ragged_paged_attention(*arrays, update_kv_cache=False, **options)

        key = (TPU_VERSION[generation], tuple(sizes.values()))
        try:
            if key not in replays:
                replays[key] = perf.model_pallas_traffic(attend, *args)
            calls = replays[key]
            refused = [note for call in calls for note in call.notes if "could not be replayed" in note]
            if refused:
                raise ValueError("; ".join(refused))
            priced = price(calls, batch, model, generation, relayouts(attend, args, generation),
                           charge_relayout=False)
            if priced["bytes_ratio"] < 1:
                # Fewer bytes than the K/V rows it must read: some of its copies escape the replay.
                raise ValueError(f"the replay counts {priced['bytes_ratio']:.2f}x the minimum bytes: some of its "
                                 "copies are not counted")
            out[generation] = {"config": sizes, "kernel": "kernel_hd64" if hd64 else "kernel", **priced,
                               **terms(calls, generation)}
        except Exception as error:  # noqa: BLE001 - recorded per generation
            out[generation] = {"config": sizes, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    return {"per_generation": out}
