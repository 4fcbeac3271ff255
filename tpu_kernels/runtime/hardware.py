"""What kernels and the performance model know about TPU generations: one source for all of them.

Shipped into every built kernel as `_hardware.py` (as the binding is shipped
as `_binding.py`): kernel code imports it relatively (`from ._hardware import
...`) and a built kernel never imports tpu_kernels. Imports only the standard
library and jax.

Where the numbers come from:
- Capacities, HBM bandwidth, MXU peaks and size, lanes and sublanes: jax's
  public TPU table, `jax.experimental.pallas.tpu.get_tpu_info_for_chip`
  (jax 0.10.2), per TensorCore. v5e: 8.20e11 B/s HBM, 1.97e14 bf16 FLOP/s,
  128 MiB VMEM, MXU 128; v6e: 1.64e12 B/s, 9.20e14 FLOP/s, 128 MiB VMEM,
  MXU 256; both 8 sublanes x 128 lanes. These match Google's public specs
  (v5e 197 TFLOP/s, 819 GB/s; v6e 918 TFLOP/s, 1640 GB/s).
- Default scoped VMEM limit (what Mosaic compiles a kernel against unless
  it sets `vmem_limit_bytes`; not in jax's table): 16 MiB on v5e and v5p,
  32 MiB on v6e, measured with libtpu's compile-only topologies: blocks plus
  scratch of exactly that size compile, one MiB more fails with
  CompileTimeScopedVmemOom (tests/test_perf.py checks each edge). TPU7x has
  no such edge: double-buffered blocks of 1 MiB with 34 MiB in all compile
  and 35 fail, blocks of 7 MiB with 36 MiB compile; it is left unknown.
- Per-grid-step cost 0.35 us (`GRID_STEP_OVERHEAD_S`), 0.72 us on TPU7x
  (`grid_step_overhead_s`): the rule of thumb kernels tile by. The Pallas
  guides do not state it (jax's docs/pallas/tpu, whole history up to commit
  cec06d1, 2026-08); fitted to real-chip timings it is 0.34 us on v5e and
  0.72 us on TPU7x (the performance model's calibrated values:
  benchmarks/perf/model_constants.json; v5p's and v6e's timings check the
  model but do not fit a step cost of their own).

Generations: kernels are tuned and compiled ahead of time for
SUPPORTED_GENERATIONS only: v5e, v5p, v6e and TPU7x (Ironwood). The device
kinds jax reports map to them through jax's table ("TPU v5 lite" -> v5e,
"TPU v5" or "TPU v5p" -> v5p, "TPU v6 lite" -> v6e, "TPU7x" -> tpu7x). On a
TPU of any other generation `current_generation` raises UnsupportedTpuError
naming them, since tiles sized for one generation can overflow another's
VMEM (v4 has 16 MiB per core). Off TPU (the CPU interpret path) the kernels
tile as for OFF_TPU_GENERATION. The environment variable
TPU_KERNELS_GENERATION names a supported generation to use instead of the
detected one.

VMEM per TensorCore is 128 MiB on v5e and v6e and 64 MiB on v5p and TPU7x.
Compile-only checks (libtpu, 2026-12-02) accept a kernel's raised limit up to
the whole capacity on v5p and TPU7x: blocks of 60 MiB under a 64 MiB limit
compile, 64 MiB of blocks fail ("Used 64.00M of 63.94M vmem").
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental.pallas import tpu as pltpu

MIB = 1 << 20

SUPPORTED_GENERATIONS = ("v5e", "v5p", "v6e", "tpu7x")
OFF_TPU_GENERATION = "v6e"
GENERATION_ENV = "TPU_KERNELS_GENERATION"

# Measured with libtpu's compile-only topologies (module docstring).
DEFAULT_SCOPED_VMEM_BYTES = {"v5e": 16 * MIB, "v5p": 16 * MIB, "v6e": 32 * MIB}
# The rule of thumb kernels tile by (the performance model's calibrated values: benchmarks/perf/model_constants.json).
GRID_STEP_OVERHEAD_S = 0.35e-6
GRID_STEP_OVERHEAD_S_BY_GENERATION = {"tpu7x": 0.72e-6}

# Raised VMEM limits (see `vmem_limit_bytes`). Mosaic allocates its own
# scratch (semaphores, relayout temporaries) on top of a kernel's blocks: 4 MiB
# for it has sufficed in every ahead-of-time compile of our kernels on v5e,
# v5p and v6e. TPU7x needs more: ragged-dot's fused GPT-OSS decode layer (16-row
# chunks, I tiles of 960) took 4.8 MiB past its blocks there (the same config
# compiles within 4 MiB on v6e); 8 MiB leaves a margin.
MOSAIC_SCRATCH_BYTES = {"tpu7x": 8 * MIB}
DEFAULT_MOSAIC_SCRATCH_BYTES = 4 * MIB
# A kernel never asks for less than the smallest default (v5e's 16 MiB), nor
# for more than a core's VMEM less what is left to the compiler (XLA's own
# VMEM use around the kernel): 28 MiB of the 128 of v5e and v6e (a kernel asks
# for at most 100), 8 MiB of the 64 of v5p and TPU7x (at most 56; blocks of
# 60 MiB compile there, module docstring). Choices, not measured limits; every
# declared shape's compile checks them.
MIN_VMEM_LIMIT_BYTES = DEFAULT_SCOPED_VMEM_BYTES["v5e"]
COMPILER_VMEM_BYTES = {"v5p": 8 * MIB, "tpu7x": 8 * MIB}
DEFAULT_COMPILER_VMEM_BYTES = 28 * MIB


class UnsupportedTpuError(RuntimeError):
    """The TPU this process runs on is not one the kernels are tuned and compiled for."""


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
    """Per-TensorCore facts of one TPU generation (sources in the module docstring)."""

    name: str
    hbm_bytes_per_s: float
    hbm_capacity_bytes: int
    vmem_capacity_bytes: int
    default_scoped_vmem_bytes: int | None
    bf16_flops_per_s: float
    int8_ops_per_s: float
    fp8_flops_per_s: float
    int4_ops_per_s: float
    mxu_size: int
    num_mxus: int
    lanes: int
    sublanes: int
    # TensorCores of one device (2 in megacore: a Pallas grid splits over them only along parallel dimensions).
    cores_per_device: int

    @property
    def device_hbm_bytes_per_s(self) -> float:
        """HBM bandwidth of one device: all its TensorCores' (a roofline's, whatever a kernel's grid lets it use)."""
        return self.hbm_bytes_per_s * self.cores_per_device

    @property
    def device_bf16_flops_per_s(self) -> float:
        """bf16 MXU peak of one device: all its TensorCores'."""
        return self.bf16_flops_per_s * self.cores_per_device


# Our names for generations whose jax ChipVersion value is a bare number ("7x"), as libtpu's topologies name them.
_JAX_CHIP_NAMES = {"tpu7x": "7x"}
_OUR_CHIP_NAMES = {jax_name: name for name, jax_name in _JAX_CHIP_NAMES.items()}
# TensorCores one device drives: v5p (like v4) runs its chip's two cores as one megacore device; a TPU7x
# device is one of its chip's two cores (jax's ChipVersion table).
MEGACORE_GENERATIONS = ("v4", "v5p")


@functools.cache
def tpu_generation(name: str) -> TpuGeneration:
    """Facts of any generation jax's table knows ("v5e", "v5p", "v6e", "tpu7x", ...), per TensorCore."""
    try:
        chip = pltpu.ChipVersion(_JAX_CHIP_NAMES.get(name, name))
    except ValueError:
        known = ", ".join(_OUR_CHIP_NAMES.get(c.value, c.value) for c in pltpu.ChipVersion)
        raise ValueError(f"generation: unknown TPU generation {name!r}; jax knows {known}") from None
    info = pltpu.get_tpu_info_for_chip(chip, 1)
    return TpuGeneration(
        name=name,
        hbm_bytes_per_s=float(info.mem_bw_bytes_per_second),
        hbm_capacity_bytes=int(info.hbm_capacity_bytes),
        vmem_capacity_bytes=int(info.vmem_capacity_bytes),
        default_scoped_vmem_bytes=DEFAULT_SCOPED_VMEM_BYTES.get(name),
        bf16_flops_per_s=float(info.bf16_ops_per_second),
        int8_ops_per_s=float(info.int8_ops_per_second),
        fp8_flops_per_s=float(info.fp8_ops_per_second),
        int4_ops_per_s=float(info.int4_ops_per_second),
        mxu_size=int(info.mxu_column_size),
        num_mxus=int(info.num_mxus),
        lanes=int(info.num_lanes),
        sublanes=int(info.num_sublanes),
        cores_per_device=2 if name in MEGACORE_GENERATIONS else 1,
    )


def grid_step_overhead_s(generation: str) -> float:
    """The per-grid-step cost kernels tile by on `generation` (module docstring)."""
    return GRID_STEP_OVERHEAD_S_BY_GENERATION.get(generation, GRID_STEP_OVERHEAD_S)


def check_generation(generation: str) -> str:
    """`generation` if the kernels support it, else a ValueError naming the supported ones."""
    if generation not in SUPPORTED_GENERATIONS:
        raise ValueError(f"generation must be one of {SUPPORTED_GENERATIONS}, got {generation!r}")
    return generation


def current_generation() -> str:
    """The supported generation to tile for in this process (see the module docstring)."""
    override = os.environ.get(GENERATION_ENV)
    if override:
        try:
            return check_generation(override)
        except ValueError as error:
            raise ValueError(f"{GENERATION_ENV}: {error}") from None
    device = jax.devices()[0]
    if device.platform != "tpu":
        return OFF_TPU_GENERATION
    try:
        chip_version = str(pltpu.get_tpu_info().chip_version)
    except ValueError:  # a device kind jax's table does not know
        chip_version = None
    chip = _OUR_CHIP_NAMES.get(chip_version, chip_version)
    if chip not in SUPPORTED_GENERATIONS:
        raise UnsupportedTpuError(
            f"this TPU ({device.device_kind!r}) is not one the kernels are tuned and compiled for: "
            f"supported generations are {SUPPORTED_GENERATIONS}. Set {GENERATION_ENV} to one of them "
            "to run its tiles here anyway (they may not fit this chip's VMEM)."
        )
    return chip


def resolve_generation(generation: str | None) -> str:
    """`generation` checked, or the current one when None."""
    return current_generation() if generation is None else check_generation(generation)


def resolve_target(generation: str | TpuGeneration | None = None) -> TpuGeneration:
    """The facts of the supported generation one kernel call tiles for: resolved once, where the call enters a
    kernel (its JAX function), and handed down to its tiles and plan. `generation` names it (or is its facts, from
    this file or another build's copy of it); None: this process's (`current_generation`)."""
    if generation is None:
        generation = current_generation()
    return tpu_generation(check_generation(generation if isinstance(generation, str) else generation.name))


def _shared_by_supported(field: str) -> int:
    values = {getattr(tpu_generation(name), field) for name in SUPPORTED_GENERATIONS}
    if len(values) != 1:
        raise AssertionError(f"{field} differs between supported generations: {values}")
    return values.pop()


# The native VMEM tile is (sublanes x 128 lanes) of 32-bit words on every supported generation.
LANES = _shared_by_supported("lanes")
SUBLANES = _shared_by_supported("sublanes")


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def sublane_multiple(dtype) -> int:
    """Rows of one native VMEM tile of `dtype`: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit types.

    Narrower types pack several rows into one 32-bit sublane; block row counts
    are aligned to this.
    """
    return SUBLANES * max(1, 4 // np.dtype(dtype).itemsize)


def padded_vmem_bytes(shape: Sequence[int], dtype) -> int:
    """Bytes a buffer of `shape` takes in VMEM/SMEM, padded to the native tile of `dtype`.

    The last two dimensions are padded to (sublane_multiple, LANES); a 1-D
    buffer is laid out along lanes, several rows' worth per 32-bit word.
    """
    itemsize = np.dtype(dtype).itemsize
    if not shape:
        return itemsize
    if len(shape) == 1:
        return round_up(shape[0], LANES * max(1, 4 // itemsize)) * itemsize
    *leading, rows, cols = shape
    return math.prod(leading) * round_up(rows, sublane_multiple(dtype)) * round_up(cols, LANES) * itemsize


def default_layout_swaps_minor_dims(shape: Sequence[int]) -> bool:
    """Whether XLA's default TPU layout stores an array of `shape` with its last two dimensions swapped.

    XLA picks the layout of a jitted function's arguments itself. For
    `[..., a, b]` whose last dimension b is not a multiple of 128 lanes but a
    is, and b is a multiple of 8, it makes `a` the minor dimension (e.g.
    `{1,2,0}`), whatever the dtype and generation (v5e, v5p, v6e, TPU7x); otherwise the
    last dimension stays minor, or (b not a multiple of 8) a leading
    dimension goes between them. Where neither a nor b is a multiple of 128
    XLA weighs the padding of both orders; this answers False there (no
    weights of the models we serve have such shapes), so a miss costs what
    reading the array as given costs. A Pallas kernel reads its operands
    row-major, so a kernel fed such an array as it is makes XLA rewrite the
    whole array on every call, while reading `swapaxes(array, -1, -2)` is a
    free bitcast. Probed with libtpu's compile-only topologies
    (tests/test_hardware.py checks it against the compiler).
    """
    if len(shape) < 2:
        return False
    rows, cols = shape[-2:]
    return rows % LANES == 0 and cols % LANES != 0 and cols % SUBLANES == 0


def max_vmem_limit_bytes(generation: str) -> int:
    """The most VMEM a kernel asks for on `generation`: a core's, less what is left to the compiler
    (COMPILER_VMEM_BYTES)."""
    return tpu_generation(generation).vmem_capacity_bytes - COMPILER_VMEM_BYTES.get(generation,
                                                                                  DEFAULT_COMPILER_VMEM_BYTES)


def mosaic_scratch_bytes(generation: str) -> int:
    """VMEM Mosaic takes on `generation` on top of a kernel's blocks and scratch (MOSAIC_SCRATCH_BYTES)."""
    return MOSAIC_SCRATCH_BYTES.get(generation, DEFAULT_MOSAIC_SCRATCH_BYTES)


def vmem_budget_bytes(generation: str, *, margin: float = 1.0, bound_bytes: int | None = None) -> int:
    """What a config's blocks and scratch, as its kernel estimates them, may take on `generation`: the most whose
    limit (`vmem_limit_bytes` with the same `margin`) a kernel may ask for, or `bound_bytes` if less.

    The one VMEM policy of every kernel; a kernel states its reasons to depart from the defaults as values:
    `margin`, the factor its estimate is taken by where the estimate may fall short of what Mosaic allocates (1:
    an exact account of its buffers, padded as Mosaic lays them out); `bound_bytes`, a bound it keeps its tiles'
    working set within, below what fits.
    """
    most = int((max_vmem_limit_bytes(generation) - mosaic_scratch_bytes(generation)) / margin)
    return most if bound_bytes is None else min(most, bound_bytes)


def vmem_limit_bytes(working_set_bytes: int, generation: str, *, margin: float = 1.0) -> int:
    """The scoped VMEM limit to request on `generation` for a kernel whose blocks and scratch take
    `working_set_bytes` by its estimate.

    The estimate taken by `margin` (`vmem_budget_bytes`), plus Mosaic's own scratch, within
    [MIN_VMEM_LIMIT_BYTES, max_vmem_limit_bytes(generation)].
    """
    return min(max(int(working_set_bytes * margin) + mosaic_scratch_bytes(generation), MIN_VMEM_LIMIT_BYTES),
               max_vmem_limit_bytes(generation))


@dataclasses.dataclass(frozen=True)
class VmemPolicy:
    """A kernel's departures from the one VMEM policy (`vmem_budget_bytes`, `vmem_limit_bytes`), as values: the
    `margin` its estimates are taken by and, per generation, the `bound_bytes` it keeps its tiles' working set
    within. Its budget and limit are the ones the kernel's tile selection and plans ask for."""

    margin: float
    bound_bytes: dict[str, int]

    def budget(self, target: TpuGeneration) -> int:
        """What a config's working set may take on `target`: the shared budget at this margin, within this bound."""
        return vmem_budget_bytes(target.name, margin=self.margin, bound_bytes=self.bound_bytes[target.name])

    def limit(self, working_set_bytes: int, target: TpuGeneration) -> int:
        """The scoped VMEM limit asked for a working set on `target`: the shared one at this margin."""
        return vmem_limit_bytes(working_set_bytes, target.name, margin=self.margin)
