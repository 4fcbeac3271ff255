"""What every kernel's benchmark suites share: shipped into each build's package as `_benchmark_harness.py` (a
build cannot import tpu_kernels), imported there by the package's `benchmark_suites`.

A kernel package's `benchmark_suites` lists its `SUITES`: each a mixin class (`KernelCase`'s subclass) that turns
a case into CPU tensors (`inputs`), runs the kernel on them (`call`) and computes the kernel's float64 reference
(`expected`), with its tables of cases for a TPU host and for interpret mode, {Benchmark class name: {workload:
case}}. The repo's `benchmarks/benchmark.py`, which `kernels benchmark` runs, loads the kernel and hands its
suites to `define`, which makes one `kernels.Benchmark` class per table entry with the `setup_`, `benchmark_` and
`verify_` methods `kernels benchmark` looks up by name. The same suites and `inputs` serve the lab's `calibrate
--from-benchmark`, which prices each case with the model.

- On a TPU host (`ON_TPU`: the accelerator `kernels` picks too) each timing is `TPU_CALLS_PER_TIMING` calls issued
  back to back, then waited for: `kernels`' timer synchronizes CUDA, XPU and MPS only, and a TPU call returns
  before the chip has finished. Back-to-back calls keep the chip busy while the host dispatches the next one,
  so a timing divided by the count approaches the device time of one call.
- Without a TPU the file's interpret-mode tables run (small shapes, Pallas' TPU interpret mode), and the first
  case says that their times mean nothing about a TPU.
- The reference is computed once per workload, on the host, and handed back on the output's device and in its
  dtype (the runner compares with `torch.allclose(out, expected, atol=1e-2)`); the runner's "Ref" column times
  that cached result, not a rival.
"""

from __future__ import annotations

import importlib
import sys

import torch
from kernels import Benchmark

SEED = 0
_ACCELERATOR = torch.accelerator.current_accelerator()
ON_TPU = _ACCELERATOR is not None and _ACCELERATOR.type == "tpu"
TPU_CALLS_PER_TIMING = 10
CALLS_PER_TIMING = TPU_CALLS_PER_TIMING if ON_TPU else 1
INTERPRET_MODE_NOTE = ("No TPU here: small shapes in Pallas TPU interpret mode. The kernels are checked against "
                       "their reference; the times measure the interpreter and mean nothing about a TPU.")


def compile_targets_of(kernel, submodule: str = "compile_targets"):
    """The loaded kernel's module of modelled shapes (`tpu-kernels check` compiles the same)."""
    return importlib.import_module(f"{kernel.__name__}.{submodule}")


def on_device(inputs: dict, device: str) -> dict:
    return {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in inputs.items()}


def finished(result: torch.Tensor) -> torch.Tensor:
    """`result` once the device has computed it."""
    if result.device.type != "cpu":
        torch.accelerator.synchronize()
    return result


class KernelCase:
    """One workload. A mixin, no Benchmark itself (kernels runs every Benchmark subclass a script defines).

    Subclasses give `make_inputs(spec, generator)` (the case's arguments as CPU tensors, a dict), `call(inputs)`
    and `expected(inputs)`; `spec(case, targets)` resolves a table's case against the modelled shapes
    (`targets(kernel)`: by default a case is a function of them)."""

    seed = SEED
    cases: dict = {}
    noted = False

    def targets(self, kernel):
        return compile_targets_of(kernel)

    def spec(self, case, targets):
        return case(targets)

    def inputs(self, case, targets, generator: torch.Generator) -> dict:
        return self.make_inputs(self.spec(case, targets), generator)

    def setup_workload(self, workload: str) -> None:
        if not ON_TPU and not KernelCase.noted:
            print(INTERPRET_MODE_NOTE, file=sys.stderr)
            KernelCase.noted = True
        self.host_inputs = self.inputs(self.cases[workload], self.targets(self.kernel),
                                       torch.Generator().manual_seed(SEED))
        self.device_inputs = on_device(self.host_inputs, self.device)
        self.expected_out = None

    def run(self) -> None:
        for _ in range(CALLS_PER_TIMING):
            self.out = self.call(self.device_inputs)
        finished(self.out)

    def verify(self) -> torch.Tensor:
        if self.expected_out is None:
            self.expected_out = self.expected(self.host_inputs).to(self.out.dtype).to(self.out.device)
        return self.expected_out


def _workload_methods(workload: str) -> dict:
    return {f"setup_{workload}": lambda self: self.setup_workload(workload),
            f"benchmark_{workload}": lambda self: self.run(),
            f"verify_{workload}": lambda self: self.verify()}


def define(namespace: dict, suites) -> None:
    """One Benchmark class per entry of each suite's table for this host, bound in `namespace` (the benchmark
    script's globals: kernels runs the classes the script's module defines, and only those).

    `suites`: (case class, TPU table, interpret-mode table), a table being {class name: {workload: case}}."""
    for case_class, tpu_table, interpret_table in suites:
        for class_name, cases in (tpu_table if ON_TPU else interpret_table).items():
            methods = {"cases": cases, "__module__": namespace["__name__"]}
            for workload in cases:
                methods |= _workload_methods(workload)
            namespace[class_name] = type(class_name, (case_class, Benchmark), methods)
