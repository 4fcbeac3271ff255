"""Packed int4 weights on the torch side: the layout `quant.py` describes, packed and unpacked.

`pack_int4` is what a checkpoint converter (or `kernelize(...,
quantize_experts="int4")`) calls on a weight's integer codes; the kernels
read its output as they stream weights.
"""

from __future__ import annotations

import torch

from .quant import INT4_PACK_ROWS, int4_packable, int4_packed_axis, int4_unpacked_shape

INT4_MIN, INT4_MAX = -8, 7


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Integer codes in [-8, 7] of a `[G, D1, D2]` weight (any integer dtype) -> its packed uint8 form: half as
    long along `quant.int4_packed_axis`, whose length must be a multiple of `quant.INT4_PACK_ROWS`."""
    if codes.dim() != 3 or codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise ValueError(f"int4 codes must be an integer [G, D1, D2] tensor, got {codes.dtype} {list(codes.shape)}")
    why = int4_packable(tuple(codes.shape))
    if why is not None:
        raise ValueError(f"cannot pack a {list(codes.shape)} weight as int4: {why}")
    if codes.numel() and (codes.min() < INT4_MIN or codes.max() > INT4_MAX):
        raise ValueError(f"int4 codes must lie in [{INT4_MIN}, {INT4_MAX}]")
    axis = int4_packed_axis(tuple(codes.shape))
    # [.., blocks, 2 (low / high nibble), INT4_PACK_ROWS / 2, ..] along the packed axis.
    shape = list(codes.shape)
    blocked = codes.to(torch.int32).unflatten(axis, (shape[axis] // INT4_PACK_ROWS, 2, INT4_PACK_ROWS // 2))
    low, high = blocked.unbind(axis + 1)
    packed = (low & 0xF) | ((high & 0xF) << 4)
    return packed.flatten(axis, axis + 1).to(torch.uint8)


def unpack_int4(packed: torch.Tensor, known_dim: int, known_axis: int) -> torch.Tensor:
    """The int8 codes of a packed `[G, a, b]` uint8 weight whose dim `known_axis` (1 or 2) is `known_dim` unpacked
    (`quant.int4_unpacked_shape`)."""
    shape = int4_unpacked_shape(tuple(packed.shape), known_dim, known_axis)
    if shape is None:
        raise ValueError(f"a packed int4 weight of shape {list(packed.shape)} cannot have dim {known_axis} = "
                         f"{known_dim} unpacked")
    axis = 1 if shape[1] != packed.shape[1] else 2
    blocked = packed.to(torch.int32).unflatten(axis, (packed.shape[axis] // (INT4_PACK_ROWS // 2),
                                                      INT4_PACK_ROWS // 2))
    low = ((blocked & 0xF) ^ 8) - 8
    high = ((blocked >> 4) ^ 8) - 8
    return torch.stack([low, high], axis + 1).flatten(axis, axis + 2).to(torch.int8)
