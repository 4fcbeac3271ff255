"""Plain attention in float64 with a materialised mask: the tests' oracle, forward and backward.

Same semantics as ``flash.kernel.differentiable_flash_attention`` (see its docstring), computed
the obvious way so that it can be trusted by reading it. It is differentiable
(torch autograd in float64): its gradients are the oracle of the backward kernels.
"""

from __future__ import annotations

import torch


def visibility_mask(
    batch: int,
    q_len: int,
    kv_len: int,
    *,
    causal: bool = True,
    q_offset: int | torch.Tensor | None = None,
    kv_lengths: torch.Tensor | None = None,
    sliding_window: int | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean [B, 1, Sq, Skv]: True where query i may attend to key j."""
    if q_offset is None:
        q_offset = kv_len - q_len
    offsets = torch.as_tensor(q_offset, dtype=torch.int64).reshape(-1).expand(batch)
    query_pos = offsets[:, None] + torch.arange(q_len)[None, :]  # [B, Sq]
    key_pos = torch.arange(kv_len)
    visible = torch.ones(batch, q_len, kv_len, dtype=torch.bool)
    if causal:
        visible &= key_pos[None, None, :] <= query_pos[:, :, None]
    if sliding_window is not None:
        visible &= key_pos[None, None, :] > query_pos[:, :, None] - sliding_window
    if kv_lengths is not None:
        visible &= key_pos[None, None, :] < kv_lengths.to(torch.int64)[:, None, None]
    visible = visible[:, None]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            visible = visible & attention_mask
        else:
            visible = visible & (attention_mask > torch.finfo(attention_mask.dtype).min)
    return visible


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    q_offset: int | torch.Tensor | None = None,
    kv_lengths: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    attention_mask: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q[B, Hq, Sq, D], k[B, Hkv, Skv, D], v[B, Hkv, Skv, Dv] -> float64 [B, Hq, Sq, Dv]; rows with no visible key
    are 0. The default scale is D ** -0.5.

    sinks [Hq]: one more logit per query head in every row's softmax, attending to nothing.
    """
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    q64, k64, v64 = (x.to(torch.float64) for x in (q, k, v))
    k64 = k64.repeat_interleave(group, dim=1)
    v64 = v64.repeat_interleave(group, dim=1)
    if kv_lengths is not None:
        # Keys past a length may hold anything; they must not reach the output.
        valid = torch.arange(kv_len)[None, :] < kv_lengths.to(torch.int64)[:, None]
        k64 = torch.where(valid[:, None, :, None], k64, 0.0)
        v64 = torch.where(valid[:, None, :, None], v64, 0.0)
    logits = q64 @ k64.transpose(-1, -2) * (head_dim**-0.5 if scale is None else scale)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        bias = attention_mask.to(torch.float64)
        logits = logits + torch.where(bias > torch.finfo(attention_mask.dtype).min, bias, 0.0)
    visible = visibility_mask(
        batch,
        q_len,
        kv_len,
        causal=causal,
        q_offset=q_offset,
        kv_lengths=kv_lengths,
        sliding_window=sliding_window,
        attention_mask=attention_mask,
    )
    logits = logits.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.to(torch.float64)[None, :, None, None].expand(batch, q_heads, q_len, 1)
        weights = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    else:
        any_visible = visible.any(dim=-1, keepdim=True)
        weights = torch.softmax(torch.where(any_visible, logits, 0.0), dim=-1)
    weights = torch.where(visible, weights, 0.0)
    return weights @ v64


def reference_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    page_table: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    window_ring: bool = False,
) -> torch.Tensor:
    """Ragged paged attention (`paged.kernel.ragged_paged_attention`) -> float64 [T, Hq, Dv], one sequence at a
    time: its keys gathered page by page from the page table, then `reference_attention` with its queries last.

    q[T, Hq, D] packed (sequence s owns rows cu_q_lens[s]:cu_q_lens[s + 1]); k_cache[num_pages, page_size, Hkv, D],
    v_cache[num_pages, page_size, Hkv, Dv]; kv_lens [S]; page_table [S, pages_per_seq]. Rows no sequence owns
    are 0. `window_ring`: key j of a sequence sits at slot j % sliding_window of its pages, and the cache holds its
    last sliding_window keys.
    """
    out = torch.zeros(*q.shape[:2], v_cache.shape[-1], dtype=torch.float64)
    page_size = k_cache.shape[1]
    for seq in range(kv_lens.shape[0]):
        q_start, q_end, kv_len = int(cu_q_lens[seq]), int(cu_q_lens[seq + 1]), int(kv_lens[seq])
        if q_end == q_start:
            continue
        first = max(0, kv_len - sliding_window) if window_ring else 0  # the first key the cache still holds
        slots = torch.arange(first, kv_len)
        if window_ring:
            slots = slots % sliding_window
        pages = page_table[seq].long()[slots // page_size]
        keys = k_cache[pages, slots % page_size]  # [keys held, Hkv, D], by position
        values = v_cache[pages, slots % page_size]
        out[q_start:q_end] = reference_attention(
            q[None, q_start:q_end].transpose(1, 2), keys[None].transpose(1, 2), values[None].transpose(1, 2),
            scale=scale, causal=causal, q_offset=kv_len - first - (q_end - q_start), sliding_window=sliding_window,
            softcap=softcap, sinks=sinks,
        )[0].transpose(0, 1)
    return out


def reference_varlen_attention(q, k, v, cu_q_lens, cu_k_lens, **options) -> torch.Tensor:
    """`reference_paged_attention` over contiguous k[total_k, Hkv, D], v[total_k, Hkv, Dv] (sequence s owns rows
    cu_k_lens[s]:cu_k_lens[s + 1]), each sequence's keys copied into pages of their own."""
    kv_lens = cu_k_lens[1:] - cu_k_lens[:-1]
    longest = max(1, int(kv_lens.max()) if kv_lens.numel() else 1)
    k_cache = torch.zeros(len(kv_lens), longest, *k.shape[1:], dtype=k.dtype)
    v_cache = torch.zeros(len(kv_lens), longest, *v.shape[1:], dtype=v.dtype)
    for seq, (start, end) in enumerate(zip(cu_k_lens[:-1].tolist(), cu_k_lens[1:].tolist())):
        k_cache[seq, : end - start] = k[start:end]
        v_cache[seq, : end - start] = v[start:end]
    page_table = torch.arange(len(kv_lens))[:, None]
    return reference_paged_attention(q, k_cache, v_cache, cu_q_lens, kv_lens, page_table, **options)


def reference_latent_attention(q_latent: torch.Tensor, q_rope: torch.Tensor | None, latent: torch.Tensor,
                               rope: torch.Tensor | None, *, scale: float | None = None, **options) -> torch.Tensor:
    """Latent (absorbed MLA) attention (`latent.kernel.latent_attention`) -> float64 [B, H, Sq, L]: plain attention
    of the query [q_latent, q_rope] over one KV head whose keys are [latent, rope] and whose values are the latent.

    q_latent [B, H, Sq, L], q_rope [B, H, Sq, R]; latent [B, 1, S, L], rope [B, 1, S, R] (None where R = 0). scale
    defaults to (L + R) ** -0.5; `options` are `reference_attention`'s (causal, q_offset, kv_lengths,
    sliding_window, softcap, attention_mask, sinks [H]: one logit per query head joining every row's softmax, over
    no value).
    """
    rope_dim = 0 if q_rope is None else q_rope.shape[-1]
    query, keys = q_latent, latent
    if rope_dim:
        query, keys = torch.cat([q_latent, q_rope], dim=-1), torch.cat([latent, rope], dim=-1)
    scale = (q_latent.shape[-1] + rope_dim) ** -0.5 if scale is None else scale
    return reference_attention(query, keys, latent, scale=scale, **options)
