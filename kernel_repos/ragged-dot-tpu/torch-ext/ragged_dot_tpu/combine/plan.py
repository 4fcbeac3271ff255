"""The combine kernel's plan: one experts call's tokens, picks and packed rows go in, the `CombinePlan` the kernel
runs comes out."""

from __future__ import annotations

from typing import NamedTuple

from jax.experimental import pallas as pl

from .._hardware import tpu_generation, vmem_limit_bytes
from .tiles import combine_vmem_bytes, select_token_tile


class CombinePlan(NamedTuple):
    """The combine kernel of one experts call."""

    tokens: int
    top_k: int
    hidden: int
    dtype: str  # the layer's output's
    tile_t: int
    tile_n: int  # the second projection's N tile, packed in `split` words (`gmm.plan.packed_plan`)
    split: int  # words per N tile: column j of the tile with column split + j
    cores: int  # TensorCores the token tiles are split over
    vmem_limit_bytes: int

    @property
    def words(self) -> int:
        """Words of one row: `split` per N tile."""
        return pl.cdiv(self.hidden, self.tile_n) * self.split

    @property
    def tiles(self) -> int:
        return pl.cdiv(self.tokens, self.tile_t)

    @property
    def tiles_per_core(self) -> int:
        return pl.cdiv(self.tiles, self.cores)


def plan_combine(tokens: int, top_k: int, hidden: int, dtype: str, tile_n: int, split: int,
                 generation: str) -> CombinePlan:
    """The token tile of `select_token_tile`, and the cores the tiles are split over (no more than the tiles)."""
    tile_t = select_token_tile(tokens, top_k, hidden, dtype, tile_n, split, generation)
    cores = min(tpu_generation(generation).cores_per_device, pl.cdiv(tokens, tile_t))
    return CombinePlan(tokens, top_k, hidden, dtype, tile_t, tile_n, split, cores,
                       vmem_limit_bytes(combine_vmem_bytes(tile_t, top_k, hidden, dtype, tile_n, split), generation))
