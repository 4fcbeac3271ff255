"""Running the query heads of one kernel step, in the forward and backward kernels alike."""

from __future__ import annotations

import jax


def loop_over_heads(num_heads: int, head) -> None:
    """head(s) for every query head s of a kernel step (its KV head is s // group); no loop for one head."""
    if num_heads == 1:
        head(0)
        return

    def body(s, carry):
        head(s)
        return carry

    jax.lax.fori_loop(0, num_heads, body, None)
