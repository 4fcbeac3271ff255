"""One case measured: ours and every rival replayed, compiled per generation and modelled, one row each."""

from __future__ import annotations

from tpu_kernels.runtime.hardware import tpu_generation

from .cache import Cache, Compiler, replay
from .modelling import joined, timings
from .ours import ours_layer, quantized_avals, quantized_layer, quantized_min_bytes, quantized_schemes
from .rivals import RIVALS, rival_layer
from .shapes import GENERATIONS, Case
from .targets import summarise
from .tuning import TOKAMAX_DEFAULT, best_in_layer, tokamax_default, tune_rival
from . import fused_search, vllm_fused


# A rival config Mosaic refuses to compile inside the layer is replaced by the next best, at most this many times.
MAX_COMPILE_FALLBACKS = 4


def measure_case(built, case: Case, cache: Cache, compiler: Compiler, rivals: list[str],
                 generations: tuple[str, ...] = GENERATIONS, quantized_prefill: bool = False):
    """Replays `case`'s kernels, queues its compiles, and returns a function that waits for them and builds its rows
    (one per generation). Quantized variants at decode, and with `quantized_prefill` at prefill too."""
    pending = queue_ours(built, case, cache, compiler, generations, quantized_prefill)
    tunings = queue_rivals(case, cache, compiler, rivals, generations, pending)

    def finish() -> list[dict]:
        rows = []
        for generation in generations:
            row = row_facts(case, generation)
            for (name, gen), (future, replayed, tilings) in pending.items():
                if gen == generation:
                    row["variants"][name] = variant(built, case, compiler, name, generation, future.result(),
                                                    replayed, tilings, tunings.get(name))
            for name in rivals:
                if name in tunings:
                    row.setdefault("rival_search", {})[name] = tunings[name]["searched"]
            summarise(row, rivals)
            rows.append(row)
        return rows

    return finish


def queue_ours(built, case: Case, cache: Cache, compiler: Compiler, generations, quantized_prefill: bool) -> dict:
    """Ours (and at decode, or everywhere with `quantized_prefill`, its quantized variants) per generation:
    (variant, generation) -> (future of the compiled program, replay, tilings)."""
    replay_args = case.avals(concrete_index=True)
    compile_avals = case.avals(concrete_index=False)
    pending = {}
    for generation in generations:
        layer = ours_layer(built, case.model, generation)
        pending[("ours", generation)] = (compiler.submit(layer, compile_avals, generation,
                                                         kind=f"ours' bf16 layers at {case.phase}"),
                                         replay(cache, layer, replay_args), None)
        if case.phase == "decode" or quantized_prefill:
            for scheme in quantized_schemes(built, generation):
                layer = quantized_layer(built, case.model, generation)
                pending[(f"ours_{scheme}", generation)] = (
                    compiler.submit(layer, quantized_avals(built, case, scheme, False), generation,
                                    kind=f"ours' quantized layers at {case.phase}"),
                    replay(cache, layer, quantized_avals(built, case, scheme, True)), None)
    return pending


def queue_rivals(case: Case, cache: Cache, compiler: Compiler, rivals: list[str], generations, pending: dict) -> dict:
    """Adds each rival's layer (and tokamax's untuned pick) to `pending`; returns the tiled rivals' tunings."""
    tunings = {}
    if vllm_fused.FUSED in rivals:
        queue_fused(case, compiler, generations, pending)
    for name in rivals:
        if name == vllm_fused.FUSED:
            continue
        rival = RIVALS[name]
        replay_args = case.avals(concrete_index=True, weights_k_n=rival.weights_k_n)
        compile_avals = case.avals(concrete_index=False, weights_k_n=rival.weights_k_n)
        if rival.tiled:
            tunings[name] = tune_rival(cache, rival, case, generations)
        else:  # XLA's ragged dots: replayed inside the layer, with the case's group sizes
            replayed = replay(cache, rival_layer(rival, case.model, [None, None]), replay_args)
        for generation in generations:
            if rival.tiled:
                chosen = tunings[name]["per_generation"][generation]
                tilings = [tiling for tiling, _ in chosen]
                replayed = joined(r for _, r in chosen)
            else:
                tilings = None
            layer = rival_layer(rival, case.model, tilings or [None, None])
            future = compiler.submit(layer, compile_avals, generation, rival.lowering_lock(), kernel_bodies=False,
                                     kind=f"rivals' layers at {case.phase}")
            pending[(name, generation)] = (future, replayed, tilings)
    if "tokamax" in rivals:
        compile_avals = case.avals(concrete_index=False)
        defaults = tokamax_default(cache, case)
        tilings = [tiling for tiling, _ in defaults]
        for generation in generations:
            layer = rival_layer(RIVALS["tokamax"], case.model, tilings)
            pending[(TOKAMAX_DEFAULT, generation)] = (
                compiler.submit(layer, compile_avals, generation, RIVALS["tokamax"].lowering_lock(),
                                kernel_bodies=False, kind=f"rivals' layers at {case.phase}"),
                joined(r for _, r in defaults), tilings)
    return tunings


def queue_fused(case: Case, compiler: Compiler, generations, pending: dict) -> None:
    """vLLM's fused kernel per generation at its searched block sizes: compiled with its body on the case's mesh,
    its schedule counted (`fused_search`)."""
    for generation, (future, sizes, found) in fused_search.queue(case, compiler, generations).items():
        pending[(vllm_fused.FUSED, generation)] = (future, sizes, found)


def row_facts(case: Case, generation: str) -> dict:
    """A row's shape facts and roofline, before its variants."""
    facts = tpu_generation(generation)
    return {
        "label": case.label, "setting": case.setting.label, "model": case.model.name, "ep": case.setting.ep,
        "mode": case.setting.mode, "tokens": case.tokens, "phase": case.phase, "generation": generation,
        "rows": case.rows, "picks": case.picks, "live_picks": case.live_picks,
        "active_experts": case.active_experts, "local_experts": case.setting.local_experts,
        "min_bytes": case.min_bytes, "useful_flops": case.useful_flops,
        "roofline_us": round(case.roofline_s(generation) * 1e6, 3),
        "roofline_bound": "compute" if case.useful_flops / facts.device_bf16_flops_per_s
        > case.min_bytes / facts.device_hbm_bytes_per_s else "hbm",
        "variants": {},
    }


def variant(built, case: Case, compiler: Compiler, name: str, generation: str, program, replayed, tilings,
            tuning: dict | None) -> dict:
    """One variant's entry in a row: its modelled time and terms, or why it has none."""
    if name == vllm_fused.FUSED:
        return fused_search.variant(case, generation, program, replayed, tilings, compiler)
    compile_avals = case.avals(concrete_index=False, weights_k_n=name in RIVALS and RIVALS[name].weights_k_n)
    refused = []
    if isinstance(program, dict) and tuning is not None:
        # The compiler refused the standalone best inside the layer: the rival's best is then the
        # next pair by standalone time that compiles.
        for pair in tuning["ranked"][generation][1:1 + MAX_COMPILE_FALLBACKS]:
            refused.append({"tiling": list(tilings), "error": program["error"]})
            tilings, replayed = [t for t, _ in pair], joined(r for _, r in pair)
            program = compiler.submit(rival_layer(RIVALS[name], case.model, tilings), compile_avals,
                                      generation, RIVALS[name].lowering_lock(), kernel_bodies=False,
                                      kind=f"rivals' layers at {case.phase}").result()
            if not isinstance(program, dict):
                break
    if isinstance(program, dict):
        return {"compiled": False, **program, "refused_tilings": refused}
    entry = {"compiled": True, **timings(program, replayed, case, generation)}
    if name != "ours" and not name.startswith("ours_"):
        entry["kernel_bodies"] = ("empty in the compile (the XLA program and placements are the layer's; "
                                  "Mosaic's check of the bodies is not made)")
    if name.startswith("ours_"):
        scheme = name.removeprefix("ours_")
        minimum = quantized_min_bytes(built, case, scheme)
        entry = {"extra_row": f"ours with {scheme} expert weights; over_roofline is against "
                              "the bf16 roofline", **entry, "quantized_min_bytes": minimum}
        if "hbm_bytes" in entry:
            entry["bytes_over_quantized_min"] = entry["hbm_bytes"] / minimum
    if name == TOKAMAX_DEFAULT:
        entry["extra_row"] = ("tokamax's kernel at tokamax 0.0.12's own untuned pick (its autotuning "
                              "cache holds none of these calls; its lookup table, else Config(): "
                              "128^3, 2 buffers); the kernel kernels-community/ragged-dot-tpu ships")
    if refused:
        entry["refused_tilings"] = refused
    if tilings and tilings[0] is not None:
        entry["tiling"] = {"gate_up": list(tilings[0]), "down": list(tilings[1])}
    if tuning is not None and entry.get("modelled", True):
        _, best_tilings, best_replay = best_in_layer(program, tuning["ranked"][generation], case, generation,
                                                     refused=[r["tiling"] for r in refused])
        if best_tilings != list(tilings):
            entry = {"compiled": True, "kernel_bodies": entry["kernel_bodies"],
                     "placement_from": f"the layer compiled at the standalone best {tilings}",
                     **timings(program, best_replay, case, generation),
                     "tiling": {"gate_up": list(best_tilings[0]), "down": list(best_tilings[1])},
                     "standalone_best_tiling": {"gate_up": list(tilings[0]), "down": list(tilings[1])},
                     "standalone_best_us": entry["headline_us"]}
    return entry
