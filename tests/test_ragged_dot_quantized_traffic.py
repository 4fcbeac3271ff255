"""What the quantized fused experts kernel moves at real decode shapes, by benchmarks.perf's grid replay.

The claim checked: with quantized weights the fused kernel's HBM traffic stays
within 5 % of the quantized minimum (each active expert's one-byte (int4:
half-byte) weights and
their scales once, biases once, the hidden states, the routing and the output
once), at decode shapes of the kernel's compile_targets.py (its `LAYERS`). The modelled times (v6e,
0.35 us per grid step) are printed beside the bf16 ones: the MoE-layer
benchmark is where they are recorded.
"""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import perf

S = jax.ShapeDtypeStruct
SCHEMES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.uint8}
# (a layer of compile_targets.LAYERS, tokens)
DECODE_SHAPES = [("qwen3-30b-a3b EP1", 1), ("qwen3-30b-a3b EP1", 256), ("qwen3-30b-a3b EP8", 256),
                 ("gemma-4-26b-a4b", 256), ("gpt-oss-20b EP1", 256), ("gpt-oss-20b EP8", 64)]


@pytest.fixture
def kernel(ragged_dot_kernel):
    return ragged_dot_kernel


@pytest.fixture
def compile_targets(kernel):
    return importlib.import_module(f"{kernel.__name__}.compile_targets")


def _routing(tokens, top_k, experts, ranks, seed=0):
    """Uniform top-k picks over all ranks' experts; other ranks' picks are sentinels (router masking)."""
    rng = np.random.default_rng(seed)
    index = np.stack([rng.choice(experts * ranks, top_k, replace=False) for _ in range(tokens)])
    index = np.where(index < experts, index, experts).astype(np.int32)
    weights = np.where(index < experts, rng.random((tokens, top_k)), 0.0).astype(jnp.bfloat16)
    return index, weights


def _decode_shape(compile_targets, layer, tokens):
    """(experts on this rank, ranks, hidden, intermediate, top-k, transposed, biases, gate, tokens) of a layer."""
    experts, hidden, intermediate, top_k, layout, gate, _ = compile_targets.LAYERS[layer]
    model = compile_targets.MODELS[next(model for model in compile_targets.MODELS if layer.startswith(model))]
    return (experts, model["experts"] // experts, hidden, intermediate, top_k, layout["weights_transposed"],
            model["biases"], gate, tokens)


def _layer(kernel, shape, weights_dtype):
    experts, ranks, hidden, intermediate, top_k, transposed, biases, gate, tokens = shape
    gate_up = (experts, hidden, 2 * intermediate) if transposed else (experts, 2 * intermediate, hidden)
    down = (experts, intermediate, hidden) if transposed else (experts, hidden, intermediate)
    index, weights = _routing(tokens, top_k, experts, ranks)
    scheme = kernel.common.quant.scheme_of(weights_dtype)
    out_axis = 2 if transposed else 1
    scales = [] if scheme is None else [
        S(kernel.expected_scales_shape(scheme, w, out_axis), jnp.float32) for w in (gate_up, down)]
    bias = [S((experts, 2 * intermediate), jnp.bfloat16), S((experts, hidden), jnp.bfloat16)] if biases else []
    fused = functools.partial(kernel.fused.kernel.fused_experts, weights_transposed=transposed, **gate)

    def fn(hidden_states, index, weights, gate_up, down, *rest):
        return fused(hidden_states, index, weights, gate_up, down, *(rest if biases else (None, None, *rest)))

    def stored(shape):  # packed int4: two weights per byte along the kernel's packed axis
        if scheme != kernel.common.quant.INT4:
            return shape
        axis = kernel.int4_packed_axis(shape)
        return tuple(d // 2 if i == axis else d for i, d in enumerate(shape))

    args = [S((tokens, hidden), jnp.bfloat16), index, weights, S(stored(gate_up), weights_dtype),
            S(stored(down), weights_dtype), *bias, *scales]
    [call] = perf.model_pallas_traffic(fn, *args)
    active = len(np.unique(index[index < experts]))
    return call, active, scales


def _minimum_bytes(kernel, shape, weights_dtype, active, scales):
    experts, _, hidden, intermediate, top_k, _, biases, _, tokens = shape
    per_expert = 3 * intermediate * hidden * (0.5 if weights_dtype == jnp.uint8 else jnp.dtype(weights_dtype).itemsize)
    per_expert += sum(int(np.prod(s.shape[1:])) * 4 for s in scales)
    per_expert += (2 * intermediate + hidden) * 2 if biases else 0
    return active * per_expert + 2 * tokens * hidden * 2 + tokens * top_k * (4 + 2)


# The bf16 layer's modelled call per decode shape, shown beside each scheme's: modelled once, not per scheme.
_bf16_calls = {}


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize(("layer", "tokens"), DECODE_SHAPES,
                         ids=[f"{layer} T={tokens}" for layer, tokens in DECODE_SHAPES])
def test_quantized_fused_kernel_moves_at_most_5_percent_over_the_minimum(kernel, compile_targets, layer, tokens,
                                                                         scheme):
    shape = _decode_shape(compile_targets, layer, tokens)
    name = f"{layer} T={tokens}"
    call, active, scales = _layer(kernel, shape, SCHEMES[scheme])
    minimum = _minimum_bytes(kernel, shape, SCHEMES[scheme], active, scales)
    bf16_call = _bf16_calls.get(name) or _bf16_calls.setdefault(name, _layer(kernel, shape, jnp.bfloat16)[0])
    quantized, bf16 = perf.roofline(call, "v6e"), perf.roofline(bf16_call, "v6e")
    print(f"{name} {scheme}: {call.hbm_bytes / 1e6:.2f} MB ({call.hbm_bytes / minimum:.3f} x the minimum "
          f"{minimum / 1e6:.2f} MB), {call.steps} steps; modelled v6e {quantized.time_s * 1e6:.1f} us vs bf16 "
          f"{bf16.time_s * 1e6:.1f} us ({bf16_call.hbm_bytes / 1e6:.2f} MB)")
    assert call.hbm_bytes <= 1.05 * minimum
