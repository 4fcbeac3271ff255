"""Calls of this repo's kernels, past its face, whose split over v5p's two TensorCores the compiler and the
performance model must agree on (test_megacore.py; tests/megacore_cases.py holds the cases the face reaches).
Compiled with libtpu's LLO dump in a process of their own: `benchmarks.perf.megacore_dump`."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from benchmarks.perf.megacore_dump import GENERATION
from tpu_kernels.runtime.hardware import resolve_target


def cases(kernels: dict) -> dict[str, tuple]:
    """{case: (fn, args, pallas_call name)}: args concrete (numpy), as the model replays them."""
    kernel = kernels["ragged-dot-tpu"]
    target = resolve_target(GENERATION)
    rng = np.random.default_rng(0)

    def normal(*shape, dtype=jnp.bfloat16):
        return rng.standard_normal(shape).astype(dtype)

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
