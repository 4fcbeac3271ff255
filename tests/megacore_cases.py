"""Kernel calls whose split over v5p's two TensorCores the compiler and the performance model must agree on
(tests/test_megacore.py): through the kernels' faces, and ragged-dot-tpu's kernels past its face (the gated grouped
matmul, tgmm, the fused kernel sharing one expert, the combine kernel). Compiled with libtpu's LLO dump in a process
of their own: `benchmarks.perf.megacore_dump`."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from benchmarks.perf.megacore_dump import GENERATION
from tpu_kernels.runtime.hardware import resolve_target


def cases(kernels: dict) -> dict[str, tuple]:
    """{case: (fn, args, pallas_call name)}: args concrete (numpy), as the model replays them."""
    rng = np.random.default_rng(0)

    def normal(*shape, dtype=jnp.bfloat16):
        return rng.standard_normal(shape).astype(dtype)

    return {**_through_the_faces(kernels, normal), **_ragged_dot_internals(kernels["ragged-dot-tpu"], normal, rng)}


def _through_the_faces(kernels: dict, normal) -> dict[str, tuple]:
    ragged_dot, rmsnorm, attention = kernels["ragged-dot-tpu"], kernels["rmsnorm-tpu"], kernels["attention-tpu"]
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


def _ragged_dot_internals(kernel, normal, rng) -> dict[str, tuple]:
    target = resolve_target(GENERATION)
    lhs, group_sizes = normal(1024, 512), np.full(8, 128, np.int32)

    def tgmm(tile_k, tile_n):
        config = kernel.tgmm.tiles.TgmmConfig(256, tile_k, tile_n, 256)
        return functools.partial(kernel.tgmm.kernel.transposed_grouped_matmul, config=config, generation=GENERATION)

    def gated(tile_n):
        """The experts' gate_up with the gate in its epilogue: rhs [8, 2 x 512, 512] read transposed."""
        problem = kernel.MatmulProblem(1024, 512, 1024, 8, "bfloat16", "bfloat16", transpose_rhs=True,
                                       zero_rows_past_groups=False)
        plan = kernel.gmm.plan.make(problem, target, kernel.gmm.tiles.TileConfig(256, 512, tile_n))
        plan = kernel.gmm.plan.gated_plan(plan, kernel.problem.Gate("silu"), target)
        return lambda x, w, sizes: kernel.gmm.kernel.call(x, w, sizes, plan)

    hidden, intermediate, experts, top_k = 512, 256, 8, 2
    # The combine kernel over 256 tokens (two tiles of 128), two picks each: one sorted row per pick, as words.
    combine_tokens = 256
    combine = kernel.combine.plan.make(
        kernel.problem.CombineProblem(combine_tokens, top_k, hidden, "bfloat16", hidden, hidden // 2), target)
    position = rng.permutation(combine_tokens * top_k).reshape(combine_tokens, top_k).astype(np.int32)
    combine_args = (rng.integers(-2**31, 2**31, (combine_tokens * top_k, hidden // 2), dtype=np.int32), position,
                    normal(combine_tokens, top_k, dtype=jnp.float32), np.ones((combine_tokens, top_k), bool))
    return {
        # The gated gate_up, two N tiles of the intermediate (each fetching a gate and an up block): one per core.
        "ragged_dot gated, two N tiles": (gated(512), (lhs, normal(8, 1024, 512), group_sizes), "ragged_dot"),
        # tgmm's grid (N tiles, K tiles, items) has two parallel axes: two N tiles split there...
        "tgmm, two N tiles": (tgmm(512, 512), (lhs, normal(1024, 1024), group_sizes), "tgmm"),
        # ...and with one N tile, the two K tiles (the second parallel axis).
        "tgmm, one N tile, two K tiles": (tgmm(256, 1024), (lhs, normal(1024, 1024), group_sizes), "tgmm"),
        # One pick: both cores share its expert, each taking one of its two I tiles.
        "fused experts, one expert shared": (
            functools.partial(kernel.fused.kernel.fused_experts, activation="silu", weights_transposed=False,
                              config=kernel.fused.tiles.FusedConfig(16, intermediate // 2, cores_per_expert=2),
                              generation=GENERATION),
            (normal(1, hidden), np.array([[3]], np.int32), normal(1, 1, dtype=jnp.float32),
             normal(experts, 2 * intermediate, hidden), normal(experts, hidden, intermediate)),
            "fused_experts"),
        # Two token tiles, one per core.
        "combine picks, two token tiles": (functools.partial(kernel.combine.kernel.call, plan=combine),
                                           combine_args, "combine_picks"),
    }
