"""The combine kernel's plan: a `CombineProblem` goes in, the `CombinePlan` the kernel runs comes out."""

from __future__ import annotations

from typing import NamedTuple

from jax.experimental import pallas as pl

from .._hardware import TpuGeneration, vmem_limit_bytes
from ..problem import CombineProblem
from .tiles import combine_vmem_bytes, select


class CombinePlan(NamedTuple):
    """The combine kernel of one experts call."""

    problem: CombineProblem
    tile_t: int
    cores: int  # TensorCores the token tiles are split over
    vmem_limit_bytes: int

    @property
    def tiles(self) -> int:
        return pl.cdiv(self.problem.tokens, self.tile_t)

    @property
    def tiles_per_core(self) -> int:
        return pl.cdiv(self.tiles, self.cores)


def make(problem: CombineProblem, target: TpuGeneration, config: int | None = None) -> CombinePlan:
    """The combine kernel's plan on `target`: `config`'s token tile, else
    `select`'s, and the cores the tiles are split over (no more than the tiles)."""
    tile_t = select(problem, target) if config is None else config
    cores = min(target.cores_per_device, pl.cdiv(problem.tokens, tile_t))
    return CombinePlan(problem, tile_t, cores, vmem_limit_bytes(combine_vmem_bytes(tile_t, problem), target.name))
