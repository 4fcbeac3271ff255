"""Helpers of the attention tests: conversions for the tests that call the JAX functions directly (small explicit
tiles), and flash-attn's semantics as an oracle for the tests of the flash-attn API."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch


def to_jax(tensor: torch.Tensor) -> jax.Array:
    if tensor.dtype == torch.bfloat16:
        return jnp.asarray(tensor.float().numpy(), jnp.bfloat16)
    return jnp.asarray(tensor.numpy())


def to_torch(array: jax.Array) -> torch.Tensor:
    return torch.from_numpy(np.array(array.astype(jnp.float32)))


@pytest.fixture
def convert():
    """(to_jax, to_torch): torch tensors to JAX arrays (bf16 kept) and JAX arrays to float32 tensors."""
    return to_jax, to_torch


def _flash_reference(q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, softmax_scale=None, sinks=None):
    """One sequence, flash-attn layout: q [Sq, Hq, D], k and v [Sk, Hkv, D] -> float64 [Sq, Hq, D]."""
    q_len, q_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[:2]
    q64, k64, v64 = (x.double().transpose(0, 1) for x in (q, k, v))
    k64, v64 = (x.repeat_interleave(q_heads // kv_heads, dim=0) for x in (k64, v64))
    logits = q64 @ k64.transpose(-1, -2) * (head_dim**-0.5 if softmax_scale is None else softmax_scale)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    position = torch.arange(q_len)[:, None] + kv_len - q_len
    key = torch.arange(kv_len)[None, :]
    left, right = window_size
    right = 0 if causal else right
    visible = torch.ones(q_len, kv_len, dtype=torch.bool)
    if left >= 0:
        visible &= key >= position - left
    if right >= 0:
        visible &= key <= position + right
    logits = logits.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks.double()[:, None, None].expand(q_heads, q_len, 1)], dim=-1)
    else:
        logits = torch.where(visible.any(-1, keepdim=True), logits, 0.0)
    weights = torch.softmax(logits, dim=-1)[..., :kv_len]
    return (torch.where(visible, weights, 0.0) @ v64).transpose(0, 1)


@pytest.fixture
def flash_reference():
    """flash-attn 2's attention of one sequence, in float64 and differentiable (`_flash_reference`)."""
    return _flash_reference
