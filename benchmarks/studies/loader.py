"""Loading a kernel from a local Hub: `tpu_kernels.get_kernel` vs the unmodified `kernels.get_kernel`.

One run of this script:

- builds kernel_repos/ragged-dot-tpu, starts a local Hub (`tpu_kernels.distribution.hub`) in a
  temp dir and publishes the build to it (trusted publisher, branch v1);
- loads `version=1` in fresh processes pointed at the Hub by HF_ENDPOINT and
  KERNELS_CACHE, as a user would, alternating the two loaders (and which goes first):
    cold    empty cache: resolve, download, verify (ours), import
    warm    cache filled by that loader's cold run, new process: resolve, import
    repeat  calls in one process once the module is imported, both loaders
            interleaved in random order (many calls: the steady state, least noisy)
    offline HF_HUB_OFFLINE=1 on the warm cache
  both loaders and the frameworks (torch, jax, pallas) are imported before the
  clock starts, so times cover the loader and the kernel's own module import;
- counts the HTTP requests of each load on the server (the loading process reads
  the server's counters just before and after the call);
- times the digest check alone on the cached variant, and the check with the private copy
  each load imports from.

Medians, minimums, ratios (ours / kernels: of the medians, of the minimums, and the
median of the per-iteration ratios) and request counts go to benchmarks/results/loader.json.
The machine is shared, so single loads are noisy: read the ratios together.

Usage:
    python -m benchmarks loader [--runs 5] [--out benchmarks/results/loader.json] [--repo kernel_repos/ragged-dot-tpu]
    (or JAX_PLATFORMS=cpu python -m benchmarks.studies.loader; paths relative to the current directory)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

# This process only publishes, to the local Hub; its first request headers would fetch huggingface_hub's agent
# registry from huggingface.co: that lookup is telemetry. huggingface_hub reads the switch when first imported.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import kernels  # noqa: E402 (after the telemetry switch)

import tpu_kernels
from benchmarks.studies import kernel_repo, require_kernel_repo, result_path, write_json
from tpu_kernels.distribution.builder import build_kernel_repo
from tpu_kernels.distribution.digest import copy_verified_variant
from tpu_kernels.distribution.hub import start_hub
from tpu_kernels.distribution.hub.server import STATS_PATH
from tpu_kernels.distribution.loader import verify_variant
from tpu_kernels.distribution.publish import upload_kernel

KERNEL_REPO = kernel_repo("ragged-dot-tpu")
DEFAULT_OUT = result_path("loader.json")
# The folder holding the tpu_kernels package this runs from: the measured processes import the same one.
PACKAGE_PARENT = Path(tpu_kernels.__file__).resolve().parents[1]
ORG = "tpu-kernels"
TOKEN = "benchmark-token"
TARGET_WARM_RATIO = 1.2
LOADERS = {"ours": "tpu_kernels.distribution.loader", "kernels": "kernels"}

# Runs in a fresh interpreter; prints one JSON line.
LOAD_SCRIPT = """
import importlib, json, os, sys, time, urllib.request
# Both loaders start from the same imported modules (tpu_kernels imports jax,
# pallas and torch), so the clock sees only what each loader does.
import jax, torch, kernels, tpu_kernels.distribution.loader
get_kernel = importlib.import_module({loader_module!r}).get_kernel

def requests_so_far():
    with urllib.request.urlopen(os.environ["HF_ENDPOINT"] + {stats_path!r}) as response:
        return json.load(response)["by_route"]

def timed_load():
    before = requests_so_far()
    start = time.perf_counter()
    module = get_kernel({repo!r}, version=1)
    seconds = time.perf_counter() - start
    after = requests_so_far()
    routes = {{route: after[route] - before.get(route, 0) for route in after if after[route] != before.get(route, 0)}}
    return module, seconds, routes

try:
    module, load_s, load_routes = timed_load()
except Exception as error:
    print(json.dumps({{"error": f"{{type(error).__name__}}: {{error}}"[:400]}}))
    sys.exit(0)
_, repeat_s, repeat_routes = timed_load()
print(json.dumps({{"load_s": load_s, "load_requests": load_routes, "repeat_s": repeat_s,
                  "repeat_requests": repeat_routes, "file": module.__file__}}))
"""


# Runs in a fresh interpreter on a warm cache: both loaders, called in random
# order, many times (the module is imported by the first call); prints one JSON line.
REPEAT_SCRIPT = """
import json, random, statistics, time
import jax, torch, kernels, tpu_kernels.distribution.loader
loaders = {{"ours": tpu_kernels.distribution.loader.get_kernel, "kernels": kernels.get_kernel}}
for get_kernel in loaders.values():
    get_kernel({repo!r}, version=1)
times = {{name: [] for name in loaders}}
for _ in range({calls}):
    order = list(loaders)
    random.shuffle(order)
    for name in order:
        start = time.perf_counter()
        loaders[name]({repo!r}, version=1)
        times[name].append(time.perf_counter() - start)
print(json.dumps({{name: {{"median_s": statistics.median(values), "min_s": min(values)}}
                  for name, values in times.items()}}))
"""


def client_env(hub_url: str, cache: Path, hf_home: Path, offline: bool) -> dict:
    env = {key: value for key, value in os.environ.items() if key not in ("HF_TOKEN", "LOCAL_KERNELS")}
    env.update(HF_ENDPOINT=hub_url, KERNELS_CACHE=str(cache), HF_HOME=str(hf_home), JAX_PLATFORMS="cpu",
               HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_OFFLINE="1" if offline else "0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(PACKAGE_PARENT), os.environ.get("PYTHONPATH")])))
    return env


def run_script(script: str, env: dict) -> dict:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True,
                            text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"benchmark process failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def load_in_fresh_process(loader: str, repo: str, hub_url: str, cache: Path, hf_home: Path, offline: bool) -> dict:
    script = LOAD_SCRIPT.format(loader_module=LOADERS[loader], stats_path=STATS_PATH, repo=repo)
    return run_script(script, client_env(hub_url, cache, hf_home, offline))


def total(routes: dict) -> int:
    return sum(routes.values())


def summary(runs: list[dict]) -> dict:
    return {
        "median_s": statistics.median(run["load_s"] for run in runs),
        "min_s": min(run["load_s"] for run in runs),
        "runs_s": [round(run["load_s"], 4) for run in runs],
        "requests_per_load": statistics.median(total(run["load_requests"]) for run in runs),
        "requests_by_route": runs[0]["load_requests"],
    }


def repeat_summary(runs: list[dict]) -> dict:
    return {
        "requests": statistics.median(total(run["repeat_requests"]) for run in runs),
        "requests_by_route": runs[0]["repeat_requests"],
    }


def digest_and_copy_times(variant: Path, copies: Path, attempts: int = 100) -> tuple[list[float], list[float]]:
    """Seconds of each digest check of a cached variant, and of each check with the private copy a load makes."""
    digest_times, copy_times = [], []
    copies.mkdir()
    for attempt in range(attempts):
        start = time.perf_counter()
        verify_variant(variant)
        digest_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        copy_verified_variant(variant, copies / str(attempt), blobs=variant.parents[3] / "blobs")
        copy_times.append(time.perf_counter() - start)
    return digest_times, copy_times


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="cold and warm loads per loader (default: 5)")
    parser.add_argument("--repeat-calls", type=int, default=200, help="in-process calls per loader (default: 200)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--repo", type=Path, default=KERNEL_REPO, help="the kernel repo to publish and load")
    return parser.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class Measured:
    """Everything one run of the benchmark measured (`measure`)."""

    repo: str
    runs: dict[str, dict[str, list[dict]]]  # loader -> "cold" / "warm" -> one fresh process's figures per run
    offline_ours: list[dict]
    offline_kernels: dict
    offline_server_requests: int
    repeat: dict  # loader -> the in-process calls' median and minimum seconds
    variant: str
    files_in_variant: int
    digest_times: list[float]
    copy_times: list[float]


def measure(args: argparse.Namespace, work: Path) -> Measured:
    """Builds and publishes the kernel repo to a local Hub in `work`, then loads it every way the module docstring
    lists."""
    built = build_kernel_repo(args.repo, work / "build")
    repo = f"{ORG}/{built.name}"
    with start_hub(work / "hub", token=TOKEN, trusted_orgs=[ORG]) as hub:
        upload_kernel(built, repo, endpoint=hub.url, token=TOKEN)
        hf_home = work / "hf-home"
        # huggingface_hub's once-a-day registry lookup, out of the way of the measured loads.
        load_in_fresh_process("kernels", repo, hub.url, work / "warm-up-cache", hf_home, offline=False)

        runs: dict[str, dict[str, list[dict]]] = {loader: {"cold": [], "warm": []} for loader in LOADERS}
        caches = {}
        for index in range(args.runs):
            # Alternate which loader goes first: the machine's load drifts.
            for loader in list(LOADERS)[:: 1 if index % 2 == 0 else -1]:
                cache = caches[loader, index] = work / f"cache-{loader}-{index}"
                runs[loader]["cold"].append(load_in_fresh_process(loader, repo, hub.url, cache, hf_home, False))
                runs[loader]["warm"].append(load_in_fresh_process(loader, repo, hub.url, cache, hf_home, False))
                print(f"run {index}: {loader} cold {runs[loader]['cold'][-1]['load_s']:.3f}s "
                      f"warm {runs[loader]['warm'][-1]['load_s']:.3f}s", flush=True)

        requests_before_offline = hub.request_count
        offline_ours = [load_in_fresh_process("ours", repo, hub.url, caches["ours", 0], hf_home, True)
                        for _ in range(max(1, args.runs // 2))]
        offline_kernels = load_in_fresh_process("kernels", repo, hub.url, caches["kernels", 0], hf_home, True)
        offline_server_requests = hub.request_count - requests_before_offline

        repeat = run_script(REPEAT_SCRIPT.format(repo=repo, calls=args.repeat_calls),
                            client_env(hub.url, caches["ours", 0], hf_home, offline=False))

        # The loaded module ran from a private copy (gone with its process): time the cache's variant.
        variant_name = Path(runs["ours"]["warm"][0]["file"]).parent.name
        (variant,) = caches["ours", 0].glob(f"kernels--*/snapshots/*/build/{variant_name}")
        files_in_variant = sum(1 for path in variant.rglob("*") if path.is_file())
        digest_times, copy_times = digest_and_copy_times(variant, work / "copies")
    return Measured(repo, runs, offline_ours, offline_kernels, offline_server_requests, repeat, variant.name,
                    files_in_variant, digest_times, copy_times)


def report(args: argparse.Namespace, measured: Measured) -> dict:
    """The JSON written: summaries of every kind of load, and ours over kernels' ratios."""
    runs, repeat, offline_ours = measured.runs, measured.repeat, measured.offline_ours
    result = {
        "kernel": measured.repo,
        "variant": measured.variant,
        "files_in_variant": measured.files_in_variant,
        "runs": args.runs,
        "environment": {
            "python": platform.python_version(),
            "huggingface_hub": importlib.metadata.version("huggingface_hub"),
            "kernels": kernels.__version__,
            "cpus": os.cpu_count(),
            "note": "local Hub over loopback; times exclude importing torch and jax",
        },
        "cold": {loader: summary(runs[loader]["cold"]) for loader in LOADERS},
        "warm": {loader: summary(runs[loader]["warm"]) for loader in LOADERS},
        "repeat_in_process": {
            "calls_per_loader": args.repeat_calls,
            **repeat,
            "requests_per_load": {loader: repeat_summary(runs[loader]["warm"]) for loader in LOADERS},
        },
        "offline": {
            "ours": {
                "median_s": statistics.median(run["load_s"] for run in offline_ours),
                "requests_per_load": statistics.median(total(run["load_requests"]) for run in offline_ours),
                "server_requests_during_offline_loads": measured.offline_server_requests,
            },
            "kernels": measured.offline_kernels.get("error") or {"median_s": measured.offline_kernels["load_s"]},
        },
        "digest_check_median_s": statistics.median(measured.digest_times),
        "digest_check_and_private_copy_median_s": statistics.median(measured.copy_times),
        "target_warm_ratio": TARGET_WARM_RATIO,
    }
    for state in ("cold", "warm"):
        result[state]["ratio_ours_over_kernels"] = (
            result[state]["ours"]["median_s"] / result[state]["kernels"]["median_s"]
        )
        # Loads of one iteration ran back to back: their ratio cancels most of the
        # drift in the machine's load that the medians still carry.
        result[state]["median_paired_ratio"] = statistics.median(
            ours["load_s"] / theirs["load_s"] for ours, theirs in zip(runs["ours"][state], runs["kernels"][state])
        )
        result[state]["ratio_of_min"] = result[state]["ours"]["min_s"] / result[state]["kernels"]["min_s"]
    result["repeat_in_process"]["ratio_ours_over_kernels"] = repeat["ours"]["median_s"] / repeat["kernels"]["median_s"]
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_kernel_repo(args.repo)
    with tempfile.TemporaryDirectory(prefix="tpu-kernels-loader-bench-") as tmp:
        measured = measure(args, Path(tmp))
    result = report(args, measured)
    write_json(args.out, result, indent=2)
    print(json.dumps({state: {key: value for key, value in result[state].items() if "ratio" in key}
                      for state in ("cold", "warm", "repeat_in_process")}, indent=2))
    print(f"offline: ours {result['offline']['ours']}, kernels {result['offline']['kernels']}")
    print(f"wrote {args.out}")
    warm_ok = result["warm"]["median_paired_ratio"] <= TARGET_WARM_RATIO
    return 0 if warm_ok and measured.offline_server_requests == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
