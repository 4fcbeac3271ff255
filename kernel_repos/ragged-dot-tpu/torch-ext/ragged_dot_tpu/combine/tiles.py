"""The combine kernel's token tile: how many tokens one grid step sums."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._hardware import LANES, TpuGeneration, round_up, vmem_budget_bytes
from ..problem import CombineProblem

# Tokens per grid step, largest first: each step copies up to K x tile rows, and a longer tile pays fewer steps'
# fixed cost. The first tile's copies wait before any sum (nothing overlaps them), so a core keeps at least
# MIN_TILES_PER_CORE tiles: the exposed copies stay an eighth of its rows (modelled by `python -m benchmarks
# moe_layer` at 2048 and 8192 tokens: 256 and 512 were the best tiles there or within 1.3 us of it; 512 at
# 2048 tokens, 4 tiles, was up to 2 % slower than 128).
TOKEN_TILES = (512, 256, 128)
MIN_TILES_PER_CORE = 8


def combine_vmem_bytes(tile_t: int, problem: CombineProblem) -> int:
    """VMEM a grid step of `tile_t` tokens holds: its tokens' picks' rows as packed words
    (`CombineProblem.words`), their routing, its output block and one N tile's sums."""
    return (2 * problem.top_k * tile_t * problem.words * 4  # the two buffers of copied rows
            + 2 * 2 * tile_t * round_up(problem.top_k, LANES) * 4  # routing weights and live flags, double-buffered
            + 2 * tile_t * problem.hidden * jnp.dtype(problem.dtype).itemsize  # the output block, double-buffered
            + 4 * tile_t * problem.split * 4)  # one N tile's f32 parts and sums


def select(problem: CombineProblem, target: TpuGeneration) -> int:
    """The token tile: the largest of TOKEN_TILES that leaves each core MIN_TILES_PER_CORE tiles and takes at most
    half of the VMEM budget of `target` (the rest stays XLA's, around the kernel),
    else the smallest."""
    chip_cores = target.cores_per_device
    return next((tile for tile in TOKEN_TILES
                 if pl.cdiv(problem.tokens, tile) >= MIN_TILES_PER_CORE * chip_cores
                 and combine_vmem_bytes(tile, problem) <= vmem_budget_bytes(target.name) // 2),
                min(TOKEN_TILES[-1], round_up(problem.tokens, 8)))
