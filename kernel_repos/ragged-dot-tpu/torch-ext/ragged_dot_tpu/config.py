"""Tile sizes per shape and TPU generation.

Kept apart from the kernel so that tuning changes data, not kernel code.
`select_config` looks the shape up in `tile_table.TABLE` (produced by
`benchmarks/search_ragged_dot_tiles.py`, a search over the HBM traffic and
roofline model) and falls back to a VMEM-aware heuristic for shapes the table
does not hold.

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

import jax
import jax.numpy as jnp

DEFAULT_GENERATION = "v6e"
GENERATIONS = ("v5e", "v6e")

# Both v5e and v6e have 128 MiB of VMEM per TensorCore (jax's TpuInfo table).
# The kernel raises its scoped VMEM limit to what its blocks need plus
# headroom for Mosaic's own scratch, never past the cap.
VMEM_CAPACITY_BYTES = 128 << 20
VMEM_HEADROOM_BYTES = 4 << 20
VMEM_LIMIT_CAP_BYTES = 100 << 20
VMEM_BUDGET_BYTES = VMEM_LIMIT_CAP_BYTES - VMEM_HEADROOM_BYTES

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
# Rows per MXU pass at which a step's matmul takes as long as streaming its
# weights (peak FLOP/s / HBM bytes/s, bf16): below, decode stays HBM-bound.
RIDGE_ROWS = {"v5e": 240, "v6e": 560}


class TileConfig(NamedTuple):
    tile_m: int
    tile_k: int
    tile_n: int
    chunk_m: int | None = None
    groups_per_step: int = 1


def current_generation() -> str:
    """The TPU generation of the default device; off-TPU the CPU path simulates v6e."""
    device = jax.devices()[0]
    if device.platform != "tpu":
        return DEFAULT_GENERATION
    kind = device.device_kind.lower()
    if "v5 lite" in kind or "v5e" in kind:
        return "v5e"
    if "v6" in kind:
        return "v6e"
    return DEFAULT_GENERATION


def sublane_rows(dtype) -> int:
    """Rows of one native (sublane, 128) VMEM tile: 8 for 32-bit, 16 for bf16."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def vmem_bytes(config: TileConfig, m: int, k: int, n: int, dtype) -> int:
    """VMEM the pipeline holds: lhs, rhs (per group slot) and out blocks, plus the f32 accumulator.

    Blocks are double-buffered except an lhs block that is the whole array
    (Mosaic keeps one copy of a block that never moves); sizes are padded to
    the native (sublane, 128) tile.
    """
    itemsize = jnp.dtype(dtype).itemsize
    sublanes = sublane_rows(dtype)

    def block(rows: int, cols: int, size: int = itemsize) -> int:
        return _round_up(rows, sublanes) * _round_up(cols, 128) * size

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
    sublanes = sublane_rows(dtype)
    for name in ("tile_m", "tile_k", "tile_n", "groups_per_step"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"config.{name} must be a positive int, got {value!r}")
    if config.tile_m < m and config.tile_m % sublanes:
        raise ValueError(f"config.tile_m={config.tile_m} must be a multiple of {sublanes} or cover all {m} rows")
    for name, dim in (("tile_k", k), ("tile_n", n)):
        value = getattr(config, name)
        if value < dim and value % 128:
            raise ValueError(f"config.{name}={value} must be a multiple of 128 or cover the whole dimension {dim}")
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
    sublanes = sublane_rows(dtype)
    tile_m = m if entry["tile_m"] == "m" else min(int(entry["tile_m"]), m)
    groups_per_step = int(entry.get("groups_per_step", 1))
    if tile_m < m or m < groups_per_step:
        groups_per_step = 1
    chunk_m = entry.get("chunk_m")
    if chunk_m is not None:
        max_chunks = MAX_UNROLLED_MATMULS // groups_per_step
        chunk_m = max(int(chunk_m), _round_up(math.ceil(tile_m / max_chunks), sublanes))
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


def heuristic_config(m: int, k: int, n: int, dtype, generation: str, num_groups: int | None = None) -> TileConfig:
    """VMEM-aware fallback for shapes the table does not hold.

    Weights blocks are as large as the budget allows (K whole if it fits, N
    whole or cut in multiples of 256) so each active group's weights are
    fetched once per N tile in few grid steps. Rows: one resident tile with
    128-row chunks when that fits VMEM and the MXU work of a step stays under
    its weight DMA, else tiles of 256 (v5e) / 512 (v6e) rows in 128-row chunks.
    """
    itemsize = jnp.dtype(dtype).itemsize
    rhs_block_bytes = HEURISTIC_RHS_BLOCK_BYTES.get(generation, HEURISTIC_RHS_BLOCK_BYTES[DEFAULT_GENERATION])
    ridge = RIDGE_ROWS.get(generation, RIDGE_ROWS[DEFAULT_GENERATION])

    tile_k = k
    tile_n = n
    while tile_k * tile_n * itemsize > rhs_block_bytes and tile_n > 256:
        tile_n = max(256, _round_up(tile_n // 2, 256))
    while tile_k * tile_n * itemsize > rhs_block_bytes and tile_k > 512:
        tile_k = max(512, _round_up(tile_k // 2, 256))

    rows_per_group = m / max(num_groups or 1, 1)
    chunk = 128
    tiled_m = 512 if generation == "v6e" else 256
    candidates = []
    if rows_per_group <= ridge:
        candidates.append(TileConfig(m, tile_k, tile_n, chunk if m > chunk else None))
    candidates.append(TileConfig(min(tiled_m, m), tile_k, tile_n, chunk if min(tiled_m, m) > chunk else None))
    candidates.append(TileConfig(min(128, m), tile_k, tile_n))
    for config in candidates:
        if _fits(config, m, k, n, dtype):
            return config
    # Shrink the weights block until the smallest row tile fits.
    config = candidates[-1]
    while not _fits(config, m, k, n, dtype) and config.tile_n > 128:
        config = config._replace(tile_n=max(128, _round_up(config.tile_n // 2, 128)))
    while not _fits(config, m, k, n, dtype) and config.tile_k > 128:
        config = config._replace(tile_k=max(128, _round_up(config.tile_k // 2, 128)))
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
    generation = generation or current_generation()
    entry = _table_entry(m, k, n, num_groups, dtype, generation)
    if entry is not None:
        config = resolve(entry, m, k, n, dtype)
        if _fits(config, m, k, n, dtype):
            return config
    return heuristic_config(m, k, n, dtype, generation, num_groups)
