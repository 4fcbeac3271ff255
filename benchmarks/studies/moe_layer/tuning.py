"""Each tiled rival at the best config of its own space, and tokamax at its own untuned pick."""

from __future__ import annotations

import functools

import jax

from tpu_kernels.runtime.hardware import round_up

from .cache import Cache, replay
from .modelling import joined, price, standalone
from .rivals import RIVALS, TOKAMAX_MIN_ROWS, Rival, candidate_tilings, rival_order, stored_order
from .shapes import DTYPE, Case, projections


def rival_replay(cache: Cache, rival: Rival, case: Case, projection: str, k: int, n: int, tiling):
    """The replay of one projection's grouped matmul by `rival` at `tiling`, on the case's group sizes."""
    _, transposed = rival_order(rival, case.model, projection)
    experts = case.setting.local_experts
    lhs = jax.ShapeDtypeStruct((rival.padded_rows(case.picks, tiling), k), DTYPE)
    rhs = jax.ShapeDtypeStruct((experts, n, k) if transposed else (experts, k, n), DTYPE)
    fn = functools.partial(rival.matmul, transpose_rhs=transposed, tiling=tiling)
    return replay(cache, lambda x, w, s, fn=fn: fn(x, w, s), (lhs, rhs, case.group_sizes), rival.replay_context)


def tune_rival(cache: Cache, rival: Rival, case: Case, generations: tuple[str, ...]) -> dict:
    """Each candidate config's replay per projection, and per generation of `generations` the best standalone config
    that fits.

    The standalone best is what a sweep over the grouped matmul alone finds
    (tokamax's autotuner works that way); it is the config compiled into the
    layer. `best_in_layer` then re-ranks the leading pairs inside the
    compiled layer, where XLA's placement can change the ranking. Ranked by
    the calibrated pipelined figure.
    """
    options = []  # per projection: [(tiling, replay)]
    searched = []
    for projection, k, n in projections(case):
        found = []
        for tiling in candidate_tilings(rival, case.picks, k, n, generations):
            replayed = rival_replay(cache, rival, case, projection, k, n, tiling)
            found.append((tiling, replayed))
            searched.append({
                "projection": projection, "tiling": list(tiling),
                "standalone_us": {g: round(standalone(replayed, g).pipelined_time_s * 1e6, 3) for g in generations},
                "fits_vmem": {g: standalone(replayed, g).fits_vmem for g in generations},
            })
        options.append(found)
    best, ranked = {}, {}
    for generation in generations:
        fitting = []
        for projection, found in zip(projections(case), options):
            fits = sorted(((standalone(r, generation).pipelined_time_s, t, r) for t, r in found
                           if standalone(r, generation).fits_vmem), key=lambda item: item[0])
            if not fits:
                raise RuntimeError(f"{case.label} {rival.name} {projection[0]}: no candidate fits {generation}'s VMEM")
            fitting.append(fits)
        pairs = sorted(((a[0] + b[0], [(a[1], a[2]), (b[1], b[2])]) for a in fitting[0] for b in fitting[1]),
                       key=lambda item: item[0])
        ranked[generation] = [pair for _, pair in pairs]
        best[generation] = ranked[generation][0]
    return {"per_generation": best, "ranked": ranked, "searched": searched}


# The pairs of configs re-ranked inside the compiled layer: the leading ones of the standalone ranking (each
# re-ranking prices the whole layer, and a search of dozens of configs per projection has hundreds of pairs).
LAYER_RERANKED_PAIRS = 16


def best_in_layer(program, ranked, case: Case, generation: str, refused=()):
    """Of the first LAYER_RERANKED_PAIRS pairs of `ranked` (fitting (gate_up, down) configs by standalone time),
    the one with the least modelled layer time under `program`'s placement, but the pairs whose layer Mosaic
    `refused` to compile."""
    best = None
    for pair in ranked[:LAYER_RERANKED_PAIRS]:
        tilings = [t for t, _ in pair]
        if tilings in refused:
            continue
        replayed = joined(r for _, r in pair)
        time_s = price(program, replayed).pipelined_time_s
        if best is None or time_s < best[0]:
            best = (time_s, tilings, replayed)
    return best


def tokamax_pick(case: Case, projection: str, k: int, n: int) -> tuple[int, int, int, int]:
    """(tile_m, tile_k, tile_n, input_buffer_count) tokamax 0.0.12 picks for one projection, untuned.

    Its op looks the call up in its autotuning cache (measurements shipped for v5e and TPU7x; none holds a
    call of these shapes), then in its heuristics: a lookup table keyed by (m, k, n, groups, quantized)
    (`GMM_TILING_TUNED_LUT`, or `GMM_RHS_TRANSPOSE_TILING_TUNED_LUT` for weights stored [E, N, K]), else
    its default `Config()`, (128, 128, 128) with 2 input buffers.
    """
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tokamax_op

    _, transposed = stored_order(case.model, projection)
    rows = round_up(max(case.picks, TOKAMAX_MIN_ROWS), 128)
    table = tokamax_op.GMM_RHS_TRANSPOSE_TILING_TUNED_LUT if transposed else tokamax_op.GMM_TILING_TUNED_LUT
    # The transposed table's key names the output dimension k and the contracting one n (its dlhs use).
    key = (rows, n, k, case.setting.local_experts, False) if transposed else (
        rows, k, n, case.setting.local_experts, False)
    if key in table:
        # Its values go to the kernel as they are: tile_k along the contracting dimension either way.
        (tile_m, tile_k, tile_n), buffers = table[key]
        return tile_m, tile_k, tile_n, buffers
    default = tokamax_op.Config()
    return default.tile_m, default.tile_k, default.tile_n, default.input_buffer_count


def tokamax_default(cache: Cache, case: Case) -> list:
    """tokamax's kernel at its own untuned pick (`tokamax_pick`), per projection: (tiling, replay)."""
    rival = RIVALS["tokamax"]
    result = []
    for projection, k, n in projections(case):
        tiling = tokamax_pick(case, projection, k, n)
        result.append((tiling, rival_replay(cache, rival, case, projection, k, n, tiling)))
    return result


# The extra row of tokamax's kernel at its own untuned pick (the kernel Hugging Face's ragged-dot-tpu ships).
TOKAMAX_DEFAULT = "tokamax_default"
