"""The torch op of the attention kernel and the one place its inputs are checked.

The JAX functions (`flash/kernel.py`, `flash_backward/kernel.py`) assume valid
inputs. The op's gradients are those of `flash.kernel.differentiable_flash_attention`
(a `jax.custom_vjp`), which the binding hands to torch autograd.
"""

from __future__ import annotations

import math

import jax
import torch

from ._ops import add_op_namespace_prefix, jax_torch_op
from .common.head_dims import head_dims_refusal
from .common.masking import Attention
from .flash.kernel import differentiable_flash_attention

FLOAT_DTYPES = (torch.float32, torch.bfloat16)


@jax_torch_op(add_op_namespace_prefix("flash_attention"))
def _flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_offset: jax.Array | None,
    kv_lengths: jax.Array,
    attention_mask: jax.Array | None,
    sinks: jax.Array | None,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    softcap: float | None,
) -> jax.Array:
    """q_offset None: the default, Skv - Sq. Differentiable in q, k, v and the sinks
    (`flash.kernel.differentiable_flash_attention`)."""
    return differentiable_flash_attention(q, k, v, scale=scale, causal=causal, q_offset=q_offset,
                                          kv_lengths=kv_lengths, sliding_window=sliding_window, softcap=softcap,
                                          attention_mask=attention_mask, sinks=sinks)


def check_tensor(name: str, value, rank: int | None = None, layout: str = "") -> None:
    """TypeError unless `value` is a torch.Tensor; ValueError unless it has `rank` dimensions (`layout`), if given."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if rank is not None and value.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(value.shape)}")


def is_integer_dtype(dtype: torch.dtype) -> bool:
    """Any of torch's integer dtypes, signed or unsigned (bool is not one)."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def check_attention_args(query, key, value, attention: Attention) -> None:
    """Types, shapes, dtypes and devices of a call, in torch terms."""
    scale, q_offset, kv_lengths = attention.scale, attention.q_offset, attention.kv_lengths
    sliding_window, softcap, attention_mask, sinks = (attention.sliding_window, attention.softcap,
                                                      attention.attention_mask, attention.sinks)
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, tensor)
        if tensor.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq, head_dim], got shape {tuple(tensor.shape)}")
    if key.shape[:3] != value.shape[:3]:
        raise ValueError(f"key and value must have the same shape but for the head_dim (the last), got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    batch, q_heads, q_len, head_dim = query.shape
    kv_batch, kv_heads, kv_len, kv_head_dim = key.shape
    if kv_batch != batch:
        raise ValueError(f"query and key must have the same batch size, got {batch} and {kv_batch}")
    if kv_head_dim != head_dim:
        raise ValueError(f"query and key must have the same head_dim, got {head_dim} and {kv_head_dim}")
    refusal = head_dims_refusal(head_dim, value.shape[3])
    if refusal:
        raise ValueError(refusal)
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(
            f"the number of query heads ({q_heads}) must be a multiple of the number of key/value heads ({kv_heads})"
        )
    if query.dtype not in FLOAT_DTYPES:
        raise TypeError(f"query must be float32 or bfloat16, got {query.dtype}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    devices = {query.device, key.device, value.device}
    if isinstance(q_offset, torch.Tensor):
        if tuple(q_offset.shape) != (batch,) or not is_integer_dtype(q_offset.dtype):
            raise ValueError(
                f"q_offset must be an int or an integer tensor of shape ({batch},), "
                f"got {q_offset.dtype} {tuple(q_offset.shape)}"
            )
        devices.add(q_offset.device)
    elif q_offset is not None and (isinstance(q_offset, bool) or not isinstance(q_offset, int)):
        raise TypeError(f"q_offset must be an int, an integer tensor [batch] or None, got {type(q_offset).__name__}")
    if kv_lengths is not None:
        check_tensor("kv_lengths", kv_lengths)
        if tuple(kv_lengths.shape) != (batch,) or not is_integer_dtype(kv_lengths.dtype):
            raise ValueError(
                f"kv_lengths must be an integer tensor of shape ({batch},), "
                f"got {kv_lengths.dtype} {tuple(kv_lengths.shape)}"
            )
        devices.add(kv_lengths.device)
    if attention_mask is not None:
        check_tensor("attention_mask", attention_mask)
        shape = tuple(attention_mask.shape)
        if len(shape) != 4 or shape[0] not in (1, batch) or shape[1] != 1 or shape[2:] != (q_len, kv_len):
            raise ValueError(f"attention_mask must have shape ({batch} or 1, 1, {q_len}, {kv_len}), got {shape}")
        if attention_mask.dtype != torch.bool and not attention_mask.dtype.is_floating_point:
            raise TypeError(
                f"attention_mask must be bool (True = attend) or floating (additive), got {attention_mask.dtype}")
        if attention_mask.requires_grad:
            raise ValueError(
                "attention_mask must not require grad: the kernel does not differentiate the additive mask")
        devices.add(attention_mask.device)
    if sinks is not None:
        check_tensor("sinks", sinks)
        if tuple(sinks.shape) != (q_heads,) or sinks.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"sinks must be a float32/bfloat16 tensor of shape ({q_heads},) (one per query head), "
                f"got {sinks.dtype} {tuple(sinks.shape)}"
            )
        devices.add(sinks.device)
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    # A comparison, not math.isfinite: torch.compile may trace the scale as a symbolic float.
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not -math.inf < scale < math.inf):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")


def flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **options) -> torch.Tensor:
    """Attention of query[B, Hq, Sq, D] over key[B, Hkv, Skv, D] and value[B, Hkv, Skv, Dv] -> [B, Hq, Sq, Dv];
    differentiable.

    Hq must be a multiple of Hkv (query head h uses KV head h // (Hq // Hkv));
    D and Dv (equal, or not: latent attention's 192 and 128, 576 and 512)
    each a multiple of 8 up to 576 (`supports_head_dims`); dtypes float32 or
    bfloat16 (one for all three).

    `options` are those of `masking.Attention`, with tensors for its arrays:
    scale (default D ** -0.5), causal (default True), q_offset (an int or an integer tensor [B]),
    kv_lengths (integer tensor [B], values clipped to [0, Skv]),
    sliding_window, softcap, attention_mask (bool, True = attend, or
    floating, additive; a floating mask that requires grad is refused) and
    sinks ([Hq] float32/bfloat16).

    Rows that see no key at all come out as zeros (with sinks: too); so does
    every row when there are no keys. Empty inputs (batch, heads, query or key
    length 0) run no kernel. Autograd runs the backward Pallas kernels for
    query, key, value and sinks.
    """
    attention = Attention(**options)
    check_attention_args(query, key, value, attention)
    q_offset, kv_lengths, attention_mask = attention.q_offset, attention.kv_lengths, attention.attention_mask
    batch, _, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    device = query.device
    # The default offset stays implicit: the kernels then know it while tracing and size their grids exactly
    # (self-attention in training always has it). Any other offset is a tensor, so that it costs no recompilation.
    if q_offset is None or (isinstance(q_offset, int) and q_offset == kv_len - q_len):
        q_offset = None
    elif isinstance(q_offset, int):
        q_offset = torch.full((batch,), q_offset, dtype=torch.int32, device=device)
    else:
        q_offset = q_offset.to(torch.int32)
    if kv_lengths is None:
        kv_lengths = torch.full((batch,), kv_len, dtype=torch.int32, device=device)
    # Clamped as int64: torch clamps no unsigned dtype wider than uint8.
    kv_lengths = kv_lengths.to(torch.int64).clamp(0, kv_len).to(torch.int32)
    scale = float(head_dim**-0.5 if attention.scale is None else attention.scale)
    softcap = None if attention.softcap is None else float(attention.softcap)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = attention_mask.to(torch.int8)
    return _flash_attention(query, key, value, q_offset, kv_lengths, attention_mask, attention.sinks, scale,
                            bool(attention.causal), attention.sliding_window, softcap)
