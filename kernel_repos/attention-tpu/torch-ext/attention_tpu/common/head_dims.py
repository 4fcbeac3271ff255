"""The head dims the kernels serve: the torch ops refuse any other (`head_dims_refusal`), and a caller such as
kernelize asks `supports_head_dims` before it routes a model's attention here.

q and k share one head dim, v and the output another (equal but for latent attention: transformers 5.25's MLA
models take (192, 128), (96, 64), (256, 256) or (128, 128) expanded and (576, 512), (160, 128), (288, 256),
(320, 256) or (512, 512) absorbed). Each may be any multiple of HEAD_DIM_MULTIPLE from HEAD_DIM_MULTIPLE to
WIDEST_HEAD_DIM, at the tiles the selectors pick. The compile targets hold the MLA models' shapes
(`compile_targets.py`); when the rule was set, a sweep compiled the forward (a prefill read sequence-minor, a decode
step), both backward kernels and the paged kernel (pages of 128 and of 16 tokens) at (D, Dv) = (8, 8), (16, 8),
(24, 40), (40, 24), (72, 72), (104, 200), (200, 104), (328, 568), (568, 328), (576, 576) in bfloat16 for v5e and
v6e, and at (8, 8), (40, 24), (200, 104), (576, 512) in float32 and (24, 40), (104, 200), (568, 328) in bfloat16 for
v5p and TPU7x.
"""

from __future__ import annotations

HEAD_DIM_MULTIPLE = 8
WIDEST_HEAD_DIM = 576


def supports_head_dim(head_dim: int) -> bool:
    """Whether the kernels serve this head dim, of q and k or of v."""
    return (isinstance(head_dim, int) and not isinstance(head_dim, bool)
            and 0 < head_dim <= WIDEST_HEAD_DIM and head_dim % HEAD_DIM_MULTIPLE == 0)


def supports_head_dims(qk_head_dim: int, v_head_dim: int) -> bool:
    """Whether the kernels serve q and k of head dim `qk_head_dim` with v (and the output) of `v_head_dim`."""
    return supports_head_dim(qk_head_dim) and supports_head_dim(v_head_dim)


# Every head dim served when q, k and v share it.
SUPPORTED_HEAD_DIMS = tuple(range(HEAD_DIM_MULTIPLE, WIDEST_HEAD_DIM + 1, HEAD_DIM_MULTIPLE))


def head_dims_refusal(qk_head_dim: int, v_head_dim: int) -> str | None:
    """Why the kernels do not serve these head dims, in torch terms; None if they do."""
    rule = f"a multiple of {HEAD_DIM_MULTIPLE} from {HEAD_DIM_MULTIPLE} to {WIDEST_HEAD_DIM}"
    for name, head_dim in (("head_dim", qk_head_dim), ("value head_dim", v_head_dim)):
        if not supports_head_dim(head_dim):
            return f"{name} must be {rule}, got {head_dim}"
    return None
