"""Torch ops over the Pallas kernels and the public functions: the one place inputs are checked.

The JAX functions (`norm/kernel.py`) assume valid inputs; the ops' gradients
are those of its `jax.custom_vjp` functions, which the binding hands to torch
autograd.

The ops see the rows (every dimension of x but the last) padded with zero rows
to their bucket (`_buckets.token_bucket`) and the results are cut back, so a
model compiles each kernel once per bucket, not once per prompt length. A zero
row normalises to zero and adds nothing to the weight's gradient; cutting the
result gives the padded rows a zero cotangent.

An x of 4 or more dimensions is a per-head norm ([..., tokens, heads, D]: the
q and k norms of Qwen3 and Gemma run on `q_proj(x).view(B, T, heads, D)`), and
its rows are padded to `token_bucket(tokens) * heads`, the tokens bucketed as
every other op buckets them. Bucketing its tokens x heads rows instead would
start a new bucket every 512 / heads tokens past 512 rows (every 16 tokens at
32 heads): most of a serving trace's distinct shapes. The transposed view
([..., heads, tokens, D], as Gemma 3 and Kolibri 1.1 normalise their q and k)
is told apart by its strides (`_heads_first`) and normalised as the view
[..., tokens, heads, D] it transposes, so it shares that bucket and its result
keeps x's layout, as the module's own forward does. A transposed x made
contiguous has lost that trace: it reads as `tokens` heads of `heads` tokens
and compiles once per token count. An x of fewer dimensions ([tokens, D],
[B, T, D]) keeps the bucket of its rows.
"""

from __future__ import annotations

import math

import jax
import torch

from ._buckets import token_bucket
from ._ops import add_op_namespace_prefix, jax_torch_op
from .norm.kernel import differentiable_fused_add_rms_norm, differentiable_rms_norm

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


@jax_torch_op(add_op_namespace_prefix("rms_norm"))
def _rms_norm_op(x: jax.Array, weight: jax.Array, eps: float, offset: float) -> jax.Array:
    return differentiable_rms_norm(x, weight, eps, offset)


@jax_torch_op(add_op_namespace_prefix("fused_add_rms_norm"))
def _fused_add_rms_norm_op(
    x: jax.Array, residual: jax.Array, weight: jax.Array, eps: float, offset: float
) -> tuple[jax.Array, jax.Array]:
    return differentiable_fused_add_rms_norm(x, residual, weight, eps, offset)


def _check_tensor(name: str, value, like: torch.Tensor | None = None) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be torch.float32 or torch.bfloat16, got {value.dtype}")
    if like is not None and value.device != like.device:
        raise ValueError(f"{name} is on {value.device} but x is on {like.device}")


def _check_number(name: str, value, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a Python float, got {type(value).__name__}")
    # Comparisons, not math.isfinite: torch.compile traces a float attribute as a symbolic float, on which
    # a comparison is a guard while math.isfinite breaks a fullgraph trace.
    if not -math.inf < value < math.inf or (positive and value <= 0):
        raise ValueError(f"{name} must be a finite number{' > 0' if positive else ''}, got {value}")
    return float(value)


def _check_norm_inputs(x, weight, eps, offset) -> tuple[float, float]:
    _check_tensor("x", x)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (the last is the hidden size), got a 0-d tensor")
    _check_tensor("weight", weight, like=x)
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must have shape [{x.shape[-1]}] (the hidden size of x), got {list(weight.shape)}")
    return _check_number("eps", eps, positive=True), _check_number("offset", offset, positive=False)


def _bucket_rows(shape: torch.Size) -> int:
    """The rows x of `shape` is padded to: its tokens' bucket times its heads if it is per-head (module docstring)."""
    rows = int(math.prod(shape[:-1]))
    if len(shape) < 4:
        return token_bucket(rows)
    heads = int(shape[-2])
    return token_bucket(rows // heads) * heads


def _heads_first(x: torch.Tensor) -> bool:
    """Whether a per-head x (4 or more dims) is the transposed view [..., heads, tokens, D].

    Its heads are the inner of its last two row dims in memory: transformers views
    a projection's [..., tokens, heads * D] as [..., tokens, heads, D] and may
    transpose that. The strides tie only where one of the two dims has size 1, and
    then that one is the heads (a single key head); a decode step's single token
    keeps the larger stride of the tokens.
    """
    tokens_stride, heads_stride = x.stride(-3), x.stride(-2)
    return heads_stride > tokens_stride or (heads_stride == tokens_stride and x.shape[-3] == 1)


def _on_rows(op, *row_tensors: torch.Tensor):
    """`op` of the row tensors (one shape [..., H]) as [bucket rows, H], its results cut back to their shape."""
    shape = row_tensors[0].shape
    rows = math.prod(shape[:-1])
    if rows == 0 or shape[-1] == 0:
        return op(*row_tensors)
    extra = _bucket_rows(shape) - rows
    results = op(*(torch.nn.functional.pad(t.reshape(rows, shape[-1]), (0, 0, 0, extra)) for t in row_tensors))
    if isinstance(results, torch.Tensor):
        return results[:rows].reshape(shape)
    return tuple(result[:rows].reshape(shape) for result in results)


def _on_bucketed_rows(op, *row_tensors: torch.Tensor):
    """`_on_rows`, a transposed per-head x (`_heads_first`) seen as the [..., tokens, heads, D] it transposes."""
    if row_tensors[0].dim() < 4 or not _heads_first(row_tensors[0]):
        return _on_rows(op, *row_tensors)
    results = _on_rows(op, *(t.transpose(-3, -2) for t in row_tensors))
    if isinstance(results, torch.Tensor):
        return results.transpose(-3, -2)
    return tuple(result.transpose(-3, -2) for result in results)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 0.0) -> torch.Tensor:
    """x / sqrt(mean(x**2, -1) + eps) * (offset + weight), in float32, returned in x's dtype.

    `offset=1.0` is the zero-centred form (Gemma, Qwen3-Next, Qwen3.5) whose
    stored weight is the deviation from 1. An empty x (no rows, or hidden size
    0) gives an empty result without running a kernel.
    """
    eps, offset = _check_norm_inputs(x, weight, eps, offset)
    return _on_bucketed_rows(lambda rows: _rms_norm_op(rows, weight, eps, offset), x)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), reading x and residual once and writing both results once.

    The sum is rounded to x's dtype before it is normalised, as in the unfused
    `hidden = residual + hidden; norm(hidden)` of a decoder layer.
    """
    eps, offset = _check_norm_inputs(x, weight, eps, offset)
    _check_tensor("residual", residual, like=x)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual must match x: x is {x.dtype} {list(x.shape)}, "
            f"residual is {residual.dtype} {list(residual.shape)}"
        )
    return _on_bucketed_rows(
        lambda rows, residual_rows: _fused_add_rms_norm_op(rows, residual_rows, weight, eps, offset), x, residual)
