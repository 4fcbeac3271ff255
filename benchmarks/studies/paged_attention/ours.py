"""Our ragged paged attention (attention-tpu's `paged` kernel) at its own tile selection, replayed and priced."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import perf

from benchmarks.studies.relayouts import relayouts
from tpu_kernels.runtime.hardware import LANES, resolve_target

from .pricing import price, terms
from .shapes import GENERATIONS, Batch, Model

DTYPE = jnp.bfloat16


def paged_inputs(batch: Batch, model: Model, page_size: int, dtype=DTYPE) -> tuple:
    """(q, k_cache, v_cache, cu_q_lens, kv_lens, page_table[, sinks]): arrays as ShapeDtypeStructs, the small
    int32 ones concrete; every sequence on pages of its own (its keys', or its window ring's), in order. Varlen
    keys: one page of every sequence's keys packed (rows to a multiple of 128, as the bucketed rows transformers
    hands over are), the page table each sequence's first row, page_size unused."""
    seqs = len(batch.q_lens)
    if model.cache == "varlen":
        held = [model.keys_held(q, n) for q, n in zip(batch.q_lens, batch.kv_lens)]
        rows = -(-sum(held) // LANES) * LANES
        kv_lens, table = held, np.concatenate([[0], np.cumsum(held)[:-1]]).astype(np.int32)[:, None]
        shape = (1, rows, model.kv_heads, model.head_dim)
    else:
        pages_per_seq = model.pages_per_seq(batch, page_size)
        kv_lens = batch.kv_lens
        table = np.arange(seqs * pages_per_seq, dtype=np.int32).reshape(seqs, pages_per_seq)
        shape = (seqs * pages_per_seq, page_size, model.kv_heads, model.head_dim)
    cache = jax.ShapeDtypeStruct(shape, dtype)
    inputs = [
        jax.ShapeDtypeStruct((batch.total_q, model.q_heads, model.head_dim), dtype), cache, cache,
        np.concatenate([[0], np.cumsum(batch.q_lens)]).astype(np.int32), np.asarray(kv_lens, np.int32), table,
    ]
    if model.sinks:
        inputs.append(jax.ShapeDtypeStruct((model.q_heads,), jnp.float32))
    return tuple(inputs)


def kernel_fn(built, batch: Batch, model: Model, generation: str):
    max_q_len = max(batch.q_lens)

    def attend(q, k_cache, v_cache, cu_q_lens, kv_lens, page_table, sinks=None):
        return built.paged.kernel.ragged_paged_attention(
            q, k_cache, v_cache, cu_q_lens, kv_lens, page_table, sinks=sinks, sliding_window=model.sliding_window,
            max_q_len=max_q_len, generation=generation, window_ring=model.window_ring,
            contiguous=model.cache == "varlen")

    return attend


def tiles(built, batch: Batch, model: Model, page_size: int, generation: str):
    inputs = paged_inputs(batch, model, page_size)
    problem = built.PagedProblem.of_shape(
        total_q=batch.total_q, num_seqs=len(batch.q_lens), q_heads=model.q_heads, kv_heads=model.kv_heads,
        head_dim=model.head_dim, page_size=inputs[1].shape[1], num_pages=inputs[1].shape[0],
        pages_per_seq=inputs[5].shape[1], dtype=DTYPE, sliding_window=None if model.window_ring else model.sliding_window,
        has_sinks=model.sinks, max_q_len=max(batch.q_lens), contiguous=model.cache == "varlen",
        max_kv_len=model.sliding_window if model.window_ring else None)
    return built.paged.tiles.select(problem, resolve_target(generation))


def measure(built, batch: Batch, model: Model, page_size: int) -> dict:
    """Per generation: the kernel's tiles and its priced replay, charged the copies XLA makes of K/V around it.
    Generations with the same tiles share a replay."""
    replays: dict = {}
    per_generation = {}
    for generation in GENERATIONS:
        config = tiles(built, batch, model, page_size, generation)
        key = (config.block_q, config.tile_q, config.block_kv)
        if key not in replays:
            replays[key] = perf.model_pallas_traffic(kernel_fn(built, batch, model, generation),
                                                     *paged_inputs(batch, model, page_size))
        calls = replays[key]
        copies = relayouts(kernel_fn(built, batch, model, generation), paged_inputs(batch, model, page_size),
                           generation)
        per_generation[generation] = {
            "tiles": {"block_q": config.block_q, "tile_q": config.tile_q, "block_kv": config.block_kv},
            **price(calls, batch, model, generation, copies), **terms(calls, generation),
        }
    return per_generation
