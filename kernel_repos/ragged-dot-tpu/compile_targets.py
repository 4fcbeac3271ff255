"""Shapes `tpu-kernels check` compiles ahead of time for each TPU generation.

Rows are token-expert picks (tokens x top-k) of one MoE layer: Qwen3-30B-A3B
(128 experts, H=2048, I=768) at 512 decode rows and 16384 prefill rows, and
Gemma-4-26B-A4B (128 experts, H=2816, I=704). transformers' weight layout is
`[E, out, in]`, so both projections use `transpose_rhs=True`.
"""

import functools

import jax
import jax.numpy as jnp

MODELS = {
    "qwen3-30b-a3b": dict(experts=128, hidden=2048, intermediate=768, rows=(512, 16384)),
    "gemma-4-26b-a4b": dict(experts=128, hidden=2816, intermediate=704, rows=(512,)),
}


def compile_targets(kernel, generation):
    targets = []
    dtype = jnp.bfloat16
    for model, shape in MODELS.items():
        experts, hidden, intermediate = shape["experts"], shape["hidden"], shape["intermediate"]
        for rows in shape["rows"]:
            for projection, k, n in (("gate_up", hidden, 2 * intermediate), ("down", intermediate, hidden)):
                fn = functools.partial(kernel.pallas_tpu.ragged_dot, transpose_rhs=True, generation=generation)
                avals = (
                    jax.ShapeDtypeStruct((rows, k), dtype),
                    jax.ShapeDtypeStruct((experts, n, k), dtype),
                    jax.ShapeDtypeStruct((experts,), jnp.int32),
                )
                targets.append((f"{model} {projection} M={rows} K={k} N={n} E={experts} bf16", fn, avals))
        # The fused experts op of one decode step (the whole layer in one program).
        fused = functools.partial(
            kernel.moe.gated_experts, activation="silu", weights_transposed=False, generation=generation
        )
        tokens, top_k = shape["rows"][0] // 8, 8
        avals = (
            jax.ShapeDtypeStruct((tokens, hidden), dtype),
            jax.ShapeDtypeStruct((tokens, top_k), jnp.int32),
            jax.ShapeDtypeStruct((tokens, top_k), dtype),
            jax.ShapeDtypeStruct((experts, 2 * intermediate, hidden), dtype),
            jax.ShapeDtypeStruct((experts, hidden, intermediate), dtype),
        )
        targets.append((f"{model} fused experts T={tokens} top-{top_k} bf16", fused, avals))
    return targets
