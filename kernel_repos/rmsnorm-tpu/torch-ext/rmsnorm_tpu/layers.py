"""`kernels` layers for transformers' RMSNorm modules, and a probe for the undecorated ones.

`kernels.kernelize` swaps in the `forward` of a layer class here; the layer
has no `__init__` and no state of its own: it reads the replaced module's
`weight` and `variance_epsilon` (or `eps`).

- `RMSNorm` (transformers' layer name "RMSNorm"): y = normalise(x) * weight.
  Like the Llama-style modules it replaces, the result has the promoted dtype
  of x and weight (so an float32 weight under bfloat16 activations gives float32).
- `RMSNormZeroCentered` (transformers' layer name "RMSNormZeroCentered",
  Qwen3.5): y = normalise(x) * (1 + weight), returned in x's dtype, as in the
  Gemma-style modules.

Many norms are not decorated for `kernels` (Gemma, Gemma 2/3, Qwen3-Next,
Llama 4, Mamba, ...). `matching_layer_name(module)` tells which of the two
layers reproduces a module's forward, by running the module's own forward on
a small random probe on the CPU and comparing; None when neither does (no
weight, gated norms, other formulas).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from . import reference
from .ops import rms_norm

PROBE_ROWS = 4
PROBE_RTOL = 1e-4
PROBE_ATOL = 1e-5


def _epsilon(module: nn.Module) -> float:
    eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        eps = getattr(module, "eps", None)
    if eps is None:
        raise AttributeError(f"{type(module).__name__} has neither `variance_epsilon` nor `eps`")
    return eps


class RMSNorm(nn.Module):
    """Pallas RMSNorm for modules computing `weight * normalise(x)` (layer name "RMSNorm")."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = rms_norm(hidden_states, self.weight, _epsilon(self))
        return normed.to(torch.promote_types(hidden_states.dtype, self.weight.dtype))


class RMSNormZeroCentered(nn.Module):
    """Pallas RMSNorm for modules computing `(1 + weight) * normalise(x)` (layer name "RMSNormZeroCentered")."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, _epsilon(self), offset=1.0)


LAYER_OFFSETS = {"RMSNorm": 0.0, "RMSNormZeroCentered": 1.0}


def _cpu_float32_probe_copy(module: nn.Module, weight: torch.Tensor) -> nn.Module:
    """A shallow copy of `module` whose tensors are CPU float32 copies, with `weight` as its weight."""
    probe = copy.copy(module)
    probe._parameters = {
        name: None if p is None else nn.Parameter(p.detach().to("cpu", torch.float32), requires_grad=False)
        for name, p in module._parameters.items()
    }
    probe._parameters["weight"] = nn.Parameter(weight, requires_grad=False)
    probe._buffers = {
        name: None if b is None else b.detach().to("cpu", torch.float32 if b.is_floating_point() else b.dtype)
        for name, b in module._buffers.items()
    }
    return probe


def matching_layer_name(module: nn.Module) -> str | None:
    """"RMSNorm" or "RMSNormZeroCentered" if that layer computes what `module.forward` computes, else None.

    The module's class forward runs on a CPU float32 copy with a random weight
    and inputs of magnitude sqrt(eps), so the weight convention (offset 0 or 1)
    and the epsilon attribute both show in the output. Costs one tiny CPU
    forward; the module itself is not touched.
    """
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.numel() == 0:
        return None
    try:
        eps = _epsilon(module)
    except AttributeError:
        return None
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        return None
    hidden = weight.numel()
    generator = torch.Generator().manual_seed(0)
    probe_weight = torch.randn(hidden, generator=generator)
    probe_input = torch.randn(PROBE_ROWS, hidden, generator=generator) * math.sqrt(eps)
    probe = _cpu_float32_probe_copy(module, probe_weight)
    try:
        with torch.no_grad():
            output = type(module).forward(probe, probe_input)
    except Exception:
        # A forward that needs more than hidden_states (gated norms) or breaks on a
        # plain [rows, hidden] input is not a norm these layers replace.
        return None
    if not isinstance(output, torch.Tensor) or output.shape != probe_input.shape:
        return None
    for name, offset in LAYER_OFFSETS.items():
        expected = reference.rms_norm(probe_input, probe_weight, float(eps), offset)
        if torch.allclose(output.float(), expected, rtol=PROBE_RTOL, atol=PROBE_ATOL):
            return name
    return None


__all__ = ["RMSNorm", "RMSNormZeroCentered", "matching_layer_name"]
