"""The command line: the backward at the training shapes (or its tile sweep), then the forward shapes."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import kernels

from benchmarks import perf
from benchmarks.studies import (
    calibration_bands, kernel_repo, report_header, require_kernel_repo, result_path, write_json,
)
from tpu_kernels.distribution.builder import build_kernel_repo

from .backward import TRAINING_SHAPES, measure_backward, summarise_backward, sweep_backward
from .forward import GENERATIONS, QUICK, SHAPES, measure, summarise, sweep_forward


KERNEL_REPO = kernel_repo("attention-tpu")
DEFAULT_OUT = result_path("attention.json")
RELAYOUT_ASSUMPTION = (
    "each priced program is compiled as a user's jitted call makes it (kernelize's binding hands torch-tpu's device "
    "tensors over in XLA's default layouts): the forward kernel's call (q, k, v, lengths) and the backward's pullback "
    "(d_out and the residuals q, k, v, out, lse; dq, dk/dv, delta and the sinks' gradient). The copies XLA makes of "
    "the arguments into the kernels' layouts and of the results back (perf.argument_layouts, kernel bodies "
    "left empty) are added to the time (`relayout_us`, in modelled_time_us, total_modelled_us and "
    "forward_modelled_us, not in the per-kernel backward times), priced as XLA copies at the fitted XLA streaming "
    "share of HBM bandwidth (`hbm_fraction`; `relayout_at_peak_bw_us` at the peak); they carry no calibrated band "
    "(band_p90_us spreads only the kernel's calibrated error; the copies add at their priced value). At head_dim 64 "
    "XLA stores [B, H, S, 64] with S minor: the forward kernel reads q, K and V and writes out so, so XLA copies "
    "none of them (prefill or decode), and the backward's kernels read d_out, q, k, v and write dq, dk, dv so, "
    "so XLA copies none of those either (blocks of no multiple of 128 read row-major and XLA copies them); "
    "head_dim 128 and up are read as given. "
    "The activations come from the model's projections: no caller allocates "
    "them in the kernel's layout. No rival here is a kernel: the XLA reference's cost_analysis is of XLA's own "
    "program, whose layouts XLA picks, so it holds whatever copies XLA makes")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=sys.modules[__package__].__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--repo", type=Path, default=KERNEL_REPO, help="the attention kernel repo")
    parser.add_argument("--quick", action="store_true", help="four forward shapes only")
    parser.add_argument("--sweep", action="store_true",
                        help="sweep the backward tiles at the training shapes and the forward's at the windowed "
                             "prefill shapes")
    args = parser.parse_args(argv)
    require_kernel_repo(args.repo)

    with tempfile.TemporaryDirectory() as build_dir:
        built = kernels.get_local_kernel(build_kernel_repo(args.repo, Path(build_dir)), backend="cpu")
        if args.sweep:
            sweeps = {}
            for shape in TRAINING_SHAPES:
                for generation in GENERATIONS:
                    sweep = sweep_backward(built, shape, jnp.bfloat16, generation)
                    sweeps[f"{shape.label} {generation}"] = sweep
                    print(shape.label, generation, json.dumps(sweep["best"]), flush=True)
            out = args.out.with_name(args.out.stem + "_backward_sweep.json")
            out.write_text(json.dumps(sweeps, indent=2) + "\n")
            print(f"wrote {out}")
            forward_sweeps = {}
            for shape in SHAPES:
                if shape.sliding_window is None or shape.q_len == 1:
                    continue
                for generation in GENERATIONS:
                    sweep = sweep_forward(built, shape, jnp.bfloat16, generation)
                    forward_sweeps[f"{shape.label} {generation}"] = sweep
                    print(shape.label, generation, json.dumps({k: sweep[k] for k in ("best", "selected")}), flush=True)
            out = args.out.with_name(args.out.stem + "_forward_sweep.json")
            write_json(out, forward_sweeps)
            print(f"wrote {out}")
            return 0
        backward = []
        for shape in TRAINING_SHAPES:
            entry = measure_backward(built, shape, jnp.bfloat16)
            backward.append(entry)
            for generation in GENERATIONS:
                result = entry["per_generation"][generation]
                kernels_text = "  ".join(
                    f"{name} {k['modelled_pipelined_time_us']:.0f} us {k['modelled_mxu_utilisation_pct']:.0f}% MXU "
                    f"({k['pipelined_pct_of_roofline']:.0f}% of roofline)" for name, k in result["kernels"].items())
                print(f"backward {shape.label:60s} {generation}: {kernels_text}  total {result['total_modelled_us']:.0f} us "
                      f"= {result['backward_over_forward']:.2f}x forward", flush=True)
        results = []
        for shape in SHAPES:
            if args.quick and shape.label not in QUICK:
                continue
            entry = measure(built, shape, jnp.bfloat16)
            results.append(entry)
            per = entry["per_generation"]
            print(f"{shape.label:48s} " + "  ".join(
                f"{g} {per[g]['modelled_time_us']:.1f} us ({per[g]['pct_of_roofline']:.0f}% of roofline, "
                f"{per[g]['bound']})" for g in GENERATIONS), flush=True)
    report = {
        **report_header("attention", args.repo),
        "traffic_model": "benchmarks.perf.model_pallas_traffic (grid replay of the kernel's BlockSpecs); times: the "
                         "calibrated pipelined figure (grid step " + ", ".join(
                             f"{g} {perf.grid_step_s(g) * 1e6:.2f} us" for g in GENERATIONS) + "), v5p and v6e on v5e's constants",
        "relayout": RELAYOUT_ASSUMPTION,
        "hbm_fraction": {g: perf.FITTED_RATES.hbm_fraction(g) for g in GENERATIONS},
        "calibrated_errors": {g: {kind: calibration_bands.describe(kind, g) for kind in ("flash_attention",
                              "flash_attention_vjp")} for g in GENERATIONS},
        "environment": {"jax": jax.__version__, "tpu": "none (model + compile-only)"},
        "summary": summarise(results),
        "results": results,
        "backward": {"summary": summarise_backward(backward), "results": backward},
    }
    write_json(args.out, report, sort_keys=True)
    print(json.dumps(report["summary"], indent=2))
    print(f"wrote {args.out}")
    print(json.dumps(report["backward"]["summary"], indent=2))
    summary = report["summary"]
    ok = summary["skips_all_fully_masked_blocks"] and summary["fetches_no_fully_masked_block"]
    return 0 if ok and summary["meets_decode_target"] else 1
