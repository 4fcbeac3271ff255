"""Host cost of the JAX -> torch op binding: the CPU path, and the part that stays on the TPU path.

CPU path. A two-tensor op (`x + y`, so that the kernel itself costs next to
nothing) is timed through the whole binding, `op(x, y)` on torch CPU tensors,
against the bare call it wraps: the same function jitted by JAX, called on
JAX arrays under the same interpret-mode settings. The difference is the
binding's overhead. Each part of the call is then timed on its own, and
marked with whether it also runs when the op gets TPU tensors.

TPU path (no TPU here). For TPU tensors the op runs the binding's TPU kernel
(`binding._TpuKernel`): a key of the arguments and a lookup around one C++
launch, torch_tpu's `call_custom_kernel`. That Python is timed by calling the
op with torch_tpu's C++ kernel registry and launcher replaced by stubs that do
nothing (the launch itself cannot be timed without a TPU), the TPU kernel
registered for CPU tensors, so that the dispatcher layers are the same. The
same ops registered through torch_tpu's `jax_op` (the binding's registration
before, whose JaxCallable normalises and keys every call in Python behind
custom_op's autograd layer) are timed beside them. Signatures are our ops' own
(rms_norm, flash attention, the fused MoE experts), read from the kernel
repos' `ops.py` (`stand_in`), with bodies that cost nothing; tensor sizes are
small because the host work does not depend on them. A decode step is then
modelled from these numbers.

Timing: every candidate runs `--calls` times per round, candidates interleaved,
for `--rounds` rounds; the JSON keeps the minimum and median of the per-call
time over rounds. The host is shared: the minimum is the figure least skewed
by other work, and the load average is recorded.

Usage:
    python -m benchmarks binding [--rounds 40] [--calls 200] [--out benchmarks/results/binding.json]
    (or python -m benchmarks.studies.binding; --out is relative to the current directory)
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import jax
import torch
from jax.experimental.pallas import tpu as pltpu

from benchmarks.studies import result_path, write_json
from benchmarks.studies.model_shapes import KERNEL_REPOS
from tpu_kernels.runtime import binding

DEFAULT_OUT = result_path("binding.json")
# torch_tpu's API-stage notice at every jax_op registration.
JAX_OP_STAGE_NOTICE = r"<TorchTpu/ApiStage/ExperimentalApi/> jax_op is experimental"
TARGET_US, STRETCH_US = 100.0, 50.0

# Decode-step model (Hugging Face's figures): a 48-layer MoE, four kernel calls
# per layer (two RMSNorms, attention, the fused experts), and the 26.5 ms step
# Hugging Face measured for it at batch 1.
LAYERS = 48
CALLS_PER_LAYER = {"rms_norm": 2, "flash_attention": 1, "gated_experts": 1}
HF_STEP_MS = 26.5


def add(x: jax.Array, y: jax.Array) -> jax.Array:
    return x + y


# The ops of a decode step: {op: (kernel repo, its package)}.
DECODE_OPS = {"rms_norm": ("rmsnorm-tpu", "rmsnorm_tpu"), "flash_attention": ("attention-tpu", "attention_tpu"),
              "gated_experts": ("ragged-dot-tpu", "ragged_dot_tpu")}


def _registers(decorator: ast.expr, op: str) -> bool:
    """`decorator` is `jax_torch_op(add_op_namespace_prefix("<op>"))`."""
    return (isinstance(decorator, ast.Call) and decorator.args and isinstance(decorator.args[0], ast.Call)
            and any(isinstance(arg, ast.Constant) and arg.value == op for arg in decorator.args[0].args))


def stand_in(op: str) -> Callable:
    """A function with the signature of the JAX function its kernel repo registers as the torch op `op` (read from
    the repo's source `ops.py`, not built), whose body returns its first argument: what the binding does around a
    call depends on the signature, not on the kernel."""
    repo, package = DECODE_OPS[op]
    path = KERNEL_REPOS / repo / "torch-ext" / package / "ops.py"
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.FunctionDef) and any(_registers(d, op) for d in node.decorator_list):
            node.name, node.decorator_list = op, []
            node.body = [ast.Return(ast.Name(node.args.args[0].arg, ast.Load()))]
            namespace = {"jax": jax}
            exec(compile(ast.fix_missing_locations(ast.Module([node], [])), str(path), "exec"), namespace)
            return namespace[op]
    raise LookupError(f"{path} registers no torch op {op!r}")


def decode_arguments() -> dict[str, tuple]:
    """Arguments of one decode-step call (batch 1) per op; small sizes, the same ranks and dtypes."""
    bf16 = torch.bfloat16
    hidden = torch.randn(1, 256, dtype=bf16)
    ones = torch.ones(1, dtype=torch.int32)
    return {
        "rms_norm": (hidden, torch.randn(256, dtype=bf16), 1e-6, 0.0),
        "flash_attention": (
            torch.randn(1, 8, 1, 128, dtype=bf16), torch.randn(1, 2, 64, 128, dtype=bf16),
            torch.randn(1, 2, 64, 128, dtype=bf16), ones * 63, ones * 64, None, None, 0.088, True, None, None,
        ),
        "gated_experts": (
            hidden, torch.zeros(1, 8, dtype=torch.int32), torch.rand(1, 8), torch.randn(16, 512, 256, dtype=bf16),
            torch.randn(16, 256, 256, dtype=bf16), None, None, None, None, "silu", True, False, 1.0, float("inf"),
        ),
    }


def timed(candidates: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, dict[str, float]]:
    """Per-call microseconds of each candidate: minimum and median over interleaved rounds."""
    for candidate in candidates.values():
        for _ in range(20):
            candidate()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, candidate in candidates.items():
            start = time.perf_counter()
            for _ in range(calls):
                candidate()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: {"min_us": min(s), "median_us": statistics.median(s)} for name, s in samples.items()}


def measure_cpu_path(rounds: int, calls: int) -> dict:
    op = binding.jax_torch_op("binding_bench::add")(add)
    opoverload = torch.ops.binding_bench.add.default
    kernel = binding._JaxFunction("binding_bench::add", add)
    x, y = torch.randn(8, 128), torch.randn(8, 128)
    xa, ya = jax.numpy.asarray(x.numpy()), jax.numpy.asarray(y.numpy())
    params = binding.interpret_params()
    jitted = jax.jit(add, compiler_options=binding.cpu_compile_options())
    out = kernel.jitted(xa, ya)

    def bare_jit():
        with pltpu.force_tpu_interpret_mode(params):
            result = jitted(xa, ya)
        result.block_until_ready()

    xn, yn = binding._to_host_array(x), binding._to_host_array(y)

    def jit_on_numpy_views():
        with pltpu.force_tpu_interpret_mode(params):
            result = jitted(xn, yn)
        result.block_until_ready()

    def interpret_mode_context():
        with pltpu.force_tpu_interpret_mode(params):
            pass

    def race_watch():
        with contextlib.redirect_stdout(binding._RaceWatch(sys.stdout)):
            pass

    times = timed(
        {
            "bare_jit": bare_jit,
            "jit_on_numpy_views": jit_on_numpy_views,
            "op": lambda: op(x, y),
            "op_overload": lambda: opoverload(x, y),
            "cpu_kernel": lambda: kernel.run_on_cpu(x, y),
            "complete_arguments": lambda: kernel._complete((x, y), {}),
            "to_host_arrays": lambda: (binding._to_host_array(x), binding._to_host_array(y)),
            "interpret_params": binding.interpret_params,
            "interpret_mode_context": interpret_mode_context,
            "output_to_torch": lambda: binding._to_torch(out),
            "race_watch": race_watch,
        },
        rounds,
        calls,
    )
    best = {name: t["min_us"] for name, t in times.items()}
    overhead = best["op"] - best["bare_jit"]
    on_tpu_too, cpu_only = True, False
    breakdown = [
        ("JaxTorchOp's autograd check", best["op"] - best["op_overload"], on_tpu_too),
        ("dispatcher (no autograd kernel)", best["op_overload"] - best["cpu_kernel"], on_tpu_too),
        ("argument completion", best["complete_arguments"], cpu_only),
        ("2 tensors -> numpy views", best["to_host_arrays"], cpu_only),
        ("jax adopting the numpy views (in the jitted call)", best["jit_on_numpy_views"] - best["bare_jit"], cpu_only),
        ("interpret-mode settings (environment read)", best["interpret_params"], cpu_only),
        ("entering/leaving interpret mode", best["interpret_mode_context"], cpu_only),
        ("result -> torch (DLPack)", best["output_to_torch"], cpu_only),
    ]
    accounted = sum(us for _, us, _ in breakdown)
    return {
        "op": "add(x: jax.Array, y: jax.Array) -> jax.Array, two float32 [8, 128] tensors",
        "per_call_us": times,
        "overhead_us": overhead,
        "target_us": TARGET_US,
        "stretch_target_us": STRETCH_US,
        "meets_target": overhead <= TARGET_US,
        "meets_stretch_target": overhead <= STRETCH_US,
        "breakdown_us": [{"part": part, "us": us, "also_on_tpu_path": tpu} for part, us, tpu in breakdown],
        "breakdown_unaccounted_us": overhead - accounted,
        "race_detection_extra_us": best["race_watch"],
        "note": "each part timed alone (minimum over rounds); the bare jitted call is the baseline and "
        "part of both. With race detection on (our tests), the binding adds race_detection_extra_us.",
    }


class _StubTpuRuntime:
    """torch_tpu's C++ kernel registry and launcher, doing nothing: what is left is jax_op's Python."""

    def __init__(self):
        self.registered = set()

    def lookup_custom_kernel(self, name, fingerprint):
        return (name, fingerprint) in self.registered

    def register_custom_kernel(self, name, fingerprint, serialized_mlir_module):
        self.registered.add((name, fingerprint))

    def call_custom_kernel(self, name, fingerprint, inputs, output_shapes, donate_argnums, device_assignment):
        return list(output_shapes)


def measure_tpu_path_python(rounds: int, calls: int) -> dict:
    from torch_tpu._internal.pallas import pallas as torch_tpu_pallas

    jax_op = torch_tpu_pallas.jax_op
    runtime, placeholder = torch_tpu_pallas.tpu_torch_pallas, torch_tpu_pallas.torch_placeholder
    torch_tpu_pallas.tpu_torch_pallas = _StubTpuRuntime()
    # Output placeholders are allocated on "tpu"; here they are CPU tensors.
    torch_tpu_pallas.torch_placeholder = lambda *a, **k: placeholder(*a, **{**k, "device": "cpu"})
    try:
        ours, previous = {}, {}
        arguments = {"add": (torch.randn(8, 128), torch.randn(8, 128)), **decode_arguments()}
        for name, fn in (("add", add), *((op, stand_in(op)) for op in DECODE_OPS)):
            op = binding.jax_torch_op(f"binding_bench_tpu::{name}")(fn)
            # For CPU tensors, through the same dispatcher layers as the TPU kernel.
            op.registered.library.impl(name, op.registered.tpu_kernel, "CPU")
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=JAX_OP_STAGE_NOTICE, category=UserWarning)
                jax_op_op = jax_op(f"binding_bench_jax_op::{name}", fn)
            jax_op_op.register_kernel("cpu")(jax_op_op._init_fn)
            args = arguments[name]
            ours[name] = lambda op=op, args=args: op(*args)
            previous[name] = lambda op=jax_op_op, args=args: op(*args)
        timings = timed({**ours, **{f"jax_op {name}": call for name, call in previous.items()}}, rounds, calls)
        times = {name: timings[name] for name in ours}
        times_jax_op = {name: timings[f"jax_op {name}"] for name in previous}
    finally:
        torch_tpu_pallas.tpu_torch_pallas, torch_tpu_pallas.torch_placeholder = runtime, placeholder
    per_layer_us = sum(count * times[name]["min_us"] for name, count in CALLS_PER_LAYER.items())
    step_ms = LAYERS * per_layer_us / 1e3
    return {
        "what": "Python host work per call of a binding op on TPU tensors (JaxTorchOp, dispatch, the TPU kernel's "
        "key and lookup), with the C++ launch (call_custom_kernel) stubbed out: a lower bound of the eager host cost",
        "per_call_us": times,
        "per_call_us_through_jax_op": times_jax_op,
        "through_jax_op": "the same functions registered with torch_tpu's jax_op, as the binding registered them "
        "before: custom_op's autograd layer and JaxCallable's normalisation and key on every call",
        "decode_step_model": {
            "assumptions": f"{LAYERS} layers x {CALLS_PER_LAYER} kernel calls; minimum per-call times "
            "above; launch cost of call_custom_kernel and all non-kernel torch ops excluded",
            "kernel_calls_per_step": LAYERS * sum(CALLS_PER_LAYER.values()),
            "host_ms_per_step_lower_bound": step_ms,
            "hf_step_ms_batch_1": HF_STEP_MS,
            "share_of_hf_step": step_ms / HF_STEP_MS,
        },
        "with_torch_compile": "torch_tpu's 'tpu' torch.compile backend lowers the FX graph by running it once on "
        "placeholder tensors (torch_tpu/_internal/compile/compiler.py: fx_to_mlir); each jax_op call then "
        "adds its Mosaic kernel to the one compiled executable, so a compiled step replays no per-op Python "
        "(read from the source, not measured: no TPU here)",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)

    results = {
        "host": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "versions": {"jax": jax.__version__, "torch": torch.__version__},
        "method": f"{args.rounds} interleaved rounds of {args.calls} calls per candidate; min and median per call",
        # Other work on the host skews CPU timings: the load average says how busy it was.
        "load_average_at_start": os.getloadavg(),
    }
    os.environ.pop(binding.RACE_DETECTION_ENV, None)
    results["cpu_path"] = measure_cpu_path(args.rounds, args.calls)
    results["tpu_path_python"] = measure_tpu_path_python(args.rounds, args.calls)
    results["load_average_at_end"] = os.getloadavg()

    cpu = results["cpu_path"]
    print(f"bare jitted call {cpu['per_call_us']['bare_jit']['min_us']:7.1f} us   "
          f"op {cpu['per_call_us']['op']['min_us']:7.1f} us   overhead {cpu['overhead_us']:6.1f} us "
          f"(target {TARGET_US:.0f}, stretch {STRETCH_US:.0f})")
    for part in cpu["breakdown_us"]:
        print(f"  {part['us']:6.1f} us  {'TPU+CPU' if part['also_on_tpu_path'] else 'CPU    '}  {part['part']}")
    print(f"  {cpu['breakdown_unaccounted_us']:6.1f} us  unaccounted (timing noise, call glue)")
    tpu = results["tpu_path_python"]
    for name, t in tpu["per_call_us"].items():
        print(f"TPU path Python, {name:<16} {t['min_us']:6.1f} us/call "
              f"(through jax_op {tpu['per_call_us_through_jax_op'][name]['min_us']:6.1f})")
    model = tpu["decode_step_model"]
    print(f"decode step: {model['kernel_calls_per_step']} kernel calls, >= {model['host_ms_per_step_lower_bound']:.1f} ms "
          f"host Python in eager mode (HF step at batch 1: {HF_STEP_MS} ms)")
    out = write_json(args.out, results, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
