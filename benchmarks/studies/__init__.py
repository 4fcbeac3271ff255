"""The project's benchmarks, one module each: `python -m benchmarks NAME [args]` or `python -m benchmarks.studies.NAME`.

Each has a `main(argv=None)` and documents itself in its docstring
(benchmarks/README.md indexes a page per study: how to run it and what it measures); the large ones (moe_layer,
attention, hub_server) are packages split by concern. Paths are relative to
the current directory, never to where this package is installed:

- results go to `benchmarks/results/<name>.json` (each benchmark's `--out`,
  or `--results`, overrides it); the project's checkout tracks that folder;
- kernel repo sources come from `--repo` (or `--kernel-repos`), by default
  `kernel_repos/<name>`; a missing one is an error that says so;
- the calibrated error bands read `benchmarks/results/calibration.json`
  (written by `python -m benchmarks calibrate`).

This module imports nothing heavy: `python -m benchmarks` lists the benchmarks from it.
"""

from __future__ import annotations

import json
from pathlib import Path

# name -> one line, in the order `python -m benchmarks --help` lists them.
BENCHMARKS = {
    "moe_layer": "one MoE experts layer as users run it: ours vs the best-tuned rivals vs the roofline (v5e, v6e)",
    "multichip": "one Qwen3-30B-A3B decode step on a v6e-8 per MoE layout: experts layer + collectives",
    "fused_moe_search": "vLLM's fused_ep_moe at its own block sizes and at the best searched, per shape and generation",
    "decode_step": "a whole decode step of Qwen3-30B-A3B and Gemma 4 26B-A4B on v6e-8: transformers' default vs kernelized",
    "moe_backward": "MoE experts backward: our grouped matmuls vs megablox's and tokamax's, in the traffic model",
    "attention": "attention kernels: HBM bytes and MXU work vs the minimum, skipped blocks, v6e compile-only cost",
    "paged_attention": "ragged paged attention: modelled share of the HBM roofline and MXU peak, ours vs rivals",
    "cb_step": "a continuous-batching attention step as transformers runs it: gather + pad + kernel vs in place",
    "mla": "one MLA layer's attention: transformers' re-expansion vs our absorbed and expanded forms vs vLLM's MLA",
    "rmsnorm": "RMSNorm kernels: HBM bytes vs the minimum, modelled time, v6e compile-only cost",
    "padding": "what padding to shape buckets costs: padded rows and bytes per bucket, at HBM rate",
    "quantization_accuracy": "quantization error of int8 / fp8 / int4 expert weights against the float model",
    "int4_granularity": "int4 per-channel vs grouped scales on the accuracy report's models (float round trip)",
    "robustness": "every published claim re-priced over the constants no chip identifies: robust or fragile",
    "calibration_fit": "fit the performance model's constants to tokamax's measured TPU timings",
    "held_out": "public real-chip timings no fit used, priced as held-out checks of the model",
    "compiles": "distinct kernel shapes and their real AOT compile seconds per workload, before and after buckets",
    "binding": "host cost of the JAX -> torch op binding",
    "loader": "loading a kernel from a local Hub: tpu_kernels.get_kernel vs kernels.get_kernel",
    "hub_server": "the local Hub server under hostile input and faults",
}
# Tools beside the benchmarks, run the same way (`python -m benchmarks NAME [args]`), listed apart: they measure nothing.
TOOLS = {
    "report": "rewrite the docs' generated blocks from benchmarks/results/ (--check: list the stale ones, exit 1)",
    "calibrate": "price measured TPU timings (tokamax's, or `kernels benchmark --output` JSON) with the model",
}
# The benchmarks that model a TPU from the CPU: `python -m benchmarks` runs them with JAX_PLATFORMS=cpu unless set.
MODELLED = frozenset({"moe_layer", "multichip", "fused_moe_search", "decode_step", "moe_backward", "attention", "paged_attention",
                      "cb_step", "mla", "rmsnorm", "padding", "calibration_fit", "compiles"})
# A kernel repo's modelled benchmark: `python -m benchmarks kernel_repos/<name> [args]` runs it with --repo.
KERNEL_REPO_BENCHMARKS = {"ragged-dot-tpu": "moe_layer", "attention-tpu": "attention", "rmsnorm-tpu": "rmsnorm"}

RESULTS_DIR = Path("benchmarks") / "results"
KERNEL_REPOS_DIR = Path("kernel_repos")


class MissingInput(SystemExit):
    """A file or folder a benchmark reads is not where it looked: exits with the message (status 1)."""


def write_json(path: Path | str, data, *, indent: int = 1, sort_keys: bool = False) -> Path:
    """`data` as JSON at `path` (its folder made), one trailing newline; the path, for the message that says so."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n")
    return path


def result_path(filename: str) -> Path:
    """benchmarks/results/<filename>, relative to the current directory (resolved when written)."""
    return RESULTS_DIR / filename


def report_header(study: str, repo: Path | str) -> dict:
    """The first fields of a kernel study's JSON: which study wrote it, the kernel repo it built, the dtype it ran."""
    from benchmarks.perf.chip import priced_at

    return {"benchmark": f"benchmarks.studies.{study}", "kernel_repo": Path(repo).as_posix(), "dtype": "bfloat16",
            "priced_at": priced_at()}


def kernel_repo(name: str) -> Path:
    """The default source of kernel repo `name`: kernel_repos/<name>, relative to the current directory."""
    return KERNEL_REPOS_DIR / name


def require_kernel_repo(path: Path | str, option: str = "--repo") -> Path:
    """`path` if it holds a kernel repo (a build.toml), else MissingInput saying where it looked and what to pass."""
    path = Path(path)
    if not (path / "build.toml").is_file():
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        raise MissingInput(f"no kernel repo at {path}{where}, no build.toml there: run from a checkout of the "
                           f"tpu-kernels project, or pass {option} PATH")
    return path
