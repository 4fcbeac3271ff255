"""`python -m benchmarks cb_step`: price every path of every step, model and generation; write the JSON."""

from __future__ import annotations

import tempfile
from pathlib import Path

import jax
import kernels

from benchmarks import perf
from benchmarks.studies import calibration_bands, moe_layer, report_header, require_kernel_repo, result_path
from benchmarks.studies.paged_attention.run import attention_arguments
from tpu_kernels.distribution.builder import build_kernel_repo

from . import kernels as step_kernels
from . import programs, steps
from .paths import PATHS, path
from .summary import summarise
from .xla import XlaPricer

DEFAULT_OUT = result_path("cb_step.json")


def copy_programs(batch, model, found) -> dict[str, list]:
    gather = programs.gather_programs(batch, model, found)
    return {"transformers_ragged": gather + programs.ragged_pad_programs(model, found),
            "transformers_padded": gather + programs.padded_programs(model, found)}


def price_case(built, batch, model, pricer: XlaPricer, wheels: Path) -> dict:
    """Every path of one (model, step) on every generation."""
    found = steps.sizes(batch, model)
    copies = copy_programs(batch, model, found)
    futures = {(name, i, generation): pricer.submit(program, generation)
               for name, listed in copies.items() for i, program in enumerate(listed)
               for generation in steps.GENERATIONS}
    kernel_rows = {"transformers_ragged": step_kernels.ragged_contiguous(built, batch, model, found),
                   "transformers_padded": step_kernels.padded_flash(built, batch, model, found),
                   "ours_in_place": step_kernels.in_place(built, batch, model),
                   "vllm_rpa_v3_in_place": step_kernels.vllm_in_place(batch, model, wheels)}
    per_generation = {}
    for generation in steps.GENERATIONS:
        priced = {name: [pricer.finish(program, futures[(name, i, generation)], generation)
                         for i, program in enumerate(listed)] for name, listed in copies.items()}
        per_generation[generation] = {name: path(priced.get(name, []), kernel_rows[name][generation], generation)
                                      for name in PATHS}
    return {"model": model.name, "step": batch.label, "kind": batch.kind, "sizes": vars(found),
            "q_heads": model.q_heads, "kv_heads": model.kv_heads, "head_dim": model.head_dim,
            "sliding_window": model.sliding_window, "sinks": model.sinks,
            "gathered_bytes": 2 * found.total_k * model.kv_heads * model.head_dim * 2,
            "per_generation": per_generation}


def main(argv=None) -> int:
    parser = attention_arguments(__package__, DEFAULT_OUT)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=moe_layer.DEFAULT_CACHE)
    args = parser.parse_args(argv)
    require_kernel_repo(args.repo)
    cache = moe_layer.Cache(args.cache_dir)
    pricer = XlaPricer(cache, moe_layer.Compiler(cache, args.jobs))
    rows = []
    with tempfile.TemporaryDirectory() as build_dir:
        built = kernels.get_local_kernel(build_kernel_repo(args.repo, Path(build_dir)), backend="cpu")
        for model in steps.MODELS[:1] if args.quick else steps.MODELS:
            for batch in steps.batches():
                row = price_case(built, batch, model, pricer, args.wheels)
                rows.append(row)
                print(f"{model.name:24s} {batch.label:44s} " + "  ".join(
                    f"{g} ragged {row['per_generation'][g]['transformers_ragged'].get('total_us', float('nan')):.0f} us"
                    f" ({row['per_generation'][g]['transformers_ragged'].get('copies_share_pct', float('nan')):.0f}%"
                    " copies)" for g in steps.GENERATIONS), flush=True)
    pricer.compiler.pool.shutdown()
    report = {
        **report_header("cb_step", args.repo),
        "per": "one attention layer, one continuous-batching step",
        "paths": PATHS,
        "assumptions": assumptions(),
        "calibrated_errors": {g: calibration_bands.describe("flash_attention", g) for g in steps.GENERATIONS},
        "hbm_fraction": {g: perf.FITTED_RATES.hbm_fraction(g) for g in steps.GENERATIONS},
        "environment": {"jax": jax.__version__, "tpu": "none (model only)"},
        "summary": summarise(rows),
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(moe_layer.dump_compact(moe_layer.rounded(report)) + "\n")
    print(f"wrote {args.out}")
    return 0


def assumptions() -> dict:
    return {
        "gather": "transformers 5.25 continuous batching off CUDA/XPU (no block table): per layer torch.index_select "
                  "of K and of V by the read index, the batch's true rows (inputs are padded only under accelerator "
                  "graphs or torch.compile, and transformers has no graph backend on TPU); sliding layers read "
                  "min(past, window - 1) cached rows + the new ones and fill those by masked_scatter_; each eager op "
                  "its own XLA program",
        "pad": "flash_api.py as it stands: without a gradient q rows padded to their token bucket, K/V rows to "
               "their key bucket (tpu_kernels.runtime.buckets) and sequences to a power of two (at least "
               f"{steps.RAGGED_SEQUENCES_FLOOR}) by torch.nn.functional.pad; with one, the batch to a power of two, "
               "each sequence's query and key length to its bucket and every sequence padded to them (K, V and q each "
               "gathered per sequence, then made heads first, each an eager op; the output gathered back)",
        "granularity": "a gather moves rows of Hkv * D elements (a few KiB or less) and is priced at the "
                       "streaming HBM rate with no cost per row, as every copy here: if anything, the copies' "
                       "figures are low",
        "relayout": "each kernel's own program (flash_attn_varlen_func's and the in-place paths' jitted call) is "
                    "charged the copies XLA makes of its arguments into the kernel's layout (perf.argument_layouts, "
                    "uncalibrated): at head_dim 64 XLA stores neither the packed K and V nor the paged cache "
                    "row-major by default; the ragged kernel reads both in XLA's layout (keys-minor: packed rows "
                    "a multiple of 128, as the key buckets make them, and pages of a multiple of "
                    "128 tokens), with no copy; the flash kernel (the gradient path) reads q, K and V and writes its "
                    "output in XLA's layout too",
        "left_out": "the cache write (index_copy_ of the new rows: the same on every path, vLLM's included), the "
                    "kernel's own reshapes of q and out, the host's dispatch of each eager op",
        "copies_priced_by": "each copy's XLA program compiled for the generation's compile-only topology, priced by "
                            "perf.program_time (HBM traffic from the optimized HLO at the fitted share); no "
                            "calibrated error (uncalibrated: the band covers the kernel's error only)",
        "kernels_priced_by": "grid replay and the kernels' scalar programs (perf.scalar_replay), priced phase by "
                             "phase, the calibrated pipelined figure; band: flash_attention's calibrated p90 in the "
                             "kernel's regime",
        "page_sizes": {"ours_in_place": steps.TRANSFORMERS_PAGE_SIZE, "vllm_rpa_v3_in_place": steps.VLLM_PAGE_SIZE,
                       "why": "transformers' paged cache block size; vLLM TPU's usual block size"},
        "steps": "64 decodes with contexts drawn uniformly in 256..8192 (seed 0); the same with one prefill chunk "
                 "of 1024 new tokens over 3072 cached (paged_attention's batches)",
    }
