"""Kernel calls whose split over v5p's two TensorCores the compiler and the performance model must agree on.

Run as `python -m tests.megacore_cases BUILD_FOLDERS_JSON` with libtpu's LLO
dump switched on (LIBTPU_INIT_ARGS="--xla_jf_dump_to=DIR
--xla_jf_dump_llo_text=true", read once when libtpu starts: hence a process
of its own): it compiles each case for v5p and prints, as JSON, the dump
files each case's compile added. tests/test_megacore.py reads them.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

GENERATION = "v5p"


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

    def tgmm(tile_k, tile_n):
        config = ragged_dot.tgmm.tiles.TgmmConfig(256, tile_k, tile_n, 256)
        return functools.partial(ragged_dot.tgmm.kernel.transposed_grouped_matmul, config=config, generation=GENERATION)

    def gated(tile_n):
        """The experts' gate_up with the gate in its epilogue: rhs [8, 2 x 512, 512] read transposed."""
        problem = ragged_dot.MatmulProblem(1024, 512, 1024, 8, "bfloat16", "bfloat16", transpose_rhs=True,
                                           zero_rows_past_groups=False)
        plan = ragged_dot.gmm.plan.make(problem, GENERATION, ragged_dot.gmm.tiles.TileConfig(256, 512, tile_n))
        plan = ragged_dot.gmm.plan.gated_plan(plan, ragged_dot.Gate("silu"))
        return lambda x, w, sizes: ragged_dot.gmm.kernel.call(x, w, sizes, plan)

    tokens, hidden, intermediate, experts, top_k = 8, 512, 256, 8, 2
    top_k_index = (np.arange(tokens * top_k).reshape(tokens, top_k) % experts).astype(np.int32)
    layer = (normal(tokens, hidden), top_k_index, normal(tokens, top_k, dtype=jnp.float32),
             normal(experts, hidden, 2 * intermediate), normal(experts, intermediate, hidden))
    q, k, v = (normal(1, 4, 512, 128) for _ in range(3))
    # The combine kernel over 256 tokens (two tiles of 128), two picks each: one sorted row per pick, as words.
    combine_tokens = 256
    combine = ragged_dot.combine.plan.make(ragged_dot.CombineProblem(combine_tokens, top_k, hidden, "bfloat16", hidden,
                                                                hidden // 2), GENERATION)
    position = rng.permutation(combine_tokens * top_k).reshape(combine_tokens, top_k).astype(np.int32)
    combine_args = (rng.integers(-2**31, 2**31, (combine_tokens * top_k, hidden // 2), dtype=np.int32), position,
                    normal(combine_tokens, top_k, dtype=jnp.float32), np.ones((combine_tokens, top_k), bool))
    return {
        # Four N tiles on the "parallel" first axis: two per core.
        "ragged_dot, four N tiles": (gmm(256), (lhs, rhs, group_sizes), "ragged_dot"),
        # One N tile: the parallel axis has a single index, nothing to split.
        "ragged_dot, one N tile": (gmm(1024), (lhs, rhs, group_sizes), "ragged_dot"),
        # The gated gate_up, two N tiles of the intermediate (each fetching a gate and an up block): one per core.
        "ragged_dot gated, two N tiles": (gated(512), (lhs, normal(8, 1024, 512), group_sizes), "ragged_dot"),
        # tgmm's grid (N tiles, K tiles, items) has two parallel axes: two N tiles split there...
        "tgmm, two N tiles": (tgmm(512, 512), (lhs, normal(1024, 1024), group_sizes), "tgmm"),
        # ...and with one N tile, the two K tiles (the second parallel axis).
        "tgmm, one N tile, two K tiles": (tgmm(256, 1024), (lhs, normal(1024, 1024), group_sizes), "tgmm"),
        # On v5p the experts are split over the two cores, each summing into a partial output of its own.
        "fused experts (decode)": (functools.partial(ragged_dot.experts_layer, fused=True, generation=GENERATION,
                                                     activation="silu", weights_transposed=False),
                                   layer, "fused_experts"),
        # One pick: both cores share its expert, each taking one of its two I tiles.
        "fused experts, one expert shared": (
            functools.partial(ragged_dot.fused.kernel.fused_experts, activation="silu", weights_transposed=False,
                              config=ragged_dot.fused.tiles.FusedConfig(16, intermediate // 2, cores_per_expert=2),
                              generation=GENERATION),
            (normal(1, hidden), np.array([[3]], np.int32), normal(1, 1, dtype=jnp.float32),
             normal(experts, 2 * intermediate, hidden), normal(experts, hidden, intermediate)),
            "fused_experts"),
        # Two token tiles, one per core.
        "combine picks, two token tiles": (functools.partial(ragged_dot.combine.kernel.call, plan=combine),
                                           combine_args, "combine_picks"),
        "rms_norm": (functools.partial(rmsnorm.norm.kernel.rms_norm_forward, eps=1e-6, generation=GENERATION,
                                       block_rows=256),
                     (normal(1024, 1024), normal(1024)), "rms_norm"),
        "flash attention forward": (
            functools.partial(attention.flash.kernel.flash_attention_forward, causal=True, generation=GENERATION),
            (q, k, v), "attention_tpu_flash"),
    }


def _compile_each(build_folders: dict[str, str], dump: Path) -> dict[str, list[str]]:
    import kernels as hf_kernels

    from tpu_kernels.aot import compile_for

    loaded = {name: hf_kernels.get_local_kernel(Path(folder), backend="cpu") for name, folder in build_folders.items()}
    added = {}
    for case, (fn, args, _) in cases(loaded).items():
        before = set(dump.iterdir()) if dump.exists() else set()
        compile_for(fn, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args], GENERATION)
        added[case] = sorted(path.name for path in set(dump.iterdir()) - before)
    return added


if __name__ == "__main__":
    build_folders, dump = json.loads(sys.argv[1]), Path(sys.argv[2])
    print(json.dumps(_compile_each(build_folders, dump)))
