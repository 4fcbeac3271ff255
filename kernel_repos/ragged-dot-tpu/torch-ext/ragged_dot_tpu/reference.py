"""Plain torch reference for ragged_dot and the experts computation: the test oracle."""

from __future__ import annotations

import torch

from .common.quant import unpack_int4
from .problem import ExpertWeights


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


def tgmm_reference(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """Per group `lhs_g^T @ rhs_g` in float64 -> `[G, K, N]`; empty groups are zero, rows past the groups unused."""
    out = torch.zeros(group_sizes.shape[0], lhs.shape[1], rhs.shape[1], dtype=torch.float64)
    start = 0
    for group, size in enumerate(group_sizes.tolist()):
        out[group] = lhs[start : start + size].double().T @ rhs[start : start + size].double()
        start += size
    return out


def gated_experts_reference(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                            *weights: torch.Tensor | None, activation: str, weights_transposed: bool,
                            interleaved: bool = False, alpha: float = 1.0, limit: float = float("inf"),
                            fp8_activations: bool = False) -> torch.Tensor:
    """The gated experts layer pick by pick in float64; picks with id == num_experts contribute nothing.

    `fp8_activations`: each matmul's activations as the fp8 MXU path takes
    them (`fp8_rows_reference`), the fused kernel's on TPU7x.

    Differentiable with torch autograd (the gradient checks' oracle).

    Layouts and arguments as `layer.experts_layer`: `weights` in `ExpertWeights`' order, float ones only
    (dequantize one-byte weights first).
    """
    layer = ExpertWeights(*weights)
    if layer.quantized:
        raise ValueError("gated_experts_reference takes float weights: dequantize one-byte ones first")
    gate_up_proj, down_proj, gate_up_bias, down_bias = layer[:4]
    num_experts = gate_up_proj.shape[0]
    out = torch.zeros(hidden_states.shape, dtype=torch.float64)
    for token, picks in enumerate(top_k_index.tolist()):
        for k, expert in enumerate(picks):
            if expert == num_experts:
                continue
            gate_up_weight, down_weight = gate_up_proj[expert].double(), down_proj[expert].double()
            if not weights_transposed:
                gate_up_weight, down_weight = gate_up_weight.T, down_weight.T
            token_row = hidden_states[token]
            gate_up = (fp8_rows_reference(token_row) if fp8_activations else token_row.double()) @ gate_up_weight
            if gate_up_bias is not None:
                gate_up = gate_up + gate_up_bias[expert].double()
            gate, up = (gate_up[0::2], gate_up[1::2]) if interleaved else gate_up.chunk(2)
            if activation == "clamped_swiglu":
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                intermediate = (up + 1) * gate * torch.sigmoid(gate * alpha)
            else:
                act = {
                    "silu": torch.nn.functional.silu,
                    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
                    "gelu": torch.nn.functional.gelu,
                }[activation]
                intermediate = act(gate) * up
            if fp8_activations:
                intermediate = fp8_rows_reference(intermediate.to(hidden_states.dtype))
            row = intermediate @ down_weight
            if down_bias is not None:
                row = row + down_bias[expert].double()
            out[token] += top_k_weights[token, k].double() * row
    return out


def fp8_rows_reference(row: torch.Tensor) -> torch.Tensor:
    """A row of activations as `common.quant.fp8_matmul` multiplies it, in float64: per 128-element block, in float32,
    scaled by the power of two that brings its amax into (224, 448] (a normal float32 one), rounded to
    float8_e4m3fn, scaled back (all-zero blocks stay zero)."""
    out = torch.zeros(row.shape, dtype=torch.float64)
    for start in range(0, row.shape[0], 128):
        block = row[start : start + 128].float()
        amax = block.abs().max()
        if amax == 0:
            continue
        fraction, exponent = torch.frexp(amax)  # amax = fraction x 2^exponent, fraction in [0.5, 1)
        shift = min(max(int(exponent) - (9 if fraction <= 0.875 else 8), -126), 126)  # a normal float32
        codes = (block * 2.0**-shift).to(torch.float8_e4m3fn)
        out[start : start + 128] = codes.double() * 2.0**shift
    return out


def dequantize_reference(weight: torch.Tensor, scales: torch.Tensor, *, out_axis: int) -> torch.Tensor:
    """Quantized `[G, D1, D2]` weights in float64 (layouts in `common/quant.py`).

    int8: each weight times its output channel's scale (`scales[G, N]`, N the
    dim `out_axis`); packed int4 (uint8) unpacked, then as int8 (the result
    has the unpacked shape); float8_e4m3fn: times its 128 x 128 block's scale.
    """
    if weight.dtype == torch.uint8:
        weight = unpack_int4(weight, scales.shape[1], out_axis)
    q = weight.double()
    if weight.dtype == torch.int8:
        return q * scales.double().unsqueeze(3 - out_axis)
    _, rows, cols = weight.shape
    expanded = scales.double().repeat_interleave(128, 1)[:, :rows].repeat_interleave(128, 2)[:, :, :cols]
    return q * expanded
