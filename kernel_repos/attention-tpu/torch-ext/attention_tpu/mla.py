"""Latent attention (MLA) for transformers' `expand_kv` architectures (DeepSeek-V2/V3/V3.2, Kimi, GLM-4.7-Flash,
Mistral 4, LongCat-Flash, ...): attention over the latent cache, never re-expanded per step.

transformers caches an MLA layer's compressed latent, `kv_nope` [B, 1, S, L] and `k_rot` [B, 1, S, R], and
at every call its `expand_kv` runs `kv_b_proj` over every cached token into per-head keys [B, H, S, nope + R]
and values [B, H, S, v] before calling the attention function. `serve_latent(module)` replaces that module's
`expand_kv` with one that hands the latent through as it is (in the key and value slots), and
`latent_attention_forward`, the attention function, takes one of two forms per call:

* absorbed: W_UK (the key half of `kv_b_proj`) folds into the query, q_latent = q_nope @ W_UK [B, H, Sq, L];
  attention runs over the latent cache as one shared KV head (`latent_ops.latent_attention`: keys L + R wide,
  values the latent itself, all heads of a sequence in one block, the cache read once); W_UV (the value half)
  maps the latent output to [B, H, Sq, v]. Inference only.
* expanded: the module's own `expand_kv` once, then the flash kernel with key and value head dims nope + R and v
  (`attention.attention_forward`). Differentiable.

A call whose result needs a gradient takes the expanded form. Any other takes whichever `absorbed_is_cheaper`
prices lower on this TPU generation: a decode step or a short chunk over a long cache the absorbed form (it
reads the latent once instead of expanding every cached token), a prefill from an empty cache the expanded form
(its attention multiplies nope + R + v wide rows instead of 2L + R wide ones).

Continuous batching (transformers' `generate_batch`, under a name holding "flash") calls it packed: every sequence
of the step in one row, each sequence's latent gathered from the pages after the one before, and no mask (a
sequence's queries are the last of its keys). Both forms serve it: the absorbed form over the sequences laid out as
a batch (`padding.PackedBuckets`), the expanded form through `flash_attn_varlen_func`.

DeepSeek Sparse Attention models (V3.2, GLM-MoE-DSA, ...) hand a non-eager attention function the indexer's
top-k key indices as `indices` [B, Sq, k] instead of folding them into the mask: both forms fold them in
(`with_selected_keys`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types

import torch

from ._hardware import TpuGeneration, resolve_target
from .attention import attention_forward, transformers_masking
from .common.latent import LatentProblem
from .common.masking import Problem, static_kv_passes
from .flash import tiles as flash_tiles
from .flash_api import flash_attn_varlen_func
from .latent import plan as latent_plan
from .latent_ops import latent_attention
from .padding import Buckets, PackedBuckets


def _keep_latent(module, kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`expand_kv` of a module `serve_latent` set up: the cached latent, unexpanded."""
    return kv_nope, k_rot


def serve_latent(module: torch.nn.Module) -> None:
    """Make this MLA attention module hand its cached latent to the attention function unexpanded (its own
    `expand_kv` is kept on its class: the expanded form calls it)."""
    module.expand_kv = types.MethodType(_keep_latent, module)


def serves_latent(module: torch.nn.Module) -> bool:
    """Whether `serve_latent` set this module up."""
    return getattr(getattr(module, "expand_kv", None), "__func__", None) is _keep_latent


def latent_refusal(module: torch.nn.Module) -> str | None:
    """Why this module's attention cannot run over its latent (then kernelize leaves it alone); None if it can."""
    for name in ("qk_nope_head_dim", "v_head_dim", "kv_b_proj"):
        if getattr(module, name, None) is None:
            return f"{type(module).__name__} has no `{name}`"
    if not callable(getattr(type(module), "expand_kv", None)):
        return f"{type(module).__name__} has no expand_kv"
    weight = getattr(module.kv_b_proj, "weight", None)
    per_head = module.qk_nope_head_dim + module.v_head_dim
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] % per_head:
        return f"kv_b_proj of {type(module).__name__} is not a linear map of {per_head} outputs per head"
    if not weight.dtype.is_floating_point:
        return f"kv_b_proj's weight is {weight.dtype} (quantized), which the absorbed form cannot fold into queries"
    if getattr(module.kv_b_proj, "bias", None) is not None:
        return "kv_b_proj has a bias"
    return None


@dataclasses.dataclass(frozen=True)
class LatentShape:
    """One MLA attention call's sizes: heads, the per-head dims (nope + rope for keys, v for values), the latent
    width L, and the batch, query and key lengths."""

    heads: int
    nope: int
    rope: int
    v: int
    latent: int
    batch: int
    q_len: int
    kv_len: int
    itemsize: int

    @property
    def visible_pairs(self) -> int:
        """Causal (query, key) pairs per head and sequence, queries last in the keys."""
        q_len, kv_len = self.q_len, self.kv_len
        if q_len > kv_len:  # the first q_len - kv_len queries sit before the first key and see none
            return kv_len * (kv_len + 1) // 2
        return q_len * (kv_len - q_len + 1) + q_len * (q_len - 1) // 2


def _streams(shape: LatentShape, target: TpuGeneration) -> tuple[float, float]:
    """How many times each form's kernel streams its keys and values on `target`, by the tiles it would pick: the
    flash kernel's per-head keys and values (once per query block that sees them), and the latent kernel's cache
    (once per query block and block of heads)."""
    dtype = {2: "bfloat16", 4: "float32"}[shape.itemsize]
    expanded = Problem.of_shape(q_heads=shape.heads, kv_heads=shape.heads, q_len=shape.q_len, kv_len=shape.kv_len,
                                head_dim=shape.nope + shape.rope, v_head_dim=shape.v, dtype=dtype)
    flash = flash_tiles.select(expanded, target)
    absorbed = LatentProblem.of_shape(heads=shape.heads, q_len=shape.q_len, kv_len=shape.kv_len,
                                      latent_dim=shape.latent, rope_dim=shape.rope, dtype=dtype)
    latent = latent_plan.make(absorbed, target)
    query_block = shape.q_len if latent.packed else latent.block_q
    latent_passes = (static_kv_passes(absorbed.attention, query_block, latent.block_kv)
                     * math.ceil(shape.heads / latent.heads_per_step))
    return static_kv_passes(expanded, flash.block_q, flash.block_kv), latent_passes


def form_costs(shape: LatentShape, target: TpuGeneration) -> dict[str, tuple[float, float]]:
    """(flops, HBM bytes) of each form of one call on `target`, as the roofline `absorbed_is_cheaper` weighs them.

    Expanded: `kv_b_proj` over every cached token, its output written, the keys assembled (k_nope read, keys
    written, as transformers' `expand_kv` does), then the flash kernel streaming keys and values (`_streams`), q
    and the output. Absorbed: the query through W_UK and the output through W_UV per query, the latent kernel
    streaming the cache (`_streams`), the latent-wide query and output written and read once each.
    """
    s, b, h = shape.itemsize, shape.batch, shape.heads
    qk, latent_key = shape.nope + shape.rope, shape.latent + shape.rope
    pairs, cached, queries = shape.visible_pairs * b * h, shape.kv_len * b, shape.q_len * b * h
    flash_streams, latent_streams = _streams(shape, target)
    expanded_flops = 2 * cached * h * shape.latent * (shape.nope + shape.v) + 2 * pairs * (qk + shape.v)
    expanded_bytes = s * (cached * latent_key + cached * h * (shape.nope + shape.v) + cached * h * (shape.nope + qk)
                          + flash_streams * cached * h * (qk + shape.v) + queries * (qk + shape.v))
    absorbed_flops = 2 * queries * shape.latent * (shape.nope + shape.v) + 2 * pairs * (latent_key + shape.latent)
    absorbed_bytes = s * (latent_streams * cached * latent_key
                          + queries * (qk + 2 * latent_key + 2 * shape.latent + shape.v))
    return {"expanded": (expanded_flops, expanded_bytes), "absorbed": (absorbed_flops, absorbed_bytes)}


def roofline_seconds(flops: float, hbm_bytes: float, target: TpuGeneration) -> float:
    """The time of work that neither the MXU nor HBM can do faster: the larger of the two."""
    return max(flops / target.device_bf16_flops_per_s, hbm_bytes / target.device_hbm_bytes_per_s)


@functools.lru_cache(maxsize=4096)
def absorbed_is_cheaper(shape: LatentShape, target: TpuGeneration) -> bool:
    """Whether the absorbed form's roofline time is below the expanded form's on `target` (remembered per shape:
    every layer of every step asks, and the kernels' tile selection is Python work)."""
    costs = {form: roofline_seconds(*work, target) for form, work in form_costs(shape, target).items()}
    return costs["absorbed"] < costs["expanded"]


def with_selected_keys(attention_mask: torch.Tensor | None, indices: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The 4-D mask [B or 1, 1, Sq, kv_len] that also hides every key the sparse indexer did not select.

    `indices` [B, Sq, k]: each query's selected key positions (-1 or out of range: none). Without a mask the
    queries are the last Sq positions and see keys up to their own (causal).
    """
    batch, q_len, _ = indices.shape
    valid = (indices >= 0) & (indices < kv_len)
    counts = torch.zeros(batch, q_len, kv_len, dtype=torch.int32, device=indices.device)
    selected = counts.scatter_add(-1, indices.clamp(0, max(kv_len - 1, 0)).long(), valid.to(torch.int32)) > 0
    selected = selected[:, None]
    if attention_mask is None:
        query_pos = torch.arange(kv_len - q_len, kv_len, device=indices.device)
        key_pos = torch.arange(kv_len, device=indices.device)
        return selected & (key_pos[None, :] <= query_pos[:, None])
    attention_mask = attention_mask[:, :, :, :kv_len]
    if attention_mask.dtype == torch.bool:
        return attention_mask & selected
    return attention_mask.masked_fill(~selected, torch.finfo(attention_mask.dtype).min)


def _needs_gradient(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _absorbed_query(module, query: torch.Tensor, latent: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_latent [B, H, Sq, L], q_rope [B, H, Sq, R], W_UV [H, L, v]): the query [B, H, Sq, nope + R] with W_UK
    folded into its no-rope part, and the value half of `kv_b_proj` for the output."""
    nope = module.qk_nope_head_dim
    weight = module.kv_b_proj.weight.view(-1, nope + module.v_head_dim, latent)  # [H, nope + v, L]
    q_latent = torch.matmul(query[..., :nope], weight[:, :nope])
    return q_latent, query[..., nope:], weight[:, nope:].transpose(1, 2)


def _absorbed(module, query: torch.Tensor, kv_nope: torch.Tensor, k_rot: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float | None, is_causal: bool,
              sinks: torch.Tensor | None) -> torch.Tensor:
    """[B, Sq, H, v]: the absorbed form of one call (query [B, H, Sq, nope + R])."""
    q_latent, q_rope, w_uv = _absorbed_query(module, query, kv_nope.shape[-1])
    batch, _, q_len, _ = query.shape
    buckets = Buckets.of(batch, q_len, kv_nope.shape[2])
    rope_width = k_rot.shape[-1]
    masking = transformers_masking(attention_mask, buckets, is_causal=is_causal, sliding_window=None)
    masking.pop("sliding_window", None)
    out_latent = latent_attention(
        buckets.queries(q_latent), buckets.queries(q_rope) if rope_width else None, buckets.keys(kv_nope),
        buckets.keys(k_rot) if rope_width else None, scale=scaling, kv_lengths=buckets.key_lengths(query.device),
        sinks=sinks, **masking)
    out = torch.matmul(buckets.unpadded(out_latent), w_uv)  # [B, H, Sq, v]
    return out.transpose(1, 2).contiguous()


def _packed(tensor: torch.Tensor) -> torch.Tensor:
    """A varlen call's [1, H, total, D] array as flash-attn's packed rows [total, H, D]."""
    return tensor[0].transpose(0, 1)


def _absorbed_packed(module, query: torch.Tensor, kv_nope: torch.Tensor, k_rot: torch.Tensor,
                     buckets: PackedBuckets, scaling: float | None, is_causal: bool,
                     sinks: torch.Tensor | None) -> torch.Tensor:
    """[1, total_q, H, v]: the absorbed form of a packed call (continuous batching's: query [1, H, total_q,
    nope + R], each sequence's latent gathered after the one before, kv_nope [1, 1, total_k, L] and k_rot
    [1, 1, total_k, R])."""
    q_latent, q_rope, w_uv = _absorbed_query(module, query, kv_nope.shape[-1])
    rope_width = k_rot.shape[-1]
    out_latent = latent_attention(
        buckets.queries(_packed(q_latent)), buckets.queries(_packed(q_rope)) if rope_width else None,
        buckets.keys(_packed(kv_nope)), buckets.keys(_packed(k_rot)) if rope_width else None, scale=scaling,
        causal=is_causal, q_offset=buckets.query_offsets(), kv_lengths=buckets.key_lengths(), sinks=sinks)
    out = torch.matmul(buckets.packed(out_latent, query.shape[2]).transpose(0, 1), w_uv)  # [H, total_q, v]
    return out.transpose(0, 1)[None].contiguous()


def _expanded_packed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict,
                     scaling: float | None, dropout: float, is_causal: bool, sliding_window: int | None,
                     softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """[1, total_q, H, v]: a packed call over expanded keys [1, H, total_k, nope + R] and values [1, H, total_k,
    v], through the kernel's `flash_attn_varlen_func` (a sliding window as transformers' flash path hands it)."""
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, sliding_window - 1)
    out = flash_attn_varlen_func(
        _packed(query), _packed(key), _packed(value), kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"],
        kwargs["max_length_q"], kwargs["max_length_k"], dropout_p=dropout, softmax_scale=scaling, causal=is_causal,
        window_size=window, softcap=softcap or 0.0, s_aux=sinks)
    return out[None]


def _options(module, kwargs: dict) -> tuple[bool, int | None, float | None, torch.Tensor | None]:
    """(is_causal, sliding_window, softcap, sinks) of one call: from the kwargs, else from the module."""
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    return (is_causal, kwargs.get("sliding_window", getattr(module, "sliding_window", None)),
            kwargs.get("softcap", getattr(module, "attn_logit_softcapping", None)), sinks)


def latent_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers AttentionInterface function for a model with MLA layers: ([B, Sq, H, v], None).

    For a module `serve_latent` set up, key and value are its cached latent, kv_nope [B, 1, S, L] and k_rot
    [B, 1, S, R], and the query [B, H, Sq, nope + R] is the module's; any other module's call (a model's
    attention layers that are not MLA) is `attention_forward`'s. The form (module docstring) follows from the
    shapes alone, so a compiled graph holds one.

    Continuous batching (`generate_batch`) calls it packed: B = 1, the sequences' queries and latents one after
    the other, `cu_seq_lens_q` / `cu_seq_lens_k` (int32 [N + 1]) where each sequence's rows lie and
    `max_length_q` / `max_length_k` (ints) the longest, no mask: a sequence's queries are the last of its keys.
    The sequences are laid out as a batch (`padding.PackedBuckets`) for the latent kernel, or the expanded keys go
    to the kernel's `flash_attn_varlen_func`; the form is priced at N sequences of the longest lengths.
    """
    is_causal, sliding_window, softcap, sinks = _options(module, kwargs)
    packed = kwargs.get("cu_seq_lens_q") is not None
    if not serves_latent(module):
        if packed:
            return _expanded_packed(query, key, value, kwargs, scaling, dropout, is_causal, sliding_window,
                                    softcap, sinks), None
        return attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    kv_nope, k_rot = key, value
    indices = kwargs.pop("indices", None)
    if indices is not None:
        attention_mask = with_selected_keys(attention_mask, indices, kv_nope.shape[2])
    if packed:
        batch, q_len, kv_len = kwargs["cu_seq_lens_q"].shape[0] - 1, kwargs["max_length_q"], kwargs["max_length_k"]
    else:
        batch, q_len, kv_len = query.shape[0], query.shape[2], kv_nope.shape[2]
    shape = LatentShape(heads=query.shape[1], nope=module.qk_nope_head_dim, rope=k_rot.shape[-1],
                        v=module.v_head_dim, latent=kv_nope.shape[-1], batch=batch, q_len=q_len, kv_len=kv_len,
                        itemsize=query.element_size())
    gradient_inputs = (query, kv_nope, k_rot, module.kv_b_proj.weight, *(() if sinks is None else (sinks,)))
    absorbed = (not _needs_gradient(*gradient_inputs) and not dropout and sliding_window is None
                and softcap is None and absorbed_is_cheaper(shape, resolve_target(None)))
    if absorbed and packed:
        buckets = PackedBuckets.of(kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], q_len, kv_len)
        return _absorbed_packed(module, query, kv_nope, k_rot, buckets, scaling, is_causal, sinks), None
    if absorbed:
        return _absorbed(module, query, kv_nope, k_rot, attention_mask, scaling, is_causal, sinks), None
    key, value = type(module).expand_kv(module, kv_nope, k_rot)
    if packed:
        return _expanded_packed(query, key, value, kwargs, scaling, dropout, is_causal, sliding_window, softcap,
                                sinks), None
    return attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


# Read by tpu_kernels.integration.kernelize, as on `attention_forward`: a call that needs gradients takes the
# expanded form, whose kernels have a backward; both forms trace under torch.compile(fullgraph=True).
latent_attention_forward.has_backward = True
latent_attention_forward.can_torch_compile = True
