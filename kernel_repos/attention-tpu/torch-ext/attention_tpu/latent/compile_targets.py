"""The latent attention shapes `tpu-kernels check` compiles ahead of time (joined to the package's
`compile_targets`): real MLA models' absorbed attention over their latent cache, bf16, one target per tile plan
(every target costs the test suite a compile on each of four generations).

The models' heads per chip and latent widths are the package's `compile_targets.LATENT_HEADS`: DeepSeek-V3 (and R1,
Kimi K2: 128 heads, kv_lora_rank 512, rope 64) whole and under TP8 (16 heads per chip, Moonlight-16B-A3B's and
DeepSeek-V2-Lite's count as well), GLM-4.7-Flash (20 heads) and under TP4 (5), GLM-5-Next under TP8 (8 of its 64
heads; no rope keys), and HY-v4 (Hy4-preview: 32 heads, every layer with attention sinks). The targets:

* decode steps (one query, per-sequence cache lengths as a static cache has them) at batch 64 over 4096 cached tokens
  (DeepSeek-V3 TP8) and batch 8 over 32768 (DeepSeek-V3 whole: 128 heads in one step);
* GLM-4.7-Flash's decode at batch 32 over 4096 tokens with a left-padding bool mask, and under TP4 a speculative step
  of 2 queries (packed rows of two queries each, the mask selected per row);
* GLM-5-Next (R = 0) decode with a DSA top-k mask (bool, [B, 1, 1, S]);
* HY-v4's decode at batch 32 over 4096 tokens with its sinks (bf16 [H], one per row of the packed step) and the top-k
  mask of its DSA indexer (2048 of the keys);
* prefill of 4096 tokens, causal, with DeepSeek-V3's 128 heads (blocks of them per step; under TP8 its 16 heads take
  the same tiles).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .kernel import latent_attention


def _avals(batch, q_len, kv_len, *, heads, latent_dim, rope_dim, mask_queries=None, sinks=False):
    """(q_latent, q_rope, latent, rope, kv_lengths[, mask [B, 1, mask_queries, S] bool][, sinks [H]]); the rope ones
    absent where rope_dim is 0."""
    def array(*shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype)

    avals = [array(batch, heads, q_len, latent_dim), array(batch, 1, kv_len, latent_dim)]
    if rope_dim:
        avals[1:1] = [array(batch, heads, q_len, rope_dim)]
        avals.append(array(batch, 1, kv_len, rope_dim))
    avals.append(array(batch, dtype=jnp.int32))
    if mask_queries is not None:
        avals.append(array(batch, 1, mask_queries, kv_len, dtype=jnp.bool_))
    if sinks:
        avals.append(array(heads))
    return tuple(avals)


def latent_compile_targets(generation, heads):
    """The targets at the models' `heads` (by tag: heads per chip, latent_dim, rope_dim)."""
    def attend(*arrays, rope=True, masked=False, sinks=False):
        arrays = list(arrays)
        sink_logits = arrays.pop() if sinks else None
        mask = arrays.pop() if masked else None
        kv_lengths = arrays.pop()
        q_latent, q_rope, latent, rope_keys = arrays if rope else (arrays[0], None, arrays[1], None)
        return latent_attention(q_latent, q_rope, latent, rope_keys, kv_lengths=kv_lengths, attention_mask=mask,
                                sinks=sink_logits, generation=generation)

    masked = functools.partial(attend, masked=True)
    glm_5_next = heads["glm-5-next tp8"]
    return [
        ("latent deepseek-v3 tp8 decode B=64 cache=4096 bf16", attend, _avals(64, 1, 4096, **heads["deepseek-v3 tp8"])),
        ("latent deepseek-v3 decode B=8 cache=32768 bf16", attend, _avals(8, 1, 32768, **heads["deepseek-v3"])),
        ("latent glm-4.7-flash decode B=32 cache=4096 padding mask bf16", masked,
         _avals(32, 1, 4096, mask_queries=1, **heads["glm-4.7-flash"])),
        ("latent glm-4.7-flash tp4 speculative decode 2 queries B=32 cache=4096 mask bf16", masked,
         _avals(32, 2, 4096, mask_queries=2, **heads["glm-4.7-flash tp4"])),
        ("latent glm-5-next tp8 decode B=32 cache=4096 top-k mask no rope bf16",
         functools.partial(attend, masked=True, rope=False), _avals(32, 1, 4096, mask_queries=1, **glm_5_next)),
        ("latent hy-v4 decode B=32 cache=4096 top-k mask sinks bf16",
         functools.partial(attend, masked=True, sinks=True),
         _avals(32, 1, 4096, mask_queries=1, sinks=True, **heads["hy-v4"])),
        ("latent deepseek-v3 prefill B=1 S=4096 causal bf16", attend, _avals(1, 4096, 4096, **heads["deepseek-v3"])),
    ]
