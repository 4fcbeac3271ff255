"""The programs behind `kernels benchmark` workloads, rebuilt for the performance model.

A workload of `kernels benchmark`'s JSON is `Class.workload`. Two families are known:

- **ours**: a class of a kernel's benchmark suites (its package's `benchmark_suites.SUITES`: case class, TPU
  table, interpret-mode table), which the repo's `benchmarks/benchmark.py` hands to `kernels benchmark`. The repo
  is built from the checkout and loaded, its suites imported from the loaded kernel, and the case's inputs are
  made exactly as the benchmark made them (the same builder and seed); the kernel's JAX function is then traced at
  those inputs: float
  arrays as shapes, integer ones (routing, lengths, page tables, group sizes) by value, since they decide
  the grids the replay walks.
- **tokamax's**: `TokamaxPallasRaggedDot` or `TokamaxRaggedDot` (XLA's) workloads name a call and config that
  tokamax timed on a TPU (its autotuning data), `<chip>_<first 12 hex of sha256 of the entry's identity>`:
  timings in this form are how tokamax's own measurements enter the same path (`tokamax_workloads` writes
  them), and their programs are `calibrate`'s rebuilds of tokamax's calls.

`Program` carries what `calibration.Analysed` prices: the compiled program's analysis and the replay.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
import torch

from benchmarks.perf import calibration, program_replay, tokamax_calls, xla_program
from benchmarks.studies import kernel_repo

KERNEL_REPOS = ("ragged-dot-tpu", "attention-tpu", "rmsnorm-tpu")
# tokamax's kinds of calls, by the class name their workloads carry.
TOKAMAX_CLASSES = {"TokamaxPallasRaggedDot": "pallas_ragged_dot", "TokamaxRaggedDot": "xla_ragged_dot"}
SHORT_HASH = 12


class UnknownWorkload(ValueError):
    """A workload no kernel repo's benchmark and no tokamax entry defines."""


@dataclass(frozen=True)
class WorkloadMeasurement(tokamax_calls.Measurement):
    """A timing of one of our workloads, in calibrate's form (its call: {"workload": name})."""

    @property
    def label(self) -> str:
        return self.call["workload"]


@dataclass(frozen=True)
class Case:
    """One of our workloads: its repo, case class, case (from the table) and whether it ran in interpret mode."""

    repo: str
    workload: str
    case_class: type
    case: object
    interpret_mode: bool
    module: object  # the kernel's benchmark_suites, which define it

    @property
    def model_constant(self) -> bool:
        """A microbenchmark of one of the model's constants (ragged-dot-tpu's `model_constant_suites`): fitted
        directly."""
        return self.case_class.__name__ == "ModelConstantCase"


class OurBenchmarks:
    """The three kernel repos built from the checkout and loaded (the torch-cpu variant), with their benchmark
    suites."""

    def __init__(self, repos: Path | None = None):
        import kernels

        from tpu_kernels.distribution.builder import build_kernel_repo

        self._folder = tempfile.TemporaryDirectory(prefix="from_benchmark_")
        self.builds, self.kernels, self.suites = {}, {}, {}
        for name in KERNEL_REPOS:
            build = self.builds[name] = build_kernel_repo((repos / name) if repos else kernel_repo(name),
                                                          Path(self._folder.name))
            self.kernels[name] = kernels.get_local_kernel(build, backend="cpu")
            self.suites[name] = benchmark_suites(self.kernels[name])

    def find(self, workload: str) -> Case | None:
        class_name, _, method = workload.partition(".")
        for repo, module in self.suites.items():
            for case_class, tpu_table, interpret_table in module.SUITES:
                for table, interpret_mode in ((tpu_table, False), (interpret_table, True)):
                    if method in table.get(class_name, {}):
                        return Case(repo, workload, case_class, table[class_name][method], interpret_mode, module)
        return None

    def program_inputs(self, case: Case) -> tuple[dict, object]:
        """The case's inputs as the benchmark made them (CPU tensors), and the kernel they are for."""
        kernel = self.kernels[case.repo]
        instance = case.case_class()
        instance.kernel = kernel
        harness = case.module.harness
        generator = torch.Generator().manual_seed(harness.SEED)
        return instance.inputs(case.case, instance.targets(kernel), generator), kernel

    def calls_per_timing(self, case: Case) -> int:
        """How many calls one timing of the case made on the host that ran it (a TPU one, or the interpreter)."""
        return 1 if case.interpret_mode else case.module.harness.TPU_CALLS_PER_TIMING


def benchmark_suites(kernel):
    """The loaded kernel's benchmark suites: the module of its package the repo's benchmarks/benchmark.py hands to
    `kernels benchmark` (`SUITES`, with the harness that times them)."""
    return importlib.import_module(f"{kernel.__name__}.benchmark_suites")


def as_traced(value):
    """A float tensor as its shape (its values do not change the program), an integer one by value."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dtype.is_floating_point:
        return jax.ShapeDtypeStruct(tuple(value.shape), jax.numpy.dtype(str(value.dtype).removeprefix("torch.")))
    return np.asarray(value.numpy())


def kernel_function(case: Case, kernel, inputs: dict, chip: str):
    """The JAX function the case's torch op runs, and its arguments, for `chip`'s tiles."""
    name = case.case_class.__name__
    if name == "ExpertsLayerCase":
        biases = [inputs["gate_up_bias"], inputs["down_bias"]] if inputs["gate_up_bias"] is not None else []
        args = [inputs[key] for key in ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj",
                                        "down_proj")] + biases
        return functools.partial(kernel.experts_layer, **inputs["options"], generation=chip), args
    if name == "GroupedMatmulCase":
        fn = functools.partial(kernel.gmm.kernel.grouped_matmul, transpose_rhs=True, generation=chip)
        return fn, [inputs["lhs"], inputs["rhs"], inputs["group_sizes"]]
    if name == "FlashCase":
        keys = sorted(inputs["options"])

        def flash(q, k, v, *options):
            return kernel.flash.kernel.differentiable_flash_attention(q, k, v, **dict(zip(keys, options)),
                                                                      generation=chip)

        return flash, [inputs["q"], inputs["k"], inputs["v"], *(inputs["options"][key] for key in keys)]
    if name == "PagedCase":
        options = dict(inputs["options"])
        sinks = options.pop("sinks", None)

        def paged(q, k_cache, v_cache, cu_q_lens, kv_lens, page_table, *sink):
            return kernel.paged.kernel.ragged_paged_attention(
                q, k_cache, v_cache, cu_q_lens, kv_lens, page_table, sinks=sink[0] if sink else None, **options,
                generation=chip)

        names = ("q", "k_cache", "v_cache", "cu_q_lens", "kv_lens", "page_table")
        return paged, [inputs[key] for key in names] + ([sinks] if sinks is not None else [])
    if name == "LatentCase":
        keys = sorted(inputs["options"])

        def latent(q_latent, q_rope, latent_cache, rope, *options):
            return kernel.latent.kernel.latent_attention(q_latent, q_rope, latent_cache, rope,
                                                         **dict(zip(keys, options)), generation=chip)

        arrays = [inputs[key] for key in ("q_latent", "q_rope", "latent", "rope")]
        return latent, arrays + [inputs["options"][key] for key in keys]
    if name == "NormCase":
        forward = getattr(kernel.norm.kernel, f"{inputs['kernel']}_forward")
        rows = [inputs["x"], inputs["residual"]] if "residual" in inputs else [inputs["x"]]
        return functools.partial(forward, eps=inputs["eps"], generation=chip), [*rows, inputs["weight"]]
    raise UnknownWorkload(f"{case.workload}: no JAX function known for case class {name}")


def analyse_ours(benchmarks: OurBenchmarks, case: Case, measurement: tokamax_calls.Measurement
                 ) -> calibration.Analysed:
    """The case's program compiled for the measurement's chip (kernel bodies empty: the replay prices them) and its
    kernels replayed at the case's inputs; a program the model cannot take comes back with the reason."""
    inputs, kernel = benchmarks.program_inputs(case)
    fn, args = kernel_function(case, kernel, inputs, measurement.chip)
    traced = [as_traced(arg) for arg in args]
    avals = [arg if isinstance(arg, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(arg.shape, arg.dtype)
             for arg in traced]
    try:
        lowered = xla_program.lower_program(fn, avals, measurement.chip, kernel_bodies=False)
        program = calibration.compile_text(lowered).analyse(measurement.chip)
        replay = program_replay.replay_program(fn, *traced)
        analysed = calibration.Analysed(measurement, program, replay)
        analysed.price()
    except Exception as error:  # noqa: BLE001 - a case the model cannot price is a result, with why
        reason = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        return calibration.Analysed(measurement, None, None, f"not modelled: {reason[:300]}")
    return analysed


def tokamax_identity_hash(measurement: tokamax_calls.Measurement) -> str:
    return hashlib.sha256(measurement.identity.encode()).hexdigest()[:SHORT_HASH]


def tokamax_workload(measurement: tokamax_calls.Measurement) -> str:
    """The workload name that stands for one timed tokamax entry."""
    class_name = {kind: name for name, kind in TOKAMAX_CLASSES.items()}[measurement.kind]
    return f"{class_name}.{measurement.chip}_{tokamax_identity_hash(measurement)}"


def tokamax_measurements(paths) -> dict[str, tokamax_calls.Measurement]:
    """Every entry of tokamax's timing files at `paths` of a kind `TOKAMAX_CLASSES` names, by workload name."""
    measurements, _ = tokamax_calls.read_measurements(paths, None)
    return {tokamax_workload(m): m for m in measurements if m.kind in TOKAMAX_CLASSES.values()}

