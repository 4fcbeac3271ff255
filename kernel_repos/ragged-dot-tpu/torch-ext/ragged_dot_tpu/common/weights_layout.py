"""The order in which the kernels read each projection's weights: the order XLA stores them in."""

from __future__ import annotations

from typing import NamedTuple

from .._hardware import default_layout_swaps_minor_dims


class WeightsOrientation(NamedTuple):
    """How the kernels read each projection's weights: `[E, in, out]` when transposed, `[E, out, in]` if not."""

    gate_up_transposed: bool
    down_transposed: bool


def weights_orientation(hidden: int, intermediate: int, *, weights_transposed: bool) -> WeightsOrientation:
    """Each projection in the order XLA's default TPU layout stores it row-major.

    transformers hands `gate_up_proj[E, 2I, H]` and `down_proj[E, H, I]`
    (`[E, H, 2I]` / `[E, I, H]` when `weights_transposed`). Where XLA keeps
    an array's last two dimensions swapped (`default_layout_swaps_minor_dims`:
    Gemma 4's `down_proj[E, 2816, 704]` is stored 704-major), the kernels read
    the swapped view, a bitcast; reading it as given makes XLA rewrite the
    whole array on every call (968 MiB for Gemma-4-26B-A4B's experts).
    """
    gate_up = (hidden, 2 * intermediate) if weights_transposed else (2 * intermediate, hidden)
    down = (intermediate, hidden) if weights_transposed else (hidden, intermediate)
    return WeightsOrientation(weights_transposed != default_layout_swaps_minor_dims(gate_up),
                              weights_transposed != default_layout_swaps_minor_dims(down))
