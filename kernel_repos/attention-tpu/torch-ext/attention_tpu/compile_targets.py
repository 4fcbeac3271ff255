"""Shapes `tpu-kernels check` compiles ahead of time for each TPU generation.

The models' heads are `HEADS` (with their `WINDOWS` and `SINKS`): the one list of them.

Forward (inference and training): Qwen3-30B-A3B attention (bf16): prefill of
4096 tokens (causal), decode steps of a batch of 8 against 4096 and 32768
cached tokens (with per-sequence cache lengths, as a static cache has them),
the explicit-mask path (a left-padded prefill batch, as transformers builds
it), the sliding-window / soft-capping path of Gemma-2-style layers (Gemma 4's
sliding heads, a window of 4096), float32, GPT-OSS-20B's sliding layer with
attention sinks (q, K, V and the output read and written sequence-minor, as
XLA stores them at head_dim 64) and a decode step of its full layers (batch 8
against 4096 cached tokens, per-sequence lengths, sinks; K and V read
keys-minor), and Gemma-4-26B-A4B's global layers: prefill of 8192 tokens
(causal) and decode steps of a batch of 64 against 8192 cached tokens.

Backward (both kernels, dq and dk/dv, and the sink gradient) at training
shapes of T = 8192 tokens per rank: Qwen3-30B-A3B (causal), Gemma-4-26B-A4B's
sliding layers and global layers (causal), GPT-OSS-20B with sinks (through
jax.grad: forward and backward in one program, every array read and written
sequence-minor), a padded batch with a boolean mask and a soft-cap, and
float32.

Latent attention (MLA) through the flash kernels (q and k of one head dim, v
and the output of another), one shape per tile plan: the expanded form's
prefill of 4096 tokens (causal, `EXPANDED_LATENT_HEADS`) at DeepSeek-V3's
heads per chip under TP8, which are Moonlight-16B-A3B's and
DeepSeek-V2-Lite's (16 heads, 192 / 128: q and k read sequence-minor, v and
the output row-major), forward alone and through jax.grad (both backward
kernels), and GLM-4.7-Flash's (20 heads, 256 / 256); the absorbed form
(`LATENT_HEADS`: one shared KV head of 576 / 512, MQA, the whole group of
query heads in one step), decode steps of a batch of 64 against 4096 cached
tokens at 16 query heads and of a batch of 8 at DeepSeek-V3's 128 on one
chip.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .flash.kernel import differentiable_flash_attention
from .flash_backward.kernel import flash_attention_backward
from .latent.compile_targets import latent_compile_targets
from .paged.compile_targets import paged_compile_targets

# The one list of the models' attention shapes, by tag: "<model>" or "<model> <layer kind>" where its layers differ.
# Plain literals: the paged targets take them from here, and the lab reads them from this file without importing the
# kernel (benchmarks/studies/model_shapes.py).
HEADS = {
    "qwen3-30b-a3b": {"q_heads": 32, "kv_heads": 4, "head_dim": 128},
    "gpt-oss-20b": {"q_heads": 64, "kv_heads": 8, "head_dim": 64},
    "gemma-4-26b-a4b sliding": {"q_heads": 16, "kv_heads": 8, "head_dim": 256},
    "gemma-4-26b-a4b global": {"q_heads": 16, "kv_heads": 2, "head_dim": 512},
}
# MLA models' attention in its absorbed form (`latent/compile_targets.py`), by tag "<model>" or "<model> tp<N>" (the
# heads on one chip under N-way tensor parallelism): query heads, latent width (kv_lora_rank) and rope width
# (qk_rope_head_dim; 0: no rope keys).
LATENT_HEADS = {
    "deepseek-v3": {"heads": 128, "latent_dim": 512, "rope_dim": 64},
    "deepseek-v3 tp8": {"heads": 16, "latent_dim": 512, "rope_dim": 64},
    "glm-4.7-flash": {"heads": 20, "latent_dim": 512, "rope_dim": 64},
    "glm-4.7-flash tp4": {"heads": 5, "latent_dim": 512, "rope_dim": 64},
    "glm-5-next tp8": {"heads": 8, "latent_dim": 512, "rope_dim": 0},
    "hy-v4": {"heads": 32, "latent_dim": 512, "rope_dim": 64},
}
# The windows of the sliding layers: GPT-OSS-20B's (every other layer) and Gemma 4's.
WINDOWS = {"gpt-oss-20b": 128, "gemma-4-26b-a4b sliding": 1024}
# The models whose layers all take attention sinks (one learned logit per query head).
SINKS = ("gpt-oss-20b",)
# The same models' attention in its expanded form (what transformers' `expand_kv` makes: per-head keys and values, as
# many KV heads as query heads), by LATENT_HEADS' tags: query heads, the keys' head dim (qk_nope_head_dim +
# qk_rope_head_dim) and the values' (v_head_dim). DeepSeek-V3's under TP8 are Moonlight-16B-A3B's and
# DeepSeek-V2-Lite's.
EXPANDED_LATENT_HEADS = {
    "deepseek-v3 tp8": {"q_heads": 16, "qk_head_dim": 192, "v_head_dim": 128},
    "glm-4.7-flash": {"q_heads": 20, "qk_head_dim": 256, "v_head_dim": 256},
}
QWEN3_30B_A3B = HEADS["qwen3-30b-a3b"]
GEMMA_4_SLIDING = HEADS["gemma-4-26b-a4b sliding"]
GEMMA_4_GLOBAL = HEADS["gemma-4-26b-a4b global"]
GPT_OSS_20B = HEADS["gpt-oss-20b"]
TOKENS_PER_RANK = 8192


def _qkv(batch, q_len, kv_len, *, q_heads, kv_heads, head_dim, dtype=jnp.bfloat16):
    return (
        jax.ShapeDtypeStruct((batch, q_heads, q_len, head_dim), dtype),
        jax.ShapeDtypeStruct((batch, kv_heads, kv_len, head_dim), dtype),
        jax.ShapeDtypeStruct((batch, kv_heads, kv_len, head_dim), dtype),
    )


def _expanded_qkv(seq, *, q_heads, qk_head_dim, v_head_dim):
    """q, k, v of a self-attention prefill of `seq` tokens in latent attention's expanded form."""
    return (jax.ShapeDtypeStruct((1, q_heads, seq, qk_head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, q_heads, seq, qk_head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, q_heads, seq, v_head_dim), jnp.bfloat16))


def _absorbed_decode_qkv(batch, cached, *, heads, latent_dim, rope_dim):
    """q, k, v of a decode step in latent attention's absorbed form through the flash kernel: one KV head of keys
    latent_dim + rope_dim wide and values latent_dim wide."""
    key_dim = latent_dim + rope_dim
    return (jax.ShapeDtypeStruct((batch, heads, 1, key_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((batch, 1, cached, key_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((batch, 1, cached, latent_dim), jnp.bfloat16))


def _backward_avals(batch, seq, *, q_heads, kv_heads, head_dim, dtype=jnp.bfloat16):
    """(d_out, q, k, v, out, lse) of a self-attention backward."""
    q, k, v = _qkv(batch, seq, seq, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    return (q, q, k, v, q, jax.ShapeDtypeStruct((batch, q_heads, seq), jnp.float32))


def _forward_targets(generation):
    flash_attention = functools.partial(differentiable_flash_attention, generation=generation)
    lengths = jax.ShapeDtypeStruct((8,), jnp.int32)
    lengths_of_64 = jax.ShapeDtypeStruct((64,), jnp.int32)
    gpt_oss_sinks = jax.ShapeDtypeStruct((GPT_OSS_20B["q_heads"],), jnp.bfloat16)
    gpt_oss_window = WINDOWS["gpt-oss-20b"]

    def with_lengths(q, k, v, kv_lengths):
        return flash_attention(q, k, v, kv_lengths=kv_lengths)

    def with_mask(q, k, v, attention_mask):
        return flash_attention(q, k, v, causal=False, attention_mask=attention_mask)

    def windowed(q, k, v):
        return flash_attention(q, k, v, sliding_window=4096, softcap=50.0)

    def with_sinks(q, k, v, sinks):
        return flash_attention(q, k, v, sliding_window=gpt_oss_window, sinks=sinks)

    def decode_with_sinks(q, k, v, kv_lengths, sinks):
        return flash_attention(q, k, v, kv_lengths=kv_lengths, sinks=sinks)

    tokens = TOKENS_PER_RANK
    return [
        ("qwen3-30b-a3b prefill B=1 S=4096 causal bf16", flash_attention, _qkv(1, 4096, 4096, **QWEN3_30B_A3B)),
        ("qwen3-30b-a3b decode B=8 cache=4096 bf16", with_lengths, (*_qkv(8, 1, 4096, **QWEN3_30B_A3B), lengths)),
        ("qwen3-30b-a3b decode B=8 cache=32768 bf16", with_lengths, (*_qkv(8, 1, 32768, **QWEN3_30B_A3B), lengths)),
        (
            "qwen3-30b-a3b prefill B=2 S=2048 bool mask bf16",
            with_mask,
            (*_qkv(2, 2048, 2048, **QWEN3_30B_A3B), jax.ShapeDtypeStruct((2, 1, 2048, 2048), jnp.bool_)),
        ),
        (
            f"gemma-2-9b-like prefill B=1 S=8192 window=4096 softcap D={GEMMA_4_SLIDING['head_dim']} bf16",
            windowed,
            _qkv(1, 8192, 8192, **GEMMA_4_SLIDING),
        ),
        ("qwen3-30b-a3b prefill B=1 S=1000 causal f32", flash_attention,
         _qkv(1, 1000, 1000, dtype=jnp.float32, **QWEN3_30B_A3B)),
        (
            f"gpt-oss-20b prefill B=1 S={tokens} window={gpt_oss_window} sinks bf16",
            with_sinks,
            (*_qkv(1, tokens, tokens, **GPT_OSS_20B), gpt_oss_sinks),
        ),
        ("gpt-oss-20b decode B=8 cache=4096 sinks bf16", decode_with_sinks,
         (*_qkv(8, 1, 4096, **GPT_OSS_20B), lengths, gpt_oss_sinks)),
        (f"gemma-4-26b-a4b global layer prefill B=1 S={tokens} causal D={GEMMA_4_GLOBAL['head_dim']} bf16",
         flash_attention, _qkv(1, tokens, tokens, **GEMMA_4_GLOBAL)),
        (f"gemma-4-26b-a4b global layer decode B=64 cache={tokens} D={GEMMA_4_GLOBAL['head_dim']} bf16", with_lengths,
         (*_qkv(64, 1, tokens, **GEMMA_4_GLOBAL), lengths_of_64)),
    ]


def _backward_targets(generation):
    flash_attention = functools.partial(differentiable_flash_attention, generation=generation)
    backward = functools.partial(flash_attention_backward, generation=generation)
    gpt_oss_sinks = jax.ShapeDtypeStruct((GPT_OSS_20B["q_heads"],), jnp.bfloat16)
    gpt_oss_window, gemma_window = WINDOWS["gpt-oss-20b"], WINDOWS["gemma-4-26b-a4b sliding"]

    def backward_windowed(*arrays):
        return backward(*arrays, sliding_window=gemma_window)

    def training_gradients_with_sinks(q, k, v, d_out, sinks):
        """The gradients jax.grad takes through the forward and both backward kernels, in one program."""

        def loss(q, k, v, sinks):
            out = flash_attention(q, k, v, sliding_window=gpt_oss_window, sinks=sinks)
            return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)

    def backward_with_mask(*arrays, attention_mask):
        return backward(*arrays, causal=False, attention_mask=attention_mask, softcap=30.0)

    def backward_f32(*arrays):
        return backward(*arrays, softcap=30.0)

    def keyword_last(fn, name):
        """fn taking its last positional array as keyword `name` (compile targets pass arrays positionally)."""
        return lambda *arrays: fn(*arrays[:-1], **{name: arrays[-1]})

    tokens = TOKENS_PER_RANK
    padding_mask = jax.ShapeDtypeStruct((2, 1, tokens // 2, tokens // 2), jnp.bool_)
    return [
        (f"backward qwen3-30b-a3b B=1 S={tokens} causal bf16", backward, _backward_avals(1, tokens, **QWEN3_30B_A3B)),
        (f"backward gemma-4-26b-a4b global layer B=1 S={tokens} causal D={GEMMA_4_GLOBAL['head_dim']} bf16",
         backward, _backward_avals(1, tokens, **GEMMA_4_GLOBAL)),
        (
            f"backward gemma-4-26b-a4b sliding layer B=1 S={tokens} window={gemma_window} "
            f"D={GEMMA_4_SLIDING['head_dim']} bf16",
            backward_windowed,
            _backward_avals(1, tokens, **GEMMA_4_SLIDING),
        ),
        (
            f"jax.grad gpt-oss-20b B=1 S={tokens} window={gpt_oss_window} sinks bf16",
            training_gradients_with_sinks,
            (*_qkv(1, tokens, tokens, **GPT_OSS_20B), _qkv(1, tokens, tokens, **GPT_OSS_20B)[0], gpt_oss_sinks),
        ),
        (
            f"backward qwen3-30b-a3b B=2 S={tokens // 2} bool padding mask softcap bf16",
            keyword_last(backward_with_mask, "attention_mask"),
            (*_backward_avals(2, tokens // 2, **QWEN3_30B_A3B), padding_mask),
        ),
        ("backward qwen3-30b-a3b B=1 S=1000 causal softcap f32", backward_f32,
         _backward_avals(1, 1000, dtype=jnp.float32, **QWEN3_30B_A3B)),
    ]


def _latent_flash_targets(generation):
    """Latent attention through the flash kernels (module docstring)."""
    flash_attention = functools.partial(differentiable_flash_attention, generation=generation)

    def with_lengths(q, k, v, kv_lengths):
        return flash_attention(q, k, v, kv_lengths=kv_lengths)

    def training_gradients(q, k, v, d_out):
        def loss(q, k, v):
            return jnp.sum(flash_attention(q, k, v).astype(jnp.float32) * d_out.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    deepseek = EXPANDED_LATENT_HEADS["deepseek-v3 tp8"]
    expanded = _expanded_qkv(4096, **deepseek)
    dims = f"qk={deepseek['qk_head_dim']} v={deepseek['v_head_dim']}"
    latent = LATENT_HEADS["deepseek-v3"]
    absorbed_dims = f"qk={latent['latent_dim'] + latent['rope_dim']} v={latent['latent_dim']}"
    return [
        (f"deepseek-v3 tp8 (moonlight-16b-a3b) expanded prefill B=1 S=4096 causal {dims} bf16", flash_attention,
         expanded),
        # d_out has the output's shape: v's, where there are as many KV heads as query heads.
        (f"jax.grad deepseek-v3 tp8 (moonlight-16b-a3b) expanded B=1 S=4096 causal {dims} bf16", training_gradients,
         (*expanded, expanded[2])),
        ("glm-4.7-flash expanded prefill B=1 S=4096 causal D=256 bf16", flash_attention,
         _expanded_qkv(4096, **EXPANDED_LATENT_HEADS["glm-4.7-flash"])),
        (f"deepseek-v3 tp8 absorbed decode B=64 cache=4096 MQA {absorbed_dims} bf16", with_lengths,
         (*_absorbed_decode_qkv(64, 4096, **LATENT_HEADS["deepseek-v3 tp8"]), jax.ShapeDtypeStruct((64,), jnp.int32))),
        (f"deepseek-v3 absorbed decode B=8 cache=4096 MQA 128 heads {absorbed_dims} bf16", with_lengths,
         (*_absorbed_decode_qkv(8, 4096, **LATENT_HEADS["deepseek-v3"]), jax.ShapeDtypeStruct((8,), jnp.int32))),
    ]


def compile_targets(generation):
    # Ragged paged attention's shapes: `paged/compile_targets.py`, at the heads above; the latent kernel's (MLA
    # models' absorbed form): `latent/compile_targets.py`.
    return [*_forward_targets(generation), *_backward_targets(generation), *_latent_flash_targets(generation),
            *paged_compile_targets(generation, HEADS, WINDOWS, SINKS, LATENT_HEADS),
            *latent_compile_targets(generation, LATENT_HEADS)]
