"""Tiles of the two backward kernels (`flash_backward.kernel`: dq, and dk/dv) per shape and TPU generation.

`select` takes each kernel's preferred tiles (capped for short
causal windows), shrinks them to the VMEM budget (`common.vmem.vmem_budget`)
by their own working sets, and spans as many KV heads per step as make a
step's MXU work outweigh its overhead; each kernel then asks Mosaic for a
scoped VMEM limit from its working set (`common.vmem.vmem_limit`). There is no
tuned table for the backward yet. Where XLA stores q, k, v or d_out
sequence-minor (a head dim that is no multiple of 128 over more than a few
positions) the blocks along that sequence are whole lane tiles, so that the
kernels read and write them so (`common.layout.sequence_minor_reads`), and the
working set counts the scratch their transposed blocks take. Every function
here takes the call's `Problem` and the generation's facts (`target`, a
`_hardware.TpuGeneration` its caller resolved once) rather than their fields.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .._hardware import LANES, SUBLANES, TpuGeneration, grid_step_overhead_s, round_up
from ..common.layout import sequence_minor_by_default, sequence_minor_reads
from ..common.masking import Problem
from ..common.tiles import MASK_ROWS, Q_BLOCK_MULTIPLE, AttentionConfig, preferred_by_width, shrink_block
from ..common.vmem import vmem_budget, vmem_limit

# Preferred backward tiles per kernel, (block_q, block_kv): dq walks KV blocks
# per query block, dk/dv walks query blocks per KV block. Chosen with the
# grid-replay model of benchmarks.perf (`python -m benchmarks attention --sweep`,
# blocks 128-1024, KV heads per step from `backward_tiles`) at training shapes
# of 8192 tokens: the best tile of Qwen3-30B-A3B (causal) and of Gemma-4's
# sliding layers on both generations, except v6e's dk/dv at Qwen3 (512 x 512 is
# 1 % slower than its best, 256 x 512, and the best for Gemma-4). v5p takes
# v5e's and TPU7x v6e's, by MXU width (not searched on them).
PREFERRED_BACKWARD_TILES = {
    "v5e": {"dq": (256, 256), "dkv": (256, 256)},
    "v5p": {"dq": (256, 256), "dkv": (256, 256)},
    "v6e": {"dq": (512, 512), "dkv": (512, 512)},
    "tpu7x": {"dq": (512, 512), "dkv": (512, 512)},
}
# Head dims the tiles above do not suit. At head_dim 512 (Gemma 4's global
# layers, 8 query heads per KV head) a step's query side (q, d_out, dq and its
# float32 accumulator, group x block_q x 512) dominates the working set:
# shrinking the key blocks first, as the budget would, leaves dq with 128-key
# blocks on v6e and TPU7x, 2.2x-2.6x slower. (256, 512) is, by the same sweep
# at Gemma-4-26B-A4B's global layer (16 query heads, 2 KV heads, S=8192,
# causal), the best tile of both kernels on v5e and v5p, and within 2 % of
# the best on v6e and TPU7x. Wider heads (latent attention's absorbed 576 /
# 512) take them too (not modelled there).
PREFERRED_BACKWARD_TILES_BY_HEAD_DIM = {
    512: {generation: {"dq": (256, 512), "dkv": (256, 512)} for generation in PREFERRED_BACKWARD_TILES},
}
# Element-wise float32 temporaries of one (query block x KV block) tile held at
# once by a backward step: logits, probabilities, dP, dS, the soft-cap slope
# and the visibility mask.
BACKWARD_TILE_TEMPORARIES = 6
# A backward step spans enough KV heads that its MXU time is at least this many
# times the per-step overhead (16: the overhead stays near 6 %).
STEP_OVERHEAD_MULTIPLE = 16
# Under a causal sliding window w, backward blocks are at most this many times
# w (rounded up to 128): each tile straddling the window's edges computes up to
# half its pairs masked. From the sweep at GPT-OSS-20B's window of 128: 128 x
# 128 is the best tile on v5e; 256 x 256 is within 11 % (dq) and 24 % (dk/dv)
# of v6e's best, where 128-wide tiles fill half of the 256-wide MXU. By MXU
# width on v5p (128) and TPU7x (256).
WINDOW_BLOCK_FACTOR = {"v5e": 1, "v5p": 1, "v6e": 2, "tpu7x": 2}


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Tiles of the two backward kernels: dq, and dk/dv (each may span several KV heads per step)."""

    dq: AttentionConfig
    dkv: AttentionConfig


def backward_vmem_bytes(kernel: str, problem: Problem, *, block_q: int, block_kv: int,
                        kv_heads_per_step: int) -> int:
    """Estimated VMEM working set of one backward kernel ("dq" or "dkv") at these tiles; where it reads an array it
    holds across its walk sequence-minor (`common.layout.sequence_minor_reads`) it transposes its blocks into
    scratch of their rows. q, k, dq and dk are head_dim wide, v, d_out and dv v_head_dim."""
    heads, group = kv_heads_per_step, problem.group
    itemsize = jnp.dtype(problem.dtype).itemsize
    mask_itemsize = 0 if problem.mask_dtype is None else jnp.dtype(problem.mask_dtype).itemsize
    minor = sequence_minor_reads(problem, block_q, block_kv)
    padded_q = round_up(block_q, SUBLANES)
    q_lanes = round_up(block_q, LANES)
    # A head dim of 64 still fills 128 lanes.
    lanes_dk, lanes_dv = round_up(problem.head_dim, LANES), round_up(problem.v_head_dim, LANES)
    rows = 2 * 2 * heads * group * SUBLANES * q_lanes * 4  # double-buffered lse and delta rows [heads, 1, block_q]
    kv = 2 * heads * block_kv * (lanes_dk + lanes_dv) * itemsize  # double-buffered k and v blocks
    mask = 2 * round_up(block_q, MASK_ROWS) * round_up(block_kv, LANES) * mask_itemsize
    # Element-wise temporaries are per query head: the heads of a step run one after the other.
    if kernel == "dq":
        q_side = 2 * heads * group * padded_q * (2 * lanes_dk + lanes_dv) * itemsize  # q, d_out in, dq out
        held = lanes_dk * minor.q + lanes_dv * minor.out  # q, d_out rows
        scratch = heads * group * padded_q * (lanes_dk * 4 + held * itemsize)  # dq; q, d_out rows
        temporaries = BACKWARD_TILE_TEMPORARIES * padded_q * round_up(block_kv, LANES) * 4
    else:
        q_side = 2 * heads * group * padded_q * (lanes_dk + lanes_dv) * itemsize  # q, d_out in
        kv = 2 * kv  # dk, dv out beside k, v in
        held = lanes_dk * minor.k + lanes_dv * minor.v  # k, v rows
        scratch = heads * round_up(block_kv, SUBLANES) * ((lanes_dk + lanes_dv) * 4 + held * itemsize)  # dk, dv
        # The mask tile is transposed in the kernel: one more tile.
        temporaries = (BACKWARD_TILE_TEMPORARIES + (mask_itemsize > 0)) * round_up(block_kv, SUBLANES) * q_lanes * 4
    return q_side + rows + kv + mask + scratch + temporaries


def backward_step_seconds(kernel: str, problem: Problem, target: TpuGeneration, *, block_q: int, block_kv: int,
                          kv_heads_per_step: int) -> float:
    """MXU time of one backward grid step at the bf16 peak, with dims padded to the MXU as it computes them."""
    mxu = target.mxu_size
    dk, dv = round_up(problem.head_dim, mxu), round_up(problem.v_head_dim, mxu)
    if kernel == "dq":  # S = q K^T (contract D), dP = dO V^T (contract Dv); dS K (contract block_kv, out D)
        flops = 2 * block_q * round_up(block_kv, mxu) * (dk + dv + dk)
    else:  # S^T (contract D), dP^T (contract Dv); P^T dO (out Dv), dS^T q (out D), contracting block_q
        flops = 2 * block_kv * round_up(block_q, mxu) * 2 * (dk + dv)
    return kv_heads_per_step * problem.group * flops / target.bf16_flops_per_s


def backward_tiles(kernel: str, problem: Problem, target: TpuGeneration, *, block_q: int,
                   block_kv: int) -> AttentionConfig | None:
    """Heads per step for these blocks: the fewest whose step outweighs the step overhead
    STEP_OVERHEAD_MULTIPLE times and whose working set fits the budget; else the most that fit (None: none
    fits)."""
    blocks = dict(block_q=block_q, block_kv=block_kv)

    def working_set(heads):
        return backward_vmem_bytes(kernel, problem, kv_heads_per_step=heads, **blocks)

    kv_heads = problem.kv_heads
    fitting = [h for h in range(1, kv_heads + 1) if kv_heads % h == 0 and working_set(h) <= vmem_budget(target)]
    if not fitting:
        return None
    least = STEP_OVERHEAD_MULTIPLE * grid_step_overhead_s(target.name)
    enough = [h for h in fitting
              if backward_step_seconds(kernel, problem, target, kv_heads_per_step=h, **blocks) >= least]
    heads = enough[0] if enough else fitting[-1]
    return AttentionConfig(block_q=block_q, block_kv=block_kv,
                           vmem_limit_bytes=vmem_limit(working_set(heads), target), kv_heads_per_step=heads)


def _heuristic_backward_tiles(kernel: str, problem: Problem, target: TpuGeneration) -> AttentionConfig:
    q_len, kv_len = problem.q_len, problem.kv_len
    cap = window_block_cap(problem, target)
    block_cap = q_len + kv_len if cap is None else cap
    preferred_q, preferred_kv = preferred_by_width(problem, PREFERRED_BACKWARD_TILES_BY_HEAD_DIM,
                                                   PREFERRED_BACKWARD_TILES)[target.name][kernel]
    block_q, block_kv = min(q_len, preferred_q, block_cap), min(kv_len, preferred_kv, block_cap)
    # Sequences along lanes: whole lane tiles, so that the kernel reads and writes its arrays as XLA stores them
    # (`plan.make`); shrinking keeps blocks of whole lane tiles.
    head_dims = (problem.head_dim, problem.v_head_dim)
    if any(sequence_minor_by_default(q_len, head_dim) for head_dim in head_dims):
        block_q = round_up(block_q, LANES)
    if any(sequence_minor_by_default(kv_len, head_dim) for head_dim in head_dims):
        block_kv = round_up(block_kv, LANES)
    # Shrink the streamed axis' block first: it costs re-reads of the other axis, not passes over this one.
    streamed_first = kernel == "dq"
    while (tiles := backward_tiles(kernel, problem, target, block_q=block_q, block_kv=block_kv)) is None:
        can_shrink_kv, can_shrink_q = block_kv > LANES, block_q > Q_BLOCK_MULTIPLE
        if can_shrink_kv and (streamed_first or not can_shrink_q):
            block_kv = shrink_block(block_kv, multiple=LANES)
        elif can_shrink_q:
            block_q = shrink_block(block_q, multiple=Q_BLOCK_MULTIPLE)
        else:
            working_set = backward_vmem_bytes(kernel, problem, block_q=block_q, block_kv=block_kv,
                                              kv_heads_per_step=1)
            return AttentionConfig(block_q, block_kv, vmem_limit(working_set, target))
    return tiles


def window_block_cap(problem: Problem, target: TpuGeneration) -> int | None:
    """Largest backward block for a causal sliding window: tiles straddling its edges compute masked pairs."""
    if problem.sliding_window is None or not problem.causal:
        return None
    return max(LANES, WINDOW_BLOCK_FACTOR[target.name] * round_up(problem.sliding_window, LANES))


def check_backward_config(config: BackwardConfig, problem: Problem) -> None:
    """Raises ValueError if a backward kernel's blocks are not legal for `problem`'s lengths and heads."""
    q_len, kv_len, kv_heads = problem.q_len, problem.kv_len, problem.kv_heads
    for name, tiles in (("dq", config.dq), ("dkv", config.dkv)):
        if not (tiles.block_q == q_len or (tiles.block_q > 0 and tiles.block_q % Q_BLOCK_MULTIPLE == 0)):
            raise ValueError(f"config.{name}.block_q must be a multiple of {Q_BLOCK_MULTIPLE} or the query length "
                             f"{q_len}, got {tiles.block_q}")
        if not (tiles.block_kv == kv_len or (tiles.block_kv > 0 and tiles.block_kv % LANES == 0)):
            raise ValueError(f"config.{name}.block_kv must be a multiple of {LANES} or the key length {kv_len}, "
                             f"got {tiles.block_kv}")
        if tiles.kv_heads_per_step < 1 or kv_heads % tiles.kv_heads_per_step:
            raise ValueError(f"config.{name}.kv_heads_per_step must divide the number of KV heads ({kv_heads}), "
                             f"got {tiles.kv_heads_per_step}")


def select(problem: Problem, target: TpuGeneration) -> BackwardConfig:
    """Tiles of the dq and dk/dv kernels for `problem` on `target` (a generation's facts, resolved once by the
    caller).

    Preferred tiles (capped for short causal windows) shrunk to the VMEM
    budget, with as many KV heads per step as make a step's MXU work outweigh
    its overhead; there is no tuned table for the backward yet.
    """
    return BackwardConfig(dq=_heuristic_backward_tiles("dq", problem, target),
                          dkv=_heuristic_backward_tiles("dkv", problem, target))
