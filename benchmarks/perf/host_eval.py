"""The replay's small computations on the host: values not known yet, and one-off jitted helpers.

A traced function's arguments given as `jax.ShapeDtypeStruct` (and whatever
is computed from them, or from a kernel's output) have no value during the
replay: they are `UNKNOWN`. The known ones (group sizes, scalar-prefetch
operands, dynamic grid sizes, index maps over all grid steps) are computed
by small jitted programs on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import jax


class _Unknown:
    def __repr__(self):
        return "<unknown>"


UNKNOWN = _Unknown()


def is_unknown(value) -> bool:
    return value is UNKNOWN


# The model's helper programs run once each on small integer arrays, so their compile time is all that counts:
# XLA's CPU backend optimizations, its fusion emitters and codegen split into parallel parts cost more
# compile time than they save (together about 0.045 s -> 0.020 s per program, measured here).
_HOST_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                         "xla_cpu_use_fusion_emitters": False, "xla_cpu_parallel_codegen_split_count": 1}


def run_on_host(fn: Callable, *args):
    """`jax.jit(fn)(*args)` on the host device, compiled without XLA's CPU optimizations."""
    return jax.jit(fn).lower(*args).compile(_HOST_COMPILE_OPTIONS)(*args)


def host_device():
    """Where the model's small computations run: the CPU when jax has it, else the default device."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return jax.devices()[0]
