"""Helpers of this repo's tests: running a JAX function in TPU interpret mode, tensors to JAX arrays, random picks,
quantized weights (int8, fp8, int4) and experts layers of them."""

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


def _quantized_weights(kernel, scheme: str, shape, out_axis: int, generator, std: float = 0.2):
    """Random `scheme` weights of `shape`, never all zero, and their positive float32 scales, sized so that the
    weights come out with about `std`: (weights as the kernels take them, scales, codes). int8's codes lie in
    [-127, 127] and int4's over its whole range [-8, 7], each with a scale per output channel; int4's weights are its
    codes packed two to a byte. fp8's weights are its codes, with a scale per 128 x 128 block."""
    experts, rows, cols = shape
    if scheme == "fp8":
        codes = (torch.randn(shape, generator=generator) * 4).to(torch.float8_e4m3fn)
        scales = (0.5 + torch.rand(experts, -(-rows // 128), -(-cols // 128), generator=generator)) * std / 4
        return codes, scales, codes
    low, high, typical_code = {"int8": (-127, 128, 64), "int4": (-8, 8, 4)}[scheme]
    codes = torch.randint(low, high, shape, generator=generator).to(torch.int8)
    scales = (0.5 + torch.rand(experts, shape[out_axis], generator=generator)) * std / typical_code
    return (kernel.pack_int4(codes) if scheme == "int4" else codes), scales, codes


@pytest.fixture
def quantized_weights():
    return _quantized_weights


def _quantized_layer(kernel, scheme: str, tokens: int, hidden: int, intermediate: int, experts: int, top_k: int, *,
                     transposed: bool, bias: bool, sentinels: float = 0.0, std: float = 0.2, seed: int = 0,
                     dtype=torch.float32):
    """One experts layer with `scheme`'s weights (`quantized_weights`): (hidden, index, weights, gate_up, down,
    biases..., scales...)."""
    generator = torch.Generator().manual_seed(seed)
    gate_up_shape = (experts, hidden, 2 * intermediate) if transposed else (experts, 2 * intermediate, hidden)
    down_shape = (experts, intermediate, hidden) if transposed else (experts, hidden, intermediate)
    out_axis = 2 if transposed else 1
    gate_up, gate_up_scales, _ = _quantized_weights(kernel, scheme, gate_up_shape, out_axis, generator, std)
    down, down_scales, _ = _quantized_weights(kernel, scheme, down_shape, out_axis, generator, std)
    biases = (torch.randn(experts, 2 * intermediate, generator=generator).to(dtype) * 0.5,
              torch.randn(experts, hidden, generator=generator).to(dtype) * 0.5) if bias else (None, None)
    index, weights = _random_picks(generator, tokens, experts, top_k, sentinels)
    hidden_states = torch.randn(tokens, hidden, generator=generator).to(dtype)
    return hidden_states, index, weights.to(dtype), gate_up, down, *biases, gate_up_scales, down_scales


@pytest.fixture
def quantized_layer():
    return _quantized_layer


def _dequantized_layer(kernel, layer, transposed: bool):
    """`layer` (a quantized_layer) with float64 weights: what the reference computes with."""
    *front, gate_up, down, gate_up_bias, down_bias, gate_up_scales, down_scales = layer
    out_axis = 2 if transposed else 1
    return (*front, kernel.reference.dequantize_reference(gate_up, gate_up_scales, out_axis=out_axis),
            kernel.reference.dequantize_reference(down, down_scales, out_axis=out_axis), gate_up_bias, down_bias)


@pytest.fixture
def dequantized_layer():
    return _dequantized_layer


def _layer_case(kernel, scheme, case):
    """A layer case (tokens, hidden, intermediate, experts, top_k, layer options, gate, fused tiles) as (its layer
    with `scheme`'s weights, the gate's options with the layer's orientation, the float64 reference output)."""
    tokens, hidden, intermediate, experts, top_k, options, gate, _ = case
    layer = _quantized_layer(kernel, scheme, tokens, hidden, intermediate, experts, top_k, **options)
    gate = dict(weights_transposed=options["transposed"], **gate)
    expected = kernel.reference.gated_experts_reference(*_dequantized_layer(kernel, layer, options["transposed"]),
                                                        **gate)
    return layer, gate, expected


def _experts_layer_paths(kernel, scheme, case):
    """A layer case's layer through both paths of experts_layer: (the fused kernel's output with the case's
    tiles, None for fused.tiles.select's; the grouped matmuls' output; the float64 reference output)."""
    layer, gate, expected = _layer_case(kernel, scheme, case)
    tiles = case[-1]
    config = None if tiles is None else kernel.fused.tiles.FusedConfig(*tiles)
    fused = _interpret(lambda: kernel.fused.kernel.fused_experts(*map(_to_jax, layer), **gate, config=config))
    grouped = _interpret(lambda: kernel.experts_layer(*map(_to_jax, layer), **gate, fused=False))
    return fused, grouped, expected


@pytest.fixture
def experts_layer_paths():
    return _experts_layer_paths


def _fused_on_v5p_cores_sharing_experts(kernel, scheme, case):
    """A layer case's layer through the fused kernel with the case's tiles and cores_per_expert 2, on two
    simulated v5p cores: (its output, the float64 reference output)."""
    layer, gate, expected = _layer_case(kernel, scheme, case)
    config = kernel.fused.tiles.FusedConfig(*case[-1], cores_per_expert=2)
    fused = _interpret(lambda: kernel.fused.kernel.fused_experts(*map(_to_jax, layer), **gate, config=config,
                                                                 generation="v5p"), cores=2)
    return fused, expected


@pytest.fixture
def fused_on_v5p_cores_sharing_experts():
    return _fused_on_v5p_cores_sharing_experts
