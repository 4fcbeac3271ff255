"""vLLM's fused_ep_moe across chips against ours at the same chip count: multichip.json's `fused_ep_moe` section.

Qwen3-30B-A3B on v6e, one decoder layer's MoE part on the busiest chip, at
2, 4 and 8 chips (meshes 1x2, 2x2 and 2x4, `MESHES`) and the multichip
study's batches:

- **fused_ep_moe**: vLLM's FUSED_MOE layer (`moe_layer.vllm_fused`) with
  the batch split over the N chips, at the fastest block sizes that fit VMEM
  (`moe_layer.fused_search`), compiled with its body on a compile-only mesh of
  N devices and priced by moe_layer's model; then what it exchanges between
  chips, priced by `benchmarks.perf.collectives` as multichip prices ours
  (`fused_ep_moe_collectives`: its barriers, its ring all-reduce of pick
  counts, its rows to the experts' chips and back per token block, the output
  all-gather and attention's all-reduce). The kernel refuses a batch that is
  not a multiple of N or leaves a chip an odd number of tokens: no figure
  there, with its reason.
- **ours**, `ep_router` and `ep_dispatch` (`collectives.moe_layer_collectives`)
  at the same N: moe_layer's cases of that rank count, our layer compiled and
  replayed as moe_layer does, with the layout's collectives.

Each figure is the experts layer plus its collectives, at the central hop
latency and host sync and at their low and high bounds (`HOP_LATENCY_S`,
`HOST_SYNC_S`); the layer at its calibrated headline figure (no band, the same
for both). Ranked per (batch, N) by the central figure.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.perf.collectives import (
    HOP_LATENCY_S, HOST_SYNC_S, ICI_LINK_BYTES_PER_S, V6E_8, Ici, Mesh, fused_ep_moe_collectives,
    moe_layer_collectives,
)
from benchmarks.studies import moe_layer
from benchmarks.studies.moe_layer import fused_search
from benchmarks.studies.moe_layer.cache import replay
from benchmarks.studies.moe_layer.modelling import timings
from benchmarks.studies.moe_layer.ours import ours_layer

GENERATION = "v6e"
MESHES = {2: Mesh(rows=1, cols=2), 4: Mesh(rows=2, cols=2), 8: V6E_8}
OUR_MODES = {"ep_router": "router-masking", "ep_dispatch": "dispatch"}
BOUNDS = ("low", "central", "high")


def case(model, chips: int, mode: str, batch: int):
    return moe_layer.make_case(moe_layer.Setting(model, chips, mode), batch)


def with_collectives(layer_us: float, listed: dict[str, list]) -> dict:
    """The layer plus its collectives per bound, and the central collectives by name."""
    return {"collectives_us": {b: round(sum(c.time_s for c in listed[b]) * 1e6, 3) for b in BOUNDS},
            "per_layer_us": {b: round(layer_us + sum(c.time_s for c in listed[b]) * 1e6, 3) for b in BOUNDS},
            "collectives": [{"name": c.name, "kind": c.kind, "bytes": c.bytes, "us": round(c.time_s * 1e6, 3)}
                            for c in listed["central"]]}


def fused_entry(model, chips: int, batch: int, compiler) -> dict:
    fused_case = case(model, chips, "dispatch", batch)  # the kernel routes the whole batch itself
    ((future, sizes, found),) = fused_search.queue(fused_case, compiler, (GENERATION,)).values()
    entry = fused_search.variant(fused_case, GENERATION, future.result(), sizes, found, compiler)
    if not entry.get("compiled") or not moe_layer.modelled(entry):
        return {"error": entry.get("error", "not modelled")}
    bt = entry["block_sizes"]["bt"]
    listed = {b: fused_ep_moe_collectives(batch, hidden=model.hidden, experts=model.experts, top_k=model.top_k,
                                          token_block=bt, mesh=MESHES[chips],
                                          ici=Ici(ICI_LINK_BYTES_PER_S, HOP_LATENCY_S[b])) for b in BOUNDS}
    return {"layer_us": entry["headline_us"], "block_sizes": entry["block_sizes"],
            "vllm_block_sizes": entry["vllm_block_sizes"], "token_blocks": entry["token_blocks"],
            **with_collectives(entry["headline_us"], listed)}


def ours_entry(built, model, chips: int, mode: str, batch: int, cache, compiler) -> dict:
    our_case = case(model, chips, OUR_MODES[mode], batch)
    layer = ours_layer(built, model, GENERATION)
    program = compiler.submit(layer, our_case.avals(concrete_index=False), GENERATION,
                              kind="ours' bf16 layers at decode").result()
    if isinstance(program, dict):
        return {"error": program["error"]}
    modelled = timings(program, replay(cache, layer, our_case.avals(concrete_index=True)), our_case, GENERATION)
    listed = {b: moe_layer_collectives(mode, batch, hidden=model.hidden, experts=model.experts, top_k=model.top_k,
                                       mesh=MESHES[chips], ici=Ici(ICI_LINK_BYTES_PER_S, HOP_LATENCY_S[b]),
                                       host_sync_s=HOST_SYNC_S[b]) for b in BOUNDS}
    return {"layer_us": modelled["headline_us"], **with_collectives(modelled["headline_us"], listed)}


def compare(model, batches, repo: Path, cache_dir: Path | None, jobs: int) -> dict:
    """Per batch and chip count: fused_ep_moe's and our layouts' layer plus collectives, the fastest central."""
    cache = moe_layer.Cache(cache_dir)
    compiler = moe_layer.Compiler(cache, jobs)
    entries = []
    with moe_layer.build_folder(cache_dir) as build_dir:
        built = moe_layer.load_kernel(repo, build_dir)
        for chips in MESHES:
            for batch in batches:
                found = {"vllm_fused_ep_moe": fused_entry(model, chips, batch, compiler)}
                found |= {mode: ours_entry(built, model, chips, mode, batch, cache, compiler) for mode in OUR_MODES}
                priced = sorted((v["per_layer_us"]["central"], name) for name, v in found.items() if "error" not in v)
                entries.append({"chips": chips, "batch": batch, "layouts": found,
                                "fastest": priced[0][1] if priced else None})
                print(f"fused vs ours: {chips} chips, batch {batch}: " + ", ".join(
                    f"{name} {v['per_layer_us']['central']:.1f} us" if "error" not in v else f"{name}: {v['error']}"
                    for name, v in found.items()), flush=True)
    compiler.pool.shutdown()
    return {"what": f"one {model.name} MoE layer on the busiest of N {GENERATION} chips: vLLM's fused_ep_moe at its "
                    "searched block sizes with what it exchanges between chips, against ours in transformers' "
                    "EP layouts at the same N (benchmarks/studies/multichip_fused.py)",
            "meshes": {str(chips): f"{mesh.rows}x{mesh.cols}" for chips, mesh in MESHES.items()},
            "entries": entries}
