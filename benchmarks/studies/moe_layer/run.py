"""The command line: cases in order of importance, replays ahead of compiles, outputs rewritten after every case."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.studies import kernel_repo, require_kernel_repo, result_path
from tpu_kernels.disk_cache import cache_root
from tpu_kernels.runtime.hardware import SUPPORTED_GENERATIONS

from .cache import CLOCK, Cache, Compiler
from .hf import hf_case
from .measure import measure_case
from .our_tiles import projection_keys, tune_case, write_table
from .ours import build_folder, load_kernel
from .report import write_outputs
from .rivals import RIVALS
from .vllm_fused import FUSED
from .shapes import (
    ANCHOR, ANCHOR_DISPATCH, DECODE_TOKENS, GENERATIONS, HEADLINE_SETTINGS, HEADLINE_TOKENS, PREFILL_TOKENS, SETTINGS,
    Case, make_cases,
)
from .targets import ANCHOR_MIN_PCT_OF_FLOOR, DECODE_MAX_OVER_ROOFLINE, summarise


# Relative to the current directory (benchmarks.studies).
DEFAULT_REPO = kernel_repo("ragged-dot-tpu")
DEFAULT_OUT = result_path("moe_layer.json")
# A run of the headline shapes only (no `--all`, no `--settings` or `--tokens`) writes here, not over the sweep.
HEADLINE_OUT = result_path("moe_layer_headline_shapes.json")
# The full sweep's wall time each time it ran with nothing in the cache (tracked: what `--all` costs a new user).
COLD_TIMES = result_path("moe_layer_cold_times.json")
COLD_TIMES_WHAT = ("wall time of `python -m benchmarks moe_layer` (the default run, or --all) from an empty cache, one "
                   "entry per such run")
# Raw rows and the run's own facts (untracked: .gitignore).
RAW_DIR = result_path("raw")
DEFAULT_CACHE = cache_root("moe_layer")


def priority(case: Case) -> tuple:
    """The order cases are modelled in: the anchors (router masking, then dispatch), then decode by tokens, then
    prefill.

    The JSON is rewritten after every case, so a run stopped early still
    leaves the most important shapes complete.
    """
    shape = (case.setting.label, case.tokens)
    anchor = 0 if shape == ANCHOR[:2] else 1 if shape == ANCHOR_DISPATCH[:2] else 2
    return (anchor, case.phase != "decode", case.tokens)


# Cases whose replays run ahead of the one being finished: enough to keep the compile threads busy
# without front-loading every replay of the run.
LOOKAHEAD = 2


def parse_args(argv) -> tuple[argparse.Namespace, list[Case]]:
    """The options (generations in `SUPPORTED_GENERATIONS`' order, the results file resolved) and the cases they
    select, in `priority` order."""
    parser = argparse.ArgumentParser(description=sys.modules[__package__].__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=DEFAULT_REPO, help="kernel repo whose layer entry is ours")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results file (default: {DEFAULT_OUT}, or moe_layer_<generations>.json beside it for "
                             "other generations than the default)")
    parser.add_argument("--generations", nargs="*", default=list(GENERATIONS), choices=SUPPORTED_GENERATIONS,
                        help=f"TPU generations to model (default: {' '.join(GENERATIONS)})")
    parser.add_argument("--raw-dir", type=Path, default=RAW_DIR, help="raw rows and the run's facts (untracked)")
    parser.add_argument("--all", action="store_true",
                        help="the full sweep: every setting at every decode and prefill token count (default: the "
                             f"headline shapes, {' and '.join(HEADLINE_SETTINGS)} at {HEADLINE_TOKENS} tokens)")
    parser.add_argument("--settings", nargs="*", default=None, help="setting labels (default: see --all)")
    parser.add_argument("--tokens", nargs="*", type=int, default=None, help="token counts (default: see --all)")
    parser.add_argument("--rivals", nargs="*", default=[*RIVALS, FUSED], choices=[*RIVALS, FUSED])
    parser.add_argument("--jobs", type=int, default=2, help="compiles run in parallel (threads)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--no-cache", action="store_true", help="recompute every compile and replay")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--quantized-prefill", action="store_true",
                        help="model the quantized variants at the prefill shapes too (default: at decode only)")
    parser.add_argument("--tune-ours", action="store_true",
                        help="only search our grouped matmul's tiles at the prefill cases and write their entries "
                             "into the kernel repo's tuned_tiles.json (then rerun without it)")
    parser.add_argument("--retarget", action="store_true",
                        help="only recompute the summary, targets, table and plot from the raw rows of the last run")
    args = parser.parse_args(argv)
    args.generations = tuple(g for g in SUPPORTED_GENERATIONS if g in args.generations)
    args.headline_only = not args.all and args.settings is None and args.tokens is None
    if args.headline_only:
        args.settings, args.tokens = list(HEADLINE_SETTINGS), list(HEADLINE_TOKENS)
    elif args.tokens is None:
        args.tokens = list(DECODE_TOKENS + PREFILL_TOKENS)
    if args.out is None:
        out = HEADLINE_OUT if args.headline_only else DEFAULT_OUT
        args.out = out if args.generations == GENERATIONS else out.with_name(
            f"{out.stem}_{'_'.join(args.generations)}.json")
    settings = [s for s in SETTINGS if args.settings is None or s.label in args.settings]
    if not settings:
        parser.error(f"no setting matches {args.settings}; known: {[s.label for s in SETTINGS]}")
    return args, sorted(make_cases(settings, args.tokens), key=priority)


def record_cold_time(args: argparse.Namespace, facts: dict, path: Path = COLD_TIMES) -> bool:
    """Adds the wall time of a full sweep or of the default run (the headline shapes) to the tracked record when it
    started from an empty cache; True if it did. (A cold run still hits its cache: programs shared by several
    shapes compile once.)"""
    if not (args.all or args.headline_only) or not facts["cache"]["empty_at_start"]:
        return False
    record = json.loads(path.read_text()) if path.is_file() else {}
    record["what"] = COLD_TIMES_WHAT
    record.setdefault("runs", []).append({
        "run": "--all" if args.all else "default (headline shapes)", "generations": list(args.generations), "seconds": facts["seconds"], "cpus": facts["cpus"],
        "jobs": facts["jobs"], "versions": facts["versions"], "load_average_1_5_15_min": facts["load_average_1_5_15_min"],
        "compiles_and_replays": facts["cache"]["misses"], "reused_within_the_run": facts["cache"]["hits"]})
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return True


def retarget(args: argparse.Namespace, cases: list[Case], cache: Cache) -> int:
    """Rewrites the outputs from the last run's raw rows, their rival summaries and the targets recomputed."""
    rows = json.loads((args.raw_dir / f"{args.out.stem}.rows.json").read_text())
    for row in rows:
        summarise(row, args.rivals)
    previous = json.loads(args.out.read_text()) if args.out.is_file() else {}
    hf = hf_case(rows, cache) if "tokamax" in args.rivals else previous.get("hf_257us")
    run = json.loads((args.raw_dir / f"{args.out.stem}.run.json").read_text())
    write_outputs(args, rows, cases, hf, run)
    return 0


def tune_ours(args: argparse.Namespace, built, cases: list[Case], cache: Cache, compiler: Compiler,
              started: float) -> int:
    """Searches our grouped matmul's tiles at the prefill cases and writes them into the kernel repo's table."""
    entries, searched = [], []
    for case in cases:
        if case.phase == "prefill":
            entries += tune_case(built, cache, compiler, case, args.generations)
            searched += [key._asdict() for generation in args.generations
                         for _, key in projection_keys(built, case, generation)]
            print(f"tuned {case.label:48s} entries {len(entries)} ({time.perf_counter() - started:.0f} s)",
                  flush=True)
    print(f"wrote {write_table(args.repo, entries, searched)}: {len(entries)} entries for the shapes searched")
    return 0


def measure_cases(args: argparse.Namespace, built, cases: list[Case], cache: Cache, compiler: Compiler,
                  started: float, run_facts: Callable[[], dict]) -> list[dict]:
    """Every case's rows, in order; up to `LOOKAHEAD` cases' replays queued ahead of the one being finished, and
    the outputs rewritten after each case."""
    rows = []
    queued: list = []
    upcoming = iter(cases)
    while True:
        for case in upcoming:
            queued.append(measure_case(built, case, cache, compiler, args.rivals, args.generations,
                                       args.quantized_prefill))
            print(f"queued {case.label:48s} rows={case.rows:5d} picks={case.picks:6d} live={case.live_picks:6d} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
            if len(queued) > LOOKAHEAD:
                break
        if not queued:
            break
        for row in queued.pop(0)():
            rows.append(row)
            ours = row["variants"].get("ours", {})
            print(f"{row['label']:48s} {row['generation']}  ours {ours.get('headline_us', float('nan')):10.1f} us"
                  f"  best rival {row.get('best_rival')} {row.get('best_rival_us', float('nan')):10.1f} us"
                  f"  roofline {row['roofline_us']:10.1f} us  ({time.perf_counter() - started:.0f} s)", flush=True)
        write_outputs(args, rows, cases, None, run_facts())
    return rows


def main(argv=None) -> int:
    args, cases = parse_args(argv)
    cache = Cache(None if args.no_cache else args.cache_dir)
    if args.retarget:
        return retarget(args, cases, cache)
    require_kernel_repo(args.repo)

    started = time.perf_counter()
    load_at_start = os.getloadavg()
    empty_at_start = cache.is_empty()
    compiler = Compiler(cache, args.jobs)

    def run_facts() -> dict:
        return {"python": platform.python_version(), "versions": cache.versions,
                "cache": {"hits": cache.hits, "misses": cache.misses, "empty_at_start": empty_at_start},
                "cpus": os.cpu_count(), "jobs": args.jobs,
                "load_average_1_5_15_min": {"start": load_at_start, "end": os.getloadavg()},
                "seconds_by_phase": {phase: round(t, 1) for phase, t in CLOCK.seconds.items()},
                "seconds": round(time.perf_counter() - started, 1)}

    with build_folder(None if args.no_cache else args.cache_dir) as build_dir:
        built = load_kernel(args.repo, build_dir)
        if args.tune_ours:
            return tune_ours(args, built, cases, cache, compiler, started)
        rows = measure_cases(args, built, cases, cache, compiler, started, run_facts)
        hf = hf_case(rows, cache) if "tokamax" in args.rivals else None
        facts = run_facts()
        report = write_outputs(args, rows, cases, hf, facts)
    compiler.pool.shutdown()
    if record_cold_time(args, facts):
        print(f"recorded this cold run's {facts['seconds']:.0f} s in {COLD_TIMES}")
    targets = report["targets"]
    anchor = targets["anchor"][" ".join(map(str, ANCHOR))]
    print(f"wrote {args.out} in {time.perf_counter() - started:.0f} s (cache hits {cache.hits}, misses "
          f"{cache.misses}); anchor {anchor['ours_us']} us (p90 band {anchor['ours_band_p90_us']}), "
          f"{anchor['ours_pct_of_floor_at_share']} % of the floor at the priced share (target {ANCHOR_MIN_PCT_OF_FLOOR} %; "
          f"none when {ANCHOR[2]} is not modelled); decode within {DECODE_MAX_OVER_ROOFLINE}x: "
          f"{targets['decode_meets']}/{targets['decode_shapes']}; shapes a rival wins: {len(targets['rival_wins'])}")
    return 0
