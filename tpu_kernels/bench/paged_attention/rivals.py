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

from tpu_kernels import perf
from tpu_kernels.bench.moe_layer import vllm_kernels

from .pricing import price, terms
from .shapes import GENERATIONS, Batch, Model

DTYPE = jnp.bfloat16
# jax's paged_attention: tokens per compute block tried (pages_per_compute_block = tokens / page size).
JAX_BLOCK_TOKENS = (512, 1024, 2048)
RPA_MODULES = ("tpu_inference.kernels.ragged_paged_attention.v3.util",
               "tpu_inference.kernels.ragged_paged_attention.v3.kernel")
RPA_PACKAGES = ("tpu_inference", "tpu_inference.kernels", "tpu_inference.kernels.ragged_paged_attention",
                "tpu_inference.kernels.ragged_paged_attention.v3")
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
            tried[per_block] = perf.model_pallas_traffic(attend, q, pages, pages, lengths, table)
        except Exception as error:  # noqa: BLE001 - recorded per configuration
            errors[per_block] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    if not tried:
        return {"error": "; ".join(f"pages_per_compute_block={k}: {v}" for k, v in errors.items())}
    out = {}
    for generation in GENERATIONS:
        priced = {k: price(calls, batch, model, generation) for k, calls in tried.items()}
        best = min(priced, key=lambda k: priced[k]["modelled_time_us"])
        out[generation] = {"config": {"pages_per_compute_block": best}, **priced[best],
                           **terms(tried[best], generation)}
    return {"per_generation": out, "configs_tried": sorted(tried), "config_errors": errors}


def load_rpa_v3(folder: Path):
    """RPA v3's kernel module from the pinned wheel (hash-checked), its modules run under their own names."""
    if RPA_MODULES[-1] in sys.modules:
        return sys.modules[RPA_MODULES[-1]]
    with zipfile.ZipFile(vllm_kernels.wheel(folder)) as archive:
        sources = {name: archive.read(name.replace(".", "/") + ".py").decode() for name in RPA_MODULES}
    for name in RPA_PACKAGES:
        package = types.ModuleType(name)
        package.__path__ = []
        package._stand_in = True
        sys.modules.setdefault(name, package)
    for name in RPA_MODULES:
        module = types.ModuleType(name)
        module.__file__ = f"{vllm_kernels.WHEEL_NAME}/{name.replace('.', '/')}.py"
        sys.modules[name] = module
        exec(compile(sources[name], module.__file__, "exec"), module.__dict__)  # noqa: S102 - the pinned wheel
    return sys.modules[RPA_MODULES[-1]]


def rpa_v3(batch: Batch, model: Model, page_size: int, folder: Path) -> dict:
    """RPA v3 at its own block sizes for the shape (its `get_default_block_sizes`, per TPU version), without the
    cache update our kernel does not do either (update_kv_cache=False)."""
    if model.sinks:
        return {"error": "no attention sinks"}
    if model.head_dim == 64:
        return {"error": "head_dim 64 runs RPA v3's separate kernel_hd64 module, not loaded here"}
    try:
        rpa = load_rpa_v3(folder)
    except Exception as error:  # noqa: BLE001
        return {"error": f"loading from the wheel: {type(error).__name__}: {error}"}
    # RPA orders decode-only sequences first, then the mixed ones; bytes and work do not depend on the order.
    order = sorted(range(len(batch.q_lens)), key=lambda s: batch.q_lens[s] != 1)
    q_lens = [batch.q_lens[s] for s in order]
    kv_lens = np.asarray([batch.kv_lens[s] for s in order], np.int32)
    decode = sum(1 for n in q_lens if n == 1)
    num_pages, pages_per_seq, table = _tables(batch, page_size)
    packing = 2
    cache = jax.ShapeDtypeStruct((num_pages, page_size, 2 * model.kv_heads // packing, packing, model.head_dim), DTYPE)
    q = jax.ShapeDtypeStruct((batch.total_q, model.q_heads, model.head_dim), DTYPE)
    kv = jax.ShapeDtypeStruct((batch.total_q, model.kv_heads, model.head_dim), DTYPE)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    distribution = np.asarray([decode, decode, len(q_lens)], np.int32)
    out, replays = {}, {}
    for generation in GENERATIONS:
        version = TPU_VERSION[generation]
        rpa.get_tpu_version = lambda version=version: version
        case = rpa.RpaCase.DECODE if batch.kind == "decode" else rpa.RpaCase.MIXED
        sizes = rpa.get_default_block_sizes(DTYPE, DTYPE, model.q_heads, model.kv_heads, model.head_dim, page_size,
                                            batch.total_q, len(q_lens), pages_per_seq, case=case)

        def attend(q, k, v, cache, kv_lens, table, cu, distribution, generation=generation):
            return rpa.ragged_paged_attention(
                q, k, v, cache, kv_lens, table, cu, distribution, update_kv_cache=False,
                sm_scale=model.head_dim**-0.5, sliding_window=model.sliding_window,
                vmem_limit_bytes=VMEM_BYTES[generation])

        key = (version, tuple(sizes.values()))
        try:
            if key not in replays:
                replays[key] = perf.model_pallas_traffic(attend, q, kv, kv, cache, kv_lens, table.reshape(-1), cu,
                                                         distribution)
            calls = replays[key]
            refused = [note for call in calls for note in call.notes if "could not be replayed" in note]
            if refused:
                raise ValueError("; ".join(refused))
            priced = price(calls, batch, model, generation)
            if priced["bytes_ratio"] < 1:
                # Fewer bytes than the K/V rows it must read: some of its copies escape the replay.
                raise ValueError(f"the replay counts {priced['bytes_ratio']:.2f}x the minimum bytes: some of its "
                                 "copies (waited on descriptors other than the ones started) are not counted")
            out[generation] = {"config": sizes, **priced, **terms(calls, generation)}
        except Exception as error:  # noqa: BLE001 - recorded per generation
            out[generation] = {"config": sizes, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    return {"per_generation": out}
