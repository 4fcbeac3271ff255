"""The fused experts kernel's plan: an `ExpertsProblem` goes in, the `FusedPlan` the kernel runs comes out."""

from __future__ import annotations

from typing import NamedTuple

from .._hardware import TpuGeneration, vmem_limit_bytes
from ..common.quant import check_served
from ..common.vmem import Buffer
from ..common.routing import expected_active_groups
from ..common.weights_layout import WeightsOrientation
from ..problem import ExpertsProblem
from .tiles import (
    FusedConfig, check_fused_config, fused_buffers, fused_chunks, fused_cores, fused_feeds_fp8_mxu, fused_vmem_bytes,
    i_tiles, i_tiles_per_core, select, slab_i,
)


class FusedPlan(NamedTuple):
    """The fused experts kernel as `fused.kernel.call` runs it."""

    problem: ExpertsProblem
    orientation: WeightsOrientation
    chunk_rows: int
    chunks: int  # chunks of `chunk_rows` rows that hold an expert's rows
    tile_i: int
    i_tiles: int
    gate_up_parts: int  # 2: gate and up blocks apart (concatenated, I tiled); 1: one block of both
    experts_per_step: int  # active experts (items) each grid step runs, one per slot of blocks
    cores: int  # TensorCores the kernel runs on (`fused.tiles.fused_cores`: 2 on v5p)
    cores_per_expert: int  # 1: the cores split the items; `cores`: each core takes its I tiles of every item
    i_tiles_per_core: int  # I tiles a core walks per item (`fused.tiles.i_tiles_per_core`)
    buffers: tuple[Buffer, ...]  # what the pipeline holds in VMEM (`fused_buffers`)
    vmem_limit_bytes: int
    active_experts: float  # expected, for the cost estimate
    fp8_matmul: bool  # fp8 weights multiplied on the fp8 MXU with fp8 activations (`fused.tiles.fused_feeds_fp8_mxu`)
    slab_i: int  # I columns per trip of the interleaved body's loop over its I tile (`fused.tiles.slab_i`)


def make(problem: ExpertsProblem, target: TpuGeneration, config: FusedConfig | None = None) -> FusedPlan:
    """The fused kernel's plan on `target`: `config`'s blocks (checked), else
    `select`'s; ValueError if none fits."""
    check_served(problem.weights_dtype, target)
    if config is None:
        config = select(problem, target)
        if config is None:
            raise ValueError(f"fused_experts: no I tiling of T={problem.tokens}, H={problem.hidden}, "
                             f"I={problem.intermediate} fits VMEM; use the grouped path")
    check_fused_config(config, problem, target)
    tiles = i_tiles(config, problem.intermediate)
    cores = fused_cores(target, problem.picks, config.cores_per_expert)
    fp8_matmul = fused_feeds_fp8_mxu(config, problem, target)
    return FusedPlan(
        problem=problem, orientation=problem.orientation, chunk_rows=config.chunk_rows,
        chunks=fused_chunks(config, problem.tokens), tile_i=config.tile_i, i_tiles=tiles,
        gate_up_parts=2 if tiles > 1 and not problem.gate.interleaved else 1,
        experts_per_step=config.experts_per_step, cores=cores, cores_per_expert=config.cores_per_expert,
        i_tiles_per_core=i_tiles_per_core(config, problem.intermediate),
        buffers=fused_buffers(config, problem, cores=cores, fp8_matmul=fp8_matmul),
        vmem_limit_bytes=vmem_limit_bytes(fused_vmem_bytes(config, problem, cores=cores, fp8_matmul=fp8_matmul),
                                          target.name),
        active_experts=expected_active_groups(problem.picks, problem.num_experts),
        fp8_matmul=fp8_matmul, slab_i=slab_i(config.tile_i, problem),
    )
