"""Tile sizes per shape and TPU generation, apart from the kernels.

`select_config` (forward) takes the tiles of TUNED_TILES (tuned_tiles.json)
when it holds the shape, else the heuristic (`heuristic_config`): preferred
tiles per generation, shrunk until the working set fits the VMEM budget
(`vmem_budget`); decode steps span as many KV heads as fit DECODE_STEP_BYTES.
`select_backward_config` does the same for the two backward kernels (dq, and
dk/dv) from their own preferred tiles and working sets. Each kernel then asks
Mosaic for a scoped VMEM limit from its working set (`vmem_limit`). Budget and
limit are the VMEM policy every tpu-kernels build shares (`_hardware.py`,
with this kernel's WORKING_SET_MARGIN and WORKING_SET_BOUND_BYTES), as are the
TPU facts (tiling, VMEM limits); the tuned table has the form every kernel's
has (`_tuning.py`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import jax.numpy as jnp

from ._hardware import (
    LANES, MIB, SUBLANES, check_generation, grid_step_overhead_s, resolve_generation, round_up, sublane_multiple,
    tpu_generation, vmem_budget_bytes, vmem_limit_bytes,
)
from ._tuning import read_tuned_tiles

# Working sets the heuristic stays within (the policy's `bound_bytes`). The
# kernel raises the scoped limit to what a config needs, so these bound tile
# size rather than what fits: v6e's is its default scoped limit (32 MiB),
# v5e's half again its default (16 MiB). Chosen with the preferred tiles
# below, not measured separately. v5p and TPU7x have 64 MiB per core: 24 MiB
# each, within what fits there with WORKING_SET_MARGIN.
WORKING_SET_BOUND_BYTES = {"v5e": 24 * MIB, "v5p": 24 * MIB, "v6e": 32 * MIB, "tpu7x": 24 * MIB}
# Preferred tiles (query positions per prefill block, keys per prefill block,
# keys per decode block), chosen with the grid-replay model of
# tpu_kernels.perf on Qwen3-30B-A3B shapes (`tpu-kernels bench attention`): at
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
# The VMEM estimate counts the pipeline buffers, the scratch and one slice's
# softmax temporaries; Mosaic's relayouts of the logits come on top. A 1.5x
# margin on the estimate (the policy's `margin`) covers them; every compile
# target also compiles without it (libtpu compile-only, v5e and v6e), so the
# margin is for shapes outside those targets.
WORKING_SET_MARGIN = 1.5
# Query blocks are multiples of 128 (or the whole query length): the
# log-sum-exp rows the forward writes and the backward kernels read put query
# positions along lanes. That is also a multiple of the int8 sublane tile (32
# rows), so the tiles of an int8 mask block line up with the query rows.
MASK_ROWS = sublane_multiple(jnp.int8)
Q_BLOCK_MULTIPLE = LANES
# Preferred backward tiles per kernel, (block_q, block_kv): dq walks KV blocks
# per query block, dk/dv walks query blocks per KV block. Chosen with the
# grid-replay model of tpu_kernels.perf (`tpu-kernels bench attention --sweep`,
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
class AttentionConfig:
    """Tile sizes of one attention call.

    block_q: query positions per grid step (1 in decode, where the rows of a
      step are the group's query heads instead).
    block_kv: keys per grid step.
    vmem_limit_bytes: scoped VMEM limit requested from Mosaic.
    kv_heads_per_step: KV heads one decode step handles (a divisor of the
      number of KV heads; prefill steps handle one).
    """

    block_q: int
    block_kv: int
    vmem_limit_bytes: int
    kv_heads_per_step: int = 1


class TunedKey(NamedTuple):
    """The shape a forward's tiles were tuned at."""

    generation: str
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: str
    mask_dtype: str | None


class ForwardTiles(NamedTuple):
    """A forward's tiles, as a tuned table holds them: an AttentionConfig's but the VMEM limit, which follows from
    them (`vmem_limit`)."""

    block_q: int
    block_kv: int
    kv_heads_per_step: int = 1


# Forward tiles tuned per shape, taken over the heuristic by `select_config`:
# data in tuned_tiles.json beside this module. None so far: the preferred tiles
# come from the model sweep above.
TUNED_TILES_FILE = Path(__file__).with_name("tuned_tiles.json")
TUNED_TILES: dict[TunedKey, ForwardTiles] = read_tuned_tiles(TUNED_TILES_FILE, TunedKey, ForwardTiles)


def is_decode(q_len: int) -> bool:
    return q_len == 1


def vmem_bytes(*, decode, group, block_q, block_kv, kv_heads_per_step, head_dim, itemsize, mask_itemsize) -> int:
    """Estimated VMEM working set of one configuration (pipeline buffers, scratch, temporaries)."""
    # A step holds `slices` row blocks of `rows` query rows: the group's heads
    # (prefill), or one block of `group` rows per KV head (decode).
    slices, rows = (kv_heads_per_step, group) if decode else (group, block_q)
    padded_rows = round_up(rows, SUBLANES)
    q_and_out = 2 * 2 * slices * padded_rows * head_dim * itemsize  # double-buffered q and out blocks
    scratch = slices * padded_rows * (head_dim + 2 * LANES) * 4  # acc, running max and sum (lane padded)
    kv = 2 * 2 * kv_heads_per_step * block_kv * head_dim * itemsize  # double-buffered k and v blocks
    temporaries = 4 * padded_rows * round_up(block_kv, LANES) * 4  # logits, probabilities, masks of one slice
    mask_rows = MASK_ROWS if decode else round_up(block_q, MASK_ROWS)
    mask = 2 * mask_rows * round_up(block_kv, LANES) * mask_itemsize
    # Double-buffered log-sum-exp block: [group, 1, block_q] (prefill) or [KV heads, group, 1] (decode).
    lse = 2 * (kv_heads_per_step * round_up(group, SUBLANES) * LANES if decode else group * SUBLANES * round_up(block_q, LANES)) * 4
    return q_and_out + scratch + kv + temporaries + mask + lse


def forward_vmem_bytes(tiles: ForwardTiles, *, q_heads: int, kv_heads: int, q_len: int, head_dim: int, dtype,
                       mask_dtype) -> int:
    """`vmem_bytes` of the forward with `tiles` at one shape."""
    return vmem_bytes(decode=is_decode(q_len), group=q_heads // kv_heads, block_q=tiles.block_q,
                      block_kv=tiles.block_kv, kv_heads_per_step=tiles.kv_heads_per_step, head_dim=head_dim,
                      itemsize=jnp.dtype(dtype).itemsize,
                      mask_itemsize=0 if mask_dtype is None else jnp.dtype(mask_dtype).itemsize)


def vmem_budget(generation: str) -> int:
    """What a config's working set may take on `generation`: the shared policy's budget with WORKING_SET_MARGIN,
    within WORKING_SET_BOUND_BYTES."""
    return vmem_budget_bytes(generation, margin=WORKING_SET_MARGIN, bound_bytes=WORKING_SET_BOUND_BYTES[generation])


def vmem_limit(working_set_bytes: int, generation: str) -> int:
    """The scoped VMEM limit asked for a working set on `generation`: the shared policy's, with WORKING_SET_MARGIN."""
    return vmem_limit_bytes(working_set_bytes, generation, margin=WORKING_SET_MARGIN)


def _shrink(block: int, *, multiple: int) -> int:
    """Halve a block size, rounding down to a multiple of ``multiple``."""
    return max(multiple, block // 2 // multiple * multiple)


def heuristic_config(
    *, q_heads: int, kv_heads: int, q_len: int, kv_len: int, head_dim: int, dtype, mask_dtype, generation: str
) -> AttentionConfig:
    """Preferred tiles shrunk to the VMEM budget; decode steps take as many KV heads as fit DECODE_STEP_BYTES.

    Block sizes are either the full extent of their axis (always legal) or a
    multiple of LANES (query blocks: of Q_BLOCK_MULTIPLE).
    """
    generation = check_generation(generation)
    decode = is_decode(q_len)
    preferred_q, preferred_kv_prefill, preferred_kv_decode = PREFERRED_TILES[generation]
    block_q = 1 if decode else min(q_len, preferred_q)
    block_kv = min(kv_len, preferred_kv_decode if decode else preferred_kv_prefill)
    itemsize = jnp.dtype(dtype).itemsize
    budget = vmem_budget(generation)

    def working_set(bq, bkv, heads):
        return forward_vmem_bytes(ForwardTiles(bq, bkv, heads), q_heads=q_heads, kv_heads=kv_heads, q_len=q_len,
                                  head_dim=head_dim, dtype=dtype, mask_dtype=mask_dtype)

    while working_set(block_q, block_kv, 1) > budget:
        if block_kv > 4 * LANES or (block_kv > LANES and (decode or block_q <= Q_BLOCK_MULTIPLE)):
            block_kv = _shrink(block_kv, multiple=LANES)
        elif not decode and block_q > Q_BLOCK_MULTIPLE:
            block_q = _shrink(block_q, multiple=Q_BLOCK_MULTIPLE)
        else:
            break
    heads_per_step = 1
    if decode:
        step_bytes = 2 * block_kv * head_dim * itemsize
        for heads in range(kv_heads, 0, -1):
            fits = heads * step_bytes <= DECODE_STEP_BYTES[generation]
            if kv_heads % heads == 0 and fits and working_set(block_q, block_kv, heads) <= budget:
                heads_per_step = heads
                break
    return AttentionConfig(
        block_q=block_q,
        block_kv=block_kv,
        vmem_limit_bytes=vmem_limit(working_set(block_q, block_kv, heads_per_step), generation),
        kv_heads_per_step=heads_per_step,
    )


def check_config(config: AttentionConfig, *, q_len: int, kv_len: int, kv_heads: int) -> None:
    """Raises ValueError if `config`'s blocks are not legal for these lengths and heads."""

    def aligned(block, extent, multiple):
        return block == extent or (block > 0 and block % multiple == 0)

    if not is_decode(q_len) and not aligned(config.block_q, q_len, Q_BLOCK_MULTIPLE):
        raise ValueError(
            f"config.block_q must be a multiple of {Q_BLOCK_MULTIPLE} or the query length {q_len}, got {config.block_q}"
        )
    if not aligned(config.block_kv, kv_len, LANES):
        raise ValueError(f"config.block_kv must be a multiple of {LANES} or the key length {kv_len}, got {config.block_kv}")
    if config.kv_heads_per_step < 1 or kv_heads % config.kv_heads_per_step:
        raise ValueError(
            f"config.kv_heads_per_step must divide the number of KV heads ({kv_heads}), got {config.kv_heads_per_step}"
        )


def tuned_config(
    *, q_heads: int, kv_heads: int, q_len: int, kv_len: int, head_dim: int, dtype, mask_dtype, generation: str
) -> AttentionConfig | None:
    """The config of the TUNED_TILES entry for this shape, if there is one: its tiles, checked like an explicit
    config, and the VMEM limit they need."""
    key = TunedKey(check_generation(generation), q_heads, kv_heads, q_len, kv_len, head_dim, jnp.dtype(dtype).name,
                   None if mask_dtype is None else jnp.dtype(mask_dtype).name)
    tiles = TUNED_TILES.get(key)
    if tiles is None:
        return None
    working_set = forward_vmem_bytes(tiles, q_heads=q_heads, kv_heads=kv_heads, q_len=q_len, head_dim=head_dim,
                                     dtype=dtype, mask_dtype=mask_dtype)
    config = AttentionConfig(tiles.block_q, tiles.block_kv, vmem_limit(working_set, generation),
                             tiles.kv_heads_per_step)
    check_config(config, q_len=q_len, kv_len=kv_len, kv_heads=kv_heads)
    return config


def select_config(
    *,
    q_heads: int,
    kv_heads: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
    dtype,
    mask_dtype=None,
    generation: str | None = None,
) -> AttentionConfig:
    """Tile sizes for one shape on `generation` (default: the current one): tuned if known, else the heuristic."""
    shape = dict(
        q_heads=q_heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len, head_dim=head_dim, dtype=dtype,
        mask_dtype=mask_dtype, generation=resolve_generation(generation),
    )
    config = tuned_config(**shape)
    return config if config is not None else heuristic_config(**shape)


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Tiles of the two backward kernels: dq, and dk/dv (each may span several KV heads per step)."""

    dq: AttentionConfig
    dkv: AttentionConfig


def backward_vmem_bytes(*, kernel, group, kv_heads_per_step, block_q, block_kv, head_dim, itemsize,
                        mask_itemsize) -> int:
    """Estimated VMEM working set of one backward kernel ("dq" or "dkv") at these tiles."""
    heads = kv_heads_per_step
    padded_q = round_up(block_q, SUBLANES)
    q_lanes = round_up(block_q, LANES)
    lanes_d = round_up(head_dim, LANES)  # a head_dim of 64 still fills 128 lanes
    rows = 2 * 2 * heads * group * SUBLANES * q_lanes * 4  # double-buffered lse and delta rows [heads, 1, block_q]
    kv = 2 * 2 * heads * block_kv * lanes_d * itemsize  # double-buffered k and v blocks
    mask = 2 * round_up(block_q, MASK_ROWS) * round_up(block_kv, LANES) * mask_itemsize
    # Element-wise temporaries are per query head: the heads of a step run one after the other.
    if kernel == "dq":
        q_side = 3 * 2 * heads * group * padded_q * lanes_d * itemsize  # q, d_out in, dq out
        scratch = heads * group * padded_q * lanes_d * 4
        temporaries = BACKWARD_TILE_TEMPORARIES * padded_q * round_up(block_kv, LANES) * 4
    else:
        q_side = 2 * 2 * heads * group * padded_q * lanes_d * itemsize  # q, d_out in
        kv = 2 * kv  # dk, dv out beside k, v in
        scratch = 2 * heads * round_up(block_kv, SUBLANES) * lanes_d * 4
        # The mask tile is transposed in the kernel: one more tile.
        temporaries = (BACKWARD_TILE_TEMPORARIES + (mask_itemsize > 0)) * round_up(block_kv, SUBLANES) * q_lanes * 4
    return q_side + rows + kv + mask + scratch + temporaries


def backward_step_seconds(kernel, *, group, kv_heads_per_step, block_q, block_kv, head_dim, generation) -> float:
    """MXU time of one backward grid step at the bf16 peak, with dims padded to the MXU as it computes them."""
    facts = tpu_generation(generation)
    mxu = facts.mxu_size
    if kernel == "dq":  # S = q K^T, dP = dO V^T (contract D); dS K (contract block_kv, out D)
        flops = 2 * (2 * block_q * round_up(head_dim, mxu) * round_up(block_kv, mxu)
                     + block_q * round_up(block_kv, mxu) * round_up(head_dim, mxu))
    else:  # S^T, dP^T (contract D); P^T dO, dS^T q (contract block_q, out D)
        flops = 2 * 2 * (block_kv * round_up(head_dim, mxu) * round_up(block_q, mxu)
                         + block_kv * round_up(block_q, mxu) * round_up(head_dim, mxu))
    return kv_heads_per_step * group * flops / facts.bf16_flops_per_s


def backward_tiles(kernel, *, block_q, block_kv, group, kv_heads, head_dim, itemsize, mask_itemsize, generation):
    """Heads per step for these blocks: the fewest whose step outweighs the step overhead
    STEP_OVERHEAD_MULTIPLE times and whose working set fits the budget; else the most that fit."""
    shape = dict(group=group, block_q=block_q, block_kv=block_kv, head_dim=head_dim)

    def working_set(heads):
        return backward_vmem_bytes(kernel=kernel, kv_heads_per_step=heads, itemsize=itemsize,
                                   mask_itemsize=mask_itemsize, **shape)

    fitting = [h for h in range(1, kv_heads + 1) if kv_heads % h == 0 and working_set(h) <= vmem_budget(generation)]
    if not fitting:
        return None
    target = STEP_OVERHEAD_MULTIPLE * grid_step_overhead_s(generation)
    enough = [h for h in fitting if backward_step_seconds(kernel, kv_heads_per_step=h, generation=generation, **shape)
              >= target]
    heads = enough[0] if enough else fitting[-1]
    return AttentionConfig(block_q=block_q, block_kv=block_kv, vmem_limit_bytes=vmem_limit(working_set(heads), generation),
                           kv_heads_per_step=heads)


def _heuristic_backward_tiles(kernel, *, group, kv_heads, q_len, kv_len, head_dim, itemsize, mask_itemsize, generation,
                              block_cap):
    preferred_q, preferred_kv = PREFERRED_BACKWARD_TILES[generation][kernel]
    block_q, block_kv = min(q_len, preferred_q, block_cap), min(kv_len, preferred_kv, block_cap)
    shape = dict(group=group, kv_heads=kv_heads, head_dim=head_dim, itemsize=itemsize, mask_itemsize=mask_itemsize,
                 generation=generation)
    # Shrink the streamed axis' block first: it costs re-reads of the other axis, not passes over this one.
    streamed_first = kernel == "dq"
    while (tiles := backward_tiles(kernel, block_q=block_q, block_kv=block_kv, **shape)) is None:
        can_shrink_kv, can_shrink_q = block_kv > LANES, block_q > Q_BLOCK_MULTIPLE
        if can_shrink_kv and (streamed_first or not can_shrink_q):
            block_kv = _shrink(block_kv, multiple=LANES)
        elif can_shrink_q:
            block_q = _shrink(block_q, multiple=Q_BLOCK_MULTIPLE)
        else:
            return AttentionConfig(block_q, block_kv, vmem_limit(backward_vmem_bytes(
                kernel=kernel, kv_heads_per_step=1, group=group, block_q=block_q, block_kv=block_kv,
                head_dim=head_dim, itemsize=itemsize, mask_itemsize=mask_itemsize), generation))
    return tiles


def window_block_cap(sliding_window: int | None, causal: bool, generation: str) -> int | None:
    """Largest backward block for a causal sliding window: tiles straddling its edges compute masked pairs."""
    if sliding_window is None or not causal:
        return None
    return max(LANES, WINDOW_BLOCK_FACTOR[generation] * round_up(sliding_window, LANES))


def check_backward_config(config: BackwardConfig, *, q_len: int, kv_len: int, kv_heads: int) -> None:
    """Raises ValueError if a backward kernel's blocks are not legal for these lengths and heads."""
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


def select_backward_config(
    *, q_heads: int, kv_heads: int, q_len: int, kv_len: int, head_dim: int, dtype, mask_dtype=None,
    sliding_window: int | None = None, causal: bool = True, generation: str | None = None,
) -> BackwardConfig:
    """Tiles of the dq and dk/dv kernels for one shape on `generation` (default: the current one).

    Preferred tiles (capped for short causal windows) shrunk to the VMEM
    budget, with as many KV heads per step as make a step's MXU work outweigh
    its overhead; there is no tuned table for the backward yet.
    """
    generation = resolve_generation(generation)
    cap = window_block_cap(sliding_window, causal, generation)
    shape = dict(
        group=q_heads // kv_heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len, head_dim=head_dim,
        itemsize=jnp.dtype(dtype).itemsize, mask_itemsize=0 if mask_dtype is None else jnp.dtype(mask_dtype).itemsize,
        generation=generation, block_cap=q_len + kv_len if cap is None else cap,
    )
    return BackwardConfig(dq=_heuristic_backward_tiles("dq", **shape), dkv=_heuristic_backward_tiles("dkv", **shape))
