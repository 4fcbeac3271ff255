"""The fused experts kernel's schedule: which item (active expert) and I tile each grid step's slots run, and
the blocks of the experts' weights (and biases, and scales) each slot reads.

Both as `kernel.py`'s module docstring describes them; the kernel body runs over them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common.quant import FP8, dequantized_in_vmem, per_channel_scales, scheme_of, stored_rows
from ..problem import ExpertWeights
from .plan import FusedPlan
from .tiles import BIAS_BLOCK_EXPERTS, SCALE_BLOCK_EXPERTS


def block_shift(block_experts: int) -> int:
    """log2 of a per-expert block's experts (a power of two: the block index is the expert id shifted)."""
    shift = block_experts.bit_length() - 1
    assert 1 << shift == block_experts
    return shift


def slot_item(core, step, slot: int, count, plan: FusedPlan):
    """(the item `slot` runs at the core's `step`, an index into the expert table; whether it is a real one).

    A core takes a contiguous share of the `count` items, `experts_per_step`
    per step. A slot past its share keeps its last real item, whose blocks
    the pipeline then does not fetch again; a slot without any (fewer items
    than slots) takes the core's last item.
    """
    slots = plan.experts_per_step
    if plan.cores_per_expert > 1:  # every core takes every item
        core = 0
    item_cores = plan.cores // plan.cores_per_expert
    # lax.div: jnp's floor division lowers through sign(), whose Mosaic rule asks the attached device its
    # generation (there is none in an ahead-of-time compile); both operands are >= 0, so truncation is floor.
    per_core = lax.div(count + item_cores - 1, item_cores)
    owned = jnp.clip(count - core * per_core, 0, per_core)
    local = step * slots + slot
    last_local = jnp.where(owned > slot, lax.div(jnp.maximum(owned - slot - 1, 0), slots) * slots + slot, owned - 1)
    item = core * per_core + jnp.where(local < owned, local, last_local)
    return jnp.clip(item, 0, plan.problem.num_experts - 1), local < owned


def grid_position(plan: FusedPlan):
    """(core, step of the core, I tile step of the core, and the number of each) from the grid: (steps, I tiles)
    on one core, (cores, steps per core, I tiles per core) on a megacore device."""
    if plan.cores == 1:
        return 0, pl.program_id(0), pl.program_id(1), pl.num_programs(0), pl.num_programs(1)
    return pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.num_programs(1), pl.num_programs(2)


def core_i_tile(core, i_step, plan: FusedPlan):
    """(the I tile a core's I step reads, whether it is one of the core's own): with the cores sharing each item,
    the core's run of tiles starts at core x `plan.i_tiles_per_core`, and a step past the last tile (the second
    core of an odd count) keeps the last one's blocks."""
    if plan.cores_per_expert == 1:
        return i_step, True
    tile = core * plan.i_tiles_per_core + i_step
    return jnp.minimum(tile, plan.i_tiles - 1), tile < plan.i_tiles


def slot_spec(spec: pl.BlockSpec, slot: int, plan: FusedPlan) -> pl.BlockSpec:
    """`spec` (indexed by item and I tile) as the blocks of `slot`, indexed by the grid (`grid_position`)."""
    def index_map(*indices):
        *position, i_step, expert, rows, count = indices
        core, step = position if plan.cores > 1 else (0, position[0])
        item = slot_item(core, step, slot, count[0], plan)[0]
        return spec.index_map(item, core_i_tile(core, i_step, plan)[0], expert, rows, count)

    return pl.BlockSpec(spec.block_shape, index_map, pipeline_mode=spec.pipeline_mode)


class WeightBlocks(NamedTuple):
    in_specs: list
    operands: list
    scratch: list


def weight_blocks(plan: FusedPlan, weights: ExpertWeights) -> WeightBlocks:
    """The experts' blocks: weights (and biases, and scales) of the item's expert and I tile.

    Index maps get (item, I tile, *scalar prefetch). A gate_up part spans
    `width` columns of 2I: gate and up apart (parts == 2: up starts
    I / tile_i blocks later), or both in one block.
    """
    problem, orientation, parts, tile_i = plan.problem, plan.orientation, plan.gate_up_parts, plan.tile_i
    hidden, i_tiles = problem.hidden, plan.i_tiles
    width = tile_i if parts == 2 else 2 * tile_i
    quantization = scheme_of(problem.weights_dtype)

    def rows(count):  # of a weights block as stored: packed int4 holds two rows per byte
        return stored_rows(count, quantization)

    def gate_up_spec(block_offset):
        if orientation.gate_up_transposed:  # [E, H, 2I]
            return pl.BlockSpec((None, rows(hidden), width),
                                lambda item, i, expert, *_: (expert[item], 0, block_offset + i))
        return pl.BlockSpec((None, rows(width), hidden),
                            lambda item, i, expert, *_: (expert[item], block_offset + i, 0))

    if orientation.down_transposed:  # [E, I, H]
        down_spec = pl.BlockSpec((None, rows(tile_i), hidden), lambda item, i, expert, *_: (expert[item], i, 0))
    else:  # [E, H, I]
        down_spec = pl.BlockSpec((None, rows(hidden), tile_i), lambda item, i, expert, *_: (expert[item], 0, i))
    def per_expert_rows(columns, block_experts, block_offset=None):
        """A [block_experts, columns] block holding the item's expert's row (biases, int8 and int4 scales): of
        the I tile's columns (`block_offset`: where the part's tiles start), else of all `columns`."""
        shift = block_shift(block_experts)
        return pl.BlockSpec((min(problem.num_experts, block_experts), columns),
                            lambda item, i, expert, *_: (expert[item] >> shift,
                                                         0 if block_offset is None else block_offset + i))

    def per_expert_specs(block_experts=BIAS_BLOCK_EXPERTS):
        return [*(per_expert_rows(width, block_experts, part * i_tiles) for part in range(parts)),
                per_expert_rows(hidden, block_experts)]

    in_specs = [*(gate_up_spec(part * i_tiles) for part in range(parts)), down_spec]
    operands = [*([weights.gate_up_proj] * parts), weights.down_proj]
    if problem.has_bias:
        in_specs += per_expert_specs()
        operands += [*([weights.gate_up_bias] * parts), weights.down_bias]
    scratch = []
    if per_channel_scales(quantization):  # [E, 2I] and [E, H], blocked as the biases (in f32's 8 rows)
        in_specs += per_expert_specs(SCALE_BLOCK_EXPERTS)
        operands += [*([weights.gate_up_scales] * parts), weights.down_scales]
    elif quantization == FP8:
        in_specs += [pl.BlockSpec((None, *scales.shape[1:]), lambda item, i, expert, *_: (expert[item], 0, 0))
                     for scales in (weights.gate_up_scales, weights.down_scales)]
        operands += [weights.gate_up_scales, weights.down_scales]
    if dequantized_in_vmem(quantization) and not plan.fp8_matmul:
        dtype = jnp.dtype(problem.dtype)
        gate_up_block = (hidden, width) if orientation.gate_up_transposed else (width, hidden)
        down_block = (tile_i, hidden) if orientation.down_transposed else (hidden, tile_i)
        scratch = [*(pltpu.VMEM(gate_up_block, dtype) for _ in range(parts)), pltpu.VMEM(down_block, dtype)]
    return WeightBlocks(in_specs, operands, scratch)
