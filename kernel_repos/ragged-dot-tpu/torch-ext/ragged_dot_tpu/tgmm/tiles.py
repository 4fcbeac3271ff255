"""Tiles of the weights' gradient (`tgmm.kernel.transposed_grouped_matmul`): `TgmmConfig` and how one is
chosen."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from .._hardware import (
    LANES, TpuGeneration, padded_vmem_bytes, round_up, sublane_multiple, vmem_budget_bytes, vmem_limit_bytes,
)
from ..common.vmem import MAX_STEP_MACS, MAX_STEP_MATMULS, Buffer, accepts, buffers_bytes, check_vmem_fits
from ..problem import TgmmProblem

# The weights' gradient (`tgmm.kernel.transposed_grouped_matmul`): per group, lhs_g^T @ rhs_g -> [G, K, N].
# Row tiles of the heuristic: large next to a chunk (fewer grid steps), small enough that a
# step runs few chunks. Not tuned.
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
      group for chunk_m / tile_m more row reads (`tgmm/kernel.py`).
    """

    tile_m: int
    tile_k: int
    tile_n: int
    chunk_m: int
    group_chunks: bool = False


def tgmm_blocks(config: TgmmConfig, problem: TgmmProblem) -> tuple[int, int, int, int]:
    """(tile_m, tile_k, tile_n, chunk_m) the kernel runs `config` with for `problem`.

    A chunk of more rows than M (rounded to the sublane tile) shrinks to them; one row tile over all
    M rows is M rounded up to whole chunks (a partial edge block whose extra rows the kernel masks).
    """
    m = problem.m
    chunk_m = min(config.chunk_m, round_up(m, sublane_multiple(problem.dtype)))
    tile_m = config.tile_m if config.tile_m < m else round_up(m, chunk_m)
    return tile_m, min(config.tile_k, problem.k), min(config.tile_n, problem.n), chunk_m


def tgmm_buffers(config: TgmmConfig, problem: TgmmProblem) -> tuple[Buffer, ...]:
    """tgmm's blocks and scratch: double-buffered lhs and rhs row blocks (windows with group chunks) and output
    block, the f32 accumulator."""
    dtype = problem.dtype
    tile_m, tile_k, tile_n, chunk_m = tgmm_blocks(config, problem)
    rows = tile_m + chunk_m if config.group_chunks and chunk_m < tile_m else tile_m  # windows with group chunks
    return (Buffer((rows, tile_k), dtype, 2), Buffer((rows, tile_n), dtype, 2),
            Buffer((tile_k, tile_n), problem.out_dtype, 2), Buffer((tile_k, tile_n), "float32"))


def tgmm_vmem_bytes(config: TgmmConfig, problem: TgmmProblem) -> int:
    """VMEM of a tgmm call: its buffers (`tgmm_buffers`) and one chunk's masked operands beside them."""
    _, tile_k, tile_n, chunk_m = tgmm_blocks(config, problem)
    return buffers_bytes(tgmm_buffers(config, problem)) + padded_vmem_bytes(
        (chunk_m, tile_k), problem.dtype) + padded_vmem_bytes((chunk_m, tile_n), problem.dtype)


def check_tgmm_config(config: TgmmConfig, problem: TgmmProblem, target: TpuGeneration) -> None:
    """Raises ValueError if `config` cannot run `problem` on `target`."""
    if not isinstance(config, TgmmConfig):
        raise TypeError(f"config must be a TgmmConfig, got {type(config).__name__}")
    for name in ("tile_m", "tile_k", "tile_n", "chunk_m"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"config.{name} must be a positive int, got {value!r}")
    if not isinstance(config.group_chunks, bool):
        raise ValueError(f"config.group_chunks must be a bool, got {config.group_chunks!r}")
    sublanes = sublane_multiple(problem.dtype)
    tile_m, tile_k, tile_n, chunk_m = tgmm_blocks(config, problem)
    if chunk_m % sublanes:
        raise ValueError(f"config.chunk_m={config.chunk_m} must be a multiple of {sublanes}")
    if tile_m % chunk_m:
        raise ValueError(f"config.tile_m={config.tile_m} must be a multiple of chunk_m={chunk_m} or cover all "
                         f"{problem.m} rows")
    for name, value, dim in (("tile_k", tile_k, problem.k), ("tile_n", tile_n, problem.n)):
        if value < dim and value % LANES:
            raise ValueError(f"config.{name}={value} must be a multiple of {LANES} or cover the whole dimension {dim}")
    if tile_m // chunk_m > MAX_STEP_MATMULS:
        raise ValueError(f"config: {tile_m // chunk_m} row chunks per step, more than {MAX_STEP_MATMULS} matmuls")
    macs = tile_m * tile_k * tile_n
    if macs > MAX_STEP_MACS:
        raise ValueError(
            f"config {tuple(config)}: one grid step multiplies {macs / 2**30:.1f} Gi multiply-adds, past the "
            f"{MAX_STEP_MACS / 2**30:.0f} Gi bound on kernel size (compile time)"
        )
    check_vmem_fits(config, tgmm_vmem_bytes(config, problem), target)


def heuristic_tgmm_config(problem: TgmmProblem, target: TpuGeneration) -> TgmmConfig:
    """Whole K and N when the output block fits TGMM_OUTPUT_SHARE of the budget (every row read once),
    else N, then K, halved in multiples of 256; on a megacore device (v5p) at least one output block per
    core (`_split_for_cores`); chunks of one MXU width (the contraction of a pass); TGMM_ROW_TILE rows,
    halved until a step fits the unrolling and VMEM bounds; group chunks where `_group_chunks_pay` says
    so."""
    out_bytes = 4 + 2 * jnp.dtype(problem.out_dtype).itemsize
    tile_k, tile_n = problem.k, problem.n
    output_budget = TGMM_OUTPUT_SHARE * vmem_budget_bytes(target.name)
    while tile_k * tile_n * out_bytes > output_budget and tile_n > 256:
        tile_n = max(256, round_up(tile_n // 2, 256))
    while tile_k * tile_n * out_bytes > output_budget and tile_k > 256:
        tile_k = max(256, round_up(tile_k // 2, 256))
    tile_k, tile_n = _split_for_cores(problem, tile_k, tile_n, target.cores_per_device)
    chunk = target.mxu_size
    config = TgmmConfig(TGMM_ROW_TILE, tile_k, tile_n, chunk)
    while config.tile_m > chunk and not accepts(check_tgmm_config, config, problem, target):
        config = config._replace(tile_m=config.tile_m // 2)
    while not accepts(check_tgmm_config, config, problem, target) and config.tile_n > LANES:
        config = config._replace(tile_n=max(LANES, round_up(config.tile_n // 2, LANES)))
    grouped = config._replace(group_chunks=True)
    if _group_chunks_pay(config, problem, target) and accepts(check_tgmm_config, grouped, problem, target):
        return grouped
    return config


def _split_for_cores(problem: TgmmProblem, tile_k: int, tile_n: int, cores: int) -> tuple[int, int]:
    """(tile_k, tile_n) with at least `cores` output blocks where the output is one block: a megacore device
    splits the grid's parallel axes (N tiles, then K tiles) over its cores, and one block leaves all but one
    idle. The split dimension is the one whose re-read costs less: N re-reads lhs ([m, k]) per N tile, K
    re-reads rhs ([m, n]) per K tile. Blocks stay multiples of the 128 lanes (a tail block is partial)."""
    k, n = problem.k, problem.n
    if cores == 1 or tile_k < k or tile_n < n:
        return tile_k, tile_n
    split_n = k <= n
    dim = n if split_n else k
    part = round_up(-(-dim // cores), LANES)
    if part >= dim:
        return tile_k, tile_n
    return (tile_k, part) if split_n else (part, tile_n)


def _group_chunks_pay(config: TgmmConfig, problem: TgmmProblem, target: TpuGeneration) -> bool:
    """Whether chunks from each group's first row make a tgmm call faster: the larger of its MXU and HBM
    times, with about one extra chunk per group at fixed offsets against half a chunk laid from group
    starts (which read chunk_m / tile_m more rows). bf16 peak; the output written once either way."""
    m, k, n, groups = problem.m, problem.k, problem.n, problem.groups
    itemsize = jnp.dtype(problem.dtype).itemsize
    tile_m, tile_k, tile_n, chunk_m = tgmm_blocks(config, problem)
    if chunk_m >= tile_m:
        return False
    row_bytes = m * (k * -(-n // tile_n) + n * -(-k // tile_k)) * itemsize
    out_bytes = groups * k * n * itemsize

    def seconds(wasted_chunks_per_group: float, row_read_factor: float) -> float:
        flops = 2 * (m + wasted_chunks_per_group * groups * chunk_m) * k * n
        return max(flops / target.bf16_flops_per_s, (row_bytes * row_read_factor + out_bytes) / target.hbm_bytes_per_s)

    return seconds(0.5, 1 + chunk_m / tile_m) < seconds(1.0, 1.0)



def select(problem: TgmmProblem, target: TpuGeneration) -> TgmmConfig:
    """Tiles for `problem` on `target`."""
    return heuristic_tgmm_config(problem, target)


def tgmm_vmem_limit(config: TgmmConfig, problem: TgmmProblem, target: TpuGeneration) -> int:
    """The scoped VMEM limit the tgmm kernel asks Mosaic for with `config` on `target`."""
    return vmem_limit_bytes(tgmm_vmem_bytes(config, problem), target.name)
