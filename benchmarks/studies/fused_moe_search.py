"""vLLM's fused_ep_moe at its own block sizes and at the best ones searched, per moe_layer shape and generation.

moe_layer prices vLLM's fused MoE kernel (`vllm_fused_ep_moe`) at the fastest
of its block sizes that fit VMEM (`moe_layer.fused_search`: its docstring says
what is searched). This benchmark records the search itself, on every
moe_layer shape and every supported generation: vLLM's own pick (its tuned
table, else its default formula, with the kernel's overrides; or why the
kernel refuses it), the searched best, both priced standalone by the same
model (the kernel's counted schedule at the shape's routing: its
`vllm_fused.replay`), and how many configs the kernel accepts, fit VMEM and
were priced. At the anchor shape both picks are also compiled as vLLM's layer
(Mosaic's check of the kernel body made) and priced as moe_layer prices the
layer (`layer_us`: the kernel and the XLA ops around it).

Usage:
    python -m benchmarks fused_moe_search [--out benchmarks/results/fused_moe_search.json] [--cache-dir DIR]
        [--no-cache]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks.studies import moe_layer, result_path
from benchmarks.studies.moe_layer import fused_search, vllm_fused
from benchmarks.studies.moe_layer.modelling import timings
from benchmarks.studies.moe_layer.shapes import DECODE_TOKENS, PREFILL_TOKENS
from tpu_kernels.runtime.hardware import SUPPORTED_GENERATIONS

DEFAULT_OUT = result_path("fused_moe_search.json")


def shape_entry(case, generation: str) -> dict:
    """vLLM's pick and the searched best for one shape on one generation, standalone."""
    found = fused_search.search(case, generation)
    try:
        vllms, source = vllm_fused.block_sizes(case.model, case.tokens, case.setting.ep)
        refused = vllm_fused.refusal(case, vllms)
    except AssertionError as error:  # vLLM's own table lookup refuses the shape
        vllms, source, refused = None, "none", f"vLLM's block-size lookup refuses it ({error})"
    entry = {"label": case.label, "generation": generation, "configs_accepted": found["searched"],
             "configs_fitting_vmem": found["fitting"], "configs_priced": found["priced"],
             "vllm": {"block_sizes": vllms, "from": source, "refused": refused, "fits_vmem": found["vllm_fits"],
                      "standalone_us": found["vllm_standalone_us"]}}
    if found["ranked"]:
        best_s, best = found["ranked"][0]
        entry["best"] = {"block_sizes": best, "standalone_us": round(best_s * 1e6, 3),
                         "weight_passes": case.tokens // case.setting.ep // best["bt"]}
    return entry


def anchor_layers(compiler) -> dict:
    """At the anchor shape, per generation: vLLM's layer compiled and priced at vLLM's pick and at the best."""
    label, tokens, _ = moe_layer.ANCHOR
    case = moe_layer.make_case(next(s for s in moe_layer.SETTINGS if s.label == label), tokens)
    layers = {}
    for generation in SUPPORTED_GENERATIONS:
        ((future, sizes, found),) = fused_search.queue(case, compiler, (generation,)).values()
        best = fused_search.variant(case, generation, future.result(), sizes, found, compiler)
        vllms = compiler.submit(None, None, generation, lower=vllm_fused.lowering(case, generation),
                                kind="vLLM's fused kernel at decode").result()
        replayed, _ = vllm_fused.replay(case)
        layers[generation] = {
            "vllm_layer_us": None if isinstance(vllms, dict) else timings(vllms, replayed, case, generation)[
                "headline_us"],
            "best_layer_us": best.get("headline_us"), "best_block_sizes": best.get("block_sizes"),
            "refused_block_sizes": best.get("refused_block_sizes"), "error": best.get("error")}
    return {"label": case.label, "per_generation": layers}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--cache-dir", type=Path, default=moe_layer.DEFAULT_CACHE)
    parser.add_argument("--no-cache", action="store_true")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    entries = []
    for setting in moe_layer.SETTINGS:
        for tokens in DECODE_TOKENS + PREFILL_TOKENS:
            case = moe_layer.make_case(setting, tokens)
            entries += [shape_entry(case, generation) for generation in SUPPORTED_GENERATIONS]
            print(f"searched {case.label} ({time.perf_counter() - started:.0f} s)", flush=True)
    # One compile at a time: each anchor layer waits for the one before (a refused pick's fallback is the next).
    compiler = moe_layer.Compiler(moe_layer.Cache(None if args.no_cache else args.cache_dir), 1)
    anchor = anchor_layers(compiler)
    compiler.pool.shutdown()
    report = {"benchmark": "benchmarks.studies.fused_moe_search",
              "what": __doc__.split("\n\n")[1].replace("\n", " "),
              "search": fused_search.__doc__.split("\n\n")[1].replace("\n", " "),
              "kernel": f"{vllm_fused.FUSED}: tpu-inference 0.32.0's fused_moe/v1/kernel.py from its pinned wheel",
              "anchor": anchor, "shapes": entries}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(moe_layer.dump_compact(moe_layer.rounded(report)) + "\n")
    print(f"wrote {args.out} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
