"""What a run writes: the tracked compact JSON, the markdown table, the plot, and the raw rows and run facts."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from benchmarks.studies import calibration_bands
from benchmarks.perf import grid_step_s
from benchmarks.perf.chip import priced_at

from .ours import LAYER_ENTRY
from .shapes import DTYPE, POPULARITY_CONCENTRATION, SEED, Case
from .targets import DECODE_MAX_OVER_ROOFLINE, check_targets, modelled
from .tuning import TOKAMAX_DEFAULT


def band_text(variant: dict) -> str:
    """"lo-hi us" of a variant's p90 band."""
    return calibration_bands.span(variant["band"]["p90_us"], 1)


def markdown_table(rows: list[dict]) -> str:
    """Ours vs the best tuned rival vs the roofline per shape and generation (headline model), as markdown."""
    lines = [
        "| shape | gen | roofline us | ours us | ours p90 band us | ours / roofline | best tuned rival | rival us "
        "| ours / rival | tokamax untuned us | ours at XLA's glue estimate us |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        ours = row["variants"].get("ours", {})
        untuned = row["variants"].get(TOKAMAX_DEFAULT, {})
        untuned_us = f"{untuned['headline_us']:.1f}" if modelled(untuned) else untuned.get("error", "")
        if row.get("best_rival") is None:
            lines.append(f"| {row['label']} | {row['generation']} | {row['roofline_us']:.1f} | "
                         f"{ours.get('headline_us', ours.get('error', 'n/a'))} | | | | | | {untuned_us} | |")
            continue
        lines.append(
            f"| {row['label']} | {row['generation']} | {row['roofline_us']:.1f} | {row['ours_us']:.1f} | "
            f"{band_text(ours)} | {row['ours_over_roofline']:.3f} | {row['best_rival']} | "
            f"{row['best_rival_us']:.1f} | {row['ours_over_best_rival']:.3f} | {untuned_us} | "
            f"{ours.get('with_xla_estimate_us', float('nan')):.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    generations = sorted({r["generation"] for r in rows})
    fig, axes = plt.subplots(len(generations), 1, figsize=(22, 6 * len(generations)), squeeze=False)
    for ax, generation in zip(axes[:, 0], generations):
        selected = [r for r in rows if r["generation"] == generation and r.get("best_rival")]
        x = np.arange(len(selected))
        ours = [r["ours_over_roofline"] for r in selected]
        rival = [r["best_rival_us"] / r["roofline_us"] for r in selected]
        # The p90 calibrated band of ours (calibration_bands); none where ours has no band.
        errors = np.array([[value - r["ours_band_p90_us"][0] / r["roofline_us"],
                            r["ours_band_p90_us"][1] / r["roofline_us"] - value] if r["ours_band_p90_us"] else [0, 0]
                           for value, r in zip(ours, selected)])
        ax.bar(x - 0.2, ours, 0.4, color="#1b7837", label="ours (bar: p90 calibrated band)",
               yerr=errors.T if len(errors) else None, error_kw={"linewidth": 0.6})
        ax.bar(x + 0.2, rival, 0.4, color="#762a83", label="best tuned rival (name above bar)")
        for position, r, value in zip(x, selected, rival):
            ax.text(position + 0.2, value * 1.05, r["best_rival"].replace("_ragged_dot", ""), rotation=90,
                    ha="center", va="bottom", fontsize=6)
        ax.axhline(1.0, color="black", linewidth=0.8, label="roofline")
        ax.axhline(DECODE_MAX_OVER_ROOFLINE, color="grey", linestyle="--", linewidth=0.8,
                   label=f"decode target {DECODE_MAX_OVER_ROOFLINE}x")
        ax.set_yscale("log")
        ax.set_ylabel("modelled time / roofline")
        ax.set_title(f"{generation}: one experts layer, calibrated pipelined model, fitted HBM share"
                     + (" (v5e's constants, checked by v6e's timings)" if generation == "v6e" else ""))
        ax.set_xticks(x, [f"{r['setting']} T={r['tokens']}" for r in selected], rotation=90, fontsize=7)
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def rounded(value):
    if isinstance(value, float):
        return float(f"{value:.5g}") if abs(value) >= 1e-3 or value == 0 else float(f"{value:.3g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


# vLLM's fused kernel's own facts (`vllm_fused.replay`, `fused_search.variant`): its block sizes and vLLM's own
# pick, the search, what its figure leaves out.
FUSED_FACTS = ("block_sizes", "block_sizes_from", "not_priced", "remote_rows", "dma_descriptors", "weight_passes",
               "vllm_block_sizes", "vllm_standalone_us", "configs_searched", "configs_fitting_vmem",
               "refused_block_sizes")
SHAPE_FIELDS = ("label", "generation", "phase", "rows", "live_picks", "active_experts", "roofline_us",
                "roofline_bound", "ours_us", "ours_band_p90_us", "ours_over_roofline", "best_rival", "best_rival_us",
                "ours_over_best_rival", "rival_wins_by_pct", "why_rival_wins", "rivals_not_modelled")


def shape_lines(rows: list[dict]) -> list[dict]:
    """One line per (shape, generation): roofline, ours, the best tuned rival."""
    return [rounded({k: row[k] for k in SHAPE_FIELDS if k in row}) for row in rows]


def variant_lines(rows: list[dict]) -> list[dict]:
    """One line per (shape, generation, variant): its headline, band and terms."""
    lines = []
    for row in rows:
        for name, v in sorted(row["variants"].items()):
            line = {"label": row["label"], "generation": row["generation"], "variant": name,
                    "compiled": v.get("compiled")}
            if not modelled(v):
                line["error"] = v.get("error")
                lines.append(line)
                continue
            kernels = v.get("kernels") or {}
            line.update({
                "us": v["headline_us"], "band_p90_us": v["band"]["p90_us"], "band_median_us": v["band"]["median_us"],
                "uncalibrated_us": v["band"]["uncalibrated_us"], "overlap_us": v["us"]["overlap"],
                "hbm85_us": v["us"]["pipelined_hbm85"], "kernels_us": kernels.get("us", 0.0),
                "grid_steps": kernels.get("grid_steps", 0), "step_cost_us": kernels.get("step_cost_us", 0.0),
                "xla_ragged_dot_us": v["xla_ragged_dot_us"], "xla_ops_us": v["xla_ops"]["us"],
                "xla_op_count": v["xla_ops"]["count"], "hbm_bytes": v["hbm_bytes"],
                "bytes_over_min": v["bytes_over_min"], "over_roofline": v["over_roofline"],
                "mxu_pct": v["mxu_utilisation_pct"],
            })
            for key in ("tiling", "standalone_best_tiling", "bytes_over_quantized_min", *FUSED_FACTS):
                if key in v:
                    line[key] = v[key]
            if v.get("refused_tilings"):
                line["refused_tilings"] = len(v["refused_tilings"])
            lines.append(rounded(line))
    return lines


def dump_compact(value, indent: int = 0) -> str:
    """JSON with sorted keys where a list of objects holds one object per line (reviewable diffs)."""
    pad = " " * indent
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = [f'{pad} {json.dumps(k)}: {dump_compact(v, indent + 1)}' for k, v in sorted(value.items())]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        items = [f"{pad} {json.dumps(v, sort_keys=True)}" for v in value]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return json.dumps(value, sort_keys=True)


def method(args) -> dict:
    return {
        "model": "benchmarks.perf.program_time.model_program: Pallas kernels by benchmarks.perf grid replay, XLA's "
                 "ragged-dot loops by benchmarks.perf.xla_ragged_dot, other XLA ops from the optimized HLO's placement "
                 "(HBM bytes at HBM bandwidth, VMEM bytes at 22x it)",
        "headline": "us: the calibrated pipelined figure, copies at the generation's fitted share of the peak HBM "
                    "bandwidth (benchmarks/perf/hbm_fractions.json) (grid step "
                    + ", ".join(f"{g} {grid_step_s(g) * 1e6:.2f} us" for g in args.generations)
                    + "".join(f"; {calibration_bands.borrowed(g, calibration_bands.MEASURED_ON[g])}"
                              for g in args.generations if calibration_bands.MEASURED_ON[g] != g) + ")",
        "bands": "band_p90_us / band_median_us: the Pallas kernels' time at the Pallas ragged-dot error and XLA's "
                 "ragged-dot loops at theirs, both in the variant's regime (streaming where its copies take longer "
                 "than its matmuls, else compute_bound; benchmarks/results/calibration.json); None, with no_band "
                 "saying why, where a term's kind has no timing in that regime; uncalibrated_us (other XLA ops) "
                 "carries no band",
        "calibrated_errors": calibration_bands.bands_used(args.generations, ("pallas_ragged_dot", "xla_ragged_dot")),
        "also": "overlap_us: each kernel's MXU work fully overlapping its copies (the headline before calibration); "
                "hbm85_us: the headline at 85 % of peak HBM bandwidth",
        "roofline": "max(min_bytes / peak HBM bandwidth, useful FLOPs / bf16 peak); min_bytes = rows in + "
                    "routing + each active expert's weights and biases once + rows out",
        "routing": f"Dirichlet({POPULARITY_CONCENTRATION}) popularity, Gumbel-top-k, seed {SEED}; EP: busiest rank",
        "ours": f"{args.repo.name}: {LAYER_ENTRY} of the built kernel, compiled with its kernel bodies",
        "rivals": "megablox gmm, vLLM's gmm (tpu-inference 0.32.0's megablox/gmm.py, from its wheel; weights "
                  "[E, K, N] as vLLM arranges them at load time) and tokamax 0.0.12 pallas_mosaic_tpu_kernel.gmm at "
                  "the best searched config (candidate_tilings) per projection and generation, XLA "
                  "lax.ragged_dot (weights [E, K, N] too: its transposed read leaves XLA's loop bounds empty, "
                  "which the model cannot price); all inside user_layer, "
                  "compiled with empty kernel bodies (lower_program(kernel_bodies=False))",
        "vllm_fused_ep_moe": "vLLM's fused_ep_moe (tpu-inference 0.32.0's fused_moe/v1/kernel.py, from its wheel) "
                             "as its FUSED_MOE layer runs it (dimensions padded to 256, router logits in, routing, "
                             "all-to-all, both matmuls and the combine in one kernel, tokens split over the EP "
                             "ranks) at the fastest of its block sizes that fit VMEM (fused_search: every config the kernel "
                             "accepts, priced standalone per generation; vLLM's own pick, vllm_block_sizes, "
                             "beside it); compiled with its body "
                             "on a compile-only mesh of the EP rank count; its copies and matmuls counted from its "
                             "schedule at the shape's global routing (the busiest rank) and priced by the same "
                             "model; not_priced says what the figure leaves out (its cross-device part at EP > 1)",
        "extra_rows": "tokamax_default: tokamax's kernel at tokamax's own untuned pick; ours_int8 / ours_fp8 "
                      "(/ ours_int4 where served) at decode"
                      + (" and prefill (--quantized-prefill)" if args.quantized_prefill else ""),
        "dtype": jnp.dtype(DTYPE).name,
        "raw": "benchmarks/results/raw/moe_layer.rows.json (untracked): every term, placement and searched config",
    }


def write_outputs(args, rows: list[dict], cases: list[Case], hf: dict | None, run: dict) -> dict:
    done = {r["label"] for r in rows}
    targets = check_targets(rows)
    report = {
        "method": method(args),
        "priced_at": priced_at(),
        "complete": len(done) == len(cases),
        "missing_shapes": [case.label for case in cases if case.label not in done],
        "targets": rounded(targets),
        "hf_257us": hf,
        "shapes": shape_lines(rows),
        "variants": variant_lines(rows),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dump_compact(report) + "\n")
    args.out.with_suffix(".md").write_text(markdown_table(rows))
    raw = args.raw_dir
    raw.mkdir(parents=True, exist_ok=True)
    (raw / f"{args.out.stem}.rows.json").write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    (raw / f"{args.out.stem}.run.json").write_text(json.dumps(run, indent=1, sort_keys=True) + "\n")
    if not args.no_plot and rows:
        plot(rows, args.out.with_suffix(".png"))
    return report
