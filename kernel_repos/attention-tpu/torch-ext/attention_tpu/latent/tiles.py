"""Tiles of the latent attention kernel (`latent.kernel`) per shape and TPU generation.

`select(problem, target)` gives the heuristic's tiles (`heuristic_config`); nothing is tuned per shape yet, so there
is no tuned table beside this module. A step of the kernel runs `heads_per_step` query heads against one block of
`block_kv` keys of the shared latent cache, in one of two forms (`packs_queries`):

* Packed (decode, and the few queries of a speculative step): a step's rows are its heads x all the call's queries,
  so each KV block costs one (rows, L + R) x (L + R, block_kv) logit product and one (rows, block_kv) x
  (block_kv, L) value product. Every head fits a step (H = 128 at 16 queries is 2048 rows, 4 MiB of float32
  accumulators), so a decode step reads the cache once. A step is then pure streaming: its DMA (block_kv
  keys of (L + R) x itemsize bytes, 1152 B in bf16 at DeepSeek's 512 + 64) should outweigh the fixed cost of a grid
  step (`_hardware.grid_step_overhead_s`, ~0.35 us; 0.72 us on TPU7x), while a block past a sequence's length is
  skipped whole but the block its length ends in is read whole: on average half a block of waste per sequence.
  `decode_block_kv` takes the power of two that minimises the sum, in keys: steps x (keys one step's fixed cost
  would stream: 249 on v5e, 374 on v5p, 498 on v6e, 2313 on TPU7x) + block / 2. At 16 heads over 4096 cached
  tokens that is 1024 keys on v5e (where 2048 prices the same), 2048 on v5p and v6e (2.4 MB, 1.4 us on v6e) and 4096
  on TPU7x; over 32768, 4096 everywhere (TPU7x's best, 16384, and 8192 pass its VMEM budget). A step of many rows
  (128 heads, or a speculative step's heads x queries) is compute-bound, where short blocks cost little.
* Blocked (prefill): a step's rows are one query block of each of its heads, as in the flash kernel's prefill, with
  the query block and KV block of flash's head_dim 512 tiles (`flash.tiles.PREFERRED_TILES_BY_HEAD_DIM`: the latent
  keys are 576 wide), not modelled for this kernel. The heads of a step are the most (a divisor of H) whose
  accumulators fit the budget: at H = 128, 256 queries and L = 512 all of them would take 64 MiB of float32
  accumulators alone. The prefill is compute-bound (2 x rows x (2L + R) flops per key of 1152 bytes), so fewer
  heads per step (the cache re-read per head block) cost little.

Working sets are sized by the attention kernels' VMEM policy (`common.vmem`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._hardware import LANES, TpuGeneration, grid_step_overhead_s, padded_vmem_bytes, round_up, sublane_multiple
from ..common.latent import LatentProblem
from ..common.layout import sequence_minor_by_default
from ..common.tiles import Q_BLOCK_MULTIPLE, shrink_block
from ..common.vmem import vmem_budget, vmem_limit

# The most queries a call may have for its steps to pack them with the heads into the rows (`packs_queries`): decode
# and speculative decode. Past them a step's rows are a block of queries (of 128 or more, or all of them).
PACKED_QUERIES_MAX = 16
# (block_q, block_kv) of a prefill step, by generation (the module docstring says where they come from).
PREFILL_TILES = {"v5e": (256, 512), "v5p": (256, 512), "v6e": (256, 1024), "tpu7x": (256, 1024)}


@dataclasses.dataclass(frozen=True)
class LatentConfig:
    """Tile sizes of one latent attention call.

    block_q: queries per step; all of the call's when they are packed (`packs_queries`).
    block_kv: keys per step.
    heads_per_step: query heads per step (a divisor of H).
    vmem_limit_bytes: scoped VMEM limit requested from Mosaic.
    """

    block_q: int
    block_kv: int
    heads_per_step: int
    vmem_limit_bytes: int


def packs_queries(problem: LatentProblem) -> bool:
    """Whether a step's rows are its heads x all the call's queries (else one query block of each head)."""
    return problem.attention.q_len <= PACKED_QUERIES_MAX


def rope_keys_minor(problem: LatentProblem, block_kv: int) -> bool:
    """Whether the kernel reads the rope keys [B, 1, S, R] as their swapped view [B, 1, R, S]: where XLA stores them
    so by default (`layout.sequence_minor_by_default`: R = 64 over more than 64 keys) and the KV blocks are whole lane
    tiles. The latent (L a multiple of 128 in every MLA model) is stored, and read, row-major."""
    kv_len, rope_dim = problem.attention.kv_len, problem.rope_dim
    return rope_dim > 0 and sequence_minor_by_default(kv_len, rope_dim) and block_kv % LANES == 0


def q_rope_queries_minor(problem: LatentProblem, block_q: int) -> bool:
    """Likewise whether a prefill reads q_rope [B, H, Sq, R] as [B, H, R, Sq] (transposing each query block once)."""
    q_len, rope_dim = problem.attention.q_len, problem.rope_dim
    return (not packs_queries(problem) and rope_dim > 0 and sequence_minor_by_default(q_len, rope_dim)
            and block_q % LANES == 0)


def vmem_bytes(problem: LatentProblem, block_q: int, block_kv: int, heads_per_step: int) -> int:
    """Estimated VMEM working set of a step at these tiles: double-buffered q, output, K/V, mask and sinks blocks,
    the softmax scratch, one slice's logit temporaries and the zeroed values of the block a sequence's length ends
    in."""
    attention, latent_dim, rope_dim = problem.attention, problem.latent_dim, problem.rope_dim
    dtype, f32 = attention.dtype, jnp.float32
    slices, rows = (1, heads_per_step * attention.q_len) if packs_queries(problem) else (heads_per_step, block_q)
    queries_minor = q_rope_queries_minor(problem, block_q)
    q_rope = 0
    if rope_dim:
        q_rope = padded_vmem_bytes((slices, rope_dim, rows) if queries_minor else (slices, rows, rope_dim), dtype)
    q_and_out = 2 * (2 * padded_vmem_bytes((slices, rows, latent_dim), dtype) + q_rope)
    q_rope_rows = padded_vmem_bytes((slices, rows, rope_dim), dtype) if queries_minor else 0
    scratch = padded_vmem_bytes((slices, rows, latent_dim), f32) + 2 * padded_vmem_bytes((slices, rows, 1), f32)
    rope = 0
    if rope_dim:
        shape = (rope_dim, block_kv) if rope_keys_minor(problem, block_kv) else (block_kv, rope_dim)
        rope = padded_vmem_bytes(shape, dtype)
    latent = padded_vmem_bytes((block_kv, latent_dim), dtype)
    kv = 2 * (latent + rope) + latent
    mask = 0
    if attention.mask_dtype is not None:
        mask_rows = attention.q_len if packs_queries(problem) else block_q
        mask = 2 * padded_vmem_bytes((mask_rows, block_kv), attention.mask_dtype)
    # A packed step's sinks are one per row, a blocked step's one per slice (`kernel._sinks_operands`).
    sinks = 0
    if attention.has_sinks:
        sinks = 2 * padded_vmem_bytes((slices, rows if packs_queries(problem) else 1, 1), f32)
    temporaries = (4 + (mask > 0)) * padded_vmem_bytes((rows, block_kv), f32)
    return q_and_out + q_rope_rows + scratch + kv + mask + sinks + temporaries


def _divisors_descending(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def packed_heads_aligned(problem: LatentProblem, heads_per_step: int) -> bool:
    """Whether a packed step of this many heads takes whole native tiles of q's rows (or all of them)."""
    attention = problem.attention
    return (heads_per_step == attention.q_heads
            or heads_per_step * attention.q_len % sublane_multiple(attention.dtype) == 0)


def decode_block_kv(problem: LatentProblem, target: TpuGeneration, fits) -> int:
    """The KV block of a packed step (module docstring): among powers of two from 128 keys (or the whole cache
    where shorter) that `fits`, the one of least steps x (keys a step's fixed cost would stream) + block / 2."""
    attention = problem.attention
    kv_len = attention.kv_len
    key_bytes = problem.key_dim * jnp.dtype(attention.dtype).itemsize
    step_keys = grid_step_overhead_s(target.name) * target.hbm_bytes_per_s / key_bytes
    # Rope keys read keys-minor come in whole lane tiles, the last block past the keys' end.
    extent = round_up(kv_len, LANES) if rope_keys_minor(problem, LANES) else kv_len
    blocks, block = [], LANES
    while not blocks or blocks[-1] < extent:
        blocks.append(min(block, extent))
        block *= 2
    fitting = [block for block in blocks if fits(block)] or blocks[:1]
    return min(fitting, key=lambda block: pl.cdiv(kv_len, block) * step_keys + block / 2)


def _packed_config(problem: LatentProblem, target: TpuGeneration) -> LatentConfig:
    """Every head in a step where they fit at the smallest KV block; the KV block `decode_block_kv`'s."""
    q_len, budget = problem.attention.q_len, vmem_budget(target)
    aligned = [heads for heads in _divisors_descending(problem.heads) if packed_heads_aligned(problem, heads)]
    smallest_block = min(problem.attention.kv_len, LANES)
    heads_per_step = next((heads for heads in aligned if vmem_bytes(problem, q_len, smallest_block, heads) <= budget),
                          aligned[-1])
    block_kv = decode_block_kv(problem, target,
                               lambda block: vmem_bytes(problem, q_len, block, heads_per_step) <= budget)
    return LatentConfig(q_len, block_kv, heads_per_step,
                        vmem_limit(vmem_bytes(problem, q_len, block_kv, heads_per_step), target))


def _blocked_config(problem: LatentProblem, target: TpuGeneration) -> LatentConfig:
    """PREFILL_TILES (within the lengths; whole lane tiles along an axis whose rope XLA stores sequence-minor),
    shrunk until one head fits the budget; then as many heads per step as fit."""
    attention, budget = problem.attention, vmem_budget(target)
    preferred_q, preferred_kv = PREFILL_TILES[target.name]
    block_q, block_kv = min(attention.q_len, preferred_q), min(attention.kv_len, preferred_kv)
    if problem.rope_dim and sequence_minor_by_default(attention.q_len, problem.rope_dim):
        block_q = round_up(block_q, LANES)
    if problem.rope_dim and sequence_minor_by_default(attention.kv_len, problem.rope_dim):
        block_kv = round_up(block_kv, LANES)
    while vmem_bytes(problem, block_q, block_kv, 1) > budget:
        if block_kv > LANES:
            block_kv = shrink_block(block_kv, multiple=LANES)
        elif block_q > Q_BLOCK_MULTIPLE:
            block_q = shrink_block(block_q, multiple=Q_BLOCK_MULTIPLE)
        else:
            break
    heads_per_step = next((heads for heads in _divisors_descending(problem.heads)
                           if vmem_bytes(problem, block_q, block_kv, heads) <= budget), 1)
    return LatentConfig(block_q, block_kv, heads_per_step,
                        vmem_limit(vmem_bytes(problem, block_q, block_kv, heads_per_step), target))


def heuristic_config(problem: LatentProblem, target: TpuGeneration) -> LatentConfig:
    """The tiles of `problem` on `target` (the module docstring says how they are chosen)."""
    return _packed_config(problem, target) if packs_queries(problem) else _blocked_config(problem, target)


def check_config(config: LatentConfig, problem: LatentProblem) -> None:
    """Raises ValueError if `config`'s blocks are not legal for `problem`'s lengths and heads."""
    q_len, kv_len, heads = problem.attention.q_len, problem.attention.kv_len, problem.heads

    def aligned(block, extent, multiple):
        return block == extent or (block > 0 and block % multiple == 0)

    if packs_queries(problem) and config.block_q != q_len:
        raise ValueError(f"config.block_q must be the query length {q_len} (at most {PACKED_QUERIES_MAX} queries "
                         f"are packed into one step), got {config.block_q}")
    if not packs_queries(problem) and not aligned(config.block_q, q_len, Q_BLOCK_MULTIPLE):
        raise ValueError(f"config.block_q must be a multiple of {Q_BLOCK_MULTIPLE} or the query length {q_len}, "
                         f"got {config.block_q}")
    if not aligned(config.block_kv, kv_len, LANES):
        raise ValueError(
            f"config.block_kv must be a multiple of {LANES} or the key length {kv_len}, got {config.block_kv}")
    if config.heads_per_step < 1 or heads % config.heads_per_step:
        raise ValueError(f"config.heads_per_step must divide the number of heads ({heads}), "
                         f"got {config.heads_per_step}")
    if packs_queries(problem) and not packed_heads_aligned(problem, config.heads_per_step):
        multiple = sublane_multiple(problem.attention.dtype)
        raise ValueError(f"config.heads_per_step x the query length ({q_len}) must be a multiple of {multiple} "
                         f"(or heads_per_step all {heads} heads), got {config.heads_per_step}")


def select(problem: LatentProblem, target: TpuGeneration) -> LatentConfig:
    """Tile sizes for `problem` on `target`: the heuristic's (nothing is tuned per shape yet)."""
    return heuristic_config(problem, target)
