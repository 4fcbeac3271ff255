"""Shapes `tpu-kernels check` compiles ahead of time for each TPU generation.

Qwen3-30B-A3B attention: 32 query heads, 4 KV heads, head_dim 128, bf16.
Prefill of 4096 tokens (causal), and decode steps of a batch of 8 against
4096 and 32768 cached tokens (with per-sequence cache lengths, as a static
cache has them). Also the explicit-mask path (a left-padded prefill batch, as
transformers builds it) and the sliding-window / soft-capping path of
Gemma-2-style layers, so that every code path of the kernel compiles.
"""

import functools

import jax
import jax.numpy as jnp

QWEN3_30B_A3B = dict(q_heads=32, kv_heads=4, head_dim=128)


def _qkv(batch, q_len, kv_len, *, q_heads, kv_heads, head_dim, dtype=jnp.bfloat16):
    return (
        jax.ShapeDtypeStruct((batch, q_heads, q_len, head_dim), dtype),
        jax.ShapeDtypeStruct((batch, kv_heads, kv_len, head_dim), dtype),
        jax.ShapeDtypeStruct((batch, kv_heads, kv_len, head_dim), dtype),
    )


def compile_targets(kernel, generation):
    flash_attention = functools.partial(kernel.pallas_tpu.flash_attention, generation=generation)
    lengths = jax.ShapeDtypeStruct((8,), jnp.int32)

    def with_lengths(q, k, v, kv_lengths):
        return flash_attention(q, k, v, kv_lengths=kv_lengths)

    def with_mask(q, k, v, attention_mask):
        return flash_attention(q, k, v, causal=False, attention_mask=attention_mask)

    def windowed(q, k, v):
        return flash_attention(q, k, v, sliding_window=4096, softcap=50.0)

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
            "gemma-2-9b-like prefill B=1 S=8192 window=4096 softcap D=256 bf16",
            windowed,
            _qkv(1, 8192, 8192, q_heads=16, kv_heads=8, head_dim=256),
        ),
        ("qwen3-30b-a3b prefill B=1 S=1000 causal f32", flash_attention, _qkv(1, 1000, 1000, dtype=jnp.float32, **QWEN3_30B_A3B)),
    ]
