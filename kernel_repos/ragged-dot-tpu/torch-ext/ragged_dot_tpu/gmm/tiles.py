"""Tiles of the grouped matmul (`gmm.kernel.grouped_matmul`): `TileConfig` and how one is chosen.

A config comes from `select`: the `TUNED_TILES` entry of the shape
(tuned_tiles.json), else a VMEM-aware heuristic (`heuristic_config`); a caller who has tuned a
shape passes its own (`grouped_matmul(..., config=...)`). Five knobs:

- `tile_m`, `tile_k`, `tile_n`: the lhs `(tile_m, tile_k)`, rhs `(tile_k,
  tile_n)` and out `(tile_m, tile_n)` blocks. `tile_m >= M` makes the whole
  of lhs and out one resident block (fetched and written once).
- `chunk_m`: the MXU works on row chunks of this size. A group's chunks
  start at the group's first row (rounded down to the native sublane
  tile), so no chunk is spent on two groups' boundary; chunks outside the
  group are skipped. `None` is one chunk per row tile.
- `groups_per_step`: how many work items (each with its own group's
  weights) one grid step multiplies. Every grid step has a fixed cost
  (~0.35 us), so for weights of a few MiB per expert several groups per
  step amortise it. Only with one row tile (`tile_m >= M`). Cost when fewer
  groups are active than slots: the idle slots fetch one extra weights
  block each in the first step.

The backward's d_lhs grouped matmul takes these tiles with longer row tiles
(`select_d_lhs`).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import jax.numpy as jnp

from .._hardware import LANES, TpuGeneration, padded_vmem_bytes, round_up, sublane_multiple, vmem_limit_bytes
from .._tuning import read_tuned_tiles
from ..common.quant import (
    FP8, FP8_BLOCK, FP8_MXU_GENERATIONS, INT8, INT4, blocks, dequantized_in_vmem, per_channel_scales, stored_rows,
)
from ..common.vmem import (
    MAX_STEP_MACS, MAX_STEP_MATMULS, Buffer, accepts, buffers_bytes, check_vmem_fits, fp8_dequantize_vmem_bytes,
    fp8_matmul_vmem_bytes, fp8_window_scales_vmem_bytes, int4_unpack_vmem_bytes,
)
from ..problem import MatmulProblem

# Group slots one grid step may multiply: each is unrolled in the kernel body (bounded with their row chunks by
# `common.vmem.MAX_STEP_MATMULS` and `common.vmem.MAX_STEP_MACS`).
MAX_GROUPS_PER_STEP = 4

# Blocks of the heuristic: weights blocks of about this many bytes keep the
# per-step cost small next to their DMA (4 MiB take 2.6 us on v6e). v5p takes
# v5e's, TPU7x v6e's (the same MXU width; double-buffered, either fits the
# budget of their 64 MiB of VMEM, 52 and 48 MiB, with room for rows).
HEURISTIC_RHS_BLOCK_BYTES = {"v5e": 8 << 20, "v5p": 8 << 20, "v6e": 16 << 20, "tpu7x": 16 << 20}
# Row tiles of the heuristic when the rows do not stay resident: about the
# ridge (`ridge_rows`: 240 on v5e, 186 on v5p, 560 on v6e, 312 on TPU7x),
# where a step's matmul takes as long as its weights' DMA, and large next to
# a chunk (each row tile reads one chunk more of lhs rows). Chunks of one MXU
# width (128 rows on v5e and v5p, 256 on v6e and TPU7x; jax's TPU table): an
# MXU pass of fewer rows takes as long as one of that many (the weights
# tile's load), and a group's last partial chunk wastes at most one chunk.
# Not tuned.
HEURISTIC_ROW_TILE = {"v5e": 512, "v5p": 512, "v6e": 512, "tpu7x": 512}


class TileConfig(NamedTuple):
    """Blocks of one grouped_matmul call (the five knobs in the module docstring)."""

    tile_m: int
    tile_k: int
    tile_n: int
    chunk_m: int | None = None
    groups_per_step: int = 1


class TunedKey(NamedTuple):
    """The shape a tuned grouped matmul's tiles were measured at."""

    generation: str
    m: int  # rows (picks, in an experts layer)
    k: int
    n: int
    groups: int
    dtype: str
    rhs_dtype: str
    transpose_rhs: bool


# Tiles tuned per shape, taken over the heuristic by `select`: data in tuned_tiles.json beside this
# module (`_tuning`'s form), written by the tpu-kernels lab's `python -m benchmarks moe_layer --tune-ours` (a
# search on its calibrated model, as its rivals get; not measured on a TPU). A shape not in it takes the heuristic.
TUNED_TILES_FILE = Path(__file__).with_name("tuned_tiles.json")
TUNED_TILES: dict[TunedKey, TileConfig] = read_tuned_tiles(TUNED_TILES_FILE, TunedKey, TileConfig)


def matmul_feeds_fp8_mxu(config: TileConfig, problem: MatmulProblem, target: TpuGeneration) -> bool:
    """Whether the grouped matmul feeds fp8 weights to the fp8 MXU (`common.quant.fp8_matmul`) rather than dequantizing
    them: on a generation that has one, with K whole or in tiles of whole 128-wide scale blocks."""
    return (problem.rhs_scheme == FP8 and target.name in FP8_MXU_GENERATIONS
            and (config.tile_k >= problem.k or config.tile_k % FP8_BLOCK == 0))


def matmul_buffers(config: TileConfig, problem: MatmulProblem, *, fp8_matmul: bool = False) -> tuple[Buffer, ...]:
    """The grouped matmul's blocks and scratch with `config`: lhs, rhs (scales, bias) per group slot, out, the f32
    accumulator (and with chunks the carry across tiles; int4 weights, and fp8 ones unless `fp8_matmul`
    (`matmul_feeds_fp8_mxu`) multiplies them as they are: a dequantized block per slot).

    Blocks are double-buffered except an lhs block that is the whole array
    (Mosaic keeps one copy of a block that never moves); with chunks the lhs
    block is a window of the tile and one more chunk.
    """
    m, k, n, dtype, rhs_dtype = problem.m, problem.k, problem.n, problem.dtype, problem.rhs_dtype
    f32, slots = "float32", config.groups_per_step
    tile_m, tile_k, tile_n = row_tile_rows(config, problem), min(config.tile_k, k), min(config.tile_n, n)
    chunk = config.chunk_m if _chunked(config, problem) else 0
    rhs_block = problem.in_rhs_order(tile_k, tile_n)
    scheme = problem.rhs_scheme
    stored_block = (stored_rows(rhs_block[0], scheme), rhs_block[1])
    buffers = [Buffer((tile_m + chunk, tile_k), dtype, 1 if tile_m >= m and tile_k == k else 2),
               *[Buffer(stored_block, rhs_dtype, 2)] * slots]
    if per_channel_scales(scheme):
        buffers += [Buffer((1, tile_n), f32, 2)] * slots
    elif scheme == FP8:  # the group's whole grid of block scales over rhs's own dims
        buffers += [Buffer(problem.in_rhs_order(blocks(k), blocks(n)), f32, 2)] * slots
    if problem.bias:
        buffers += [Buffer((1, tile_n), f32, 2)] * slots
    if dequantized_in_vmem(scheme) and not fp8_matmul:
        buffers += [Buffer(rhs_block, dtype)] * slots
    buffers += [Buffer((tile_m, tile_n), dtype, 2), Buffer((tile_m, tile_n), f32)]
    return tuple(buffers + ([Buffer((2 * chunk, tile_n), f32)] if chunk else []))


def vmem_bytes(config: TileConfig, problem: MatmulProblem, *, fp8_matmul: bool = False) -> int:
    """VMEM of a grouped matmul with `config`: its buffers (`matmul_buffers`) and what dequantizing one-byte
    weights takes beside them: an int8 block cast to the activation dtype; fp8 blocks dequantized 128 rows at a
    time through f32 (`common.quant.dequantize_fp8_block`), or with `fp8_matmul` each slot's block scales spread over
    the columns and one 128-wide K block's product (`common.quant.fp8_matmul`); int4 blocks unpacked a packed block
    (two 32-row slabs) at a time through int32 (`common.quant.unpack_int4_block`)."""
    buffers_held = buffers_bytes(matmul_buffers(config, problem, fp8_matmul=fp8_matmul))
    scheme = problem.rhs_scheme
    tile_k, tile_n = min(config.tile_k, problem.k), min(config.tile_n, problem.n)
    rhs_block = problem.in_rhs_order(tile_k, tile_n)
    if fp8_matmul:
        rows = config.chunk_m if _chunked(config, problem) else row_tile_rows(config, problem)
        return (buffers_held + config.groups_per_step * fp8_window_scales_vmem_bytes(tile_k, tile_n)
                + fp8_matmul_vmem_bytes(rows, tile_n))
    if scheme == INT8:
        return buffers_held + padded_vmem_bytes(rhs_block, problem.dtype)
    if scheme == INT4:
        return buffers_held + int4_unpack_vmem_bytes(rhs_block[1])  # the stored block's lanes
    if scheme is not None:
        return buffers_held + fp8_dequantize_vmem_bytes(max(tile_k, tile_n))
    return buffers_held


def _chunked(config: TileConfig, problem: MatmulProblem) -> bool:
    return config.chunk_m is not None and config.chunk_m < round_up(min(config.tile_m, problem.m),
                                                                    sublane_multiple(problem.dtype))


def row_tile_rows(config: TileConfig, problem: MatmulProblem) -> int:
    """Rows of the kernel's row tile: `tile_m`, or, for one tile over all M rows, M rounded up.

    Rounded up to the sublane tile, or with chunks to a whole number of
    chunks: a tile holds whole chunks, which start on the sublane grid (where
    Mosaic can slice VMEM). The rounded-up block is a partial edge block,
    whose extra rows the kernel masks out.
    """
    if config.tile_m < problem.m:
        return config.tile_m
    return round_up(problem.m, config.chunk_m if _chunked(config, problem) else sublane_multiple(problem.dtype))


def row_chunks(config: TileConfig, problem: MatmulProblem) -> int:
    """Chunks of a row tile: the matmuls one group slot runs per grid step."""
    if not _chunked(config, problem):
        return 1
    return row_tile_rows(config, problem) // config.chunk_m


def check_config(config: TileConfig, problem: MatmulProblem, target: TpuGeneration) -> None:
    """Raises ValueError if `config` cannot run `problem` (its shape, dtypes, layout and bias) on `target`."""
    if not isinstance(config, TileConfig):
        raise TypeError(f"config must be a TileConfig, got {type(config).__name__}")
    m, k, n = problem.m, problem.k, problem.n
    sublanes = sublane_multiple(problem.dtype)
    for name in ("tile_m", "tile_k", "tile_n", "groups_per_step"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"config.{name} must be a positive int, got {value!r}")
    if config.tile_m < m and config.tile_m % sublanes:
        raise ValueError(f"config.tile_m={config.tile_m} must be a multiple of {sublanes} or cover all {m} rows")
    for name, dim in (("tile_k", k), ("tile_n", n)):
        value = getattr(config, name)
        if value < dim and value % LANES:
            raise ValueError(f"config.{name}={value} must be a multiple of {LANES} or cover the whole dimension {dim}")
    tile_m = min(config.tile_m, m)
    if config.chunk_m is not None:
        if not isinstance(config.chunk_m, int) or config.chunk_m < 1:
            raise ValueError(f"config.chunk_m must be a positive int or None, got {config.chunk_m!r}")
        if config.chunk_m < tile_m and config.chunk_m % sublanes:
            raise ValueError(f"config.chunk_m={config.chunk_m} must be a multiple of {sublanes}")
        if config.chunk_m < tile_m and config.tile_m < m and config.tile_m % config.chunk_m:
            raise ValueError(f"config.tile_m={config.tile_m} must be a multiple of chunk_m={config.chunk_m}")
    if config.groups_per_step > MAX_GROUPS_PER_STEP:
        raise ValueError(f"config.groups_per_step must be at most {MAX_GROUPS_PER_STEP}, got {config.groups_per_step}")
    chunks = row_chunks(config, problem)
    if chunks * config.groups_per_step > MAX_STEP_MATMULS:
        raise ValueError(
            f"config: {config.groups_per_step} group slots x {chunks} row chunks of {config.chunk_m} is more than "
            f"{MAX_STEP_MATMULS} matmuls per grid step"
        )
    if config.groups_per_step > 1 and config.tile_m < m:
        raise ValueError(
            f"config.groups_per_step={config.groups_per_step} needs one row tile (tile_m >= {m}), got tile_m={config.tile_m}"
        )
    macs = config.groups_per_step * tile_m * min(config.tile_k, k) * min(config.tile_n, n)
    if macs > MAX_STEP_MACS:
        raise ValueError(
            f"config {tuple(config)}: one grid step multiplies {macs / 2**30:.1f} Gi multiply-adds, past the "
            f"{MAX_STEP_MACS / 2**30:.0f} Gi bound on kernel size (compile time)"
        )
    fp8_matmul = matmul_feeds_fp8_mxu(config, problem, target)
    check_vmem_fits(config, vmem_bytes(config, problem, fp8_matmul=fp8_matmul), target)


def ridge_rows(target: TpuGeneration) -> int:
    """Rows per MXU pass at which a step's matmul takes as long as streaming its weights.

    bf16 peak FLOP/s over HBM bytes/s (2 FLOPs per weight element of 2
    bytes): 240 on v5e, 186 on v5p, 560 on v6e, 312 on TPU7x. Below it, decode stays HBM-bound.
    """
    return int(target.bf16_flops_per_s / target.hbm_bytes_per_s)


def n_tile(n: int, max_cols: int, mxu: int, cores: int = 1) -> int:
    """The N tile for weights blocks of at most `max_cols` columns (at least 256): all of N if it fits.

    Else, among multiples of 128 from half the widest fitting tile up to it
    (not narrower: every N tile is a grid step per row tile), the one whose
    tiles take the fewest MXU passes on the busier of the device's `cores`
    (which split the N tiles, in whole tiles), then over all of N (a tile's
    columns round up to whole `mxu`-wide passes, and a partial last tile is
    padded to the tile), then the fewest tiles, then the least padding of
    the last tile. On v5p GPT-OSS's 5760 gate_up columns take 6 tiles of
    1024 (48 passes, 24 per core), not 5 of 1152 (45 passes, 27 on one core).
    Halving N in multiples of 256 instead can waste passes: GPT-OSS's 5760
    gate_up columns on v5e made 8 tiles of 768 (48 passes of 128, the last
    tile half empty) where 5 tiles of 1152 take 45.
    """
    if n <= max(256, max_cols):
        return n
    widest = max(256, max_cols // LANES * LANES)
    candidates = range(max(LANES, widest // 2 // LANES * LANES), widest + 1, LANES)

    def cost(tile: int) -> tuple[int, int, int, int]:
        tiles, passes = -(-n // tile), -(-tile // mxu)
        return -(-tiles // cores) * passes, tiles * passes, tiles, tiles * tile - n

    return min(candidates, key=cost)


def heuristic_config(problem: MatmulProblem, target: TpuGeneration) -> TileConfig:
    """Tiles that fit VMEM, from the problem and the generation.

    Weights blocks are as large as HEURISTIC_RHS_BLOCK_BYTES allows (K whole
    if it fits, else halved down to 512; N whole or the tile of `n_tile`,
    which wastes the fewest MXU passes; on a megacore device at least one N
    tile per core, the axis its two cores split) so each active group's weights are
    fetched once per N tile in few grid steps. Rows: one resident tile in
    chunks of the MXU width when the rows per group stay under `ridge_rows`,
    else HEURISTIC_ROW_TILE rows, else one chunk of rows; the first that fits.
    """
    m, k, n = problem.m, problem.k, problem.n
    itemsize = jnp.dtype(problem.dtype).itemsize
    rhs_block_bytes = HEURISTIC_RHS_BLOCK_BYTES[target.name]

    tile_k = k
    max_cols = rhs_block_bytes // (k * itemsize)
    cores = target.cores_per_device
    if cores > 1:
        # A megacore device (v5p) splits the grid's first parallel axis, the N tiles: at least one per core.
        max_cols = min(max_cols, round_up(-(-n // cores), LANES))
    tile_n = n_tile(n, max_cols, target.mxu_size, cores)
    while tile_k * tile_n * itemsize > rhs_block_bytes and tile_k > 512:
        tile_k = max(512, round_up(tile_k // 2, 256))

    rows_per_group = m / max(problem.groups, 1)
    chunk = target.mxu_size
    tiled_m = min(HEURISTIC_ROW_TILE[target.name], m)
    candidates = []
    if rows_per_group <= ridge_rows(target):
        candidates.append(TileConfig(m, tile_k, tile_n, chunk if m > chunk else None))
    candidates.append(TileConfig(tiled_m, tile_k, tile_n, chunk if tiled_m > chunk else None))
    candidates.append(TileConfig(min(chunk, m), tile_k, tile_n))
    for config in candidates:
        if accepts(check_config, config, problem, target):
            return config
    # Shrink the weights block until the smallest row tile fits.
    config = candidates[-1]
    while not accepts(check_config, config, problem, target) and config.tile_n > LANES:
        config = config._replace(tile_n=max(LANES, round_up(config.tile_n // 2, LANES)))
    while not accepts(check_config, config, problem, target) and config.tile_k > LANES:
        config = config._replace(tile_k=max(LANES, round_up(config.tile_k // 2, LANES)))
    return config



def select(problem: MatmulProblem, target: TpuGeneration) -> TileConfig:
    """Tiles for `problem` on `target`: the TUNED_TILES entry of its shape
    (checked like an explicit config), else the heuristic."""
    key = TunedKey(target.name, problem.m, problem.k, problem.n, problem.groups, problem.dtype, problem.rhs_dtype,
                   problem.transpose_rhs)
    tuned = TUNED_TILES.get(key)
    if tuned is None:
        return heuristic_config(problem, target)
    check_config(tuned, problem, target)
    return tuned


def vmem_limit(config: TileConfig, problem: MatmulProblem, target: TpuGeneration) -> int:
    """The scoped VMEM limit the kernel asks Mosaic for with `config` on `target`."""
    fp8_matmul = matmul_feeds_fp8_mxu(config, problem, target)
    return vmem_limit_bytes(vmem_bytes(config, problem, fp8_matmul=fp8_matmul), target.name)


# The backward's d_lhs grouped matmul runs at training sizes, where the heuristic tiles rows
# (HEURISTIC_ROW_TILE) in chunks and each row tile reads one chunk more of lhs rows: a longer row
# tile halves that extra read (modelled by `python -m benchmarks moe_backward`: Qwen3-30B-A3B's down
# projection on v6e, 73 % -> 82 % of its roofline). Taken where it passes `check_config`.
D_LHS_ROW_TILE = 1024


def select_d_lhs(problem: MatmulProblem, target: TpuGeneration) -> TileConfig:
    """Tiles of the backward's d_lhs grouped matmul `problem` (`d_out[m, k] x rhs[groups, k, n]`: the forward's
    weights read the other way round, K and N swapped): `select`'s, with row tiles of D_LHS_ROW_TILE rows
    where they fit. Both are chosen for the weights read in (K, N) order, whichever order `problem` reads them
    in: the tiles the backward has always run (read transposed, GPT-OSS's 2880-wide down projection on v5e
    would take others, which no benchmark has rated)."""
    as_chosen = problem._replace(transpose_rhs=False)
    config = select(as_chosen, target)
    longer = config._replace(tile_m=min(D_LHS_ROW_TILE, problem.m))
    if config.tile_m < longer.tile_m and accepts(check_config, longer, as_chosen, target):
        return longer
    return config
