"""The order in which the forward and backward kernels read q, K and V (and d_out) and write their results: the order
XLA's default TPU layout stores them in."""

from __future__ import annotations

from typing import NamedTuple

from .._hardware import LANES, SUBLANES, round_up
from .masking import Problem


def sequence_minor_by_default(seq_len: int, head_dim: int) -> bool:
    """Whether XLA's default TPU layout stores an array [B, H, seq_len, head_dim] (q, k, v, the output)
    sequence-minor ({2,3,1,0}).

    XLA picks the layout of a jitted function's arguments and results (and
    torch-tpu of its device tensors) itself. For a head_dim that is a
    multiple of 8 sublanes it tiles the last two dimensions in (8, 128 lanes)
    tiles and stores them in the order that pads less: sequence-minor
    (physically [B, H, head_dim, seq_len]) where `round_up(head_dim, 8) *
    round_up(seq_len, 128)` is strictly less than `round_up(seq_len, 8) *
    round_up(head_dim, 128)`; otherwise head_dim stays minor (or, where
    seq_len is not a multiple of 8, a head axis may go between them). So a
    head_dim that is a multiple of 128 is never stored sequence-minor, and
    head_dim 64 is exactly when seq_len > 64: at 65, 1000, 4096 or 4097
    positions alike. Batch, heads, dtype and generation do not change it.
    Probed with libtpu's compile-only topologies for v5e, v5p, v6e and TPU7x
    over head_dim 8 to 512 and seq_len 1 to 32769, bfloat16 and float32,
    several batch and head counts (the project's tests/test_flash_layout.py
    checks it against the compiler). A head_dim that is not a multiple of 8
    (no model we serve has one) is answered False: XLA weighs other orders
    there.

    The kernel reads such K and V, and in prefill such q, as `swapaxes(x, -1,
    -2)`, a free bitcast, and writes such an output swapped likewise;
    reading them row-major makes XLA copy each into that layout on every
    call (at decode the whole cache, per layer and step), and the output
    back. Correctness never rests on this answer: where XLA's layout
    differs, XLA copies.
    """
    if head_dim % LANES == 0 or head_dim % SUBLANES != 0:
        return False
    sequence_minor_tiles = round_up(head_dim, SUBLANES) * round_up(seq_len, LANES)
    row_major_tiles = round_up(seq_len, SUBLANES) * round_up(head_dim, LANES)
    return sequence_minor_tiles < row_major_tiles


class SequenceMinor(NamedTuple):
    """Which arrays of one call a flash kernel reads (and writes) as their swapped, sequence-minor views [B, H, D, S]:
    each on its own, since q and k (head dim D) and v and the output (Dv) may be stored differently (latent
    attention's D of 192 over 4096 positions is stored sequence-minor, its Dv of 128 row-major)."""

    q: bool  # q, and the backward's dq
    k: bool  # k, and dk
    v: bool  # v, and dv
    out: bool  # the output, and the backward's d_out


def sequence_minor_reads(problem: Problem, block_q: int, block_kv: int) -> SequenceMinor:
    """Each array read as XLA stores it by default (`sequence_minor_by_default` of its length and head dim) where
    that is sequence-minor and its blocks along the sequence are whole lane tiles; row-major otherwise (where XLA
    stores it otherwise, XLA copies it). A single query (decode) is never stored sequence-minor."""
    whole_query_tiles, whole_key_tiles = block_q % LANES == 0, block_kv % LANES == 0
    return SequenceMinor(
        q=whole_query_tiles and sequence_minor_by_default(problem.q_len, problem.head_dim),
        k=whole_key_tiles and sequence_minor_by_default(problem.kv_len, problem.head_dim),
        v=whole_key_tiles and sequence_minor_by_default(problem.kv_len, problem.v_head_dim),
        out=whole_query_tiles and sequence_minor_by_default(problem.q_len, problem.v_head_dim),
    )
