"""Tiles of the fused experts kernel (`fused.kernel.fused_experts`): `FusedConfig` and how one is chosen.

`select` picks the blocks of a layer (I whole unless the expert's
weights do not fit VMEM double-buffered); whether the fused kernel serves a
call at all is the rule of `plan.fused_path_config`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp

from .._hardware import (
    LANES, TpuGeneration, grid_step_overhead_s, padded_vmem_bytes, round_up, sublane_multiple, vmem_budget_bytes,
)
from ..common.gates import DEINTERLEAVED_COLUMNS
from ..common.quant import (
    FP8, FP8_BLOCK, FP8_MXU_GENERATIONS, INT4, INT8, blocks, dequantized_in_vmem, per_channel_scales, scheme_of,
    stored_rows, weight_row_multiple,
)
from ..common.vmem import (
    Buffer, buffers_bytes, check_vmem_fits, fp8_dequantize_vmem_bytes, fp8_matmul_vmem_bytes,
    fp8_window_scales_vmem_bytes, int4_unpack_vmem_bytes,
)
from ..common.routing import expected_active_groups
from ..problem import ExpertsProblem


# Rows per MXU pass of the fused kernel: T rounded to the native tile, at
# most 128 (the v5e MXU's width); at most 64 where each expert expects few
# rows (T over the experts T picks would activate, at most
# FEW_ROWS_PER_EXPERT; Qwen3-30B-A3B at EP8 and 256 tokens: 16). A chunk runs
# whole, so there smaller chunks waste less MXU work and VMEM; where experts
# get more rows, fewer chunks load the weights and the hidden states into the
# MXU fewer times (GPT-OSS at EP8, 256 tokens: 64 rows each, 2 % slower in
# 64-row chunks). Chosen on moe_layer's decode shapes, not searched further.
FUSED_MAX_CHUNK_ROWS = 128
FEW_ROWS_CHUNK_ROWS = 64
FEW_ROWS_PER_EXPERT = 32
# Several experts per grid step only from this many tokens. A call's first
# step fetches every slot's weights, and a slot without an active expert
# then reads one expert's weights for nothing: with T >= 32 tokens of
# top-k >= 2 routing, fewer active experts on a rank than slots is unlikely
# even where most picks are other ranks' (Qwen3-30B-A3B at EP8: 16 of 128
# experts local; 256 picks leave a local expert idle with probability
# e^-2). Not tuned.
MULTI_EXPERT_MIN_TOKENS = 32
# The most experts one grid step takes; more would unroll more matmuls per
# step for a grid-step cost already divided by the VMEM that holds them.
MAX_EXPERTS_PER_STEP = 4
# On a megacore device the cores share every expert only where that models at least this much faster than
# splitting the experts: both cores then gather and scatter every expert's rows, work the estimate leaves out,
# and a tie (as busy either way) keeps the experts apart. Not tuned.
SHARED_EXPERTS_MIN_GAIN = 0.01
# The fused kernel's biases come in blocks of this many experts (a 16-row
# block is aligned for 32- and 16-bit types); the kernel picks its expert's
# row out of the block.
BIAS_BLOCK_EXPERTS = 16
# Per-channel scales (int8, int4; float32, native tile 8 rows) come in blocks of this many experts: at one
# token each active expert's step reads its block's other experts' scales too.
SCALE_BLOCK_EXPERTS = 8


# The interleaved gate/up body (`fused.expert._interleaved_rows`, unless fp8 feeds the fp8 MXU) works its I tile
# in slabs of at most this many I columns, one trip of a rolled loop each: Mosaic compiles the loop body once,
# where a whole I tile unrolls every vector op of its block. Compile time follows that block, not the grid
# (#46: GPT-OSS's int8 layer at the whole I of 2880 compiled in 7.7 s a generation, 0.56 s at tiles of 320),
# while the one DMA block per tile, and the grid's steps, stay as they are. Smaller slabs compile faster still
# but model slower: slabs of 320 cost GPT-OSS's quantized decode 1 to 2 % on v5e and v6e (more MXU passes, each
# slab's K off the MXU's width), slabs of 960 nothing (moe_layer's model, EP8 dispatch at 64 tokens).
MAX_SLAB_I = 960


class FusedConfig(NamedTuple):
    """Blocks of one fused experts call.

    - `chunk_rows`: rows per MXU pass. An expert has at most T rows (one per
      token that picked it), held in ceil(T / chunk_rows) chunks; chunks past
      the expert's picks are skipped.
    - `tile_i`: intermediate columns per grid step; the whole I unless the
      expert's weights do not fit VMEM double-buffered, then I / n for the
      smallest n whose blocks are aligned and fit (fp8 on the fp8 MXU with
      interleaved gate/up: a multiple of 128, the last tile partial where it
      does not divide I, `partial_i_tiles`).
    - `experts_per_step`: active experts each grid step runs, one after the
      other, their weights fetched together (the whole I only): a grid step
      has a fixed cost (`hardware.grid_step_overhead_s`), so fewer, larger
      steps stream the same bytes sooner.
    - `cores_per_expert`: on a megacore device (v5p), 2 has both cores take
      every expert, each its share of the I tiles (the second core one fewer
      when they are odd), and sum the down projection's partials; 1 has each
      core take whole experts. Few active experts split unevenly over the
      cores (one expert: one core idle), every expert's I tiles evenly.
    """

    chunk_rows: int
    tile_i: int
    experts_per_step: int = 1
    cores_per_expert: int = 1


def i_tiles(config: FusedConfig, intermediate: int) -> int:
    """I tiles per expert; the last one partial where `tile_i` does not divide I (`partial_i_tiles`)."""
    return -(-intermediate // config.tile_i)


def i_tiles_per_core(config: FusedConfig, intermediate: int) -> int:
    """I tiles one core walks per expert: all of them, or its share when the cores share each expert (the first
    core's, the larger)."""
    return -(-i_tiles(config, intermediate) // config.cores_per_expert)


def slab_i(tile_i: int, problem: ExpertsProblem) -> int:
    """I columns per slab of an I tile in the interleaved body (MAX_SLAB_I): the largest divisor of `tile_i` at
    most MAX_SLAB_I whose slices are aligned as the body cuts them (2 x slab gate/up columns and the biases' and
    scales' lanes on whole 128-lane tiles; the down block's slab rows on whole sublane tiles of the weights' dtype,
    or its lanes), else the whole tile."""
    sublanes = weight_row_multiple(problem.weights_dtype)
    down_multiple = sublanes if problem.orientation.down_transposed else LANES
    aligned = [slab for slab in range(LANES // 2, min(tile_i, MAX_SLAB_I) + 1, LANES // 2)
               if tile_i % slab == 0 and slab % down_multiple == 0]
    return max(aligned, default=tile_i)


def partial_i_tiles(problem: ExpertsProblem, target: TpuGeneration) -> bool:
    """Whether I may be cut into FP8_BLOCK-aligned tiles with a partial last one: for fp8 weights on the fp8 MXU in
    the interleaved gate/up layout, whose kernel masks the last tile's columns past I
    (`fused.kernel._interleaved_fp8_rows`). GPT-OSS's I = 2880 has no divisor that is a multiple of 128, and its
    whole I does not fit VMEM with double-buffered fp8 blocks. In the concatenated layout the up block's offset
    is counted in whole tiles, so the tiles must divide I there."""
    return (problem.gate.interleaved and scheme_of(problem.weights_dtype) == FP8
            and target.name in FP8_MXU_GENERATIONS)


def fused_chunks(config: FusedConfig, tokens: int) -> int:
    """Chunks of `chunk_rows` rows that hold an expert's rows: one per `chunk_rows` tokens."""
    return -(-tokens // config.chunk_rows)


def _tile_i_aligned(tile_i: int, problem: ExpertsProblem, partial: bool = False) -> bool:
    """Whether I tiles of `tile_i` make legal blocks of the weights (and biases, and int8 and int4 scales) as the
    kernel reads them (`ExpertsProblem.orientation`).

    The whole I always does (a block equal to its dimension). A part does if
    it divides I and each block's cut dimension is a multiple of its native
    tile: 128 lanes where it is the last dimension, the sublane multiple of
    the weights' dtype where it is the second to last (packed int4: a whole
    packed block). With `partial` (`partial_i_tiles`) a multiple of
    FP8_BLOCK less than I does too, dividing it or not.
    """
    intermediate, orientation = problem.intermediate, problem.orientation
    if tile_i == intermediate:
        return True
    if partial and tile_i < intermediate and tile_i % FP8_BLOCK == 0:
        return True
    if intermediate % tile_i:
        return False
    sublanes = weight_row_multiple(problem.weights_dtype)
    gate_up_cut = 2 * tile_i if problem.gate.interleaved else tile_i
    gate_up_multiple = LANES if orientation.gate_up_transposed else sublanes
    down_multiple = sublanes if orientation.down_transposed else LANES
    # Biases and int8 scales are [E, 2I] rows, cut along their lanes.
    columns_ok = (not (problem.has_bias or per_channel_scales(scheme_of(problem.weights_dtype)))
                  or gate_up_cut % LANES == 0)
    return gate_up_cut % gate_up_multiple == 0 and tile_i % down_multiple == 0 and columns_ok


def fused_feeds_fp8_mxu(config: FusedConfig, problem: ExpertsProblem, target: TpuGeneration) -> bool:
    """Whether the fused kernel feeds fp8 weights to the fp8 MXU (`common.quant.fp8_matmul`) rather than dequantizing
    them: on a generation that has one, with I whole or in tiles of whole scale blocks (the down projection's K
    offsets). Either gate/up layout: the interleaved one is de-interleaved on the MXU there, in row orientation
    (`fused.kernel._interleaved_fp8_rows`)."""
    return (scheme_of(problem.weights_dtype) == FP8 and target.name in FP8_MXU_GENERATIONS
            and (config.tile_i == problem.intermediate or config.tile_i % FP8_BLOCK == 0))


def fused_buffers(config: FusedConfig, problem: ExpertsProblem, *, cores: int = 1, fp8_matmul: bool = False
                  ) -> tuple[Buffer, ...]:
    """The fused kernel's blocks and scratch: the resident hidden states and routing, each gate_up part's and the
    down block (biases, scales) of each slot's expert and I tile, the resident output (each core's f32 partial when
    `cores` > 1), the f32 accumulator; scratch for interleaved gates, I tiles and int4 weights, and for fp8 weights
    unless `fp8_matmul` (`fused_feeds_fp8_mxu`) multiplies them as they are. Weights blocks in the order the kernel
    reads them (`ExpertsProblem.orientation`), packed int4's with half the rows."""
    tokens, hidden, intermediate = problem.tokens, problem.hidden, problem.intermediate
    dtype, weights_dtype, interleaved, f32 = problem.dtype, problem.weights_dtype, problem.gate.interleaved, "float32"
    chunk, tile_i, slots = config.chunk_rows, config.tile_i, config.experts_per_step
    parts = 2 if i_tiles(config, intermediate) > 1 and not interleaved else 1
    width = tile_i if parts == 2 else 2 * tile_i
    gate_up_transposed, down_transposed = problem.orientation
    gate_up_block = (hidden, width) if gate_up_transposed else (width, hidden)
    down_block = (tile_i, hidden) if down_transposed else (hidden, tile_i)

    def per_expert_rows(block_experts):
        rows = min(problem.num_experts, block_experts)
        return [*[Buffer((rows, width), f32, 2)] * parts, Buffer((rows, hidden), f32, 2)]

    scheme = scheme_of(weights_dtype)

    def stored(block):
        return (stored_rows(block[0], scheme), block[1])

    slot = [*[Buffer(stored(gate_up_block), weights_dtype, 2)] * parts, Buffer(stored(down_block), weights_dtype, 2)]
    if problem.has_bias:
        slot += [b._replace(dtype=dtype) for b in per_expert_rows(BIAS_BLOCK_EXPERTS)]
    if per_channel_scales(scheme):
        slot += per_expert_rows(SCALE_BLOCK_EXPERTS)
    elif scheme == FP8:  # each stored weight's whole grid of block scales
        gate_up_stored = (hidden, 2 * intermediate) if gate_up_transposed else (2 * intermediate, hidden)
        down_stored = (intermediate, hidden) if down_transposed else (hidden, intermediate)
        slot += [Buffer(tuple(blocks(d) for d in stored), f32, 2) for stored in (gate_up_stored, down_stored)]
    top_k = problem.top_k
    buffers = [Buffer((tokens, hidden), dtype), Buffer((tokens, top_k), "int32"),
               Buffer((tokens, top_k), problem.routing_dtype), *slot * slots]
    # The output block never moves (on each core): Mosaic keeps one copy of it.
    buffers += [Buffer((tokens, hidden), dtype if cores == 1 else f32), Buffer((tokens, hidden), f32)]
    if interleaved and not fp8_matmul:
        buffers.append(Buffer((2 * tile_i, chunk), f32))  # gate_up, transposed, to split even and odd rows
    if i_tiles_per_core(config, intermediate) > 1:
        rows = fused_chunks(config, tokens) * chunk
        buffers += [Buffer((rows, hidden), dtype), Buffer((rows, hidden), f32)]  # gathered rows, partial out
    if dequantized_in_vmem(scheme) and not fp8_matmul:
        buffers += [*[Buffer(gate_up_block, dtype)] * parts, Buffer(down_block, dtype)]  # dequantized blocks
    return tuple(buffers)


def fused_vmem_bytes(config: FusedConfig, problem: ExpertsProblem, *, cores: int = 1, fp8_matmul: bool = False
                     ) -> int:
    """VMEM of a fused experts call: its buffers (`fused_buffers`) and the f32 values Mosaic keeps beside them:
    the expert's weight and rank per token as columns, the triangle that counts the ranks, one chunk's gate_up
    and down results (the columns once per expert of the step); an int8 block cast to the activation dtype, what
    dequantizing fp8 or unpacking int4 blocks takes, or, for fp8 on the MXU (`fp8_matmul`), each slot's weight
    scales spread over the step's windows and one K block's product (interleaved: and the de-interleaving)."""
    f32 = jnp.float32
    tokens, hidden, dtype, weights_dtype = problem.tokens, problem.hidden, problem.dtype, problem.weights_dtype
    buffers = fused_buffers(config, problem, cores=cores, fp8_matmul=fp8_matmul)
    chunk, tile_i, slots = config.chunk_rows, config.tile_i, config.experts_per_step
    values = (2 * slots * padded_vmem_bytes((tokens, 1), f32) + padded_vmem_bytes((tokens, tokens), f32)
              + padded_vmem_bytes((chunk, 2 * tile_i), f32) + padded_vmem_bytes((chunk, hidden), f32))
    if scheme_of(weights_dtype) == INT8:
        values += max(padded_vmem_bytes((hidden, 2 * tile_i), dtype), padded_vmem_bytes((2 * tile_i, hidden), dtype))
    elif scheme_of(weights_dtype) == INT4:
        values += int4_unpack_vmem_bytes(max(hidden, 2 * tile_i))
    elif fp8_matmul:
        window_scales = fp8_window_scales_vmem_bytes(hidden, 2 * tile_i) + fp8_window_scales_vmem_bytes(tile_i, hidden)
        values += slots * window_scales + fp8_matmul_vmem_bytes(chunk, max(hidden, 2 * tile_i))
        if problem.gate.interleaved:  # the de-interleaving 0/1 matrix and its product (`common.gates.deinterleaved_gated`)
            values += (padded_vmem_bytes((DEINTERLEAVED_COLUMNS, DEINTERLEAVED_COLUMNS), f32)
                       + padded_vmem_bytes((chunk, DEINTERLEAVED_COLUMNS), f32))
    elif scheme_of(weights_dtype) is not None:
        values += fp8_dequantize_vmem_bytes(max(hidden, 2 * tile_i))
    return buffers_bytes(buffers) + values


def fused_cores(target: TpuGeneration, picks: int | None = None, cores_per_expert: int = 1) -> int:
    """TensorCores the fused kernel runs on on `target`: both of a megacore device's (v5p), each summing its
    experts (or its I tiles of every expert, `cores_per_expert`) into an f32 partial output of its own; one for a
    single pick split by experts (decode of one token under EP dispatch), where the second core would have no
    expert and still fetch a step's weights."""
    cores = target.cores_per_device
    if picks is None or cores_per_expert > 1:
        return cores
    return max(1, min(cores, picks))


def busier_core_seconds(config: FusedConfig, problem: ExpertsProblem, target: TpuGeneration) -> float:
    """Modelled seconds of a call's busier TensorCore under `config`'s split: its share of the active experts'
    weights streamed at one core's HBM rate, and its grid steps at their fixed cost (`grid_step_overhead_s`).

    Active experts as `expected_active_groups` of the call's picks (T x
    top-k; under EP router masking other ranks' picks count as local ones,
    which overestimates the active experts and favours keeping them apart),
    a real number: split by experts, the busier core takes
    ceil(active / cores) of them (one expert: a whole one, the other core
    idle); shared, every core takes its I tiles of each. Decode is bound by
    the weights: MXU work, which splits as they do, and the pipeline's
    first fetch are left out.
    """
    intermediate = problem.intermediate
    active = expected_active_groups(problem.picks, problem.num_experts)
    tiles = i_tiles(config, intermediate)
    fetch = _expert_fetch_seconds(problem, target)
    if config.cores_per_expert > 1:
        share = i_tiles_per_core(config, intermediate)
        experts, steps = active * share / tiles, math.ceil(active) * share
    else:
        experts = math.ceil(active / target.cores_per_device)
        steps = math.ceil(experts / config.experts_per_step) * tiles
    return experts * fetch + steps * grid_step_overhead_s(target.name)


def experts_per_step_saving(config: FusedConfig, problem: ExpertsProblem, target: TpuGeneration) -> float:
    """Seconds a call saves with `config.experts_per_step` experts per grid step rather than one (negative: loses).

    Each step saved saves its fixed cost (`grid_step_overhead_s`); what the
    larger steps lose is the pipeline's edges: the first step's weights
    arrive before any compute and the last step's compute follows the last
    fetch, so one of the two grows by the extra experts' fetch or compute,
    whichever is shorter. Active experts as `expected_active_groups` of T
    picks (top-1: the fewest a call can have), split over the device's cores;
    an expert's rows its share of T, in whole chunks, each chunk's MXU work
    the expert's matmuls and the one-hot gather and scatter over the T
    tokens; per-core HBM and bf16 MXU peaks.
    """
    tokens, hidden, intermediate = problem.tokens, problem.hidden, problem.intermediate
    active = expected_active_groups(tokens, problem.num_experts)
    per_core = active / target.cores_per_device
    steps_saved = math.ceil(per_core) - math.ceil(per_core / config.experts_per_step)
    fetch = _expert_fetch_seconds(problem, target)
    mxu_rows = config.chunk_rows * math.ceil(tokens / active / config.chunk_rows)
    compute = 2 * mxu_rows * (3 * hidden * intermediate + 2 * tokens * hidden) / target.bf16_flops_per_s
    return steps_saved * grid_step_overhead_s(target.name) - (config.experts_per_step - 1) * min(fetch, compute)


def _expert_fetch_seconds(problem: ExpertsProblem, chip) -> float:
    """One expert's weights (both projections) at one core's HBM rate."""
    weight_bytes = 0.5 if scheme_of(problem.weights_dtype) == INT4 else jnp.dtype(problem.weights_dtype).itemsize
    return 3 * problem.hidden * problem.intermediate * weight_bytes / chip.hbm_bytes_per_s


def _tile_i_candidates(intermediate: int, partial: bool) -> list[int]:
    """I tiles by their count n, fewest first: with `partial`, the FP8_BLOCK multiple that covers I in n tiles (the
    last one partial), then I / n where n divides I."""
    found = []
    for parts in range(1, intermediate + 1):
        if partial and parts > 1:
            tile_i = round_up(-(-intermediate // parts), FP8_BLOCK)
            if -(-intermediate // tile_i) == parts and tile_i not in found:
                found.append(tile_i)
        if intermediate % parts == 0 and intermediate // parts not in found:
            found.append(intermediate // parts)
    return found


def select(problem: ExpertsProblem, target: TpuGeneration) -> FusedConfig | None:
    """The fused kernel's blocks for this layer, or None if no I tiling fits VMEM.

    Rows: T (the most one expert can get) rounded to the native sublane tile,
    in chunks of at most FUSED_MAX_CHUNK_ROWS, or FEW_ROWS_CHUNK_ROWS where
    each expert expects few rows. I: whole, or I / n for the smallest n that
    is aligned (`_tile_i_aligned`) and fits the VMEM budget of `target`;
    where `partial_i_tiles`, for each n first the
    FP8_BLOCK multiple that covers I in n tiles (the fp8 MXU's). Experts per
    step: with the whole I and at least MULTI_EXPERT_MIN_TOKENS tokens, of
    those that fit (up to MAX_EXPERTS_PER_STEP and the experts), the one
    `experts_per_step_saving` rates best. On a megacore device, that config
    or one whose cores share every expert (`cores_per_expert`, any aligned I
    tiling that fits, at least one tile per core) if `busier_core_seconds`
    rates it at least SHARED_EXPERTS_MIN_GAIN faster for the problem's picks.
    Not tuned per generation otherwise: decode streams each active expert's
    weights once whatever the tiles, so they only need to fit.
    """
    tokens, intermediate = problem.tokens, problem.intermediate
    few_rows = tokens / expected_active_groups(tokens, problem.num_experts) <= FEW_ROWS_PER_EXPERT
    chunk = min(round_up(tokens, sublane_multiple(problem.dtype)),
                FEW_ROWS_CHUNK_ROWS if few_rows else FUSED_MAX_CHUNK_ROWS)
    budget, cores = vmem_budget_bytes(target.name), fused_cores(target)

    def fits(config: FusedConfig) -> bool:
        fp8_matmul = fused_feeds_fp8_mxu(config, problem, target)
        return fused_vmem_bytes(config, problem, cores=cores, fp8_matmul=fp8_matmul) <= budget

    partial = partial_i_tiles(problem, target)
    aligned = [FusedConfig(chunk, tile_i) for tile_i in _tile_i_candidates(intermediate, partial)
               if _tile_i_aligned(tile_i, problem, partial)]
    by_experts = next((config for config in aligned if fits(config)), None)
    if by_experts is None:
        return None
    if by_experts.tile_i == intermediate and tokens >= MULTI_EXPERT_MIN_TOKENS:
        most = min(MAX_EXPERTS_PER_STEP, problem.num_experts)
        candidates = [c for c in (by_experts._replace(experts_per_step=n) for n in range(1, most + 1)) if fits(c)]
        by_experts = max(candidates, key=lambda c: experts_per_step_saving(c, problem, target))
    if cores == 1:
        return by_experts
    shared = [c for c in (config._replace(cores_per_expert=cores) for config in aligned)
              if i_tiles(c, intermediate) >= cores and fits(c)]
    fastest = min(shared, key=lambda c: busier_core_seconds(c, problem, target), default=None)
    if fastest is not None and (busier_core_seconds(fastest, problem, target)
                                < (1 - SHARED_EXPERTS_MIN_GAIN) * busier_core_seconds(by_experts, problem, target)):
        return fastest
    return by_experts


def check_fused_config(config: FusedConfig, problem: ExpertsProblem, target: TpuGeneration) -> None:
    """Raises ValueError if `config` cannot run this fused experts layer."""
    if not isinstance(config, FusedConfig):
        raise TypeError(f"config must be a FusedConfig, got {type(config).__name__}")
    for name, value in config._asdict().items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"config.{name} must be a positive int, got {value!r}")
    intermediate = problem.intermediate
    if config.experts_per_step > 1 and config.tile_i != intermediate:
        raise ValueError(f"config.experts_per_step={config.experts_per_step} needs the whole I per step "
                         f"(tile_i={intermediate}), got tile_i={config.tile_i}")
    if config.cores_per_expert not in (1, fused_cores(target)):
        raise ValueError(f"config.cores_per_expert={config.cores_per_expert}: {target.name} has "
                         f"{fused_cores(target)} TensorCore(s) per device; take 1 or all of them")
    if i_tiles(config, intermediate) < config.cores_per_expert:
        raise ValueError(f"config.cores_per_expert={config.cores_per_expert} needs at least as many I tiles, got "
                         f"tile_i={config.tile_i} of I={intermediate}")
    sublanes = sublane_multiple(problem.dtype)
    if config.chunk_rows % sublanes:
        raise ValueError(f"config.chunk_rows={config.chunk_rows} must be a multiple of {sublanes}")
    partial = partial_i_tiles(problem, target)
    if not _tile_i_aligned(config.tile_i, problem, partial):
        raise ValueError(
            f"config.tile_i={config.tile_i} must be I={intermediate}"
            + (f", a multiple of {FP8_BLOCK} below it," if partial else "")
            + " or divide it into blocks aligned to the native tile of the weights as the kernel reads them "
            "(ExpertsProblem.orientation)"
        )
    fp8_matmul = fused_feeds_fp8_mxu(config, problem, target)
    check_vmem_fits(config, fused_vmem_bytes(config, problem, cores=fused_cores(target), fp8_matmul=fp8_matmul),
                    target)
