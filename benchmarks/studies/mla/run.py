"""The command line: every model's calls on its generations, the JSON rewritten after every model and generation."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks import perf
from benchmarks.perf.chip import priced_at
from benchmarks.studies import calibration_bands, kernel_repo, moe_layer, require_kernel_repo, result_path
from benchmarks.studies.moe_layer.vllm_kernels import DEFAULT_FOLDER
from tpu_kernels.disk_cache import cache_root

from . import measure, summary
from .shapes import MODELS, MODELS_BY_KEY, SOURCES, calls

DEFAULT_OUT = result_path("mla.json")
DEFAULT_REPO = kernel_repo("attention-tpu")
# Compiles and the kernel build live apart from moe_layer's (whose build folder holds the ragged-dot repo).
DEFAULT_CACHE = cache_root("mla")


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=sys.modules[__package__].__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--repo", type=Path, default=DEFAULT_REPO, help="the attention kernel repo")
    parser.add_argument("--wheels", type=Path, default=DEFAULT_FOLDER, help="where the pinned vLLM wheel is kept")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS_BY_KEY), default=[m.key for m in MODELS])
    parser.add_argument("--generations", nargs="+", help="only these generations (each model's own by default)")
    parser.add_argument("--quick", action="store_true", help="one decode and one prefill call per model")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM's MLA kernel out")
    parser.add_argument("--jobs", type=int, default=2, help="compile threads")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--no-cache", action="store_true")
    parser.add_argument("--step", action="store_true",
                        help="price Moonlight-16B-A3B's whole decode step (`step`) into --out, keeping its layer rows")
    parser.add_argument("--resummarize", action="store_true",
                        help="re-read each row's rule from --repo's build and recompute --out's summary (no compile)")
    parser.add_argument("--experts-repo", type=Path, default=kernel_repo("ragged-dot-tpu"))
    parser.add_argument("--rmsnorm-repo", type=Path, default=kernel_repo("rmsnorm-tpu"))
    return parser


def method(repo: Path) -> dict:
    gens = sorted({g for model in MODELS for g in model.generations})
    return {
        "what": "one MLA layer's attention per call on one chip: transformers 5.25's own path (kv_b_proj over every "
                "cached token, the keys assembled, sdpa), ours (absorbed: q_nope @ W_UK, the latent kernel over the "
                "latent cache, @ W_UV; expanded: transformers' expansion once, then flash attention with key and "
                "value head dims nope + R and v; the cheaper of the two as priced), vLLM tpu-inference 0.32.0's MLA "
                "v2 kernel at its best modelled block sizes, and the latent cache read once",
        "kernel_repo": repo.as_posix(),
        "priced": "XLA programs (one per eager torch op) compiled ahead of time per generation and priced by "
                  "benchmarks.perf.program_time (their bytes at the fitted HBM share and FLOPs at the MXU peak; no "
                  "fixed cost per op, no calibrated error); kernels by grid replay, vLLM's by its scalar program's "
                  "replay (perf.scalar_replay), at the calibrated pipelined figure with flash attention's p90 error "
                  "band in the figure's regime (a path's band covers its kernel only)",
        "left_out": "the projections into q, the latent and k_rot, RoPE, the cache update, the query's concatenation, "
                    "the output's transpose and o_proj (the same on every path); the copies XLA might make of a "
                    "kernel's arguments into its layout (not probed); key lengths are powers of two, so no call "
                    "pads its keys to a bucket",
        "hbm_fraction": {g: perf.FITTED_RATES.hbm_fraction(g) for g in gens},
        "calibrated_errors": {g: calibration_bands.describe(kernel_band_kind(), g) for g in gens},
        "models": {m.key: {"name": m.name, "heads": m.heads, "latent": m.latent, "rope": m.rope, "nope": m.nope,
                           "v": m.v, "generations": list(m.generations), "plan": m.plan, "source": SOURCES[m.key]}
                   for m in MODELS},
    }


def kernel_band_kind() -> str:
    from .kernels import BAND_KIND

    return BAND_KIND


def decode_step(args, compiler) -> int:
    """Moonlight's whole decode step (`step.price`) written into --out's report beside its layer rows."""
    import json

    from benchmarks.studies.decode_step.pricing import XlaPricer
    from benchmarks.studies.decode_step.run import BATCH, CONTEXT, load_built

    from . import step

    for repo, option in ((args.experts_repo, "--experts-repo"), (args.rmsnorm_repo, "--rmsnorm-repo")):
        require_kernel_repo(repo, option)
    report = json.loads(args.out.read_text())
    with moe_layer.build_folder(compiler.cache.folder) as build_dir:
        built = {"attention": moe_layer.load_kernel(args.repo, build_dir / "attention"),
                 "experts": moe_layer.load_kernel(args.experts_repo, build_dir / "experts"),
                 "rmsnorm": load_built(args.rmsnorm_repo, build_dir / "rmsnorm")}
        found = step.price(built, BATCH, CONTEXT, XlaPricer(compiler.cache, compiler), compiler.cache, compiler)
    decode_step_json = result_path("decode_step.json")
    found["beside"] = step.beside(json.loads(decode_step_json.read_text()) if decode_step_json.exists() else None)
    report["decode_step"] = found
    args.out.write_text(moe_layer.dump_compact(moe_layer.rounded(report)) + "\n")
    print(f"{found['model']}: " + ", ".join(f"{name} {path['total']['ms']:.2f} ms" for name, path in
                                            found["paths"].items()) + f"; wrote {args.out}")
    return 0


def resummarize(args) -> int:
    """--out's rows kept, each row's rule re-read from --repo's build (its `mla` module), the summary recomputed."""
    import json

    report = json.loads(args.out.read_text())
    with moe_layer.build_folder(None if args.no_cache else args.cache_dir) as build_dir:
        built = moe_layer.load_kernel(args.repo, build_dir)
        rule = measure.rule_module(built)
        for row in report["results"]:
            model = MODELS_BY_KEY[row["model"]]
            call = next(c for c in calls(model) if c.label == row["call"])
            row["rule"] = measure.rule_pick(rule, built, model, call, row["generation"])
            if row.get("model_pick"):
                row["rule_agrees"] = None if row["rule"]["pick"] is None else row["rule"]["pick"] == row["model_pick"]
    report["summary"] = summary.summarise(report["results"])
    args.out.write_text(moe_layer.dump_compact(moe_layer.rounded(report)) + "\n")
    print(f"wrote {args.out}: the rule checked at {report['summary']['rule_checked']} calls, "
          f"{len(report['summary']['rule_disagreements'])} disagreements")
    return 0


def main(argv=None) -> int:
    args = arguments().parse_args(argv)
    require_kernel_repo(args.repo)
    if args.resummarize:
        return resummarize(args)
    started = time.perf_counter()
    cache_dir = None if args.no_cache else args.cache_dir
    compiler = moe_layer.Compiler(moe_layer.Cache(cache_dir), args.jobs)
    if args.step:
        try:
            return decode_step(args, compiler)
        finally:
            compiler.pool.shutdown()
    xla = measure.XlaTerms(compiler)
    rival = None
    if not args.no_vllm:
        from .vllm_mla import VllmMla

        rival = VllmMla(args.wheels)
    rows = []
    with moe_layer.build_folder(cache_dir) as build_dir:
        built = moe_layer.load_kernel(args.repo, build_dir)
        rule = measure.rule_module(built)
        plan = [(MODELS_BY_KEY[key], g) for key in args.models for g in MODELS_BY_KEY[key].generations
                if args.generations is None or g in args.generations]
        for model, generation in plan:
            for call in calls(model, args.quick):
                measure.submit_case(xla, model, call, generation)
        for model, generation in plan:
            for call in calls(model, args.quick):
                row = measure.measure(built, rule, xla, model, call, generation, rival)
                rows.append(row)
                print(f"{model.key:20s} {generation:5s} {call.label:32s} " + "  ".join(
                    f"{name} {row[name]['us']:.0f}" for name in ("transformers", "absorbed", "expanded")), flush=True)
            write(args.out, args.repo, rows, started)
    compiler.pool.shutdown()
    print(f"wrote {args.out}")
    return 0


def write(out: Path, repo: Path, rows: list[dict], started: float) -> None:
    import json

    kept = json.loads(out.read_text()).get("decode_step") if out.exists() else None
    report = {"benchmark": "benchmarks.studies.mla", "method": method(repo), "priced_at": priced_at(), "summary": summary.summarise(rows),
              "results": rows, **({"decode_step": kept} if kept else {})}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(moe_layer.dump_compact(moe_layer.rounded(report)) + "\n")
    (moe_layer.RAW_DIR).mkdir(parents=True, exist_ok=True)
    (moe_layer.RAW_DIR / f"{out.stem}.run.json").write_text(
        f'{{"seconds": {time.perf_counter() - started:.1f}}}\n')
