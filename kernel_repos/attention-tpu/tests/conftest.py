"""Helpers of the attention tests that call the JAX functions directly (small explicit tiles)."""

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
