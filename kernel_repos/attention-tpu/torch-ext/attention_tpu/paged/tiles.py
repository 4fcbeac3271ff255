"""Tiles of ragged paged attention (`paged.kernel`) per shape and TPU generation.

Three sizes, in tokens: `block_q` query rows per grid step, `tile_q` query rows per matmul (a step's sequences
each run the row tiles they own), `block_kv` keys per K/V block (whole pages, or an equal part of one page; a
multiple of 128 lanes where the kernel reads either cache keys-minor, `PagedProblem.lane_chunks`).
Besides `tile_q`, the kernel has the smallest legal row tile (`min_tile_q`): a sequence whose rows in a step are
at most half as many in small tiles (a decode row: one token, `group` rows) runs those, not a whole `tile_q` tile. The
heuristic starts from PREFERRED_TILES and halves the largest term of the working set until it fits the VMEM
budget (`common.vmem.vmem_budget`); the kernel then asks Mosaic for the limit its working set needs.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from .._hardware import LANES, TpuGeneration, round_up, sublane_multiple
from ..common.paged import PagedProblem
from ..common.vmem import vmem_budget, vmem_limit

# A row tile's rows (tokens x the query heads of one KV head) are a multiple of the dtype's native tile rows
# (`min_tile_q`); a tile aims at TILE_ROWS rows (an MXU-sized matmul) when the sequences are long.
TILE_ROWS = 256
# Preferred (query rows per step, keys per K/V block): decode-sized steps hold a few row tiles; keys as the
# forward's (`flash.tiles.PREFERRED_TILES`). Not tuned on hardware. A batch of sequences of at most DECODE_MAX_Q
# queries takes the preferred steps too, but on a megacore device (v5p: two TensorCores) no more than half its rows,
# so that both TensorCores get a step.
PREFERRED_TILES = {"v5e": (128, 512), "v5p": (128, 512), "v6e": (128, 1024), "tpu7x": (128, 1024)}
DECODE_MAX_Q = 16


@dataclasses.dataclass(frozen=True)
class PagedConfig:
    """Tile sizes of one ragged paged attention call (tokens; see the module docstring)."""

    block_q: int
    tile_q: int
    block_kv: int
    vmem_limit_bytes: int


def min_tile_q(problem: PagedProblem) -> int:
    """The fewest tokens of a row tile: their rows (tokens x group) fill whole native tiles of the dtype (8 rows of
    float32, 16 of bfloat16), so that every tile starts on one. A group of 8 in bfloat16: 2 tokens, 16 rows."""
    rows = sublane_multiple(jnp.dtype(problem.dtype))
    return rows // math.gcd(rows, problem.group)


# Under a window a sequence's first visible key sits anywhere in a page, and its blocks start at the chunk holding
# it: a chunk is at most 1 / WINDOW_CHUNKS of the window (and at least WINDOW_MIN_CHUNK tokens, when a page part that
# small exists), so that a window costs at most ~2 / WINDOW_CHUNKS more keys than it holds. A cache read keys-minor
# is read in chunks of whole lanes (LANES keys): a decode row under GPT-OSS's 128-key window then reads the two
# 128-key chunks its window spans (256 keys) where 16-key chunks read 144, 16 / 9 of the K/V bytes; the row-major
# read would cost XLA a copy of the whole cache instead.
WINDOW_CHUNKS = 8
WINDOW_MIN_CHUNK = 16


def _window_chunk_bound(problem: PagedProblem) -> int:
    if problem.lane_chunks:
        return LANES
    return max(WINDOW_MIN_CHUNK, problem.sliding_window // WINDOW_CHUNKS)


def _key_multiple(problem: PagedProblem) -> int:
    """What a page part (a chunk, a block within a page) is a multiple of, where the page has such parts: whole
    lanes where a cache is read keys-minor, else 8 rows."""
    return LANES if problem.lane_chunks else 8


def chunk_tokens(problem: PagedProblem, block_kv: int) -> int:
    """Tokens of one K/V DMA: a whole page, or the part of one a block holds; under a window no more than its
    WINDOW_CHUNKS-th part, or one lane width keys-minor (contiguous keys: the block, whose DMA starts at any row;
    keys-minor, a 128-row tile, so that tiles past a sequence's keys are not fetched)."""
    if problem.contiguous:
        return LANES if problem.lane_chunks else block_kv
    chunk = min(block_kv, problem.page_size)
    if problem.sliding_window is not None:
        chunk = _page_part(chunk, _window_chunk_bound(problem), _key_multiple(problem))
    return chunk


def vmem_bytes(problem: PagedProblem, *, block_q: int, tile_q: int, block_kv: int) -> int:
    """Estimated VMEM working set (pipeline buffers, scratch, one tile's temporaries), padded to native tiles."""
    dtype = jnp.dtype(problem.dtype)
    itemsize, rows_multiple = dtype.itemsize, sublane_multiple(dtype)
    kv_heads, head_dim, v_head_dim, group = problem.kv_heads, problem.head_dim, problem.v_head_dim, problem.group
    step_rows = block_q * group

    def kv_buffer(cache_dim: int, keys_minor: bool) -> int:
        """The double buffer of K (or V) blocks."""
        if keys_minor:  # K^T per KV head, [Hkv, D, block_kv]
            return 2 * kv_heads * round_up(cache_dim, rows_multiple) * round_up(block_kv, LANES) * itemsize
        # Pages keep the cache's [tokens, Hkv, D] layout in VMEM: Hkv is padded to a native tile.
        return 2 * block_kv * round_up(kv_heads, rows_multiple) * cache_dim * itemsize

    kv_buffers = kv_buffer(head_dim, problem.keys_minor) + kv_buffer(v_head_dim, problem.values_minor)
    q_and_out = 2 * kv_heads * round_up(step_rows, rows_multiple) * (head_dim + v_head_dim) * itemsize
    scratch = kv_heads * step_rows * (v_head_dim + 2 * LANES) * 4  # acc, running max and sum (lane padded)
    sinks = 2 * kv_heads * step_rows * LANES * 4 if problem.has_sinks else 0
    tile_rows = tile_q * group
    temporaries = 4 * tile_rows * round_up(block_kv, LANES) * 4 + 3 * block_kv * max(head_dim, v_head_dim) * 4
    return kv_buffers + q_and_out + scratch + sinks + temporaries


def _page_part(page_size: int, most: int, multiple: int = 8) -> int:
    """The largest part of a page (a divisor of page_size) of at most `most` tokens, a multiple of `multiple` if any
    is."""
    divisors = [d for d in range(1, min(page_size, most) + 1) if page_size % d == 0]
    aligned = [d for d in divisors if d % multiple == 0]
    return (aligned or divisors)[-1]


def _shrink_kv(block_kv: int, problem: PagedProblem) -> int:
    page_size = problem.page_size
    if problem.contiguous:
        multiple = LANES if problem.lane_chunks else 8
        return max(min(multiple, block_kv), block_kv // 2 // multiple * multiple)
    if block_kv > page_size:
        return max(page_size, block_kv // 2 // page_size * page_size)
    if problem.lane_chunks:  # no part of a page below one lane width
        return _page_part(page_size, max(LANES, block_kv // 2), LANES)
    return _page_part(page_size, block_kv // 2) if block_kv > 1 else block_kv


def visible_keys(problem: PagedProblem, tile_q: int) -> int:
    """The most keys one row tile (of tile_q tokens) sees: its sequence's page table's tokens (at most max_kv_len),
    and under a causal window the window and the tile's queries."""
    keys = problem.page_size if problem.contiguous else problem.pages_per_seq * problem.page_size
    if problem.max_kv_len is not None:
        keys = min(keys, problem.max_kv_len)
    if problem.causal and problem.sliding_window is not None:
        keys = min(keys, problem.sliding_window + min(tile_q, problem.longest_query) - 1)
    return keys


def heuristic_config(problem: PagedProblem, target: TpuGeneration) -> PagedConfig:
    """Preferred tiles, the query ones no longer than the longest sequence's queries and the key blocks no longer
    than the keys a row tile sees (and the chunk before them a block starts at: a tile computes a block whole, and
    a 1024-key block under a 128-key window would compute 8x its keys), shrunk to the VMEM budget."""
    preferred_q, preferred_kv = PREFERRED_TILES[target.name]
    longest = max(1, problem.longest_query)
    multiple = min_tile_q(problem)
    tile_q = min(round_up(max(1, TILE_ROWS // problem.group), multiple), round_up(longest, multiple))
    keys = visible_keys(problem, tile_q)
    if problem.sliding_window is not None and not problem.lane_chunks:
        keys += _window_chunk_bound(problem) - 1  # blocks start at the first visible key's chunk
    # Read in whole lanes (keys-minor), blocks start at the 128-key chunk holding the first visible key: a block of
    # the visible keys' lanes, not one more, so that a window starting mid-chunk takes two blocks of the bytes it
    # moves anyway and one starting on a chunk (a ring's, varlen keys of whole windows) one, where a block of one
    # lane more would compute twice its keys (TPU7x's decode batch under GPT-OSS's window is then vector-bound).
    preferred_kv = min(preferred_kv, round_up(keys, LANES))
    packed = round_up(max(1, problem.total_q), tile_q)
    block_q = min(packed, preferred_q)
    if longest <= DECODE_MAX_Q and target.cores_per_device > 1:
        block_q = min(block_q, round_up(-(-packed // 2), tile_q))
    block_q = max(tile_q, block_q // tile_q * tile_q)
    page = problem.page_size
    if problem.contiguous:
        # Any block up to the keys' rows: its DMA starts at a sequence's row, not at a page.
        block_kv = min(preferred_kv, page)
    elif page <= preferred_kv:
        block_kv = max(1, preferred_kv // page) * page
    else:
        block_kv = _page_part(page, preferred_kv, _key_multiple(problem))
    budget = vmem_budget(target)

    def working_set(bq, tq, bkv):
        return vmem_bytes(problem, block_q=bq, tile_q=tq, block_kv=bkv)

    while working_set(block_q, tile_q, block_kv) > budget:
        if block_kv > 128 and _shrink_kv(block_kv, problem) < block_kv:
            block_kv = _shrink_kv(block_kv, problem)
        elif block_q > tile_q:
            block_q = max(tile_q, block_q // 2 // tile_q * tile_q)
        elif tile_q > multiple:
            tile_q = block_q = max(multiple, tile_q // 2 // multiple * multiple)
        elif _shrink_kv(block_kv, problem) < block_kv:
            block_kv = _shrink_kv(block_kv, problem)
        else:
            break
    return PagedConfig(block_q, tile_q, block_kv, vmem_limit(working_set(block_q, tile_q, block_kv), target))


def check_config(config: PagedConfig, problem: PagedProblem) -> None:
    """Raises ValueError if `config`'s tiles are not legal for `problem`."""
    multiple = min_tile_q(problem)
    if config.tile_q < 1 or config.tile_q % multiple:
        raise ValueError(f"config.tile_q must be a positive multiple of {multiple} (rows of whole native tiles for "
                         f"a group of {problem.group} in {problem.dtype}), got {config.tile_q}")
    if config.block_q < 1 or config.block_q % config.tile_q:
        raise ValueError(f"config.block_q must be a positive multiple of tile_q ({config.tile_q}), "
                         f"got {config.block_q}")
    page = problem.page_size
    if problem.lane_chunks and config.block_kv % LANES:
        raise ValueError(f"config.block_kv must be a multiple of {LANES} where the keys are read keys-minor "
                         f"(head_dims {problem.head_dim} and {problem.v_head_dim} over pages of {page}), "
                         f"got {config.block_kv}")
    if problem.contiguous:
        if not 0 < config.block_kv <= page:
            raise ValueError(f"config.block_kv must be in [1, {page}] (the contiguous keys' rows), "
                             f"got {config.block_kv}")
        return
    whole_pages = config.block_kv >= page and config.block_kv % page == 0
    page_part = 0 < config.block_kv < page and page % config.block_kv == 0
    if not (whole_pages or page_part):
        raise ValueError(f"config.block_kv must be a multiple or a divisor of the page size ({page}), "
                         f"got {config.block_kv}")


def select(problem: PagedProblem, target: TpuGeneration) -> PagedConfig:
    """Tile sizes for `problem` on `target` (a generation's facts, resolved once by the caller): the heuristic (no
    tuned table yet)."""
    return heuristic_config(problem, target)
