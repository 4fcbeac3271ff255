"""The flash-attn 2 API over the Pallas kernels: `flash_attn_func` and `flash_attn_varlen_func`.

`flash_attn_func` runs the flash kernel. `flash_attn_varlen_func` runs it too
when a gradient is to be computed (the flash kernel has a backward), padding
the sequences to one length; otherwise (inference, continuous batching) it
runs the ragged paged kernel, which reads the packed sequences in place.

transformers calls these when a model's `attn_implementation` names this
kernel repo on the Hub (`"<org>/attention-tpu"`; with `":flash_attn_varlen_func"`
appended the name also holds "flash", which continuous batching asks for).
transformers decides which keyword arguments to pass by reading the
functions' parameter names, so every name here is one it knows, and one this
kernel either computes or refuses with a ValueError naming it.

Layouts are flash-attn's: q [B, Sq, Hq, D], k [B, Sk, Hkv, D] and v
[B, Sk, Hkv, Dv] -> [B, Sq, Hq, Dv]; the varlen form packs the sequences,
q [total_q, Hq, D], k [total_k, Hkv, D] and v [total_k, Hkv, Dv], sequence b
spanning rows cu_seqlens[b]:cu_seqlens[b + 1]. Dv = D in flash-attn 2;
flash-attn 3 lets it differ (latent attention: D 192, Dv 128), and so does
this kernel. transformers' flash path pads v to D for latent attention and
cuts the output back: both calls give the same result. With causal (and
windows), query i of a sequence sits at key position i + Sk - Sq (aligned
bottom-right, as flash-attn >= 2.1), so a query whose position is negative
sees no key and its row is zero.

Every kernel call is handed lengths padded to buckets (`padding.py`: query
lengths and rows to token buckets, key lengths and rows to key buckets,
numbers of sequences to powers of two), with the real lengths and offsets, so
a model compiles each kernel a bounded number of times whatever its prompts.
"""

from __future__ import annotations

import torch

from . import paged_ops
from ._buckets import token_bucket
from .ops import FLOAT_DTYPES, check_tensor, flash_attention
from .padding import (
    RAGGED_SEQUENCES_FLOOR, PackedBuckets, batch_rows, key_rows, lengths_tensor, padded, power_of_two,
    query_length_bound, query_rows, with_empty_sequences,
)


def _window_options(window_size, causal: bool, kv_len: int) -> tuple[bool, int | None]:
    """flash-attn's (left, right) window, -1 = unbounded, as the kernel's (causal, sliding_window).

    As flash-attn does: causal sets right to 0, a side at least `kv_len` long is
    unbounded, and (-1, 0) is causal. The kernel's window bounds the left side
    only, so a right side between 0 and kv_len (non-causal) is refused.
    """
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= -1 for s in window_size)):
        raise ValueError(f"window_size must be a pair of ints >= -1 (left, right; -1 = unbounded), got {window_size!r}")
    left, right = window_size
    if left >= kv_len:
        left = -1
    if right >= kv_len:
        right = -1
    if causal or right == 0:
        return True, None if left < 0 else left + 1
    if right > 0:
        raise ValueError(
            f"window_size={tuple(window_size)}: the TPU attention kernel bounds a window on the left only; a right "
            "side other than 0 (causal) or -1 (unbounded) is not supported"
        )
    return False, None if left < 0 else left + 1


def _sinks(s_aux, learnable_sink):
    if s_aux is not None and learnable_sink is not None:
        raise ValueError("pass attention sinks as s_aux or as learnable_sink, not both")
    return s_aux if learnable_sink is None else learnable_sink


def _refuse_unsupported(dropout_p, alibi_slopes, return_attn_probs, softcap) -> float | None:
    """ValueError for what the kernel does not compute; returns the softcap as the kernel takes it (0 = none)."""
    if dropout_p:
        raise ValueError(f"dropout_p={dropout_p}: the TPU attention kernel has no dropout (use dropout_p=0.0)")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: the TPU attention kernel does not add ALiBi biases")
    if return_attn_probs:
        raise ValueError("return_attn_probs=True: the TPU attention kernel does not return attention probabilities")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap < 0:
        raise ValueError(f"softcap must be a number >= 0 (0 = none), got {softcap!r}")
    return float(softcap) if softcap > 0 else None


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    s_aux: torch.Tensor | None = None,
    learnable_sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash-attn 2's `flash_attn_func`: q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] -> [B, Sq, Hq, Dv].

    Hq a multiple of Hkv (grouped-query attention); D and Dv head dims the
    kernel serves (`supports_head_dims`; Dv = D, or not as in flash-attn 3);
    float32 or bfloat16. softmax_scale defaults to D ** -0.5.
    window_size (left, right) with -1 unbounded; softcap > 0 caps the logits;
    s_aux (or learnable_sink) [Hq] is one sink logit per query head. The
    kernel is deterministic, so `deterministic` asks for nothing more.
    Refused (ValueError): dropout_p > 0, alibi_slopes, return_attn_probs, a
    right window side the kernel cannot bound. Differentiable in q, k, v and
    the sinks.
    """
    softcap = _refuse_unsupported(dropout_p, alibi_slopes, return_attn_probs, softcap)
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, tensor, 4, "[batch, seqlen, heads, head_dim]")
    # Checked before the padding to buckets below, which would hide a mismatch of batch or key length.
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same shape but for the head_dim (the last), got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    batch, q_len, kv_len = q.shape[0], q.shape[1], k.shape[1]
    causal, sliding_window = _window_options(window_size, bool(causal), kv_len)
    sequences, q_padded, kv_padded = batch_rows(batch), query_rows(q_len), key_rows(kv_len)
    q, k, v = (padded(padded(tensor, 1, rows), 0, sequences).transpose(1, 2)
               for tensor, rows in ((q, q_padded), (k, kv_padded), (v, kv_padded)))
    # The real offset is the kernel's default only at bucket sizes; elsewhere it changes with the lengths: a tensor.
    q_offset = kv_len - q_len if kv_padded - q_padded == kv_len - q_len else lengths_tensor(
        [kv_len - q_len] * sequences, q.device)
    out = flash_attention(q, k, v, scale=softmax_scale, causal=causal, q_offset=q_offset,
                          kv_lengths=lengths_tensor([kv_len] * batch + [0] * (sequences - batch), q.device),
                          sliding_window=sliding_window, softcap=softcap, sinks=_sinks(s_aux, learnable_sink))
    return out.transpose(1, 2)[:batch, :q_len]


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> tuple[int, int]:
    """Layouts and cumulative lengths of a varlen call; returns the maximum lengths as ints."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, tensor, 3, "[total_tokens, heads, head_dim]")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same shape but for the head_dim (the last), got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    # Checked here so that both kernels' paths name the arguments alike.
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[2]} and {k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"the number of query heads ({q.shape[1]}) must be a multiple of the number of key/value "
                         f"heads ({k.shape[1]})")
    if q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"q must be float32 or bfloat16, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, cu, 1, "[batch + 1]")
        if cu.dtype not in (torch.int32, torch.int64) or cu.shape[0] < 1:
            raise ValueError(f"{name} must be an int32/int64 tensor [batch + 1], got {cu.dtype} {tuple(cu.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must give one batch, got shapes "
                         f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}")
    maxima = []
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_floating_point:
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        maxima.append(value)
    # Checked where it costs no device sync: on CPU tensors (off TPU) and outside torch.compile.
    if cu_seqlens_q.device.type == "cpu" and cu_seqlens_k.device.type == "cpu" and not torch.compiler.is_compiling():
        for name, cu, total, longest in (("q", cu_seqlens_q, q.shape[0], maxima[0]),
                                         ("k", cu_seqlens_k, k.shape[0], maxima[1])):
            lengths = cu.diff()
            if int(cu[0]) != 0 or bool((lengths < 0).any()) or int(cu[-1]) > total:
                raise ValueError(f"cu_seqlens_{name} must start at 0, never decrease and end at most at {name}'s "
                                 f"{total} rows, got {cu.tolist()}")
            if lengths.numel() and int(lengths.max()) > longest:
                raise ValueError(f"max_seqlen_{name}={longest} is less than the longest sequence "
                                 f"({int(lengths.max())})")
    return maxima[0], maxima[1]


def padded_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, **options):
    """`flash_attn_varlen_func` on the flash kernel, which has a backward (inputs checked): packed q, k, v ->
    packed [total_q, Hq, Dv].

    Each sequence is padded to a common length; the flash kernel masks the
    padded keys by length (and skips key blocks past every length) and places
    each sequence's queries at its last positions; rows past
    `cu_seqlens_q[-1]` come out zero. The batch is rounded up to a power of
    two, the lengths to their buckets (`padding.PackedBuckets`): each new shape
    compiles the kernel anew.
    """
    total_q = q.shape[0]
    if total_q == 0 or cu_seqlens_q.shape[0] == 1 or k.shape[0] == 0:
        return q.new_zeros((*q.shape[:2], v.shape[2]))
    buckets = PackedBuckets.of(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out = flash_attention(buckets.queries(q), buckets.keys(k), buckets.keys(v), q_offset=buckets.query_offsets(),
                          kv_lengths=buckets.key_lengths(), **options)
    return buckets.packed(out, total_q)


def ragged_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, *, scale, causal: bool,
                            sliding_window: int | None, softcap: float | None, sinks) -> torch.Tensor:
    """`flash_attn_varlen_func` on the ragged paged kernel, inference only (inputs checked): packed q, k, v ->
    packed [total_q, Hq, Dv].

    The kernel reads each sequence's queries and keys where they lie, so a
    decode row costs one query's work whatever the other sequences' lengths.
    Continuous batching changes the batch at every step and each new shape
    compiles the kernel anew, so the rows of q and of k, v are padded to their
    token and key buckets and the number of sequences to a power of two (zero
    rows past the last sequence, which no sequence owns and no key range
    reaches; sequences of no queries and no keys), and the query-length bound
    to its token bucket.
    """
    total_q, num_seqs = q.shape[0], cu_seqlens_q.shape[0] - 1
    if total_q == 0 or num_seqs == 0 or k.shape[0] == 0:
        return q.new_zeros((*q.shape[:2], v.shape[2]))
    sequences = power_of_two(num_seqs, RAGGED_SEQUENCES_FLOOR)
    q_rows, kv_rows = token_bucket(total_q), key_rows(k.shape[0])
    out = paged_ops.ragged_varlen_attention(
        padded(q, 0, q_rows), padded(k, 0, kv_rows), padded(v, 0, kv_rows),
        with_empty_sequences(cu_seqlens_q, sequences), with_empty_sequences(cu_seqlens_k, sequences),
        scale=scale, causal=causal, sliding_window=sliding_window, softcap=softcap, sinks=sinks,
        max_q_len=query_length_bound(max_seqlen_q, q_rows))
    return out[:total_q]


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
    learnable_sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash-attn 2's `flash_attn_varlen_func`: packed q [total_q, Hq, D], k [total_k, Hkv, D] and v [total_k, Hkv,
    Dv] -> [total_q, Hq, Dv].

    Sequence b is q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]] against
    k, v[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]; max_seqlen_q/k bound those
    lengths (ints, or one-element integer tensors). The options are those of
    `flash_attn_func`, and so are the refusals; `block_table` (a paged cache)
    is refused too. Rows of q past cu_seqlens_q[-1] come out zero.

    With a gradient to compute (grad mode on and q, k, v or the sinks
    requiring grad) the sequences are padded for the flash kernel, which has
    a backward (`padded_varlen_attention`); otherwise the ragged paged kernel
    reads them in place (`ragged_varlen_attention`).
    """
    softcap = _refuse_unsupported(dropout_p, alibi_slopes, return_attn_probs, softcap)
    if block_table is not None:
        raise ValueError("block_table: flash_attn_varlen_func of the TPU attention kernel reads no paged cache")
    max_seqlen_q, max_seqlen_k = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    causal, sliding_window = _window_options(window_size, bool(causal), max_seqlen_k)
    sinks = _sinks(s_aux, learnable_sink)
    if _needs_grad(q, k, v, sinks):
        return padded_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       scale=softmax_scale, causal=causal, sliding_window=sliding_window,
                                       softcap=softcap, sinks=sinks)
    return ragged_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale=softmax_scale,
                                   causal=causal, sliding_window=sliding_window, softcap=softcap, sinks=sinks)
