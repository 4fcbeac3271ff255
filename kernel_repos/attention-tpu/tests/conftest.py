"""Helpers of the attention tests that call the JAX functions directly (small explicit tiles)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax._src.pallas.mosaic.interpret import interpret_pallas_call
from jax.experimental.pallas import tpu as pltpu


@pytest.fixture
def interpret():
    """run(thunk): the thunk's JAX result, computed in TPU interpret mode with race detection and NaN-filled
    uninitialised memory; fails if any kernel raced."""

    def run(thunk):
        params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
        with pltpu.force_tpu_interpret_mode(params):
            out = jax.block_until_ready(thunk())
        assert not interpret_pallas_call.races.races_found, "the TPU interpreter detected a data race"
        return out

    return run


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
