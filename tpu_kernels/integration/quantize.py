"""Quantized expert weights: quantize a transformers experts module in place, once.

`kernelize(model, quantize_experts="int8" | "fp8" | "int4")` calls `quantize_experts_module`
on each experts module the ragged-dot kernel's fused path serves. Its
`gate_up_proj` and `down_proj` become int8, float8_e4m3fn or packed int4 (uint8) parameters, with
float32 dequantization multipliers beside them under transformers' FP8 names,
`gate_up_proj_scale_inv` and `down_proj_scale_inv` (weight = q x scale_inv),
in the layouts ragged-dot-tpu reads (its `common/quant.py`); the float originals are
released. Biases, routers and shared experts (plain MLPs, not experts
modules) are left alone.

- int8: symmetric, one scale per output channel: scale_inv = max|w| / 127
  over the channel's inputs, q = round(w / scale_inv) (a zero channel gets
  scale_inv 1).
- int4: symmetric, one scale per output channel, scale_inv = r x max|w| / 7
  with the clipping ratio r of INT4_CLIP_RATIOS whose codes give the channel
  the least squared error (4 bits leave 15 levels: clipping a channel's few
  largest weights gives all the others finer steps), q = round(w /
  scale_inv) clamped to [-7, 7], packed two per byte by the kernel's
  own `pack_int4` (its layout: ragged-dot-tpu's `common/quant.py`). A weight
  whose packed dim is not a multiple of 64 rows stays float (the report
  says so). Not served on TPU7x (the kernel's `NOT_SERVED`: fp8 there).
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
INT4 = "int4"
SCHEMES = (INT8, FP8, INT4)
FP8_BLOCK = 128
_FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
_INT8_MAX = 127
_INT4_MAX = 7
INT4_CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)
PROJECTIONS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class QuantizedModule:
    """Bytes of one experts module's projections before (float) and after (one-byte weights plus scales)."""

    name: str
    bytes_before: int
    bytes_after: int


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _per_channel(weight: torch.Tensor, out_axis: int, q_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel codes in [-q_max, q_max] (int8) and their float32 scale_inv `[E, D_out]`."""
    contraction = 3 - out_axis
    values = weight.detach().float()
    amax = values.abs().amax(dim=contraction)
    scale_inv = torch.where(amax > 0, amax / q_max, torch.ones_like(amax))
    q = torch.round(values / scale_inv.unsqueeze(contraction)).clamp(-q_max, q_max).to(torch.int8)
    return q, scale_inv


def quantize_int8(weight: torch.Tensor, out_axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight[E, D1, D2]` -> (int8 q, float32 scale_inv `[E, D_out]`), one scale per output channel (`out_axis`)."""
    return _per_channel(weight, out_axis, _INT8_MAX)


def quantize_int4(weight: torch.Tensor, out_axis: int, kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight[E, D1, D2]` -> (packed uint8 q, float32 scale_inv `[E, D_out]`), one scale per output channel,
    packed by `kernel` (ragged-dot-tpu) as it reads them."""
    q, scale_inv = int4_codes(weight, out_axis)
    return kernel.pack_int4(q), scale_inv


def int4_codes(weight: torch.Tensor, out_axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight[E, D1, D2]` -> (int8 codes in [-7, 7], float32 scale_inv `[E, D_out]`): one scale per output
    channel, at the clipping ratio of INT4_CLIP_RATIOS with the least squared error."""
    contraction = 3 - out_axis
    values = weight.detach().float()
    amax = values.abs().amax(dim=contraction)
    best_q, best_scale, best_error = None, None, None
    for ratio in INT4_CLIP_RATIOS:
        scale_inv = torch.where(amax > 0, amax * ratio / _INT4_MAX, torch.ones_like(amax))
        q = torch.round(values / scale_inv.unsqueeze(contraction)).clamp(-_INT4_MAX, _INT4_MAX)
        error = (q * scale_inv.unsqueeze(contraction) - values).square().sum(dim=contraction)
        if best_q is None:
            best_q, best_scale, best_error = q, scale_inv, error
            continue
        better = error < best_error
        best_q = torch.where(better.unsqueeze(contraction), q, best_q)
        best_scale, best_error = torch.where(better, scale_inv, best_scale), torch.minimum(error, best_error)
    return best_q.to(torch.int8), best_scale


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


def quantize_weight(weight: torch.Tensor, scheme: str, out_axis: int, kernel) -> tuple[torch.Tensor, torch.Tensor]:
    if scheme == INT8:
        return quantize_int8(weight, out_axis)
    if scheme == INT4:
        return quantize_int4(weight, out_axis, kernel)
    return quantize_fp8(weight)


def check_scheme(scheme: str | None) -> None:
    if scheme is not None and scheme not in SCHEMES:
        raise ValueError(f"quantize_experts must be None, 'int8', 'fp8' or 'int4', got {scheme!r}")


def why_not_quantized(module: torch.nn.Module, scheme: str, kernel) -> str | None:
    """Why `kernel` cannot take `module`'s weights in `scheme`, or None (int4: both projections packable)."""
    if scheme != INT4:
        return None
    for projection in PROJECTIONS:
        why = kernel.int4_packable(tuple(getattr(module, projection).shape))
        if why is not None:
            return f"{projection}: {why}"
    return None


def quantize_experts_module(name: str, module: torch.nn.Module, scheme: str, kernel) -> QuantizedModule:
    """Replace `module`'s float gate_up_proj and down_proj by quantized weights (as `kernel`, ragged-dot-tpu,
    reads them) and their `*_scale_inv`."""
    out_axis = 2 if module.is_transposed else 1
    before = after = 0
    for projection in PROJECTIONS:
        weight = getattr(module, projection)
        if not weight.dtype.is_floating_point or weight.element_size() == 1:
            raise ValueError(f"{name}.{projection} is {weight.dtype}: only float weights are quantized")
        q, scale_inv = quantize_weight(weight, scheme, out_axis, kernel)
        before += _bytes(weight)
        after += _bytes(q) + _bytes(scale_inv)
        # Replacing the parameters drops the module's references to the float originals.
        setattr(module, projection, torch.nn.Parameter(q, requires_grad=False))
        setattr(module, f"{projection}_scale_inv", torch.nn.Parameter(scale_inv, requires_grad=False))
    return QuantizedModule(name, before, after)
