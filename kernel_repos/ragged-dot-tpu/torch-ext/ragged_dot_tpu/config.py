"""Tile sizes per shape and TPU generation.

Kept apart from the kernel so that tuning changes data, not kernel code.
`select_config` takes the tuned config (`tuned_config`: the shape looked up
in `tile_table.TABLE`, produced by `benchmarks/search_ragged_dot_tiles.py`, a
search over the HBM traffic and roofline model) and falls back to a
VMEM-aware heuristic (`heuristic_config`) for shapes the table does not hold.
TPU facts (VMEM, bandwidth, MXU peak, tiling) come from `_hardware.py`.

A config has five knobs:
- `tile_m`, `tile_k`, `tile_n`: the lhs `(tile_m, tile_k)`, rhs `(tile_k,
  tile_n)` and out `(tile_m, tile_n)` blocks. `tile_m >= M` makes the whole of
  lhs and out one resident block (fetched and written once).
- `chunk_m`: the MXU works on row chunks of this size and skips the chunks
  outside the current group, so a large row tile wastes no MXU work on rows of
  other groups. `None` is one chunk per row tile.
- `groups_per_step`: how many work items (each with its own group's weights)
  one grid step multiplies. Every grid step has a fixed cost (~0.35 us), so
  for weights of a few MiB per expert (decode) several groups per step
  amortise it. Only with one row tile (`tile_m >= M`). Cost when fewer groups
  are active than slots (possible only if several rows share an expert): the
  idle slots fetch one extra weights block each in the first step.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp

from ._hardware import (
    LANES, MAX_VMEM_LIMIT_BYTES, MOSAIC_SCRATCH_BYTES, check_generation, resolve_generation, round_up,
    sublane_multiple, tpu_generation, vmem_limit_bytes,
)

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

# Blocks of the heuristic fallback: weights blocks of about this many bytes
# keep the per-step cost small next to their DMA (4 MiB take 2.6 us on v6e).
HEURISTIC_RHS_BLOCK_BYTES = {"v5e": 8 << 20, "v6e": 16 << 20}
# Row tiles of the heuristic when the rows do not stay resident: about the
# ridge (`ridge_rows`: 240 on v5e, 560 on v6e), where a step's matmul takes as
# long as its weights' DMA. Chunks of 128 rows bound the MXU work a group's
# last partial chunk wastes; not tuned.
HEURISTIC_ROW_TILE = {"v5e": 256, "v6e": 512}
HEURISTIC_CHUNK_M = 128


class TileConfig(NamedTuple):
    """Blocks of one ragged_dot call (the five knobs in the module docstring)."""

    tile_m: int
    tile_k: int
    tile_n: int
    chunk_m: int | None = None
    groups_per_step: int = 1


def vmem_bytes(config: TileConfig, m: int, k: int, n: int, dtype) -> int:
    """VMEM the pipeline holds: lhs, rhs (per group slot) and out blocks, plus the f32 accumulator.

    Blocks are double-buffered except an lhs block that is the whole array
    (Mosaic keeps one copy of a block that never moves); sizes are padded to
    the native (sublane, 128) tile.
    """
    itemsize = jnp.dtype(dtype).itemsize
    sublanes = sublane_multiple(dtype)

    def block(rows: int, cols: int, size: int = itemsize) -> int:
        return round_up(rows, sublanes) * round_up(cols, LANES) * size

    tile_m, tile_k, tile_n = min(config.tile_m, m), min(config.tile_k, k), min(config.tile_n, n)
    lhs_buffers = 1 if (tile_m, tile_k) == (m, k) else 2
    return (
        lhs_buffers * block(tile_m, tile_k)
        + 2 * config.groups_per_step * block(tile_k, tile_n)
        + 2 * block(tile_m, tile_n)
        + block(tile_m, tile_n, 4)
    )


def check_config(config: TileConfig, m: int, k: int, n: int, dtype) -> None:
    """Raises ValueError if `config` cannot run `lhs[m,k] x rhs[.,k,n]` of `dtype`."""
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
    if config.groups_per_step > MAX_GROUPS_PER_STEP:
        raise ValueError(f"config.groups_per_step must be at most {MAX_GROUPS_PER_STEP}, got {config.groups_per_step}")
    chunks = math.ceil(tile_m / (config.chunk_m or tile_m))
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
    needed = vmem_bytes(config, m, k, n, dtype)
    if needed > VMEM_BUDGET_BYTES:
        raise ValueError(f"config {tuple(config)} needs {needed / 2**20:.1f} MiB of VMEM, past the {VMEM_BUDGET_BYTES >> 20} MiB budget")


def resolve(entry: dict, m: int, k: int, n: int, dtype) -> TileConfig:
    """A table entry made concrete for `m` rows.

    tile_m "m" is the whole lhs; group slots need one row tile and at least
    as many rows as slots; chunks grow until the unrolled matmuls stay within
    bounds.
    """
    sublanes = sublane_multiple(dtype)
    tile_m = m if entry["tile_m"] == "m" else min(int(entry["tile_m"]), m)
    groups_per_step = int(entry.get("groups_per_step", 1))
    if tile_m < m or m < groups_per_step:
        groups_per_step = 1
    chunk_m = entry.get("chunk_m")
    if chunk_m is not None:
        max_chunks = MAX_UNROLLED_MATMULS // groups_per_step
        chunk_m = max(int(chunk_m), round_up(math.ceil(tile_m / max_chunks), sublanes))
        if chunk_m >= tile_m:
            chunk_m = None
    return TileConfig(
        tile_m=tile_m,
        tile_k=min(int(entry["tile_k"]), k),
        tile_n=min(int(entry["tile_n"]), n),
        chunk_m=chunk_m,
        groups_per_step=groups_per_step,
    )


def _table_entry(m: int, k: int, n: int, num_groups: int | None, dtype, generation: str) -> dict | None:
    """The searched entry for (k, n) whose (M, groups) bucket is nearest to (m, num_groups) in log space."""
    from .tile_table import TABLE

    candidates = [
        entry
        for entry in TABLE.get(generation, ())
        if entry["k"] == k and entry["n"] == n and entry["dtype"] == jnp.dtype(dtype).name
    ]
    if not candidates:
        return None

    def distance(entry: dict) -> float:
        rows = math.log2(entry["m"]) - math.log2(max(m, 1))
        groups = 0.0 if num_groups is None else math.log2(entry["groups"]) - math.log2(max(num_groups, 1))
        return rows * rows + groups * groups

    return min(candidates, key=distance)


def tuned_config(
    m: int, k: int, n: int, dtype, generation: str, num_groups: int | None = None
) -> TileConfig | None:
    """The searched table's config for this shape, made concrete for `m`; None if the table has none that fits."""
    entry = _table_entry(m, k, n, num_groups, dtype, check_generation(generation))
    if entry is None:
        return None
    config = resolve(entry, m, k, n, dtype)
    return config if _fits(config, m, k, n, dtype) else None


def ridge_rows(generation: str) -> int:
    """Rows per MXU pass at which a step's matmul takes as long as streaming its weights.

    bf16 peak FLOP/s over HBM bytes/s (2 FLOPs per weight element of 2
    bytes): 240 on v5e, 560 on v6e. Below it, decode stays HBM-bound.
    """
    facts = tpu_generation(generation)
    return int(facts.bf16_flops_per_s / facts.hbm_bytes_per_s)


def heuristic_config(m: int, k: int, n: int, dtype, generation: str, num_groups: int | None = None) -> TileConfig:
    """VMEM-aware fallback for shapes the table does not hold.

    Weights blocks are as large as HEURISTIC_RHS_BLOCK_BYTES allows (K whole
    if it fits, else halved down to 512; N whole or halved in multiples of
    256, v6e's MXU width) so each active group's weights are fetched once per
    N tile in few grid steps. Rows: one resident tile in HEURISTIC_CHUNK_M-row
    chunks when the rows per group stay under `ridge_rows`, else
    HEURISTIC_ROW_TILE rows, else one chunk of rows; the first that fits.
    """
    generation = check_generation(generation)
    itemsize = jnp.dtype(dtype).itemsize
    rhs_block_bytes = HEURISTIC_RHS_BLOCK_BYTES[generation]

    tile_k = k
    tile_n = n
    while tile_k * tile_n * itemsize > rhs_block_bytes and tile_n > 256:
        tile_n = max(256, round_up(tile_n // 2, 256))
    while tile_k * tile_n * itemsize > rhs_block_bytes and tile_k > 512:
        tile_k = max(512, round_up(tile_k // 2, 256))

    rows_per_group = m / max(num_groups or 1, 1)
    chunk = HEURISTIC_CHUNK_M
    tiled_m = min(HEURISTIC_ROW_TILE[generation], m)
    candidates = []
    if rows_per_group <= ridge_rows(generation):
        candidates.append(TileConfig(m, tile_k, tile_n, chunk if m > chunk else None))
    candidates.append(TileConfig(tiled_m, tile_k, tile_n, chunk if tiled_m > chunk else None))
    candidates.append(TileConfig(min(chunk, m), tile_k, tile_n))
    for config in candidates:
        if _fits(config, m, k, n, dtype):
            return config
    # Shrink the weights block until the smallest row tile fits.
    config = candidates[-1]
    while not _fits(config, m, k, n, dtype) and config.tile_n > LANES:
        config = config._replace(tile_n=max(LANES, round_up(config.tile_n // 2, LANES)))
    while not _fits(config, m, k, n, dtype) and config.tile_k > LANES:
        config = config._replace(tile_k=max(LANES, round_up(config.tile_k // 2, LANES)))
    return config


def _fits(config: TileConfig, m: int, k: int, n: int, dtype) -> bool:
    try:
        check_config(config, m, k, n, dtype)
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
) -> TileConfig:
    """Tiles for `lhs[m,k] x rhs[num_groups,k,n]` on `generation` (default: the current device's).

    The searched table entry of the nearest (M, groups) bucket for this (K, N)
    and dtype, made concrete for `m`; the heuristic when the table has no
    entry for (K, N) or the entry does not fit VMEM at this `m`.
    """
    generation = resolve_generation(generation)
    config = tuned_config(m, k, n, dtype, generation, num_groups)
    return config if config is not None else heuristic_config(m, k, n, dtype, generation, num_groups)


def vmem_limit(config: TileConfig, m: int, k: int, n: int, dtype) -> int:
    """The scoped VMEM limit the kernel asks Mosaic for with `config`."""
    return vmem_limit_bytes(vmem_bytes(config, m, k, n, dtype))
