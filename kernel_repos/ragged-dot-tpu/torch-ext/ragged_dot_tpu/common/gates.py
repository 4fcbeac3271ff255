"""The gated activations of the experts layers we fuse, on f32 arrays: in XLA and inside the kernels alike."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from .._hardware import LANES


def _gelu_erf(x: jax.Array) -> jax.Array:
    # torch's exact GELU. jax.nn.gelu(approximate=False) goes through erfc,
    # which Mosaic does not lower; erf it does.
    return 0.5 * x * (1.0 + lax.erf(x * (1.0 / math.sqrt(2.0))))


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": _gelu_erf,
}
# GPT-OSS: clamped SwiGLU, `(clip(up) + 1) * g * sigmoid(alpha * g)` with g = min(gate, limit).
CLAMPED_SWIGLU = "clamped_swiglu"
GATES = (*ACTIVATIONS, CLAMPED_SWIGLU)


def gated(gate: jax.Array, up: jax.Array, activation: str, *, alpha: float, limit: float) -> jax.Array:
    """The intermediate from the gate and up projections (f32)."""
    if activation == CLAMPED_SWIGLU:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1.0) * gate * jax.nn.sigmoid(gate * alpha)
    return ACTIVATIONS[activation](gate) * up


def split_gate_up(gate_up: jax.Array, *, interleaved: bool) -> tuple[jax.Array, jax.Array]:
    """Gate and up halves of a `[rows, 2I]` projection: first and second half, or even and odd columns."""
    if interleaved:
        return gate_up[:, 0::2], gate_up[:, 1::2]
    return jnp.split(gate_up, 2, axis=-1)


# Columns of interleaved pairs one matmul de-interleaves: into 128 gate, then 128 up lanes (`deinterleaved_gated`).
DEINTERLEAVED_COLUMNS = 2 * LANES


def _deinterleaving_matrix(width: int, dtype) -> jax.Array:
    """`[width, 2 x 128]` 0/1: column i of a chunk of interleaved pairs (gate, up, gate, ...) to lane i // 2 of the
    gate's 128 lanes (even i) or of the up's (odd i)."""
    column = lax.broadcasted_iota(jnp.int32, (width, DEINTERLEAVED_COLUMNS), 0)
    lane = lax.broadcasted_iota(jnp.int32, (width, DEINTERLEAVED_COLUMNS), 1)
    return (lane == (column & 1) * LANES + (column >> 1)).astype(dtype)


def deinterleaved_gated(pairs: jax.Array, activation: str, *, alpha: float, limit: float, exact: bool) -> jax.Array:
    """The gated intermediate (`[rows, width // 2]` f32) of `pairs`, `[rows, width]` f32 interleaved (gate, up)
    columns with width even and at most DEINTERLEAVED_COLUMNS, inside a kernel.

    Lanes have no strided load (Mosaic: "Stride on last dim is not 1"), so
    the pairs are de-interleaved by a matmul with a 0/1 matrix into 128 gate
    then 128 up lanes. One nonzero term per sum: exact in f32 at HIGHEST
    precision (`exact`); otherwise one bf16 pass, which rounds gate and up to
    bf16 first. Garbage columns (possibly NaN) would spread to every lane:
    callers zero them first.
    """
    width = pairs.shape[1]
    if exact:
        split = lax.dot_general(pairs, _deinterleaving_matrix(width, jnp.float32), (((1,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
    else:
        split = lax.dot_general(pairs.astype(jnp.bfloat16), _deinterleaving_matrix(width, jnp.bfloat16),
                                (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return gated(split[:, :LANES], split[:, LANES:], activation, alpha=alpha, limit=limit)[:, : width // 2]
