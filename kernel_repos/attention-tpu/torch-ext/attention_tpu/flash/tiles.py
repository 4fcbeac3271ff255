"""Tiles of the forward kernel (`flash.kernel`) per shape and TPU generation.

`select(problem, target)` takes the tiles of TUNED_TILES (tuned_tiles.json, beside this
module) when it holds the shape, else the heuristic (`heuristic_config`):
preferred tiles per generation, shrunk until the working set fits the VMEM
budget (`common.vmem.vmem_budget`); decode steps span as many KV heads as fit
DECODE_STEP_BYTES. Every function here takes the call's `Problem` and the
generation's facts (`target`, a `_hardware.TpuGeneration` its caller resolved
once) rather than their fields. The kernel then asks Mosaic for a scoped VMEM limit from
its working set (`common.vmem.vmem_limit`). Budget and limit are the VMEM
policy every tpu-kernels build shares (`_hardware.py`), as are the TPU facts
(tiling, VMEM limits); the tuned table has the form every kernel's has
(`_tuning.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import jax.numpy as jnp

from .._hardware import LANES, MIB, SUBLANES, TpuGeneration, round_up
from .._tuning import read_tuned_tiles
from ..common.layout import sequence_minor_by_default, sequence_minor_reads
from ..common.masking import Problem
from ..common.tiles import MASK_ROWS, Q_BLOCK_MULTIPLE, AttentionConfig, preferred_by_width, shrink_block
from ..common.vmem import vmem_budget, vmem_limit

# Preferred tiles (query positions per prefill block, keys per prefill block,
# keys per decode block), chosen with the grid-replay model of
# benchmarks.perf on Qwen3-30B-A3B shapes (`python -m benchmarks attention`): at
# S=4096-8192, (512, 512) on v5e and (512, 1024) on v6e come within ~3% of the
# best modelled time, 10-20% faster than (256, 512). Decode streams K/V, so its
# blocks are long and span several KV heads, to amortise the per-step overhead
# (~0.35 us) against the DMA time: a decode step moves up to
# DECODE_STEP_BYTES of K and V (4 MiB take 5 us on v5e, 8 MiB 5 us on v6e).
# v5p takes v5e's tiles and TPU7x v6e's, by MXU width (128 and 256; not
# searched on them): 4 MiB take 3.4 us on v5p, 8 MiB 2.3 us on TPU7x.
PREFERRED_TILES = {"v5e": (512, 512, 2048), "v5p": (512, 512, 2048), "v6e": (512, 1024, 4096),
                   "tpu7x": (512, 1024, 4096)}
DECODE_STEP_BYTES = {"v5e": 4 * MIB, "v5p": 4 * MIB, "v6e": 8 * MIB, "tpu7x": 8 * MIB}
# Head dims whose prefill steps the tiles above do not suit. At head_dim 512
# (Gemma 4's global layers, 8 query heads per KV head) a step's query side
# (the group's q and out blocks and float32 accumulators) is 4x that of
# head_dim 128, so query blocks are 256. By the same model at
# Gemma-4-26B-A4B's global layer (16 query heads, 2 KV heads, S=8192,
# causal) these are the best prefill tiles on every generation: (256, 512)
# on v5e and v5p, what the budget shrinks the tiles above to anyway;
# (256, 1024) on v6e and TPU7x, where that shrunk (256, 512) is 5 % and 20 %
# slower. Decode keeps its tiles (the best, or within 3 % of it). Wider
# heads (latent attention's absorbed 576 / 512) take them too, by the same
# reasoning (not modelled there): the budget shrinks what does not fit.
PREFERRED_TILES_BY_HEAD_DIM = {
    512: {"v5e": (256, 512, 2048), "v5p": (256, 512, 2048), "v6e": (256, 1024, 4096), "tpu7x": (256, 1024, 4096)},
}


# A prefill query block under a sliding window sees its own rows and the window before them: blocks much wider than
# the window compute mostly masked pairs (GPT-OSS-20B's window of 128 at (512, 1024) tiles: 45x the visible work).
# By the grid-replay model at GPT-OSS-20B's sliding layer (S=4096, window 128, head_dim 64), blocks of at most two
# windows (rounded to lanes) are within 6 % of the best tiles swept ((128..512) x (128..1024)) on every generation
# (`python -m benchmarks attention --sweep`, attention_forward_sweep.json) and faster than the preferred ones; at
# Gemma 4's window of 1024 the preferred tiles are narrower than that already.
WINDOW_BLOCK_SPAN = 2


class TunedKey(NamedTuple):
    """The shape a forward's tiles were tuned at."""

    generation: str
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    v_head_dim: int
    dtype: str
    mask_dtype: str | None


class ForwardTiles(NamedTuple):
    """A forward's tiles, as a tuned table holds them: an AttentionConfig's but the VMEM limit, which follows from
    them (`vmem_limit`)."""

    block_q: int
    block_kv: int
    kv_heads_per_step: int = 1


# Forward tiles tuned per shape, taken over the heuristic by `select`:
# data in tuned_tiles.json beside this module. None so far: the preferred tiles
# come from the model sweep above.
TUNED_TILES_FILE = Path(__file__).with_name("tuned_tiles.json")
TUNED_TILES: dict[TunedKey, ForwardTiles] = read_tuned_tiles(TUNED_TILES_FILE, TunedKey, ForwardTiles)


def is_decode(q_len: int) -> bool:
    return q_len == 1


def vmem_bytes(problem: Problem, tiles: ForwardTiles) -> int:
    """Estimated VMEM working set of the forward at `problem` with `tiles` (pipeline buffers, scratch,
    temporaries); a prefill whose q is read queries-minor (`plan.ForwardPlan`) transposes it into a scratch of its
    rows. q and k are head_dim wide, v, the output and the accumulator v_head_dim."""
    decode = is_decode(problem.q_len)
    group, head_dim, v_head_dim, block_kv = problem.group, problem.head_dim, problem.v_head_dim, tiles.block_kv
    itemsize = jnp.dtype(problem.dtype).itemsize
    mask_itemsize = 0 if problem.mask_dtype is None else jnp.dtype(problem.mask_dtype).itemsize
    # A step holds `slices` row blocks of `rows` query rows: the group's heads
    # (prefill), or one block of `group` rows per KV head (decode).
    slices, rows = (tiles.kv_heads_per_step, group) if decode else (group, tiles.block_q)
    padded_rows = round_up(rows, SUBLANES)
    q_and_out = 2 * slices * padded_rows * (head_dim + v_head_dim) * itemsize  # double-buffered q and out blocks
    scratch = slices * padded_rows * (v_head_dim + 2 * LANES) * 4  # acc, running max and sum (lane padded)
    kv = 2 * tiles.kv_heads_per_step * block_kv * (head_dim + v_head_dim) * itemsize  # double-buffered k and v
    temporaries = 4 * padded_rows * round_up(block_kv, LANES) * 4  # logits, probabilities, masks of one slice
    mask_rows = MASK_ROWS if decode else round_up(tiles.block_q, MASK_ROWS)
    mask = 2 * mask_rows * round_up(block_kv, LANES) * mask_itemsize
    # Double-buffered log-sum-exp block: [group, 1, block_q] (prefill) or [KV heads, group, 1] (decode).
    if decode:
        lse = 2 * tiles.kv_heads_per_step * round_up(group, SUBLANES) * LANES * 4
    else:
        lse = 2 * group * SUBLANES * round_up(tiles.block_q, LANES) * 4
    queries_minor = sequence_minor_reads(problem, tiles.block_q, block_kv).q
    q_rows = slices * padded_rows * head_dim * itemsize if queries_minor else 0
    return q_and_out + scratch + kv + temporaries + mask + lse + q_rows


def _preferred_blocks(problem: Problem, target: TpuGeneration) -> tuple[int, int]:
    """(block_q, block_kv) of the preferred tiles for `problem`, within its lengths and, under a sliding window,
    WINDOW_BLOCK_SPAN windows; whole lane tiles along an axis XLA stores sequence-minor (for any of its arrays)."""
    decode = is_decode(problem.q_len)
    preferred_q, preferred_kv_prefill, preferred_kv_decode = preferred_by_width(
        problem, PREFERRED_TILES_BY_HEAD_DIM, PREFERRED_TILES)[target.name]
    block_q = 1 if decode else min(problem.q_len, preferred_q)
    block_kv = min(problem.kv_len, preferred_kv_decode if decode else preferred_kv_prefill)
    if problem.sliding_window is not None and not decode:
        widest = WINDOW_BLOCK_SPAN * round_up(problem.sliding_window, LANES)
        block_q, block_kv = min(block_q, widest), min(block_kv, widest)
    # Keys (queries) along lanes: whole lane tiles, so that the kernel reads K and V (q, and writes the output) as
    # XLA stores them (`plan.make`).
    head_dims = (problem.head_dim, problem.v_head_dim)
    if any(sequence_minor_by_default(problem.kv_len, head_dim) for head_dim in head_dims):
        block_kv = round_up(block_kv, LANES)
    if not decode and any(sequence_minor_by_default(problem.q_len, head_dim) for head_dim in head_dims):
        block_q = round_up(block_q, LANES)
    return block_q, block_kv


def heuristic_config(problem: Problem, target: TpuGeneration) -> AttentionConfig:
    """Preferred tiles shrunk to the VMEM budget; decode steps take as many KV heads as fit DECODE_STEP_BYTES.
    Under a sliding window, prefill blocks span at most WINDOW_BLOCK_SPAN windows.

    Block sizes are either the full extent of their axis (always legal) or a
    multiple of LANES (query blocks: of Q_BLOCK_MULTIPLE); KV blocks of K and V
    that XLA stores keys-minor are a multiple of LANES, the last block past
    the keys' end where the keys are fewer, and so are the query blocks of a
    prefill whose q XLA stores queries-minor.
    """
    decode = is_decode(problem.q_len)
    block_q, block_kv = _preferred_blocks(problem, target)
    budget = vmem_budget(target)

    def working_set(bq, bkv, heads):
        return vmem_bytes(problem, ForwardTiles(bq, bkv, heads))

    while working_set(block_q, block_kv, 1) > budget:
        if block_kv > 4 * LANES or (block_kv > LANES and (decode or block_q <= Q_BLOCK_MULTIPLE)):
            block_kv = shrink_block(block_kv, multiple=LANES)
        elif not decode and block_q > Q_BLOCK_MULTIPLE:
            block_q = shrink_block(block_q, multiple=Q_BLOCK_MULTIPLE)
        else:
            break
    heads_per_step = 1
    if decode:
        step_bytes = block_kv * (problem.head_dim + problem.v_head_dim) * jnp.dtype(problem.dtype).itemsize
        for heads in range(problem.kv_heads, 0, -1):
            fits = heads * step_bytes <= DECODE_STEP_BYTES[target.name]
            if problem.kv_heads % heads == 0 and fits and working_set(block_q, block_kv, heads) <= budget:
                heads_per_step = heads
                break
    return AttentionConfig(
        block_q=block_q,
        block_kv=block_kv,
        vmem_limit_bytes=vmem_limit(working_set(block_q, block_kv, heads_per_step), target),
        kv_heads_per_step=heads_per_step,
    )


def check_config(config: AttentionConfig, problem: Problem) -> None:
    """Raises ValueError if `config`'s blocks are not legal for `problem`'s lengths and heads."""
    q_len, kv_len, kv_heads = problem.q_len, problem.kv_len, problem.kv_heads

    def aligned(block, extent, multiple):
        return block == extent or (block > 0 and block % multiple == 0)

    if not is_decode(q_len) and not aligned(config.block_q, q_len, Q_BLOCK_MULTIPLE):
        raise ValueError(
            f"config.block_q must be a multiple of {Q_BLOCK_MULTIPLE} or the query length {q_len}, got {config.block_q}"
        )
    if not aligned(config.block_kv, kv_len, LANES):
        raise ValueError(
            f"config.block_kv must be a multiple of {LANES} or the key length {kv_len}, got {config.block_kv}"
        )
    if config.kv_heads_per_step < 1 or kv_heads % config.kv_heads_per_step:
        raise ValueError(
            f"config.kv_heads_per_step must divide the number of KV heads ({kv_heads}), got {config.kv_heads_per_step}"
        )


def tuned_config(problem: Problem, target: TpuGeneration) -> AttentionConfig | None:
    """The config of the TUNED_TILES entry for `problem`'s shape, if there is one: its tiles, checked like an
    explicit config, and the VMEM limit they need."""
    tiles = TUNED_TILES.get(TunedKey(target.name, problem.q_heads, problem.kv_heads, problem.q_len, problem.kv_len,
                                     problem.head_dim, problem.v_head_dim, problem.dtype, problem.mask_dtype))
    if tiles is None:
        return None
    config = AttentionConfig(tiles.block_q, tiles.block_kv, vmem_limit(vmem_bytes(problem, tiles), target),
                             tiles.kv_heads_per_step)
    check_config(config, problem)
    return config


def select(problem: Problem, target: TpuGeneration) -> AttentionConfig:
    """Tile sizes for `problem` on `target`: tuned if known, else the heuristic."""
    config = tuned_config(problem, target)
    return config if config is not None else heuristic_config(problem, target)
