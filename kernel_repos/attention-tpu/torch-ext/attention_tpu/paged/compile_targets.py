"""The ragged paged attention shapes `tpu-kernels check` compiles ahead of time (joined to the package's
`compile_targets`).

Real model attention in bf16 over a paged cache of transformers' default page size (256 tokens) or of 16-token
pages (vLLM's and flash-attn's common size), and 128-token ones (vLLM TPU's); GPT-OSS's head_dim 64 over pages of
128 and 256 tokens is read keys-minor (`PagedProblem.keys_minor`), its window's blocks starting mid-page in the
latter: a decode batch of 64 sequences with mixed context lengths (page tables for up to 32768 tokens), or a mixed
batch of one 960-token prefill chunk and 64 decode rows; and the contiguous (varlen) keys of a packed 4096-token
prefill and of a continuous batching decode step as `flash_attn_varlen_func` hands it to the kernel. Each model and
each feature (small and large pages, keys-minor, decode and mixed batches, window, sinks, head_dim 512) compiles
once per generation: every target costs the test suite a compile on each of four generations. Models:
Qwen3-30B-A3B (32 query heads, 4 KV heads, head_dim 128), GPT-OSS-20B's sliding layer (64 / 8, head_dim 64, window
128, sinks), Gemma 4 26B-A4B's sliding layers (16 / 8, head_dim 256, window 1024) and its global layers (16 / 2,
head_dim 512).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .kernel import ragged_paged_attention, ragged_varlen_attention

QWEN3_30B_A3B = dict(q_heads=32, kv_heads=4, head_dim=128)
GPT_OSS_20B = dict(q_heads=64, kv_heads=8, head_dim=64, sliding_window=128, sinks=True)
GEMMA_4_SLIDING = dict(q_heads=16, kv_heads=8, head_dim=256, sliding_window=1024)
GEMMA_4_GLOBAL = dict(q_heads=16, kv_heads=2, head_dim=512)
DECODE_BATCH = 64
PREFILL_CHUNK = 960
MAX_CONTEXT = 32768


def _avals(total_q, num_seqs, *, q_heads, kv_heads, head_dim, page_size, sinks=False):
    """(q, k_cache, v_cache, cu_q_lens, kv_lens, page_table[, sinks]) for page tables of MAX_CONTEXT tokens over a
    cache of half the batch's full capacity."""
    pages_per_seq = MAX_CONTEXT // page_size
    num_pages = num_seqs * pages_per_seq // 2
    cache = jax.ShapeDtypeStruct((num_pages, page_size, kv_heads, head_dim), jnp.bfloat16)
    avals = [
        jax.ShapeDtypeStruct((total_q, q_heads, head_dim), jnp.bfloat16), cache, cache,
        jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32), jax.ShapeDtypeStruct((num_seqs,), jnp.int32),
        jax.ShapeDtypeStruct((num_seqs, pages_per_seq), jnp.int32),
    ]
    if sinks:
        avals.append(jax.ShapeDtypeStruct((q_heads,), jnp.float32))
    return tuple(avals)


def paged_compile_targets(generation):
    targets = []
    # (name, model, page size, batches): "decode" (64 one-token rows) and / or "mixed" (a prefill chunk + decode).
    models = [("qwen3-30b-a3b", QWEN3_30B_A3B, 16, ("decode",)), ("qwen3-30b-a3b", QWEN3_30B_A3B, 256, ("mixed",)),
              ("gpt-oss-20b sliding", GPT_OSS_20B, 16, ("mixed",)),
              # Read keys-minor: 128-key chunks, whole pages of 128 keys, halves of 256-key pages.
              ("gpt-oss-20b sliding", GPT_OSS_20B, 128, ("decode",)),
              ("gpt-oss-20b sliding", GPT_OSS_20B, 256, ("mixed",)),
              ("gemma-4-26b-a4b sliding", GEMMA_4_SLIDING, 256, ("decode",)),
              ("gemma-4-26b-a4b global", GEMMA_4_GLOBAL, 256, ("decode",))]
    for name, model, page_size, batches in models:
        shape = {key: model[key] for key in ("q_heads", "kv_heads", "head_dim")}
        options = dict(sliding_window=model.get("sliding_window"), generation=generation)
        sinks = model.get("sinks", False)

        def attend(*arrays, max_q_len, options=options, sinks=sinks):
            arrays, sink_logits = (arrays[:-1], arrays[-1]) if sinks else (arrays, None)
            return ragged_paged_attention(*arrays, sinks=sink_logits, max_q_len=max_q_len, **options)

        label = f"paged {name} page={page_size} bf16"
        if "decode" in batches:
            targets.append((f"{label} decode B={DECODE_BATCH}", functools.partial(attend, max_q_len=1),
                            _avals(DECODE_BATCH, DECODE_BATCH, page_size=page_size, sinks=sinks, **shape)))
        if "mixed" in batches:
            targets.append((f"{label} prefill {PREFILL_CHUNK} + decode {DECODE_BATCH}",
                            functools.partial(attend, max_q_len=None),
                            _avals(PREFILL_CHUNK + DECODE_BATCH, DECODE_BATCH + 1, page_size=page_size, sinks=sinks,
                                   **shape)))
    # Contiguous (varlen) keys, as flash_attn_varlen_func gets them: a packed prefill of 4 prompts, 4096 tokens.
    varlen = jax.ShapeDtypeStruct((4096, QWEN3_30B_A3B["kv_heads"], QWEN3_30B_A3B["head_dim"]), jnp.bfloat16)
    targets.append(("varlen qwen3-30b-a3b prefill 4 sequences T=4096 bf16",
                    functools.partial(ragged_varlen_attention, generation=generation),
                    (jax.ShapeDtypeStruct((4096, QWEN3_30B_A3B["q_heads"], QWEN3_30B_A3B["head_dim"]), jnp.bfloat16),
                     varlen, varlen, jax.ShapeDtypeStruct((5,), jnp.int32), jax.ShapeDtypeStruct((5,), jnp.int32))))
    targets.append(_varlen_decode_target(generation))
    return targets


def _varlen_decode_target(generation):
    """A continuous batching decode step of GPT-OSS's sliding layer as `flash_attn_varlen_func` hands it over (its
    rows and sequences rounded up to powers of two): 64 one-token rows over the keys of 64 contexts of up to 2048
    tokens gathered from the paged cache, one query each (max_q_len=1)."""
    q_heads, kv_heads, head_dim = (GPT_OSS_20B[key] for key in ("q_heads", "kv_heads", "head_dim"))
    keys = DECODE_BATCH * 2048
    kv = jax.ShapeDtypeStruct((keys, kv_heads, head_dim), jnp.bfloat16)
    cumulative = jax.ShapeDtypeStruct((DECODE_BATCH + 1,), jnp.int32)

    def decode(q, k, v, cu_q_lens, cu_k_lens, sinks):
        return ragged_varlen_attention(q, k, v, cu_q_lens, cu_k_lens, sinks=sinks, max_q_len=1,
                                       sliding_window=GPT_OSS_20B["sliding_window"], generation=generation)

    return (f"varlen gpt-oss-20b sliding decode {DECODE_BATCH} sequences keys={keys} window=128 sinks bf16", decode,
            (jax.ShapeDtypeStruct((DECODE_BATCH, q_heads, head_dim), jnp.bfloat16), kv, kv, cumulative, cumulative,
             jax.ShapeDtypeStruct((q_heads,), jnp.float32)))
