"""The order in which the forward and backward kernels read q, K and V (and d_out) and write their results: the order
XLA's default TPU layout stores them in."""

from __future__ import annotations

from .._hardware import LANES, SUBLANES, round_up


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
