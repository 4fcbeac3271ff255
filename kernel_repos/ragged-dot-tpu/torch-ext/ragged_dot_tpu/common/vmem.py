"""What every kernel's tiles must respect, and how their VMEM is counted.

The budget a config's blocks may take, the bounds on what one grid step
unrolls (compile time), and `Buffer`: one VMEM buffer of a kernel's
pipeline, padded as Mosaic lays it out. The tiles of each kernel
(`gmm/tiles.py`, `tgmm/tiles.py`, `fused/tiles.py`) list their buffers in it.

Budgets and limits come from the VMEM policy every tpu-kernels build shares
(`_hardware.vmem_budget_bytes`, `_hardware.vmem_limit_bytes`), with no
margin: these accounts of buffers and temporaries are padded as Mosaic lays
them out. Heuristics that keep some blocks smaller (tgmm's output blocks,
combine's token tiles) take a share of that budget.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp

from .._hardware import TpuGeneration, padded_vmem_bytes, vmem_budget_bytes
from .quant import FP8_BLOCK, INT4_PACK_ROWS, blocks

# A grid step's matmuls (every (group slot, row chunk) pair) and the
# multiply-adds they cover (group slots x tile_m x tile_k x tile_n) are
# bounded. Mosaic's compile time grows with the matmuls the kernel body
# holds: measured with libtpu's compile-only topologies when every chunk was
# unrolled, ~2 s at 2^31 and ~77 s at 17e9 (a resident 1024-row tile of
# GPT-OSS's 2880 x 5760 experts). Group slots are still unrolled; each
# slot's chunks are now one loop, whose body Mosaic compiles once. The
# bounds stay as they were: the tile search and the tuned tiles were made
# within them.
MAX_STEP_MATMULS = 16
MAX_STEP_MACS = 2**31


class Buffer(NamedTuple):
    """A VMEM buffer a kernel's pipeline holds: a block (`count` 2 when double-buffered, 1 when resident) or
    scratch (1)."""

    shape: tuple[int, ...]
    dtype: str
    count: int = 1

    @property
    def bytes(self) -> int:
        return self.count * padded_vmem_bytes(self.shape, self.dtype)


def accepts(check: Callable[..., None], *arguments) -> bool:
    """Whether `check(*arguments)` passes: the tile checks raise ValueError on a config that does not fit."""
    try:
        check(*arguments)
    except ValueError:
        return False
    return True


def check_vmem_fits(config, needed: int, target: TpuGeneration) -> None:
    """Raises ValueError if `needed` bytes of VMEM pass the budget of `target`:
    `_hardware.vmem_budget_bytes`: 96 MiB on v5e and v6e, 52 MiB on v5p, 48 MiB on TPU7x."""
    budget = vmem_budget_bytes(target.name)
    if needed > budget:
        raise ValueError(f"config {tuple(config)} needs {needed / 2**20:.1f} MiB of VMEM, past the {budget >> 20} MiB "
                         f"budget on {target.name}")


def buffers_bytes(buffers) -> int:
    """VMEM of `buffers`, each padded to the native (sublane, 128) tile: what `benchmarks.perf` derives from the
    kernel's block specs and scratch."""
    return sum(buffer.bytes for buffer in buffers)


def fp8_dequantize_vmem_bytes(cols: int) -> int:
    """f32 values `common.quant.dequantize_fp8_block` keeps for a window `cols` wide (at most): the grid's scales spread
    over the columns, one 128-row slab's scales, weights and product (at most 24 grid rows: H, I <= 3072)."""
    return 4 * padded_vmem_bytes((FP8_BLOCK, cols), jnp.float32)


def fp8_matmul_vmem_bytes(rows: int, cols: int) -> int:
    """f32 values `common.quant.fp8_matmul` keeps beside its running result for `rows` x `cols` outputs, per 128-wide K
    block: the rows' f32 slice, the block's product and its scaled term. (The weights' scales spread over the
    columns, `common.quant.fp8_window_scales`, are its caller's.)"""
    return padded_vmem_bytes((rows, FP8_BLOCK), jnp.float32) + 2 * padded_vmem_bytes((rows, cols), jnp.float32)


def fp8_window_scales_vmem_bytes(window_k: int, cols: int) -> int:
    """The f32 scales `common.quant.fp8_window_scales` spreads over a weights window `window_k` deep and `cols` wide."""
    return padded_vmem_bytes((blocks(window_k), cols), jnp.float32)


def int4_unpack_vmem_bytes(cols: int) -> int:
    """32-bit values `common.quant.unpack_int4_block` keeps for a window `cols` wide: one packed block's bytes as int32,
    each nibble's two shifts and its conversion through f32: ten 32-row slabs in all (Mosaic's own count for
    GPT-OSS's 5760-wide gate_up on v5e passed six by 0.1 MiB; for its fused decode layer in 16-row chunks
    and whole I tiles on v5e and v6e, eight by 20 KiB with four experts, top-1, and by 0.75 MiB with 32,
    top-4)."""
    return 10 * padded_vmem_bytes((INT4_PACK_ROWS // 2, cols), jnp.int32)
