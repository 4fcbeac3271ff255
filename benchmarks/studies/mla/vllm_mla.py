"""vLLM tpu-inference 0.32.0's MLA kernel (`kernels/mla/v2`: `mla_ragged_paged_attention`), loaded from the pinned,
hash-checked wheel the way `paged_attention.rpa_v3` loads RPA v3, priced at its fastest modelled block sizes that fit
VMEM, beside vLLM's default.

vLLM's MLA layer (`layers/common/attention_interface.py`, `mla_attention`) hands the kernel q_nope @ W_UK head-major
[H, T, L], q_rope [T, H, R], the new tokens' latent and rope keys, and a paged cache of L + R (each padded to 128
lanes) per token; the kernel writes the new tokens into the cache, transposes q and the output with Pallas
transpose kernels, and runs a batched-decode call (`decode_batch_size` sequences a step) for decode rows and a mixed
call for the rest. Its block sizes come from `tuned_params.get_tuned_params` (a table keyed by the call; no entry
holds a bf16 cache, so vLLM runs its defaults there: `vllm_default`). The search walks the decode call's KV pages per
block and decode batch, and the mixed call's KV pages and queries per block, one at a time from vLLM's default
(coordinate descent, SEARCH_ROUNDS rounds), keeping only configurations the model's VMEM check fits at vLLM's limit.
The kernel asks the device nothing, so one replay per configuration serves every generation.

The cache is bf16 on pages of PAGE_SIZE tokens (vLLM's MLA tables are keyed at 256 rows per packing word, fp8); its
R rope lanes are padded to 128 as vLLM stores them. The path adds the same two XLA matmuls ours has (vLLM computes
them as einsums around the kernel).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from benchmarks import perf
from benchmarks.studies.moe_layer import vllm_kernels

from .kernels import priced
from .shapes import Call, MlaModel, latent_cache_bytes

DTYPE = jnp.bfloat16
MODULES = ("tpu_inference.kernels.ragged_paged_attention.v3.util", "tpu_inference.kernels.mla.v2.kv_utils",
           "tpu_inference.kernels.mla.v2.transpose", "tpu_inference.kernels.mla.v2.tuned_params",
           "tpu_inference.kernels.mla.v2.kernel")
# tpu_inference.envs' defaults for what the kernel reads (its module imports vllm: a stand-in holds them).
ENVS = {"MLA_XPOSE_N_TILE_SIZE": 160, "MLA_TRANSPOSE_KV_CACHE": False}
PAGE_SIZE = 256
VMEM_LIMIT = 62914560  # what vLLM's tuned parameters ask for, on every generation
PAGES = (1, 2, 4, 8)
DECODE_BATCHES = (1, 2, 4, 8)
QUERIES = (16, 64, 256)
SEARCH_ROUNDS = 1
# Longer prefill chunks are not replayed: the scalar replay runs the mixed call's loop once per query block and KV
# block (at 8192 queries over 16384 keys, tens of thousands of iterations per configuration).
MAX_PREFILL_QUERIES = 1024
RECIPROCAL_STAND_IN = ("jax 0.10.2 has no pltpu.reciprocal (the kernel calls pltpu.reciprocal(l, approx=True); the "
                       "wheel pins jax 0.11.2): pl.reciprocal, the same Mosaic op, stands in for it")


def load(folder: Path) -> types.ModuleType:
    """The kernel module from the pinned wheel, under stand-in parent packages, logger and envs."""
    if MODULES[-1] not in sys.modules:
        envs = types.ModuleType("tpu_inference.envs")
        envs.__dict__.update(ENVS)
        sys.modules.setdefault("tpu_inference.envs", envs)
    module = vllm_kernels.load_modules(folder, MODULES)
    if not hasattr(pltpu, "reciprocal"):
        namespace = types.ModuleType(pltpu.__name__)
        namespace.__dict__.update(vars(pltpu))
        namespace.reciprocal = pl.reciprocal
        module.pltpu = namespace
    return module


@dataclasses.dataclass(frozen=True)
class Layout:
    """One call's arguments as vLLM hands them (abstract arrays; the small int32 ones concrete)."""

    args: tuple
    decode: bool
    pages_per_seq: int


def layout(kernel, model: MlaModel, call: Call) -> Layout:
    tokens, seqs = call.batch * call.q_len, call.batch
    pages_per_seq = -(-call.kv_len // PAGE_SIZE)
    lanes = -(-model.latent // 128) * 128 + -(-model.rope // 128) * 128
    cache = kernel.get_kv_cache_shape(seqs * pages_per_seq, PAGE_SIZE, lanes, DTYPE)
    decode = call.q_len == 1
    distribution = [seqs, seqs, seqs] if decode else [0, 0, seqs]

    def array(*shape):
        return jax.ShapeDtypeStruct(shape, DTYPE)

    args = (array(model.heads, tokens, model.latent), array(tokens, model.heads, model.rope),
            array(tokens, model.latent), array(tokens, model.rope), array(*cache),
            np.full(seqs, call.kv_len, np.int32), np.arange(seqs * pages_per_seq, dtype=np.int32),
            (np.arange(seqs + 1) * call.q_len).astype(np.int32), np.asarray(distribution, np.int32))
    return Layout(args, decode, pages_per_seq)


def vllm_default(kernel, model: MlaModel, call: Call, found: Layout) -> dict:
    """What vLLM's attention interface asks its tuned table for, per case (vLLM's own lookup)."""
    tuned = sys.modules["tpu_inference.kernels.mla.v2.tuned_params"]
    ql, q_rope, _, _, cache = found.args[:5]

    def lookup(case):
        return tuned.get_tuned_params(tuned.TuningKey(
            case=case, max_num_tokens=ql.shape[1], actual_num_q_heads=model.heads, actual_lkv_dim=model.latent,
            actual_r_dim=model.rope, kv_dtype=jnp.dtype(DTYPE).name, q_dtype=jnp.dtype(DTYPE).name,
            page_size_per_kv_packing=cache.shape[1], kv_packing=cache.shape[2], max_num_seqs=call.batch,
            pages_per_seq=found.pages_per_seq))

    decode, mixed = lookup("batched_decode"), lookup("mixed")
    return {"decode_pages": decode.num_kv_pages_per_block, "decode_batch_size": decode.decode_batch_size,
            "mixed_pages": mixed.num_kv_pages_per_block, "mixed_queries": mixed.num_queries_per_block,
            "mixed_q_split": mixed.q_split}


def search_axes(model: MlaModel, call: Call, found: Layout) -> dict[str, list[int]]:
    """The values tried per parameter: decode's pages per block and sequences per step (dividing the batch), or the
    mixed call's pages and queries per block."""
    pages = [p for p in PAGES if p <= found.pages_per_seq] or [1]
    if found.decode:
        return {"decode_pages": pages, "decode_batch_size": [b for b in DECODE_BATCHES if call.batch % b == 0]}
    return {"mixed_pages": pages, "mixed_queries": [q for q in QUERIES if q <= max(call.q_len, QUERIES[0])]}


def _attend(kernel, model: MlaModel, config: dict):
    def attend(*arrays):
        return kernel.mla_ragged_paged_attention(
            *arrays, sm_scale=model.key_dim ** -0.5, num_kv_pages_per_block=(
                config["decode_pages"], config["mixed_pages"], config["mixed_pages"]),
            num_queries_per_block=(1, config["mixed_queries"], config["mixed_queries"]),
            decode_batch_size=config["decode_batch_size"], mixed_q_split=config["mixed_q_split"],
            vmem_limit_bytes=VMEM_LIMIT)

    return attend


class VllmMla:
    """The rival of `measure.measure`: per (model, call) its replays by configuration, each once; per generation its
    search's best and vLLM's default, priced, with the two XLA matmuls of ours."""

    def __init__(self, wheels: Path):
        self.wheels, self.replays = wheels, {}

    def replay(self, kernel, model: MlaModel, call: Call, found: Layout, config: dict):
        key = (model.key, call, tuple(sorted(config.items())))
        if key not in self.replays:
            try:
                calls = perf.model_pallas_traffic(_attend(kernel, model, config), *found.args)
                refused = [note for c in calls for note in c.notes if "could not be replayed" in note]
                self.replays[key] = ValueError("; ".join(refused)) if refused else calls
            except Exception as error:  # noqa: BLE001 - a configuration the kernel or the model refuses
                self.replays[key] = error
        return self.replays[key]

    def time_s(self, calls, model: MlaModel, call: Call, generation: str) -> float:
        if isinstance(calls, Exception):
            return math.inf
        modelled = perf.roofline(calls, generation, min_bytes=latent_cache_bytes(model, call))
        return modelled.pipelined_time_s if modelled.fits_vmem else math.inf

    def search(self, kernel, model: MlaModel, call: Call, found: Layout, generation: str, start: dict) -> dict:
        def cost(config):
            return self.time_s(self.replay(kernel, model, call, found, config), model, call, generation)

        best, best_s = start, cost(start)
        axes = search_axes(model, call, found)
        for _ in range(SEARCH_ROUNDS):
            moved = False
            for name, values in axes.items():
                for value in values:
                    candidate = {**best, name: value}
                    if cost(candidate) < best_s:
                        best, best_s, moved = candidate, cost(candidate), True
            if not moved:
                break
        return best

    def __call__(self, model: MlaModel, call: Call, generation: str, matmuls: list[dict]) -> dict:
        if call.q_len > MAX_PREFILL_QUERIES:
            return {"error": f"not replayed: a prefill chunk over {MAX_PREFILL_QUERIES} queries (MAX_PREFILL_QUERIES)"}
        try:
            kernel = load(self.wheels)
            found = layout(kernel, model, call)
            default = vllm_default(kernel, model, call, found)
        except Exception as error:  # noqa: BLE001 - a rival that does not load is a row with the reason
            return {"error": f"loading from the wheel: {type(error).__name__}: {str(error).splitlines()[0][:300]}"}
        best = self.search(kernel, model, call, found, generation, default)
        rows = {"best": best, "default": default}
        out = {"adapted": RECIPROCAL_STAND_IN, "page_size": PAGE_SIZE,
               "search": {"axes": search_axes(model, call, found), "configs_replayed": len(self.replays),
                          "method": "coordinate descent from vLLM's default, fitting configurations only"}}
        extra_us = sum(t["us"] for t in matmuls)
        for name, config in rows.items():
            calls = self.replay(kernel, model, call, found, config)
            if isinstance(calls, Exception):
                out[name] = {"config": config, "error": f"{type(calls).__name__}: {str(calls).splitlines()[0][:300]}"}
                continue
            kernel_row = priced(calls, generation, latent_cache_bytes(model, call))
            kernel_row["vmem_limit_bytes"] = VMEM_LIMIT
            if not kernel_row["fits_vmem"]:
                out[name] = {"config": config, "error": "does not fit VMEM by the model", **kernel_row}
                continue
            band = kernel_row.get("band_p90_us")
            out[name] = {"config": config, "us": kernel_row["us"] + extra_us, "kernel": kernel_row,
                         "band_p90_us": None if band is None else [band[0] + extra_us, band[1] + extra_us]}
        return out
