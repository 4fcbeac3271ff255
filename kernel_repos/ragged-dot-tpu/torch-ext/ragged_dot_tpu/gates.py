"""The gated activations of the experts layers we fuse, on f32 arrays: in XLA and inside the kernels alike."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax


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
