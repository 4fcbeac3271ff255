"""transformers entry points: an AttentionInterface function and its mask function.

Register both under one name (a name without "flash" in it: transformers
treats any implementation whose name contains "flash" as a FlashAttention
variant and hands it 2-D padding masks):

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register("tpu_attention", attention_tpu.attention_forward)
    AttentionMaskInterface.register("tpu_attention", attention_tpu.attention_mask)
    model.set_attn_implementation("tpu_attention")

Without the mask registration transformers builds no mask at all for an
unknown implementation name, and padded batches would silently attend to
their padding.
"""

from __future__ import annotations

import torch

from .ops import flash_attention
from .padding import Buckets


def attention_mask(*args, **kwargs):
    """Mask function for AttentionMaskInterface: transformers' own sdpa masks.

    They are boolean [B, 1, Sq, Skv] (True = attend), or None when the mask is
    plain causal (or full, for a single query) without padding; in that case
    `attention_forward` applies causality itself with sdpa's conventions.
    """
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


_UNSUPPORTED_KWARGS = {"position_bias": "additive position biases"}


def _reject_unsupported(dropout: float, kwargs: dict) -> None:
    """Raises ValueError for what the kernel does not compute: dropout, position biases, attention weights, paged
    caches."""
    if dropout:
        raise ValueError(
            f"attention dropout ({dropout}) is not supported by the TPU attention kernel. Set the model's "
            "attention_dropout to 0 (or call model.eval() for inference)."
        )
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"the TPU attention kernel does not support {what} (got `{name}`)")
    if kwargs.get("output_attentions"):
        raise ValueError("the TPU attention kernel cannot return attention weights (output_attentions=True)")
    cache = kwargs.get("cache")
    if cache is not None:
        raise ValueError(
            f"attention_forward does not read paged caches (got {type(cache).__name__}): for continuous batching "
            "select the kernel's flash-attn API, attn_implementation=\"<org>/attention-tpu:flash_attn_varlen_func\"")


def transformers_masking(attention_mask: torch.Tensor | None, buckets: Buckets, *, is_causal: bool,
                         sliding_window: int | None) -> dict:
    """The kernel's masking options for the mask transformers hands an attention function (`attention_mask` above
    made it), at the bucketed sizes.

    None means sdpa's conventions for a skipped mask: causal only with more than one query, aligned top-left (query
    i sees keys 0..i), which transformers only skips to when that equals the bottom-right alignment or the cache was
    empty; a single query sees every key. A 4-D mask carries padding, sliding windows and cache offsets itself; one
    built for a longer static cache is cut to the keys present, as eager attention does.
    """
    q_len, kv_len = buckets.q_len, buckets.kv_len
    if attention_mask is None:
        causal = bool(is_causal) and q_len > 1
        # Without causality or a window, the queries' offset hides no key: it stays the kernel's default.
        return dict(causal=causal, q_offset=0 if causal else None, sliding_window=sliding_window if causal else None)
    if attention_mask.dim() != 4:
        raise ValueError(
            f"attention_mask must be a 4-D mask [B, 1, Sq, Skv] (register `attention_mask` from this kernel in "
            f"transformers' AttentionMaskInterface), got shape {tuple(attention_mask.shape)}"
        )
    return dict(causal=False, attention_mask=buckets.mask(attention_mask[:, :, :, :kv_len]))


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers AttentionInterface function running the Pallas TPU kernel.

    query [B, Hq, Sq, D], key [B, Hkv, Skv, D], value [B, Hkv, Skv, Dv] (no
    repeat of K/V for GQA; Dv = D but for latent attention, e.g. 192 and
    128); returns ([B, Sq, Hq, Dv], None). `sliding_window` and `softcap` are
    read from kwargs, else from the module (`sliding_window`,
    `attn_logit_softcapping`); attention sinks from the `s_aux` kwarg
    (GPT-OSS passes its `sinks` parameter so) or `sinks`. Differentiable:
    gradients reach query, key, value and the sinks.

    Query and key lengths are padded to their buckets and the batch to a power
    of two (`padding.py`), so a model compiles the kernel once per bucket, not
    once per prompt length, generated token or batch size; the result is that
    of the unpadded call.

    The mask is what `attention_mask` (above) produced: a boolean or additive
    4-D mask carries padding, sliding windows and cache offsets itself; None
    means causal (upper-left aligned, as sdpa's `is_causal`) for more than one
    query, and every key for a single query.
    """
    _reject_unsupported(dropout, kwargs)
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    sliding_window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    softcap = kwargs.get("softcap", getattr(module, "attn_logit_softcapping", None))
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    # Padded to buckets (padding.py): the real key lengths hide the padded keys (and the padded sequences, which
    # have none), the real offsets place the queries.
    buckets = Buckets.of(batch, q_len, kv_len)
    query = buckets.queries(query)
    key, value = buckets.keys(key), buckets.keys(value)
    masking = transformers_masking(attention_mask, buckets, is_causal=is_causal, sliding_window=sliding_window)
    out = flash_attention(query, key, value, scale=scaling, kv_lengths=buckets.key_lengths(query.device),
                          softcap=softcap, sinks=sinks, **masking)
    out = buckets.unpadded(out)
    return out.transpose(1, 2).contiguous(), None


# Read by tpu_kernels.integration.kernelize: differentiable (backward kernels, torch autograd), and traceable by
# torch.compile(fullgraph=True).
attention_forward.has_backward = True
attention_forward.can_torch_compile = True
