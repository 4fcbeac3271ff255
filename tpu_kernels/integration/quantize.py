"""One-byte expert weights: quantize a transformers experts module in place, once.

`kernelize(model, quantize_experts="int8" | "fp8")` calls `quantize_experts_module`
on each experts module the ragged-dot kernel's fused path serves. Its
`gate_up_proj` and `down_proj` become int8 or float8_e4m3fn parameters, with
float32 dequantization multipliers beside them under transformers' FP8 names,
`gate_up_proj_scale_inv` and `down_proj_scale_inv` (weight = q x scale_inv),
in the layouts ragged-dot-tpu reads (its `quant.py`); the float originals are
released. Biases, routers and shared experts (plain MLPs, not experts
modules) are left alone.

- int8: symmetric, one scale per output channel: scale_inv = max|w| / 127
  over the channel's inputs, q = round(w / scale_inv) (a zero channel gets
  scale_inv 1).
- fp8: 128 x 128 blocks over the weight's two stored dims, with transformers'
  own arithmetic (`integrations.finegrained_fp8.Fp8Quantize`): per block,
  scale = 448 / max|w| in float32, q = clamp(w x scale) as e4m3, scale_inv =
  1 / scale. A model loaded from a fine-grained FP8 checkpoint, which
  transformers dequantizes to bf16 off GPU as `(q.f32 x scale_inv).to(bf16)`,
  thus gets back the checkpoint's fp8 weights bit for bit: a block's largest
  weight comes back within bf16's rounding (2^-9) of 448 x scale_inv, so every
  q/448 ratio is reproduced within 2^-8, well inside half of e4m3's 2^-3 spacing.
  (For I a multiple of 128, the blocks of the merged `[E, 2I, H]` gate_up
  tensor are those of the checkpoint's separate gate and up projections.)
  Transformers' `Fp8Quantize` itself is not called: it leaves a weight whose
  dims are not multiples of 128 unquantized (GPT-OSS's 2880), where this
  gives the last block of a dim fewer rows or columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8 = "int8"
FP8 = "fp8"
SCHEMES = (INT8, FP8)
FP8_BLOCK = 128
_FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
_INT8_MAX = 127
PROJECTIONS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class QuantizedModule:
    """Bytes of one experts module's projections before (float) and after (one-byte weights plus scales)."""

    name: str
    bytes_before: int
    bytes_after: int


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def quantize_int8(weight: torch.Tensor, out_axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight[E, D1, D2]` -> (int8 q, float32 scale_inv `[E, D_out]`), one scale per output channel (`out_axis`)."""
    contraction = 3 - out_axis
    values = weight.detach().float()
    amax = values.abs().amax(dim=contraction)
    scale_inv = torch.where(amax > 0, amax / _INT8_MAX, torch.ones_like(amax))
    q = torch.round(values / scale_inv.unsqueeze(contraction)).clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q, scale_inv


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight[E, D1, D2]` -> (float8_e4m3fn q, float32 scale_inv `[E, ceil(D1/128), ceil(D2/128)]`).

    One expert at a time, so the float32 working copy stays one expert's size.
    """
    experts, rows, cols = weight.shape
    row_blocks, col_blocks = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    q = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
    scale_inv = torch.empty(experts, row_blocks, col_blocks, dtype=torch.float32, device=weight.device)
    for expert in range(experts):
        # Zero padding to whole blocks leaves every block's max|w| as it is.
        padded = torch.zeros(row_blocks * FP8_BLOCK, col_blocks * FP8_BLOCK, device=weight.device)
        padded[:rows, :cols] = weight[expert].detach().float()
        tiles = padded.reshape(row_blocks, FP8_BLOCK, col_blocks, FP8_BLOCK)
        amax = tiles.abs().amax(dim=(1, 3))
        scales = torch.where(amax > 0, _FP8_MAX / torch.where(amax > 0, amax, torch.ones_like(amax)),
                             torch.ones_like(amax))
        quantized = torch.clamp(tiles * scales[:, None, :, None], min=-_FP8_MAX, max=_FP8_MAX)
        q[expert] = quantized.reshape(padded.shape)[:rows, :cols].to(torch.float8_e4m3fn)
        scale_inv[expert] = 1.0 / scales
    return q, scale_inv


def quantize_weight(weight: torch.Tensor, scheme: str, out_axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    if scheme == INT8:
        return quantize_int8(weight, out_axis)
    return quantize_fp8(weight)


def check_scheme(scheme: str | None) -> None:
    if scheme is not None and scheme not in SCHEMES:
        raise ValueError(f"quantize_experts must be None, 'int8' or 'fp8', got {scheme!r}")


def quantize_experts_module(name: str, module: torch.nn.Module, scheme: str) -> QuantizedModule:
    """Replace `module`'s float gate_up_proj and down_proj by one-byte weights and their `*_scale_inv`."""
    out_axis = 2 if module.is_transposed else 1
    before = after = 0
    for projection in PROJECTIONS:
        weight = getattr(module, projection)
        if not weight.dtype.is_floating_point or weight.element_size() == 1:
            raise ValueError(f"{name}.{projection} is {weight.dtype}: only float weights are quantized")
        q, scale_inv = quantize_weight(weight, scheme, out_axis)
        before += _bytes(weight)
        after += _bytes(q) + _bytes(scale_inv)
        # Replacing the parameters drops the module's references to the float originals.
        setattr(module, projection, torch.nn.Parameter(q, requires_grad=False))
        setattr(module, f"{projection}_scale_inv", torch.nn.Parameter(scale_inv, requires_grad=False))
    return QuantizedModule(name, before, after)
