"""Tiles per shape and TPU generation, and which kernel serves an experts layer.

Kept apart from the kernels so that tuning changes data, not kernel code.
TPU facts (VMEM, bandwidth, MXU peak, tiling) come from `_hardware.py`.

Two kernels, two configs:

- `TileConfig` tiles the grouped matmul (`pallas_gmm.ragged_dot`). It comes
  from `select_config`, a VMEM-aware heuristic (`heuristic_config`); a caller
  who has tuned a shape passes its own (`ragged_dot(..., config=...)`).
  Five knobs:
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
- `FusedConfig` tiles the fused experts kernel (`pallas_fused.fused_experts`),
  from `fused_config`; `use_fused_experts` is the rule that picks it over
  the two grouped matmuls.

Both paths read each projection's weights in the order XLA already stores
them (`weights_orientation`), which is not always transformers' layout.

`plan.py` turns a call's problem into the plan its kernels run, from the
choices made here.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp

from ._hardware import (
    LANES, MAX_VMEM_LIMIT_BYTES, MOSAIC_SCRATCH_BYTES, check_generation, default_layout_swaps_minor_dims,
    padded_vmem_bytes, resolve_generation, round_up, sublane_multiple, tpu_generation, vmem_limit_bytes,
)
from .quant import FP8_BLOCK, INT8, blocks, scheme_of

# What a config's blocks may take: the most the kernel asks Mosaic for, less
# Mosaic's own scratch.
VMEM_BUDGET_BYTES = MAX_VMEM_LIMIT_BYTES - MOSAIC_SCRATCH_BYTES

# Every (group slot, row chunk) pair is one matmul unrolled in the kernel
# body. Mosaic's compile time grows with their number and, above all, with
# the multiply-adds they cover (group slots x tile_m x tile_k x tile_n):
# measured with libtpu's compile-only topologies, ~2 s at 2^31 and ~77 s at
# 17e9 (a resident 1024-row tile of GPT-OSS's 2880 x 5760 experts). Both are
# bounded.
MAX_UNROLLED_MATMULS = 16
MAX_UNROLLED_MACS = 2**31
MAX_GROUPS_PER_STEP = 4

# Blocks of the heuristic: weights blocks of about this many bytes keep the
# per-step cost small next to their DMA (4 MiB take 2.6 us on v6e).
HEURISTIC_RHS_BLOCK_BYTES = {"v5e": 8 << 20, "v6e": 16 << 20}
# Row tiles of the heuristic when the rows do not stay resident: about the
# ridge (`ridge_rows`: 240 on v5e, 560 on v6e), where a step's matmul takes as
# long as its weights' DMA, and large next to a chunk (each row tile reads
# one chunk more of lhs rows). Chunks of one MXU width (128 rows on v5e, 256
# on v6e; jax's TPU table): an MXU pass of fewer rows takes as long as one of
# that many (the weights tile's load), and a group's last partial chunk
# wastes at most one chunk. Not tuned.
HEURISTIC_ROW_TILE = {"v5e": 512, "v6e": 512}

# The fused experts kernel serves calls of at most this many tokens (decode
# batches). It gathers an expert's rows and scatters its results with one-hot
# matmuls against all T tokens: 2 x T x H multiply-adds per row on top of the
# expert's 3 x I x H, so at T = 512 and the I of today's MoE models (704 to
# 2880) at most 49 % more MXU work, which decode (rows per expert far below
# `ridge_rows`, weight streaming the bound) hides; the work grows with T, and
# prefill-sized calls take the two grouped matmuls. 512, not 256: under EP
# token dispatch a rank's call holds the picks sent to it, one per row, and at
# a decode batch of 256 the busiest rank gets more than 256 of them (Qwen3-30B-A3B
# on 8 ranks: 301 in benchmarks/moe_layer.py), which the grouped path served
# at 1.28x its roofline on v6e, the fused kernel at 1.06x.
FUSED_MAX_TOKENS = 512
# Rows per MXU pass of the fused kernel: T rounded to the native tile, at
# most 128 (the v5e MXU's width); an expert's rows fill whole passes but the
# last. Not tuned.
FUSED_MAX_CHUNK_ROWS = 128
# The fused kernel's biases come in blocks of this many experts (a 16-row
# block is aligned for 32- and 16-bit types); the kernel picks its expert's
# row out of the block.
BIAS_BLOCK_EXPERTS = 16


class TileConfig(NamedTuple):
    """Blocks of one ragged_dot call (the five knobs in the module docstring)."""

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
    groups: int | None
    dtype: str
    rhs_dtype: str
    transpose_rhs: bool


# Tiles measured best on a TPU, per shape: data, taken over the heuristic by `select_config`. Empty until a
# sweep runs on a real chip (none is at hand here: the heuristic's choices are what the grid-replay model and
# the AOT compiles checked). An entry is `TunedKey(...): TileConfig(...)`.
TUNED_TILES: dict[TunedKey, TileConfig] = {}


class Buffer(NamedTuple):
    """A VMEM buffer a kernel's pipeline holds: a block (`count` 2 when double-buffered, 1 when resident) or
    scratch (1)."""

    shape: tuple[int, ...]
    dtype: str
    count: int = 1

    @property
    def bytes(self) -> int:
        return self.count * padded_vmem_bytes(self.shape, self.dtype)


def buffers_bytes(buffers) -> int:
    """VMEM of `buffers`, each padded to the native (sublane, 128) tile: what `tpu_kernels.perf` derives from the
    kernel's block specs and scratch."""
    return sum(buffer.bytes for buffer in buffers)


def matmul_buffers(config: TileConfig, m: int, k: int, n: int, dtype, rhs_dtype=None,
                   transpose_rhs: bool = False) -> tuple[Buffer, ...]:
    """The grouped matmul's blocks and scratch with `config`: lhs, rhs (and scales) per group slot, out, the f32
    accumulator (and with chunks the carry across tiles; fp8 weights: a dequantized block per slot).

    Blocks are double-buffered except an lhs block that is the whole array
    (Mosaic keeps one copy of a block that never moves); with chunks the lhs
    block is a window of the tile and one more chunk.
    """
    dtype, rhs_dtype = jnp.dtype(dtype).name, jnp.dtype(dtype if rhs_dtype is None else rhs_dtype).name
    f32, slots = "float32", config.groups_per_step
    tile_m, tile_k, tile_n = row_tile_rows(config, m, dtype), min(config.tile_k, k), min(config.tile_n, n)
    chunk = config.chunk_m if _chunked(config, m, dtype) else 0
    rhs_block = (tile_n, tile_k) if transpose_rhs else (tile_k, tile_n)
    buffers = [Buffer((tile_m + chunk, tile_k), dtype, 1 if tile_m >= m and tile_k == k else 2),
               *[Buffer(rhs_block, rhs_dtype, 2)] * slots]
    if scheme_of(rhs_dtype) == INT8:
        buffers += [Buffer((1, tile_n), f32, 2)] * slots
    elif scheme_of(rhs_dtype) is not None:  # fp8: the group's whole grid of block scales over rhs's own dims
        grid = (blocks(n), blocks(k)) if transpose_rhs else (blocks(k), blocks(n))
        buffers += [Buffer(grid, f32, 2)] * slots + [Buffer(rhs_block, dtype)] * slots
    buffers += [Buffer((tile_m, tile_n), dtype, 2), Buffer((tile_m, tile_n), f32)]
    return tuple(buffers + ([Buffer((2 * chunk, tile_n), f32)] if chunk else []))


def vmem_bytes(config: TileConfig, m: int, k: int, n: int, dtype, rhs_dtype=None, transpose_rhs: bool = False) -> int:
    """VMEM of a grouped matmul with `config`: its buffers (`matmul_buffers`) and what dequantizing one-byte
    weights takes beside them: an int8 block cast to the activation dtype; fp8 blocks dequantized 128 rows at a
    time through f32 (`quant.dequantize_fp8_block`)."""
    buffers = matmul_buffers(config, m, k, n, dtype, rhs_dtype, transpose_rhs)
    scheme = scheme_of(dtype if rhs_dtype is None else rhs_dtype)
    tile_k, tile_n = min(config.tile_k, k), min(config.tile_n, n)
    if scheme == INT8:
        return buffers_bytes(buffers) + padded_vmem_bytes((tile_n, tile_k) if transpose_rhs else (tile_k, tile_n),
                                                          dtype)
    if scheme is not None:
        return buffers_bytes(buffers) + fp8_dequantize_vmem_bytes(max(tile_k, tile_n))
    return buffers_bytes(buffers)


def fp8_dequantize_vmem_bytes(cols: int) -> int:
    """f32 values `quant.dequantize_fp8_block` keeps for a window `cols` wide (at most): the grid's scales spread
    over the columns, one 128-row slab's scales, weights and product (at most 24 grid rows: H, I <= 3072)."""
    return 4 * padded_vmem_bytes((FP8_BLOCK, cols), jnp.float32)


def _chunked(config: TileConfig, m: int, dtype) -> bool:
    return config.chunk_m is not None and config.chunk_m < round_up(min(config.tile_m, m), sublane_multiple(dtype))


def row_tile_rows(config: TileConfig, m: int, dtype) -> int:
    """Rows of the kernel's row tile: `tile_m`, or, for one tile over all M rows, M rounded up.

    Rounded up to the sublane tile, or with chunks to a whole number of
    chunks: a tile holds whole chunks, which start on the sublane grid (where
    Mosaic can slice VMEM). The rounded-up block is a partial edge block,
    whose extra rows the kernel masks out.
    """
    if config.tile_m < m:
        return config.tile_m
    return round_up(m, config.chunk_m if _chunked(config, m, dtype) else sublane_multiple(dtype))


def row_chunks(config: TileConfig, m: int, dtype) -> int:
    """Chunks of a row tile: the matmuls one group slot unrolls per grid step."""
    if not _chunked(config, m, dtype):
        return 1
    return row_tile_rows(config, m, dtype) // config.chunk_m


def check_config(config: TileConfig, m: int, k: int, n: int, dtype, rhs_dtype=None, transpose_rhs: bool = False) -> None:
    """Raises ValueError if `config` cannot run `lhs[m,k] x rhs[.,k,n]` (`[., n, k]` with `transpose_rhs`) of
    `dtype` (weights of `rhs_dtype`: the same, or int8 / fp8)."""
    if not isinstance(config, TileConfig):
        raise TypeError(f"config must be a TileConfig, got {type(config).__name__}")
    sublanes = sublane_multiple(dtype)
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
    chunks = row_chunks(config, m, dtype)
    if chunks * config.groups_per_step > MAX_UNROLLED_MATMULS:
        raise ValueError(
            f"config: {config.groups_per_step} group slots x {chunks} row chunks of {config.chunk_m} is more than "
            f"{MAX_UNROLLED_MATMULS} unrolled matmuls"
        )
    if config.groups_per_step > 1 and config.tile_m < m:
        raise ValueError(
            f"config.groups_per_step={config.groups_per_step} needs one row tile (tile_m >= {m}), got tile_m={config.tile_m}"
        )
    macs = config.groups_per_step * tile_m * min(config.tile_k, k) * min(config.tile_n, n)
    if macs > MAX_UNROLLED_MACS:
        raise ValueError(
            f"config {tuple(config)}: one grid step unrolls {macs / 2**30:.1f} Gi multiply-adds, past the "
            f"{MAX_UNROLLED_MACS / 2**30:.0f} Gi bound on kernel size (compile time)"
        )
    needed = vmem_bytes(config, m, k, n, dtype, rhs_dtype, transpose_rhs)
    if needed > VMEM_BUDGET_BYTES:
        raise ValueError(f"config {tuple(config)} needs {needed / 2**20:.1f} MiB of VMEM, past the {VMEM_BUDGET_BYTES >> 20} MiB budget")


def ridge_rows(generation: str) -> int:
    """Rows per MXU pass at which a step's matmul takes as long as streaming its weights.

    bf16 peak FLOP/s over HBM bytes/s (2 FLOPs per weight element of 2
    bytes): 240 on v5e, 560 on v6e. Below it, decode stays HBM-bound.
    """
    facts = tpu_generation(generation)
    return int(facts.bf16_flops_per_s / facts.hbm_bytes_per_s)


def n_tile(n: int, max_cols: int, mxu: int) -> int:
    """The N tile for weights blocks of at most `max_cols` columns (at least 256): all of N if it fits.

    Else, among multiples of 128 from half the widest fitting tile up to it
    (not narrower: every N tile is a grid step per row tile), the one whose
    tiles take the fewest MXU passes over all of N (a tile's columns round up
    to whole `mxu`-wide passes, and a partial last tile is padded to the
    tile), then the fewest tiles, then the least padding of the last tile.
    Halving N in multiples of 256 instead can waste passes: GPT-OSS's 5760
    gate_up columns on v5e made 8 tiles of 768 (48 passes of 128, the last
    tile half empty) where 5 tiles of 1152 take 45.
    """
    if n <= max(256, max_cols):
        return n
    widest = max(256, max_cols // LANES * LANES)
    candidates = range(max(LANES, widest // 2 // LANES * LANES), widest + 1, LANES)

    def cost(tile: int) -> tuple[int, int, int]:
        tiles = -(-n // tile)
        return tiles * -(-tile // mxu), tiles, tiles * tile - n

    return min(candidates, key=cost)


def heuristic_config(m: int, k: int, n: int, dtype, generation: str, num_groups: int | None = None,
                     rhs_dtype=None, transpose_rhs: bool = False) -> TileConfig:
    """Tiles that fit VMEM, from the shape and the generation.

    Weights blocks are as large as HEURISTIC_RHS_BLOCK_BYTES allows (K whole
    if it fits, else halved down to 512; N whole or the tile of `n_tile`,
    which wastes the fewest MXU passes) so each active group's weights are
    fetched once per N tile in few grid steps. Rows: one resident tile in
    chunks of the MXU width when the rows per group stay under `ridge_rows`,
    else HEURISTIC_ROW_TILE rows, else one chunk of rows; the first that fits.
    """
    generation = check_generation(generation)
    itemsize = jnp.dtype(dtype).itemsize
    rhs_block_bytes = HEURISTIC_RHS_BLOCK_BYTES[generation]

    tile_k = k
    tile_n = n_tile(n, rhs_block_bytes // (k * itemsize), tpu_generation(generation).mxu_size)
    while tile_k * tile_n * itemsize > rhs_block_bytes and tile_k > 512:
        tile_k = max(512, round_up(tile_k // 2, 256))

    rows_per_group = m / max(num_groups or 1, 1)
    chunk = tpu_generation(generation).mxu_size
    tiled_m = min(HEURISTIC_ROW_TILE[generation], m)
    candidates = []
    if rows_per_group <= ridge_rows(generation):
        candidates.append(TileConfig(m, tile_k, tile_n, chunk if m > chunk else None))
    candidates.append(TileConfig(tiled_m, tile_k, tile_n, chunk if tiled_m > chunk else None))
    candidates.append(TileConfig(min(chunk, m), tile_k, tile_n))
    for config in candidates:
        if _fits(config, m, k, n, dtype, rhs_dtype, transpose_rhs):
            return config
    # Shrink the weights block until the smallest row tile fits.
    config = candidates[-1]
    while not _fits(config, m, k, n, dtype, rhs_dtype, transpose_rhs) and config.tile_n > LANES:
        config = config._replace(tile_n=max(LANES, round_up(config.tile_n // 2, LANES)))
    while not _fits(config, m, k, n, dtype, rhs_dtype, transpose_rhs) and config.tile_k > LANES:
        config = config._replace(tile_k=max(LANES, round_up(config.tile_k // 2, LANES)))
    return config


def _fits(config: TileConfig, m: int, k: int, n: int, dtype, rhs_dtype=None, transpose_rhs: bool = False) -> bool:
    try:
        check_config(config, m, k, n, dtype, rhs_dtype, transpose_rhs)
    except ValueError:
        return False
    return True


def select_config(
    m: int,
    k: int,
    n: int,
    dtype,
    *,
    generation: str | None = None,
    num_groups: int | None = None,
    rhs_dtype=None,
    transpose_rhs: bool = False,
) -> TileConfig:
    """Tiles for `lhs[m,k] x rhs[num_groups,k,n]` on `generation` (default: the current device's): the
    TUNED_TILES entry of the shape (checked like an explicit config), else the heuristic."""
    generation = resolve_generation(generation)
    rhs_dtype = dtype if rhs_dtype is None else rhs_dtype
    key = TunedKey(generation, m, k, n, num_groups, jnp.dtype(dtype).name, jnp.dtype(rhs_dtype).name,
                   bool(transpose_rhs))
    tuned = TUNED_TILES.get(key)
    if tuned is None:
        return heuristic_config(m, k, n, dtype, generation, num_groups, rhs_dtype, transpose_rhs)
    check_config(tuned, m, k, n, dtype, rhs_dtype, transpose_rhs)
    return tuned


def vmem_limit(config: TileConfig, m: int, k: int, n: int, dtype, rhs_dtype=None, transpose_rhs: bool = False) -> int:
    """The scoped VMEM limit the kernel asks Mosaic for with `config`."""
    return vmem_limit_bytes(vmem_bytes(config, m, k, n, dtype, rhs_dtype, transpose_rhs))


def expected_active_groups(rows: int, num_groups: int) -> float:
    """Groups that receive at least one of `rows` rows routed uniformly at random: G (1 - (1 - 1/G)^rows).

    What a kernel's cost estimate assumes for the weights it reads when the
    group sizes are not known at trace time (they are data). It takes every
    row as live: under expert-parallel router masking (most rows other ranks'
    sentinels) it overestimates the weights read at small batches.
    """
    return num_groups * (1.0 - (1.0 - 1.0 / num_groups) ** rows)


class WeightsOrientation(NamedTuple):
    """How the kernels read each projection's weights: `[E, in, out]` when transposed, `[E, out, in]` if not."""

    gate_up_transposed: bool
    down_transposed: bool


def weights_orientation(hidden: int, intermediate: int, *, weights_transposed: bool) -> WeightsOrientation:
    """Each projection in the order XLA's default TPU layout stores it row-major.

    transformers hands `gate_up_proj[E, 2I, H]` and `down_proj[E, H, I]`
    (`[E, H, 2I]` / `[E, I, H]` when `weights_transposed`). Where XLA keeps
    an array's last two dimensions swapped (`default_layout_swaps_minor_dims`:
    Gemma 4's `down_proj[E, 2816, 704]` is stored 704-major), the kernels read
    the swapped view, a bitcast; reading it as given makes XLA rewrite the
    whole array on every call (968 MiB for Gemma-4-26B-A4B's experts).
    """
    gate_up = (hidden, 2 * intermediate) if weights_transposed else (2 * intermediate, hidden)
    down = (intermediate, hidden) if weights_transposed else (hidden, intermediate)
    return WeightsOrientation(weights_transposed != default_layout_swaps_minor_dims(gate_up),
                              weights_transposed != default_layout_swaps_minor_dims(down))


class FusedConfig(NamedTuple):
    """Blocks of one fused experts call.

    - `chunk_rows`: rows per MXU pass. An expert has at most T rows (one per
      token that picked it), held in ceil(T / chunk_rows) chunks; chunks past
      the expert's picks are skipped.
    - `tile_i`: intermediate columns per grid step; the whole I unless the
      expert's weights do not fit VMEM double-buffered, then I / n for the
      smallest n whose blocks are aligned and fit.
    """

    chunk_rows: int
    tile_i: int


def fused_chunks(config: FusedConfig, tokens: int) -> int:
    """Chunks of `chunk_rows` rows that hold an expert's rows: one per `chunk_rows` tokens."""
    return -(-tokens // config.chunk_rows)


def _tile_i_aligned(tile_i: int, intermediate: int, dtype, *, orientation: WeightsOrientation, interleaved: bool,
                    has_bias: bool, weights_dtype=None) -> bool:
    """Whether I tiles of `tile_i` make legal blocks of the weights (and biases, and int8 scales) as the kernel
    reads them (`orientation`).

    The whole I always does (a block equal to its dimension). A part does if
    it divides I and each block's cut dimension is a multiple of its native
    tile: 128 lanes where it is the last dimension, the sublane multiple of
    the weights' dtype where it is the second to last.
    """
    if tile_i == intermediate:
        return True
    if intermediate % tile_i:
        return False
    sublanes = sublane_multiple(dtype if weights_dtype is None else weights_dtype)
    gate_up_cut = 2 * tile_i if interleaved else tile_i
    gate_up_multiple = LANES if orientation.gate_up_transposed else sublanes
    down_multiple = sublanes if orientation.down_transposed else LANES
    # Biases and int8 scales are [E, 2I] rows, cut along their lanes.
    columns_ok = not (has_bias or scheme_of(weights_dtype or dtype) == INT8) or gate_up_cut % LANES == 0
    return gate_up_cut % gate_up_multiple == 0 and tile_i % down_multiple == 0 and columns_ok


def fused_buffers(config: FusedConfig, tokens: int, hidden: int, intermediate: int, num_experts: int, dtype, *,
                  interleaved: bool, has_bias: bool, weights_dtype=None, weights_transposed: bool = False,
                  top_k: int = 1, routing_dtype="float32") -> tuple[Buffer, ...]:
    """The fused kernel's blocks and scratch: the resident hidden states and routing, each gate_up part's and the
    down block (biases, scales) of the item's expert and I tile, the resident output, the f32 accumulator; scratch for
    interleaved gates, I tiles and fp8 weights. Weights blocks in the order the kernel reads them
    (`weights_orientation`)."""
    dtype, f32 = jnp.dtype(dtype).name, "float32"
    weights_dtype = dtype if weights_dtype is None else jnp.dtype(weights_dtype).name
    chunk, tile_i = config
    i_tiles = intermediate // tile_i
    parts = 2 if i_tiles > 1 and not interleaved else 1
    width = tile_i if parts == 2 else 2 * tile_i
    gate_up_transposed, down_transposed = weights_orientation(hidden, intermediate,
                                                              weights_transposed=weights_transposed)
    gate_up_block = (hidden, width) if gate_up_transposed else (width, hidden)
    down_block = (tile_i, hidden) if down_transposed else (hidden, tile_i)
    bias_rows = min(num_experts, BIAS_BLOCK_EXPERTS)
    per_expert_rows = [*[Buffer((bias_rows, width), f32, 2)] * parts, Buffer((bias_rows, hidden), f32, 2)]
    buffers = [Buffer((tokens, hidden), dtype), Buffer((tokens, top_k), "int32"), Buffer((tokens, top_k), routing_dtype),
               *[Buffer(gate_up_block, weights_dtype, 2)] * parts, Buffer(down_block, weights_dtype, 2)]
    if has_bias:
        buffers += [b._replace(dtype=dtype) for b in per_expert_rows]
    if scheme_of(weights_dtype) == INT8:
        buffers += per_expert_rows
    elif scheme_of(weights_dtype) is not None:  # fp8: each stored weight's whole grid of block scales
        gate_up_stored = (hidden, 2 * intermediate) if gate_up_transposed else (2 * intermediate, hidden)
        down_stored = (intermediate, hidden) if down_transposed else (hidden, intermediate)
        buffers += [Buffer(tuple(blocks(d) for d in stored), f32, 2) for stored in (gate_up_stored, down_stored)]
    # The output block never moves: Mosaic keeps one copy of it.
    buffers += [Buffer((tokens, hidden), dtype), Buffer((tokens, hidden), f32)]
    if interleaved:
        buffers.append(Buffer((2 * tile_i, chunk), f32))  # gate_up, transposed, to split even and odd rows
    if i_tiles > 1:
        rows = fused_chunks(config, tokens) * chunk
        buffers += [Buffer((rows, hidden), dtype), Buffer((rows, hidden), f32)]  # gathered rows, partial out
    if scheme_of(weights_dtype) not in (None, INT8):
        buffers += [*[Buffer(gate_up_block, dtype)] * parts, Buffer(down_block, dtype)]  # dequantized blocks
    return tuple(buffers)


def fused_vmem_bytes(config: FusedConfig, tokens: int, hidden: int, intermediate: int, num_experts: int, dtype,
                     *, interleaved: bool, has_bias: bool, weights_dtype=None, weights_transposed: bool = False,
                     top_k: int = 1, routing_dtype="float32") -> int:
    """VMEM of a fused experts call: its buffers (`fused_buffers`) and the f32 values Mosaic keeps beside them:
    the expert's weight and rank per token as columns, the triangle that counts the ranks, one chunk's gate_up
    and down results; an int8 block cast to the activation dtype, or what dequantizing fp8 blocks takes."""
    f32 = jnp.float32
    weights_dtype = dtype if weights_dtype is None else weights_dtype
    buffers = fused_buffers(config, tokens, hidden, intermediate, num_experts, dtype, interleaved=interleaved,
                            has_bias=has_bias, weights_dtype=weights_dtype, weights_transposed=weights_transposed,
                            top_k=top_k, routing_dtype=routing_dtype)
    chunk, tile_i = config
    values = (2 * padded_vmem_bytes((tokens, 1), f32) + padded_vmem_bytes((tokens, tokens), f32)
              + padded_vmem_bytes((chunk, 2 * tile_i), f32) + padded_vmem_bytes((chunk, hidden), f32))
    if scheme_of(weights_dtype) == INT8:
        values += max(padded_vmem_bytes((hidden, 2 * tile_i), dtype), padded_vmem_bytes((2 * tile_i, hidden), dtype))
    elif scheme_of(weights_dtype) is not None:
        values += fp8_dequantize_vmem_bytes(max(hidden, 2 * tile_i))
    return buffers_bytes(buffers) + values


def fused_config(tokens: int, hidden: int, intermediate: int, num_experts: int, dtype, *, weights_transposed: bool,
                 interleaved: bool, has_bias: bool, weights_dtype=None) -> FusedConfig | None:
    """The fused kernel's blocks for this layer, or None if no I tiling fits VMEM.

    Rows: T (the most one expert can get) rounded to the native sublane tile,
    in chunks of at most FUSED_MAX_CHUNK_ROWS (more if T needs more than
    MAX_UNROLLED_MATMULS of them). I: whole, or I / n for the smallest n that is
    aligned (`_tile_i_aligned`) and fits VMEM_BUDGET_BYTES. Not tuned per
    generation: decode streams each active expert's weights once whatever the
    tiles, so they only need to fit.
    """
    sublanes = sublane_multiple(dtype)
    chunk = max(min(round_up(tokens, sublanes), FUSED_MAX_CHUNK_ROWS),
                round_up(-(-tokens // MAX_UNROLLED_MATMULS), sublanes))
    orientation = weights_orientation(hidden, intermediate, weights_transposed=weights_transposed)
    for parts in range(1, intermediate + 1):
        if intermediate % parts:
            continue
        tile_i = intermediate // parts
        if not _tile_i_aligned(tile_i, intermediate, dtype, orientation=orientation, interleaved=interleaved,
                               has_bias=has_bias, weights_dtype=weights_dtype):
            continue
        config = FusedConfig(chunk, tile_i)
        needed = fused_vmem_bytes(config, tokens, hidden, intermediate, num_experts, dtype, interleaved=interleaved,
                                  has_bias=has_bias, weights_dtype=weights_dtype, weights_transposed=weights_transposed)
        if needed <= VMEM_BUDGET_BYTES:
            return config
    return None


def check_fused_config(config: FusedConfig, tokens: int, hidden: int, intermediate: int, num_experts: int, dtype, *,
                       weights_transposed: bool, interleaved: bool, has_bias: bool, weights_dtype=None) -> None:
    """Raises ValueError if `config` cannot run this fused experts layer."""
    if not isinstance(config, FusedConfig):
        raise TypeError(f"config must be a FusedConfig, got {type(config).__name__}")
    for name, value in config._asdict().items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"config.{name} must be a positive int, got {value!r}")
    if fused_chunks(config, tokens) > MAX_UNROLLED_MATMULS:
        raise ValueError(
            f"config: {tokens} tokens make more than {MAX_UNROLLED_MATMULS} chunks of {config.chunk_rows} rows per step"
        )
    if config.chunk_rows % sublane_multiple(dtype):
        raise ValueError(f"config.chunk_rows={config.chunk_rows} must be a multiple of {sublane_multiple(dtype)}")
    orientation = weights_orientation(hidden, intermediate, weights_transposed=weights_transposed)
    if not _tile_i_aligned(config.tile_i, intermediate, dtype, orientation=orientation, interleaved=interleaved,
                           has_bias=has_bias, weights_dtype=weights_dtype):
        raise ValueError(
            f"config.tile_i={config.tile_i} must be I={intermediate} or divide it into blocks aligned to the native "
            "tile of the weights as the kernel reads them (weights_orientation)"
        )
    needed = fused_vmem_bytes(config, tokens, hidden, intermediate, num_experts, dtype, interleaved=interleaved,
                              has_bias=has_bias, weights_dtype=weights_dtype, weights_transposed=weights_transposed)
    if needed > VMEM_BUDGET_BYTES:
        raise ValueError(f"config {tuple(config)} needs {needed / 2**20:.1f} MiB of VMEM, past the {VMEM_BUDGET_BYTES >> 20} MiB budget")


def use_fused_experts(tokens: int, hidden: int, intermediate: int, num_experts: int, dtype, *,
                      weights_transposed: bool, interleaved: bool, has_bias: bool, weights_dtype=None) -> bool:
    """The rule: the fused kernel for decode-sized calls (T <= FUSED_MAX_TOKENS) whose blocks fit VMEM,
    the two grouped matmuls otherwise (see FUSED_MAX_TOKENS for why)."""
    return tokens <= FUSED_MAX_TOKENS and fused_config(
        tokens, hidden, intermediate, num_experts, dtype, weights_transposed=weights_transposed,
        interleaved=interleaved, has_bias=has_bias, weights_dtype=weights_dtype,
    ) is not None


# The weights' gradient (`pallas_tgmm.tgmm`): per group, lhs_g^T @ rhs_g -> [G, K, N].
# Row tiles of the heuristic: large next to a chunk (fewer grid steps), small enough that a
# step unrolls few chunks. Not tuned.
TGMM_ROW_TILE = 512
# What the resident output block (f32 accumulator and the double-buffered output) may take of
# the budget; the row blocks take the rest.
TGMM_OUTPUT_SHARE = 0.75


class TgmmConfig(NamedTuple):
    """Blocks of one tgmm call.

    - `tile_m`: rows per grid step (lhs `(tile_m, tile_k)` and rhs
      `(tile_m, tile_n)` blocks); at least M means one row tile.
    - `tile_k`, `tile_n`: the output block `(tile_k, tile_n)` of a group's
      gradient, resident while the grid walks the group's rows. Whole K and N
      read every row once; smaller ones read lhs once per N tile and rhs once
      per K tile.
    - `chunk_m`: rows per MXU pass (the contraction); chunks outside an item's
      group are skipped.
    - `group_chunks`: chunks laid from each group's first row rather than at
      fixed offsets of the row tile: about half a chunk less MXU work per
      group for chunk_m / tile_m more row reads (`pallas_tgmm`).
    """

    tile_m: int
    tile_k: int
    tile_n: int
    chunk_m: int
    group_chunks: bool = False


def tgmm_blocks(config: TgmmConfig, m: int, k: int, n: int, dtype) -> tuple[int, int, int, int]:
    """(tile_m, tile_k, tile_n, chunk_m) the kernel runs `config` with, for `lhs[m,k]`, `rhs[m,n]`.

    A chunk of more rows than M (rounded to the sublane tile) shrinks to them; one row tile over all
    M rows is M rounded up to whole chunks (a partial edge block whose extra rows the kernel masks).
    """
    chunk_m = min(config.chunk_m, round_up(m, sublane_multiple(dtype)))
    tile_m = config.tile_m if config.tile_m < m else round_up(m, chunk_m)
    return tile_m, min(config.tile_k, k), min(config.tile_n, n), chunk_m


def tgmm_buffers(config: TgmmConfig, m: int, k: int, n: int, dtype, out_dtype=None) -> tuple[Buffer, ...]:
    """tgmm's blocks and scratch: double-buffered lhs and rhs row blocks (windows with group chunks) and output
    block, the f32 accumulator."""
    dtype = jnp.dtype(dtype).name
    out_dtype = dtype if out_dtype is None else jnp.dtype(out_dtype).name
    tile_m, tile_k, tile_n, chunk_m = tgmm_blocks(config, m, k, n, dtype)
    rows = tile_m + chunk_m if config.group_chunks and chunk_m < tile_m else tile_m  # windows with group chunks
    return (Buffer((rows, tile_k), dtype, 2), Buffer((rows, tile_n), dtype, 2), Buffer((tile_k, tile_n), out_dtype, 2),
            Buffer((tile_k, tile_n), "float32"))


def tgmm_vmem_bytes(config: TgmmConfig, m: int, k: int, n: int, dtype, out_dtype=None) -> int:
    """VMEM of a tgmm call: its buffers (`tgmm_buffers`) and one chunk's masked operands beside them."""
    _, tile_k, tile_n, chunk_m = tgmm_blocks(config, m, k, n, dtype)
    return buffers_bytes(tgmm_buffers(config, m, k, n, dtype, out_dtype)) + padded_vmem_bytes(
        (chunk_m, tile_k), dtype) + padded_vmem_bytes((chunk_m, tile_n), dtype)


def check_tgmm_config(config: TgmmConfig, m: int, k: int, n: int, dtype, out_dtype=None) -> None:
    """Raises ValueError if `config` cannot run tgmm of `lhs[m,k]`, `rhs[m,n]` in `dtype`."""
    if not isinstance(config, TgmmConfig):
        raise TypeError(f"config must be a TgmmConfig, got {type(config).__name__}")
    for name in ("tile_m", "tile_k", "tile_n", "chunk_m"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"config.{name} must be a positive int, got {value!r}")
    if not isinstance(config.group_chunks, bool):
        raise ValueError(f"config.group_chunks must be a bool, got {config.group_chunks!r}")
    sublanes = sublane_multiple(dtype)
    tile_m, tile_k, tile_n, chunk_m = tgmm_blocks(config, m, k, n, dtype)
    if chunk_m % sublanes:
        raise ValueError(f"config.chunk_m={config.chunk_m} must be a multiple of {sublanes}")
    if tile_m % chunk_m:
        raise ValueError(f"config.tile_m={config.tile_m} must be a multiple of chunk_m={chunk_m} or cover all {m} rows")
    for name, value, dim in (("tile_k", tile_k, k), ("tile_n", tile_n, n)):
        if value < dim and value % LANES:
            raise ValueError(f"config.{name}={value} must be a multiple of {LANES} or cover the whole dimension {dim}")
    if tile_m // chunk_m > MAX_UNROLLED_MATMULS:
        raise ValueError(f"config: {tile_m // chunk_m} row chunks per step, more than {MAX_UNROLLED_MATMULS} unrolled matmuls")
    macs = tile_m * tile_k * tile_n
    if macs > MAX_UNROLLED_MACS:
        raise ValueError(
            f"config {tuple(config)}: one grid step unrolls {macs / 2**30:.1f} Gi multiply-adds, past the "
            f"{MAX_UNROLLED_MACS / 2**30:.0f} Gi bound on kernel size (compile time)"
        )
    needed = tgmm_vmem_bytes(config, m, k, n, dtype, out_dtype)
    if needed > VMEM_BUDGET_BYTES:
        raise ValueError(f"config {tuple(config)} needs {needed / 2**20:.1f} MiB of VMEM, past the {VMEM_BUDGET_BYTES >> 20} MiB budget")


def heuristic_tgmm_config(m: int, k: int, n: int, dtype, generation: str, out_dtype=None,
                          num_groups: int = 1) -> TgmmConfig:
    """Whole K and N when the output block fits TGMM_OUTPUT_SHARE of the budget (every row read once),
    else N, then K, halved in multiples of 256; chunks of one MXU width (the contraction of a pass);
    TGMM_ROW_TILE rows, halved until a step fits the unrolling and VMEM bounds; group chunks where
    `_group_chunks_pay` says so."""
    generation = check_generation(generation)
    out_dtype = dtype if out_dtype is None else out_dtype
    out_bytes = 4 + 2 * jnp.dtype(out_dtype).itemsize
    tile_k, tile_n = k, n
    while tile_k * tile_n * out_bytes > TGMM_OUTPUT_SHARE * VMEM_BUDGET_BYTES and tile_n > 256:
        tile_n = max(256, round_up(tile_n // 2, 256))
    while tile_k * tile_n * out_bytes > TGMM_OUTPUT_SHARE * VMEM_BUDGET_BYTES and tile_k > 256:
        tile_k = max(256, round_up(tile_k // 2, 256))
    chunk = tpu_generation(generation).mxu_size
    config = TgmmConfig(TGMM_ROW_TILE, tile_k, tile_n, chunk)
    while config.tile_m > chunk and not _tgmm_fits(config, m, k, n, dtype, out_dtype):
        config = config._replace(tile_m=config.tile_m // 2)
    while not _tgmm_fits(config, m, k, n, dtype, out_dtype) and config.tile_n > LANES:
        config = config._replace(tile_n=max(LANES, round_up(config.tile_n // 2, LANES)))
    grouped = config._replace(group_chunks=True)
    if _group_chunks_pay(config, m, k, n, dtype, generation, num_groups) and _tgmm_fits(grouped, m, k, n, dtype,
                                                                                       out_dtype):
        return grouped
    return config


def _group_chunks_pay(config: TgmmConfig, m: int, k: int, n: int, dtype, generation: str, num_groups: int) -> bool:
    """Whether chunks from each group's first row make a tgmm call faster: the larger of its MXU and HBM
    times, with about one extra chunk per group at fixed offsets against half a chunk laid from group
    starts (which read chunk_m / tile_m more rows). bf16 peak; the output written once either way."""
    facts = tpu_generation(generation)
    itemsize = jnp.dtype(dtype).itemsize
    tile_m, tile_k, tile_n, chunk_m = tgmm_blocks(config, m, k, n, dtype)
    if chunk_m >= tile_m:
        return False
    row_bytes = m * (k * -(-n // tile_n) + n * -(-k // tile_k)) * itemsize
    out_bytes = num_groups * k * n * itemsize

    def seconds(wasted_chunks_per_group: float, row_read_factor: float) -> float:
        flops = 2 * (m + wasted_chunks_per_group * num_groups * chunk_m) * k * n
        return max(flops / facts.bf16_flops_per_s, (row_bytes * row_read_factor + out_bytes) / facts.hbm_bytes_per_s)

    return seconds(0.5, 1 + chunk_m / tile_m) < seconds(1.0, 1.0)


def _tgmm_fits(config: TgmmConfig, m: int, k: int, n: int, dtype, out_dtype) -> bool:
    try:
        check_tgmm_config(config, m, k, n, dtype, out_dtype)
    except ValueError:
        return False
    return True


def select_tgmm_config(m: int, k: int, n: int, dtype, *, generation: str | None = None, out_dtype=None,
                       num_groups: int = 1) -> TgmmConfig:
    """Tiles for tgmm of `lhs[m,k]`, `rhs[m,n]` into `num_groups` groups on `generation` (default: the
    current device's)."""
    return heuristic_tgmm_config(m, k, n, dtype, resolve_generation(generation), out_dtype, num_groups)


def tgmm_vmem_limit(config: TgmmConfig, m: int, k: int, n: int, dtype, out_dtype=None) -> int:
    """The scoped VMEM limit the tgmm kernel asks Mosaic for with `config`."""
    return vmem_limit_bytes(tgmm_vmem_bytes(config, m, k, n, dtype, out_dtype))


# The backward's d_lhs grouped matmul runs at training sizes, where the heuristic tiles rows
# (HEURISTIC_ROW_TILE) in chunks and each row tile reads one chunk more of lhs rows: a longer row
# tile halves that extra read (modelled in benchmarks/moe_backward.py: Qwen3-30B-A3B's down
# projection on v6e, 73 % -> 82 % of its roofline). Taken where it passes `check_config`.
D_LHS_ROW_TILE = 1024


def select_d_lhs_config(m: int, k: int, n: int, dtype, *, generation: str | None = None,
                        num_groups: int | None = None) -> TileConfig:
    """Tiles of the backward's d_lhs grouped matmul `d_out[m,k] x rhs[.,k,n]`: `select_config`'s,
    with row tiles of D_LHS_ROW_TILE rows where they fit."""
    config = select_config(m, k, n, dtype, generation=generation, num_groups=num_groups)
    longer = config._replace(tile_m=min(D_LHS_ROW_TILE, m))
    if config.tile_m < longer.tile_m and _fits(longer, m, k, n, dtype):
        return longer
    return config
