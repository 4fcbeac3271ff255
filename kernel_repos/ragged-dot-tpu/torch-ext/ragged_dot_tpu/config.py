"""Tile sizes per shape and TPU generation.

Kept apart from the kernel so that tuning (a table per generation produced by
a search over the traffic model) changes data, not kernel code.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# Scoped VMEM the compiler grants a kernel by default; the kernel raises its
# limit to what the tiles need, but staying well inside keeps room for Mosaic's
# own scratch. Sources: jax's pltpu docs (16 MiB default scoped limit on v5e,
# 32 MiB on v6e; 128 MiB physical on both).
VMEM_BUDGET_BYTES = {"v5e": 12 << 20, "v6e": 24 << 20}
DEFAULT_GENERATION = "v6e"


class TileConfig(NamedTuple):
    tile_m: int
    tile_k: int
    tile_n: int


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


def _lane_tile(dim: int, preferred: int) -> int:
    """A block size along a lane (last) axis: the whole dim if small, else a multiple of 128."""
    if dim <= preferred:
        return dim
    return preferred


def select_config(
    m: int,
    k: int,
    n: int,
    dtype,
    *,
    generation: str | None = None,
) -> TileConfig:
    """Tiles for `lhs[m,k] x rhs[.,k,n]`.

    Row tiles stay small for decode-sized M so padding rows do not multiply the
    weight traffic; K is kept whole when it fits so each group's weights are
    fetched once per N tile; N tiles shrink until the double-buffered blocks fit
    the generation's VMEM budget.
    """
    generation = generation or current_generation()
    budget = VMEM_BUDGET_BYTES.get(generation, VMEM_BUDGET_BYTES[DEFAULT_GENERATION])
    itemsize = jnp.dtype(dtype).itemsize

    # A block dim must be a multiple of the native tile or the whole array dim.
    preferred_m = 128 if m <= 4096 else 512
    tile_m = m if m <= preferred_m else preferred_m
    tile_k = _lane_tile(k, 2048)
    tile_n = _lane_tile(n, 1024 if generation == "v6e" else 512)

    def footprint(tm: int, tk: int, tn: int) -> int:
        return 2 * (tm * tk + tk * tn + tm * tn) * itemsize + tm * tn * 4

    while footprint(tile_m, tile_k, tile_n) > budget and tile_n > 128 and tile_n % 256 == 0:
        tile_n //= 2
    while footprint(tile_m, tile_k, tile_n) > budget and tile_k > 128 and tile_k % 256 == 0:
        tile_k //= 2
    return TileConfig(tile_m=tile_m, tile_k=tile_k, tile_n=tile_n)
