"""Helpers of this repo's tests: running a JAX function in TPU interpret mode, tensors to JAX arrays, random picks."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tpu_kernels import testing


def _interpret(fn, cores: int = 1):
    """`testing.interpret(fn, cores)`'s result as a float32 torch tensor."""
    out = testing.interpret(fn, cores)
    return torch.from_numpy(np.array(out.astype(jnp.float32)))


def _to_jax(tensor):
    """A torch tensor as a JAX array of its dtype (int32/int64 as int32); None stays None."""
    if tensor is None:
        return None
    if tensor.dtype in (torch.int8, torch.uint8):
        return jnp.asarray(tensor.numpy())
    if tensor.dtype == torch.float8_e4m3fn:  # numpy has no fp8: the bits cross as bytes
        return jnp.asarray(tensor.view(torch.uint8).numpy()).view(jnp.float8_e4m3fn)
    if tensor.dtype in (torch.int32, torch.int64):
        return jnp.asarray(tensor.numpy(), jnp.int32)
    return jnp.asarray(tensor.float().numpy(), jnp.bfloat16 if tensor.dtype == torch.bfloat16 else jnp.float32)


@pytest.fixture
def interpret():
    return _interpret


@pytest.fixture
def to_jax():
    return _to_jax


def _random_picks(generator, tokens: int, experts: int, top_k: int, sentinels: float = 0.0):
    """A router's output: index [T, K] int32 of distinct experts per token and softmax weights [T, K] float32; about a
    `sentinels` share of the picks goes to other ranks (expert-parallel sentinels: id == experts, weight 0)."""
    index = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, top_k, generator=generator).softmax(-1)
    if sentinels:
        other_rank = torch.rand(tokens, top_k, generator=generator) < sentinels
        index = index.masked_fill(other_rank, experts)
        weights = weights.masked_fill(other_rank, 0.0)
    return index, weights


@pytest.fixture
def random_picks():
    return _random_picks
