"""The torch op of latent attention (`latent/kernel.py`: multi-head latent attention in its absorbed form, over
transformers' compressed MLA cache) and the one place its inputs are checked.

Inference only: the kernel has no backward, so the op refuses inputs that would need one (training takes the
expanded form through the differentiable flash kernel).
"""

from __future__ import annotations

import math

import jax
import torch

from ._ops import add_op_namespace_prefix, jax_torch_op
from .common.latent import default_scale
from .latent.kernel import latent_attention as _jax_latent_attention
from .ops import FLOAT_DTYPES, check_tensor, is_integer_dtype


@jax_torch_op(add_op_namespace_prefix("latent_attention"))
def _latent_attention(
    q_latent: jax.Array,
    q_rope: jax.Array | None,
    latent: jax.Array,
    rope: jax.Array | None,
    q_offset: jax.Array | None,
    kv_lengths: jax.Array,
    attention_mask: jax.Array | None,
    sinks: jax.Array | None,
    scale: float,
    causal: bool,
) -> jax.Array:
    """q_rope and rope None: no rope keys (R = 0); q_offset None: the default, S - Sq."""
    return _jax_latent_attention(q_latent, q_rope, latent, rope, scale=scale, causal=causal, q_offset=q_offset,
                                 kv_lengths=kv_lengths, attention_mask=attention_mask, sinks=sinks)


def _check_arrays(q_latent, q_rope, latent, rope) -> None:
    """The four arrays' types, shapes and dtypes, in torch terms."""
    check_tensor("q_latent", q_latent, 4, "[batch, heads, q_len, kv_lora_rank]")
    check_tensor("latent", latent, 4, "[batch, 1, kv_len, kv_lora_rank]")
    batch, heads, q_len, latent_dim = q_latent.shape
    if latent.shape[0] != batch or latent.shape[1] != 1 or latent.shape[3] != latent_dim:
        raise ValueError(f"latent must have shape ({batch}, 1, kv_len, {latent_dim}) (one KV head, q_latent's batch "
                         f"and width), got {tuple(latent.shape)}")
    if (q_rope is None) != (rope is None):
        raise ValueError("q_rope and rope must both be given or both be None (no rope keys)")
    if q_rope is not None:
        check_tensor("q_rope", q_rope, 4, "[batch, heads, q_len, rope_dim]")
        check_tensor("rope", rope, 4, "[batch, 1, kv_len, rope_dim]")
        rope_dim = q_rope.shape[-1]
        if tuple(q_rope.shape) != (batch, heads, q_len, rope_dim):
            raise ValueError(f"q_rope must have shape ({batch}, {heads}, {q_len}, rope_dim) like q_latent, got "
                             f"{tuple(q_rope.shape)}")
        if tuple(rope.shape) != (batch, 1, latent.shape[2], rope_dim):
            raise ValueError(f"rope must have shape ({batch}, 1, {latent.shape[2]}, {rope_dim}) (latent's keys, "
                             f"q_rope's width), got {tuple(rope.shape)}")
    if q_latent.dtype not in FLOAT_DTYPES:
        raise TypeError(f"q_latent must be float32 or bfloat16, got {q_latent.dtype}")
    dtypes = [t.dtype for t in (q_latent, q_rope, latent, rope) if t is not None]
    if any(dtype != q_latent.dtype for dtype in dtypes):
        raise TypeError(f"q_latent, q_rope, latent and rope must share one dtype, got {dtypes}")


def _check_options(q_latent, latent, *, scale, q_offset, kv_lengths, attention_mask, sinks) -> list[torch.Tensor]:
    """The options' types, shapes and dtypes, in torch terms; the tensors among them."""
    batch, heads, q_len, _ = q_latent.shape
    kv_len = latent.shape[2]
    tensors = []
    if isinstance(q_offset, torch.Tensor):
        if tuple(q_offset.shape) != (batch,) or not is_integer_dtype(q_offset.dtype):
            raise ValueError(f"q_offset must be an int or an integer tensor of shape ({batch},), "
                             f"got {q_offset.dtype} {tuple(q_offset.shape)}")
        tensors.append(q_offset)
    elif q_offset is not None and (isinstance(q_offset, bool) or not isinstance(q_offset, int)):
        raise TypeError(f"q_offset must be an int, an integer tensor [batch] or None, got {type(q_offset).__name__}")
    if kv_lengths is not None:
        check_tensor("kv_lengths", kv_lengths)
        if tuple(kv_lengths.shape) != (batch,) or not is_integer_dtype(kv_lengths.dtype):
            raise ValueError(f"kv_lengths must be an integer tensor of shape ({batch},), "
                             f"got {kv_lengths.dtype} {tuple(kv_lengths.shape)}")
        tensors.append(kv_lengths)
    if attention_mask is not None:
        check_tensor("attention_mask", attention_mask)
        shape = tuple(attention_mask.shape)
        if len(shape) != 4 or shape[0] not in (1, batch) or shape[1] != 1 or shape[2:] != (q_len, kv_len):
            raise ValueError(f"attention_mask must have shape ({batch} or 1, 1, {q_len}, {kv_len}), got {shape}")
        if attention_mask.dtype not in (torch.bool, torch.int8) and not attention_mask.dtype.is_floating_point:
            raise TypeError("attention_mask must be bool or int8 (nonzero = attend) or floating (additive), "
                            f"got {attention_mask.dtype}")
        tensors.append(attention_mask)
    if sinks is not None:
        check_tensor("sinks", sinks)
        if tuple(sinks.shape) != (heads,):
            raise ValueError(f"sinks must have shape ({heads},) (one per query head), got {tuple(sinks.shape)}")
        if sinks.dtype not in FLOAT_DTYPES:
            raise TypeError(f"sinks must be float32 or bfloat16, got {sinks.dtype}")
        tensors.append(sinks)
    # A comparison, not math.isfinite: torch.compile may trace the scale as a symbolic float.
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not -math.inf < scale < math.inf):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    return tensors


def latent_attention(q_latent: torch.Tensor, q_rope: torch.Tensor | None, latent: torch.Tensor,
                     rope: torch.Tensor | None, *, scale: float | None = None, causal: bool = True,
                     q_offset: int | torch.Tensor | None = None, kv_lengths: torch.Tensor | None = None,
                     attention_mask: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Multi-head latent attention in its absorbed form over the latent cache -> [B, H, Sq, L] (inference only).

    q_latent [B, H, Sq, L] (the query's no-rope part through W_UK) and q_rope [B, H, Sq, R]; latent [B, 1, S, L]
    and rope [B, 1, S, R], the compressed cache transformers keeps (`kv_nope`, `k_rot`), read in place. q_rope and
    rope may both be None (or R = 0). logits = scale * (q_latent . latent + q_rope . rope) (scale default
    (L + R) ** -0.5: pass the model's), output = softmax(logits) @ latent (apply W_UV to it); float32 or bfloat16,
    one for all four.

    causal (default True); q_offset: the cache position of the first query (an int or an integer tensor [B];
    default S - Sq); kv_lengths: integer tensor [B], keys at and past it are masked (clipped to [0, S]);
    attention_mask [B or 1, 1, Sq, S]: bool or int8 (nonzero = attend) or floating (additive; values at the
    dtype's minimum mask the key out), combined with the above; sinks [H] float32 or bfloat16: one logit per query
    head that joins every row's softmax denominator and attends to nothing (HY-v4's `s_aux`; not scaled). Rows that
    see no key come out as zeros, with sinks too; empty inputs run no kernel. Refuses inputs that require grad while
    grad is enabled.
    """
    _check_arrays(q_latent, q_rope, latent, rope)
    options = _check_options(q_latent, latent, scale=scale, q_offset=q_offset, kv_lengths=kv_lengths,
                             attention_mask=attention_mask, sinks=sinks)
    arrays = [t for t in (q_latent, q_rope, latent, rope) if t is not None]
    devices = {t.device for t in arrays + options}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in arrays + options):
        raise ValueError("latent attention is inference-only: q_latent, q_rope, latent, rope, attention_mask and sinks "
                         "must not require grad (or run under torch.no_grad()); train with the expanded form through "
                         "flash_attention")
    batch, _, q_len, latent_dim = q_latent.shape
    kv_len = latent.shape[2]
    if q_rope is not None and q_rope.shape[-1] == 0:
        q_rope = rope = None
    rope_dim = 0 if q_rope is None else q_rope.shape[-1]
    scale = default_scale(latent_dim, rope_dim) if scale is None else float(scale)
    # The default offset stays implicit (the grid is then sized exactly); any other is a tensor, so that it costs no
    # recompilation.
    if q_offset is None or (isinstance(q_offset, int) and q_offset == kv_len - q_len):
        q_offset = None
    elif isinstance(q_offset, int):
        q_offset = torch.full((batch,), q_offset, dtype=torch.int32, device=q_latent.device)
    else:
        q_offset = q_offset.to(torch.int32)
    if kv_lengths is None:
        kv_lengths = torch.full((batch,), kv_len, dtype=torch.int32, device=q_latent.device)
    # Clamped as int64: torch clamps no unsigned dtype wider than uint8.
    kv_lengths = kv_lengths.to(torch.int64).clamp(0, kv_len).to(torch.int32)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = attention_mask.to(torch.int8)
    return _latent_attention(q_latent, q_rope, latent, rope, q_offset, kv_lengths, attention_mask, sinks, scale,
                             bool(causal))
