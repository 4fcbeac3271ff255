"""The ragged paged attention shapes `tpu-kernels check` compiles ahead of time (joined to the package's
`compile_targets`).

Real model attention in bf16 over a paged cache of transformers' default page size (256 tokens) or of 16-token
pages (vLLM's and flash-attn's common size), and 128-token ones (vLLM TPU's); GPT-OSS's head_dim 64 over pages of
128 and 256 tokens is read keys-minor (`PagedProblem.keys_minor`), its window's blocks starting mid-page in the
latter: a decode batch of 64 sequences with mixed context lengths (page tables for up to 32768 tokens), or a mixed
batch of one 960-token prefill chunk and 64 decode rows; and the contiguous (varlen) keys of a packed 4096-token
prefill and of a continuous batching decode step as `flash_attn_varlen_func` hands it to the kernel; a decode batch
of GPT-OSS's sliding layer over window rings (`window_ring`, one 128-slot page per sequence). Each model and
each feature (small and large pages, keys-minor, decode and mixed batches, window, sinks, head_dim 512) compiles
once per generation: every target costs the test suite a compile on each of four generations. Models (their heads,
windows and sinks: the package's `compile_targets.HEADS`, `WINDOWS` and `SINKS`): Qwen3-30B-A3B, GPT-OSS-20B's
sliding layer, Gemma 4 26B-A4B's sliding layers and its global layers. Latent attention (`LATENT_HEADS`): a decode
batch of DeepSeek-V3's absorbed form at its heads per chip under TP8 (one KV head, keys 576 wide read keys-minor,
values 512 wide row-major, in the same 128-key chunks) over pages of 256 tokens. The expanded form's (Moonlight's
16 KV heads of 192 / 128) is the same plan but for the heads, and compiles several times longer (a copy of the work
per KV head): it compiled for every generation when it was added, and is not a target.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .kernel import ragged_paged_attention, ragged_varlen_attention

DECODE_BATCH = 64
PREFILL_CHUNK = 960
MAX_CONTEXT = 32768


def _avals(total_q, num_seqs, *, q_heads, kv_heads, head_dim, page_size, sinks=False, v_head_dim=None):
    """(q, k_cache, v_cache, cu_q_lens, kv_lens, page_table[, sinks]) for page tables of MAX_CONTEXT tokens over a
    cache of half the batch's full capacity; values `v_head_dim` wide (default: head_dim)."""
    pages_per_seq = MAX_CONTEXT // page_size
    num_pages = num_seqs * pages_per_seq // 2
    k_cache = jax.ShapeDtypeStruct((num_pages, page_size, kv_heads, head_dim), jnp.bfloat16)
    v_cache = jax.ShapeDtypeStruct((num_pages, page_size, kv_heads, v_head_dim or head_dim), jnp.bfloat16)
    avals = [
        jax.ShapeDtypeStruct((total_q, q_heads, head_dim), jnp.bfloat16), k_cache, v_cache,
        jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32), jax.ShapeDtypeStruct((num_seqs,), jnp.int32),
        jax.ShapeDtypeStruct((num_seqs, pages_per_seq), jnp.int32),
    ]
    if sinks:
        avals.append(jax.ShapeDtypeStruct((q_heads,), jnp.float32))
    return tuple(avals)


# (the heads' tag, the label's name, page size, batches): "decode" (64 one-token rows) and / or "mixed" (a prefill
# chunk + decode). GPT-OSS-20B's are its sliding layers (with their window).
PAGED_MODELS = [("qwen3-30b-a3b", "qwen3-30b-a3b", 16, ("decode",)), ("qwen3-30b-a3b", "qwen3-30b-a3b", 256, ("mixed",)),
                ("gpt-oss-20b", "gpt-oss-20b sliding", 16, ("mixed",)),
                # Read keys-minor: 128-key chunks, whole pages of 128 keys, halves of 256-key pages.
                ("gpt-oss-20b", "gpt-oss-20b sliding", 128, ("decode",)),
                ("gpt-oss-20b", "gpt-oss-20b sliding", 256, ("mixed",)),
                ("gemma-4-26b-a4b sliding", "gemma-4-26b-a4b sliding", 256, ("decode",)),
                ("gemma-4-26b-a4b global", "gemma-4-26b-a4b global", 256, ("decode",))]


def paged_compile_targets(generation, heads, windows, sinks_of, latent_heads):
    """The targets at the models' `heads` (by tag), their sliding `windows`, the tags whose layers take sinks
    (`sinks_of`) and the latent attention layers' `latent_heads` (by tag)."""
    targets = []
    for tag, name, page_size, batches in PAGED_MODELS:
        shape = heads[tag]
        options = dict(sliding_window=windows.get(tag), generation=generation)
        sinks = tag in sinks_of

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
    qwen3 = heads["qwen3-30b-a3b"]
    varlen = jax.ShapeDtypeStruct((4096, qwen3["kv_heads"], qwen3["head_dim"]), jnp.bfloat16)
    targets.append(("varlen qwen3-30b-a3b prefill 4 sequences T=4096 bf16",
                    functools.partial(ragged_varlen_attention, generation=generation),
                    (jax.ShapeDtypeStruct((4096, qwen3["q_heads"], qwen3["head_dim"]), jnp.bfloat16),
                     varlen, varlen, jax.ShapeDtypeStruct((5,), jnp.int32), jax.ShapeDtypeStruct((5,), jnp.int32))))
    targets.append(_varlen_decode_target(generation, heads["gpt-oss-20b"], windows["gpt-oss-20b"]))
    targets.append(_ring_decode_target(generation, heads["gpt-oss-20b"], windows["gpt-oss-20b"]))
    return targets + _latent_targets(generation, latent_heads)


def _latent_targets(generation, latent_heads):
    """A decode batch of DeepSeek-V3's absorbed latent attention (TP8) over 256-token pages."""
    decode = functools.partial(ragged_paged_attention, max_q_len=1, generation=generation)
    deepseek = latent_heads["deepseek-v3 tp8"]
    absorbed = dict(q_heads=deepseek["heads"], kv_heads=1, head_dim=deepseek["latent_dim"] + deepseek["rope_dim"],
                    v_head_dim=deepseek["latent_dim"])
    return [(f"paged deepseek-v3 TP8 absorbed page=256 bf16 decode B={DECODE_BATCH} qk={absorbed['head_dim']} "
             f"v={absorbed['v_head_dim']}", decode, _avals(DECODE_BATCH, DECODE_BATCH, page_size=256, **absorbed))]


def _ring_decode_target(generation, gpt_oss, window):
    """A decode batch of GPT-OSS's sliding layer over window rings (`window_ring`): each sequence's one page of 128
    slots (its window), read keys-minor in one 128-key chunk."""
    q_heads, kv_heads, head_dim = (gpt_oss[key] for key in ("q_heads", "kv_heads", "head_dim"))
    cache = jax.ShapeDtypeStruct((4 * DECODE_BATCH, window, kv_heads, head_dim), jnp.bfloat16)

    def decode(q, k_cache, v_cache, cu_q_lens, kv_lens, page_table, sinks):
        return ragged_paged_attention(q, k_cache, v_cache, cu_q_lens, kv_lens, page_table, sinks=sinks, max_q_len=1,
                                      sliding_window=window, window_ring=True, generation=generation)

    return (f"paged gpt-oss-20b sliding window rings page={window} bf16 decode B={DECODE_BATCH}", decode,
            (jax.ShapeDtypeStruct((DECODE_BATCH, q_heads, head_dim), jnp.bfloat16), cache, cache,
             jax.ShapeDtypeStruct((DECODE_BATCH + 1,), jnp.int32), jax.ShapeDtypeStruct((DECODE_BATCH,), jnp.int32),
             jax.ShapeDtypeStruct((DECODE_BATCH, 1), jnp.int32), jax.ShapeDtypeStruct((q_heads,), jnp.float32)))


def _varlen_decode_target(generation, gpt_oss, window):
    """A continuous batching decode step of GPT-OSS's sliding layer (heads `gpt_oss`, its `window`) as
    `flash_attn_varlen_func` hands it over (its rows and sequences rounded up to powers of two): 64 one-token rows
    over the keys of 64 contexts of up to 2048 tokens gathered from the paged cache, one query each (max_q_len=1)."""
    q_heads, kv_heads, head_dim = (gpt_oss[key] for key in ("q_heads", "kv_heads", "head_dim"))
    keys = DECODE_BATCH * 2048
    kv = jax.ShapeDtypeStruct((keys, kv_heads, head_dim), jnp.bfloat16)
    cumulative = jax.ShapeDtypeStruct((DECODE_BATCH + 1,), jnp.int32)

    def decode(q, k, v, cu_q_lens, cu_k_lens, sinks):
        return ragged_varlen_attention(q, k, v, cu_q_lens, cu_k_lens, sinks=sinks, max_q_len=1,
                                       sliding_window=window, generation=generation)

    return (f"varlen gpt-oss-20b sliding decode {DECODE_BATCH} sequences keys={keys} window={window} sinks bf16", decode,
            (jax.ShapeDtypeStruct((DECODE_BATCH, q_heads, head_dim), jnp.bfloat16), kv, kv, cumulative, cumulative,
             jax.ShapeDtypeStruct((q_heads,), jnp.float32)))
