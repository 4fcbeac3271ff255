"""The command line: every model, batch and page size; ours and the rivals per generation; the JSON and the figure."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import sys
import tempfile
from pathlib import Path

import jax
import kernels

from benchmarks import perf
from benchmarks.studies import (
    calibration_bands, kernel_repo, report_header, require_kernel_repo, result_path, write_json,
)
from benchmarks.studies.moe_layer.vllm_kernels import DEFAULT_FOLDER
from tpu_kernels.distribution.builder import build_kernel_repo

from . import ours, rivals, rpa_v3
from .shapes import (GENERATIONS, MODELS, PAGE_SIZES, PLOT_PAGE_SIZE, ROOFLINE_TARGET_PCT, TARGET_FROM_CONTEXT,
                     decode_batches, minimum_bytes, mixed_batch)
from .summary import plot, summarise

KERNEL_REPO = kernel_repo("attention-tpu")
DEFAULT_OUT = result_path("paged_attention.json")


def cases(quick: bool):
    """(model, batch, page size): the mixed-length decode batch at every page size, the per-length decode points and
    (but over window rings, which hold decode rows' keys only) the mixed prefill + decode batch at PLOT_PAGE_SIZE."""
    decode = decode_batches()
    for model in MODELS[:1] if quick else MODELS:
        # Varlen keys have no pages: their mixed-length batch once, at PLOT_PAGE_SIZE's place in the tables.
        for page_size in (PLOT_PAGE_SIZE,) if model.cache == "varlen" else PAGE_SIZES:
            yield model, decode[0], page_size
        for batch in decode[1:]:
            yield model, batch, PLOT_PAGE_SIZE
        if not model.window_ring:
            yield model, mixed_batch(), PLOT_PAGE_SIZE


def attention_arguments(package: str, default_out: Path) -> argparse.ArgumentParser:
    """The options of a benchmark of the attention kernel against vLLM's (this one and cb_step)."""
    parser = argparse.ArgumentParser(description=sys.modules[package].__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--repo", type=Path, default=KERNEL_REPO, help="the attention kernel repo")
    parser.add_argument("--wheels", type=Path, default=DEFAULT_FOLDER, help="where the pinned vLLM wheel is kept")
    parser.add_argument("--quick", action="store_true", help="Qwen3-30B-A3B only")
    return parser


_WORKER: dict = {}


def _start_worker(repo: Path, wheels: Path, rivals_from: Path | None = None) -> None:
    """A worker process: the attention kernel built once, into a folder that lives as long as the process; the
    rivals of `rivals_from`'s rows by case."""
    _WORKER["build_dir"] = tempfile.TemporaryDirectory()
    _WORKER["built"] = kernels.get_local_kernel(build_kernel_repo(repo, Path(_WORKER["build_dir"].name)),
                                                backend="cpu")
    _WORKER["wheels"] = wheels
    rows = json.loads(rivals_from.read_text())["results"] if rivals_from else []
    _WORKER["rivals"] = {(row["model"], row["batch"], row["page_size"]): row["rivals"] for row in rows}


def _rivals(model, batch, page_size: int) -> dict:
    """The rivals of a case: kept from `--rivals-from` where it has the case, else replayed and priced."""
    kept = _WORKER["rivals"].get((model.name, batch.label, page_size))
    if kept is not None:
        return kept
    if model.cache == "varlen":
        why = {"error": "reads pages, not varlen keys: the same keys over pages are the window rings' row"}
        return {"jax_paged_attention": why, "vllm_rpa_v3": why}
    # The rivals read no window rings: they make the call that reads the same keys over pages (`Model.read_as`).
    rival_batch, rival_model = model.read_as(batch)
    return {"jax_paged_attention": rivals.jax_paged_attention(rival_batch, rival_model, page_size),
            "vllm_rpa_v3": rpa_v3.rpa_v3(rival_batch, rival_model, page_size, _WORKER["wheels"])}


def measure_case(case: tuple) -> dict:
    """One (model, batch, page size): ours and the rivals per generation (in a worker started by _start_worker)."""
    model, batch, page_size = case
    built = _WORKER["built"]
    row = {"model": model.name, "batch": batch.label, "kind": batch.kind, "context": batch.context,
           "page_size": page_size, "q_heads": model.q_heads, "kv_heads": model.kv_heads,
           "head_dim": model.head_dim, "sliding_window": model.sliding_window, "sinks": model.sinks,
           "cache": model.cache,
           "min_bytes": minimum_bytes(batch, model), "ours": ours.measure(built, batch, model, page_size),
           "rivals": _rivals(model, batch, page_size)}
    print(f"{model.name:24s} {batch.label:44s} page {page_size:4d}  " + "  ".join(
        f"{g} {row['ours'][g]['pct_of_hbm_roofline_peak']:.0f}%" for g in GENERATIONS), flush=True)
    return row


def _measure(all_cases: list, args) -> list[dict]:
    """Every case's row, in order, `args.jobs` at a time (each job a process of its own); the rows measured so far
    are kept in a partial JSON beside the output."""
    done: dict[int, dict] = {}

    def keep(index: int, row: dict) -> None:
        done[index] = row
        write_json(args.out.with_suffix(".partial.json"), [done[i] for i in sorted(done)])

    if args.jobs == 1:
        _start_worker(args.repo, args.wheels, args.rivals_from)
        for index, case in enumerate(all_cases):
            keep(index, measure_case(case))
        return [done[i] for i in range(len(all_cases))]
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=_start_worker,
                                                initargs=(args.repo, args.wheels, args.rivals_from)) as pool:
        futures = {pool.submit(measure_case, case): index for index, case in enumerate(all_cases)}
        for future in concurrent.futures.as_completed(futures):
            keep(futures[future], future.result())
    return [done[i] for i in range(len(all_cases))]


def main(argv=None) -> int:
    parser = attention_arguments(__package__, DEFAULT_OUT)
    parser.add_argument("--jobs", type=int, default=1, help="cases measured at once, each in a process of its own")
    parser.add_argument("--rivals-from", type=Path, default=None,
                        help="a previous paged_attention.json whose rivals' rows to keep for the cases it holds (they "
                             "do not depend on our kernel; re-run without it when the model's constants change)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    require_kernel_repo(args.repo)
    rows = _measure(list(cases(args.quick)), args)
    report = {
        **report_header("paged_attention", args.repo),
        "model": "benchmarks.perf: grid replay, the kernels' own K/V copies and work counted by running their "
                 "scalar programs (perf.scalar_replay), priced phase by phase (the calibrated pipelined figure); "
                 "grid step " + ", ".join(f"{g} {perf.grid_step_s(g) * 1e6:.2f} us" for g in GENERATIONS),
        "relayout": "our kernel's time includes the copies XLA makes of its arguments into "
                    "the kernel's layout when the call is jitted as it is made, the arguments in XLA's default "
                    "layouts (perf.argument_layouts; `relayout_us`, uncalibrated, at the fitted HBM share): at "
                    "head_dim 64 XLA stores our [pages, page, Hkv, 64] cache with the page rows minor over pages of "
                    "a multiple of 128 tokens, which our kernel reads as it is (keys-minor, no copy), and with the "
                    "pages minor over smaller pages, which no kernel can read a page of: there the call copies the "
                    "whole cache (here the batch's pages; a serving cache is larger). RPA v3's [pages, page, "
                    "Hkv*2/2, 2, 128] cache is not stored row-major at head_dim 64 either. A caller that keeps "
                    "the cache in the kernel's layout (its jit's argument layout pinned) has no such copy: that is "
                    "not what a plain jitted call gets. The rivals run at their best configuration, in serving "
                    "systems that allocate their cache in jax and can keep it in the kernel's layout: their copy is "
                    "recorded (relayout_if_default_layout_us), not added to their time",
        "hbm_fraction": {g: perf.FITTED_RATES.hbm_fraction(g) for g in GENERATIONS},
        "calibrated_errors": {g: calibration_bands.describe("flash_attention", g) for g in GENERATIONS},
        "page_sizes": {"16": "vLLM's default block size", "128": "vLLM TPU's usual block size",
                       "256": "transformers' paged cache default"},
        "targets": {"decode_pct_of_hbm_roofline": ROOFLINE_TARGET_PCT, "from_context": TARGET_FROM_CONTEXT,
                    "published_rpa_v3_tpu7x_pct": 86, "no_rival_faster": True},
        "environment": {"jax": jax.__version__, "tpu": "none (model only)"},
        "summary": summarise(rows),
        "results": rows,
    }
    write_json(args.out, report, sort_keys=True)
    args.out.with_suffix(".partial.json").unlink(missing_ok=True)
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")
    return 0
