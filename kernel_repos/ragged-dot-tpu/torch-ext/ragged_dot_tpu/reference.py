"""Plain torch reference for ragged_dot and the experts computation: the test oracle."""

from __future__ import annotations

import torch


def ragged_dot_reference(
    lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, *, transpose_rhs: bool = False
) -> torch.Tensor:
    """Per-group matmul in float64; rows past the groups are zero."""
    out = torch.zeros(lhs.shape[0], rhs.shape[1] if transpose_rhs else rhs.shape[2], dtype=torch.float64)
    start = 0
    for group, size in enumerate(group_sizes.tolist()):
        weight = rhs[group].double()
        if transpose_rhs:
            weight = weight.T
        out[start : start + size] = lhs[start : start + size].double() @ weight
        start += size
    return out.to(lhs.dtype)
