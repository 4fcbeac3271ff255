"""Plain torch RMSNorm: the test oracle, written the way transformers' norms compute.

The math runs in float32 and the result is cast to the input dtype once, as in
Gemma-style norms; Llama-style norms cast before the weight multiply, which
differs from this by at most one bfloat16 rounding.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    x32 = x.float()
    inverse_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * inverse_rms * (offset + weight.float())).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps, offset), new_residual
