"""`kernels benchmark tpu-kernels/rmsnorm-tpu --version 1`: RMSNorm and fused residual-add + RMSNorm, bfloat16.

The cases ship in the kernel's package (`rmsnorm_tpu.benchmark_suites`: what each case runs and how it is checked,
beside the shapes `tpu-kernels check` compiles, which they name); this file hands them to `kernels benchmark` as
the Benchmark classes it runs.
"""

import importlib
from pathlib import Path

import kernels

# This repo's kernel, loaded as `kernels benchmark` loads it next: kernels imports a build once, and both get the
# same module. The repo is the folder above this file as kernels found it (not resolved: a Hub snapshot's files
# are links into its blob store).
_kernel = kernels.get_local_kernel(Path(__file__).absolute().parents[1])
_suites = importlib.import_module(f"{_kernel.__name__}.benchmark_suites")
_suites.harness.define(globals(), _suites.SUITES)
