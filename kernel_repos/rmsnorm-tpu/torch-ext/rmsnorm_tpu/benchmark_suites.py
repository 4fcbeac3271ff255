"""The suites `kernels benchmark tpu-kernels/rmsnorm-tpu --version 1` runs (through the repo's
benchmarks/benchmark.py): RMSNorm and fused residual-add + RMSNorm, bfloat16.

On a TPU host the cases are shapes `tpu-kernels check` compiles (the kernel's `compile_targets`: its hidden
sizes and row counts, from one decode row to a prefill chunk of 8192); each case fails if `compile_targets` no
longer models it. Without a TPU, small shapes in interpret mode. `_benchmark_harness.py` (shipped into every
build) says how a case is timed and checked. The fused kernel is checked on its normalised output (the new
residual is the plain sum). Weights lie in [0.05, 0.25) so that outputs stay below 2, where bfloat16's rounding
stays within the runner's absolute tolerance of 0.01.
"""

import torch

from . import _benchmark_harness as harness


def modelled(kernel: str, rows: int, hidden: int):
    """A case at a shape of compile_targets (checked when the case runs)."""

    def case(targets):
        if rows not in targets.ROW_COUNTS or hidden not in targets.HIDDEN_SIZES:
            raise ValueError(f"{kernel} rows={rows} H={hidden} is not among compile_targets' shapes")
        return dict(kernel=kernel, rows=rows, hidden=hidden, eps=targets.EPS)

    return case


def small(kernel: str, rows: int, hidden: int):
    return lambda targets: dict(kernel=kernel, rows=rows, hidden=hidden, eps=targets.EPS)


KERNELS = ("rms_norm", "fused_add_rms_norm")
HIDDEN_SIZES = (2048, 2816, 4096, 7168)
ROW_COUNTS = (1, 64, 8192)
CASES = {"RMSNorm": {f"{kernel}_h{hidden}_r{rows}": modelled(kernel, rows, hidden) for kernel in KERNELS
                     for hidden in HIDDEN_SIZES for rows in ROW_COUNTS}}
INTERPRET_CASES = {"InterpretModeRMSNorm": {f"{kernel}_h256_r16": small(kernel, 16, 256) for kernel in KERNELS}}


def norm_inputs(case: dict, generator: torch.Generator) -> dict:
    """x (and a residual for the fused kernel) `[rows, hidden]` and the weight `[hidden]`."""
    rows, hidden = case["rows"], case["hidden"]
    inputs = dict(kernel=case["kernel"], eps=case["eps"],
                  x=torch.randn(rows, hidden, generator=generator).to(torch.bfloat16),
                  weight=(0.05 + 0.2 * torch.rand(hidden, generator=generator)).to(torch.bfloat16))
    if case["kernel"] == "fused_add_rms_norm":
        inputs["residual"] = torch.randn(rows, hidden, generator=generator).to(torch.bfloat16)
    return inputs


class NormCase(harness.KernelCase):
    def make_inputs(self, spec, generator):
        return norm_inputs(spec, generator)

    def call(self, inputs):
        if inputs["kernel"] == "rms_norm":
            return self.kernel.rms_norm(inputs["x"], inputs["weight"], inputs["eps"])
        return self.kernel.fused_add_rms_norm(inputs["x"], inputs["residual"], inputs["weight"], inputs["eps"])[0]

    def expected(self, inputs):
        if inputs["kernel"] == "rms_norm":
            return self.kernel.reference.rms_norm(inputs["x"], inputs["weight"], inputs["eps"])
        return self.kernel.reference.fused_add_rms_norm(inputs["x"], inputs["residual"], inputs["weight"],
                                                        inputs["eps"])[0]


SUITES = [(NormCase, CASES, INTERPRET_CASES)]
