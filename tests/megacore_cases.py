"""Kernel calls, through the kernels' faces, whose split over v5p's two TensorCores the compiler and the performance
model must agree on (tests/test_megacore.py; ragged-dot-tpu's tests hold the cases of its kernels' internals).
Compiled with libtpu's LLO dump in a process of their own: `benchmarks.perf.megacore_dump`."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from benchmarks.perf.megacore_dump import GENERATION


def cases(kernels: dict) -> dict[str, tuple]:
    """{case: (fn, args, pallas_call name)}: args concrete (numpy), as the model replays them."""
    ragged_dot, rmsnorm, attention = kernels["ragged-dot-tpu"], kernels["rmsnorm-tpu"], kernels["attention-tpu"]
    rng = np.random.default_rng(0)

    def normal(*shape, dtype=jnp.bfloat16):
        return rng.standard_normal(shape).astype(dtype)

    lhs, rhs = normal(1024, 512), normal(8, 512, 1024)
    group_sizes = np.full(8, 128, np.int32)

    def gmm(tile_n):
        config = ragged_dot.gmm.tiles.TileConfig(256, 512, tile_n)
        return functools.partial(ragged_dot.gmm.kernel.grouped_matmul, config=config, generation=GENERATION)

    tokens, hidden, intermediate, experts, top_k = 8, 512, 256, 8, 2
    top_k_index = (np.arange(tokens * top_k).reshape(tokens, top_k) % experts).astype(np.int32)
    layer = (normal(tokens, hidden), top_k_index, normal(tokens, top_k, dtype=jnp.float32),
             normal(experts, hidden, 2 * intermediate), normal(experts, intermediate, hidden))
    q, k, v = (normal(1, 4, 512, 128) for _ in range(3))
    return {
        # Four N tiles on the "parallel" first axis: two per core.
        "ragged_dot, four N tiles": (gmm(256), (lhs, rhs, group_sizes), "ragged_dot"),
        # One N tile: the parallel axis has a single index, nothing to split.
        "ragged_dot, one N tile": (gmm(1024), (lhs, rhs, group_sizes), "ragged_dot"),
        # On v5p the experts are split over the two cores, each summing into a partial output of its own.
        "fused experts (decode)": (functools.partial(ragged_dot.experts_layer, fused=True, generation=GENERATION,
                                                     activation="silu", weights_transposed=False),
                                   layer, "fused_experts"),
        "rms_norm": (functools.partial(rmsnorm.norm.kernel.rms_norm_forward, eps=1e-6, generation=GENERATION,
                                       block_rows=256),
                     (normal(1024, 1024), normal(1024)), "rms_norm"),
        "flash attention forward": (
            functools.partial(attention.flash.kernel.flash_attention_forward, causal=True, generation=GENERATION),
            (q, k, v), "attention_tpu_flash"),
    }
