"""`tpu-kernels doctor`: each kernel in each TorchTPU mode on this host, checked against its reference, in one JSON.

On a TPU host every kernel runs a small case in strict eager (`DEFER_NEVER`, TorchTPU's default), deferred and fused
eager (`DEFER_AND_FUSE`) and compiled (`torch.compile(backend="tpu", dynamic=False, fullgraph=True)`), twice: a
warm-up pass and a second pass. Each pass is checked against the kernel's plain reference, and counted with
torch_tpu's compile cache statistics (`torch.tpu._get_cache_stats()`): a second pass that still compiles or misses
the cache is a program compiled per call. The report also names the versions, the chip and whether our ops launch
their kernels directly (docs/binding.md). Attach it to an issue.

With `--device cpu` (the default on a host without a TPU) it runs what it can: the kernels in Pallas' interpret mode, eagerly and under
`torch.compile(backend="aot_eager")`, counting jax's compiles; TorchTPU's modes need a TPU, and the report says which
it skipped. Exit code 0 when every mode that ran matched the reference, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.metadata
import json
import platform
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from .kernelize import DEFAULT_REPOS, KernelSpec

MODES = ("strict_eager", "deferred_and_fused", "compiled")
TOLERANCE = 3e-2  # relative to the reference's largest value: bfloat16 inputs, float32 accumulation
NEEDS_A_TPU = "needs a TPU: TorchTPU's eager modes and its compile backend run on its runtime"


@dataclass(frozen=True)
class Case:
    """One call of a kernel: the op, its reference (float64 or the input dtype) and inputs made on `device`."""

    kernel: str  # the kind it belongs to (kernelize's kinds)
    name: str
    inputs: Callable  # (kernel module, device) -> tuple of tensors
    call: Callable  # (kernel module, *inputs) -> tensor
    reference: Callable  # (kernel module, *inputs on the CPU) -> tensor
    program: str  # the JAX function of its op, as jax names its compiles on the CPU


def _random(*shape, seed: int, scale: float = 1.0):
    import torch

    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


def _ragged_dot_inputs(kernel, device):
    import torch

    group_sizes = torch.tensor([16, 0, 32, 8], dtype=torch.int32)
    return _random(64, 128, seed=1).to(device), _random(4, 128, 128, seed=2, scale=0.1).to(device), group_sizes.to(
        device)


def _rms_norm_inputs(kernel, device):
    import torch

    weight = (0.05 + 0.2 * torch.rand(256, generator=torch.Generator().manual_seed(4))).to(torch.bfloat16)
    return _random(16, 256, seed=3).to(device), weight.to(device)


def _attention_inputs(kernel, device):
    return tuple(_random(*shape, seed=seed).to(device)
                 for seed, shape in enumerate(((1, 4, 16, 128), (1, 2, 128, 128), (1, 2, 128, 128)), start=5))


CASES = (
    Case("experts", "ragged_dot", _ragged_dot_inputs, lambda k, *a: k.ragged_dot(*a),
         lambda k, *a: k.reference.ragged_dot_reference(*a), "_ragged_dot"),
    Case("rmsnorm", "rms_norm", _rms_norm_inputs, lambda k, x, w: k.rms_norm(x, w, 1e-6),
         lambda k, x, w: k.reference.rms_norm(x, w, 1e-6), "_rms_norm_op"),
    Case("attention", "flash_attention", _attention_inputs, lambda k, *a: k.flash_attention(*a, causal=True),
         lambda k, *a: k.reference.reference_attention(*a, causal=True), "_flash_attention"),
)


class _Counter:
    """What compiled during a pass: torch_tpu's cache statistics on a TPU; on the CPU, jax's compiles, among them
    the op's program (interpret mode also compiles small eager jax programs on the host as it goes)."""

    JAX_COMPILE = "/jax/core/compile/backend_compile_duration"

    def __init__(self, device: str):
        self.device, self.programs = device, []
        if device == "cpu":
            import jax

            jax.monitoring.register_event_duration_secs_listener(self._jax_event)

    def close(self) -> None:
        if self.device == "cpu":
            import jax

            jax.monitoring.unregister_event_duration_listener(self._jax_event)

    def _jax_event(self, event, _seconds, fun_name: str = "", **_):
        if event == self.JAX_COMPILE:
            self.programs.append(fun_name)

    def mark(self):
        if self.device == "cpu":
            return len(self.programs)
        import torch

        # torch_tpu 0.2.0's only account of its compiles and cache misses (vllm-torchtpu reads it so); private.
        stats = getattr(torch.get_device_module("tpu"), "_get_cache_stats", None)
        return _numbers(stats()) if stats is not None else {}

    def since(self, mark, case: Case) -> dict:
        if self.device == "cpu":
            programs = self.programs[mark:]
            return {"jax_compiles": len(programs), "op_program": programs.count(f"jit({case.program})")}
        return _changes(mark, self.mark())


def recompiled(compiled: dict) -> bool:
    """Whether a pass compiled its op's program (CPU) or compiled or missed torch_tpu's cache (TPU)."""
    return any(compiled.get(key, 0) > 0 for key in ("op_program", "num_compilations", "num_cache_misses"))


def _changes(before: dict, after: dict) -> dict:
    """torch_tpu's cache statistics over a pass (torch_tpu 0.2.0's `PerfStats`: num_cache_reqs, num_cache_hits,
    num_compilations, peak_compilation_host_memory_bytes): each count's increase and the misses they imply; a peak
    is a high-water mark, so it is given as it stands after the pass."""
    changes = {k: after[k] - before[k] for k in after if k in before and not k.startswith("peak_")}
    if "num_cache_reqs" in changes and "num_cache_hits" in changes:
        changes["num_cache_misses"] = changes["num_cache_reqs"] - changes["num_cache_hits"]
    return changes | {k: v for k, v in after.items() if k.startswith("peak_")}


def _numbers(stats) -> dict:
    """The numeric fields of torch_tpu's statistics object (or mapping), by name."""
    items = stats.items() if isinstance(stats, dict) else (
        (name, getattr(stats, name)) for name in dir(stats) if not name.startswith("_"))
    return {name: value for name, value in items if isinstance(value, (int, float)) and not isinstance(value, bool)}


def _mode_runner(mode: str, device: str, fn: Callable) -> Callable | None:
    """`fn` as `mode` runs it on `device`, or None where it cannot run there."""
    import torch

    if device == "cpu":
        if mode == "strict_eager":
            return fn
        if mode == "compiled":
            return torch.compile(fn, backend="aot_eager", dynamic=False, fullgraph=True)
        return None
    if mode == "compiled":
        return torch.compile(fn, backend="tpu", dynamic=False, fullgraph=True)
    eager_mode = torch.tpu.EagerMode.DEFER_NEVER if mode == "strict_eager" else torch.tpu.EagerMode.DEFER_AND_FUSE

    def in_mode(*args):
        with torch.tpu.set_eager_mode(eager_mode):
            return fn(*args).cpu()  # materialised inside the mode: a deferred graph runs here

    return in_mode


def _relative_error(out, expected) -> float:
    out, expected = out.detach().cpu().double(), expected.detach().cpu().double()
    return float((out - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def run_case(case: Case, kernel, device: str, counter: _Counter) -> dict:
    """The case in every mode: per mode, the status, the largest relative error of each pass and its compiles."""
    try:
        inputs = case.inputs(kernel, device)
        expected = case.reference(kernel, *(tensor.cpu() for tensor in inputs))
    except Exception as failure:  # e.g. no device to put the inputs on: every mode says so
        error = "making the inputs: " + "".join(traceback.format_exception_only(failure)).strip()
        return {mode: {"status": "error", "error": error, "passes": []} for mode in MODES}
    results = {}
    for mode in MODES:
        runner = _mode_runner(mode, device, lambda *args: case.call(kernel, *args))
        if runner is None:
            results[mode] = {"status": "skipped", "reason": NEEDS_A_TPU}
            continue
        passes = []
        try:
            for _ in ("warm-up", "second pass"):
                mark = counter.mark()
                error = _relative_error(runner(*inputs), expected)
                passes.append({"relative_error": error, "compiled": counter.since(mark, case)})
        except Exception as failure:  # reported, not raised: one broken mode must not hide the others
            results[mode] = {"status": "error", "error": "".join(traceback.format_exception_only(failure)).strip(),
                             "passes": passes}
            continue
        matched = all(p["relative_error"] <= TOLERANCE for p in passes)
        results[mode] = {"status": "ok" if matched else "mismatch", "tolerance": TOLERANCE, "passes": passes,
                         "second_pass_compiled": recompiled(passes[1]["compiled"])}
    return results


def _versions() -> dict:
    versions = {"python": platform.python_version()}
    for package in ("tpu-kernels", "torch", "torch_tpu", "libtpu", "jax", "jaxlib", "transformers", "kernels"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    return versions


def doctor(device: str, repos: dict[str, str], trust_remote_code: bool = False) -> dict:
    """The report (module docstring) of each kernel kind in `repos` (kernelize's kinds -> specs) on `device`."""
    import torch

    counter = _Counter(device)
    report = {"tool": "tpu-kernels doctor", "device": device, "versions": _versions(),
              "chip": torch.tpu.get_device_name() if device == "tpu" else None, "tolerance": TOLERANCE, "kernels": {}}
    try:
        for case in CASES:
            spec = KernelSpec.parse(repos[case.kernel])
            kernel = spec.load(device, trust_remote_code)
            # Whether TPU calls launch the registered kernel directly or through JaxCallable (docs/binding.md).
            direct = report["versions"].get("torch_tpu") in kernel._binding.DIRECT_LAUNCH_TORCH_TPU
            report["kernels"][case.name] = {"source": str(spec), "module": kernel.__name__, "direct_launch": direct,
                                            "modes": run_case(case, kernel, device, counter)}
    finally:
        counter.close()
    results = [(mode, result) for entry in report["kernels"].values() for mode, result in entry["modes"].items()]
    report["skipped_modes"] = sorted({mode for mode, result in results if result["status"] == "skipped"})
    report["ok"] = all(result["status"] in ("ok", "skipped") for _, result in results)
    return report


def doctor_main(argv: list[str]) -> int:
    """`tpu-kernels doctor [--device tpu|cpu] [--repo KIND=SPEC ...] [--out FILE]`."""
    parser = argparse.ArgumentParser(prog="tpu-kernels doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("tpu", "cpu"), default=None,
                        help="default: tpu on a host with one, else cpu")
    parser.add_argument("--repo", action="append", default=[], metavar="KIND=SPEC",
                        help="a kind's kernel (experts, rmsnorm, attention): org/name@version or a local build "
                             "folder (default: kernelize's)")
    parser.add_argument("--out", default="tpu-kernels-doctor.json", help="the JSON report (default: %(default)s)")
    parser.add_argument("--trust-remote-code", action="store_true", help="load kernels of untrusted publishers")
    args = parser.parse_args(argv)
    repos = dict(DEFAULT_REPOS)
    for given in args.repo:
        kind, _, spec = given.partition("=")
        if kind not in repos or not spec:
            parser.error(f"--repo {given!r}: expected KIND=SPEC with KIND one of {', '.join(repos)}")
        repos[kind] = spec
    device = args.device or ("tpu" if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") else "cpu")
    report = doctor(device, repos, args.trust_remote_code)
    with open(args.out, "w") as out:
        json.dump(report, out, indent=1)
    for name, entry in report["kernels"].items():
        print(f"{name:<16} " + "  ".join(f"{mode}: {result['status']}" + (
            " (compiled again on the second pass)" if result.get("second_pass_compiled") else "")
            for mode, result in entry["modes"].items()))
    print(f"report: {args.out}" + ("" if report["ok"] else " (a mode failed: please attach it to an issue)"))
    return 0 if report["ok"] else 1
