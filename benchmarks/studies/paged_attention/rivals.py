"""The rivals, replayed and priced like ours: jax's Pallas `paged_attention` (decode only) here, and vLLM
tpu-inference's ragged paged attention v3 (RPA v3) in `rpa_v3`.

A rival that cannot run a shape (an option it lacks) or that the model cannot replay gets a row with the reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import perf
from benchmarks.studies.relayouts import relayouts

from .pricing import price, terms
from .shapes import GENERATIONS, Batch, Model

DTYPE = jnp.bfloat16
# jax's paged_attention: tokens per compute block tried (pages_per_compute_block = tokens / page size).
JAX_BLOCK_TOKENS = (512, 1024, 2048)


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
