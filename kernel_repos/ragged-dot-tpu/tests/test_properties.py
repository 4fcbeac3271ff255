"""Properties of every op and layer this kernel exports, against the plain reference (`reference.py`).

Each test draws shapes in which any dimension may be 0 or 1, every layout and
dtype the op accepts, and random (never zero) values, runs the built kernel
(TPU interpret mode, race detection on) and compares with the reference,
gradients included. An input with an empty dimension must give its result
without any Pallas kernel: `pallas_call` fails while it runs. The next edge
case goes here: a value in a strategy, or an `@example`.

Examples stay few and tiny: every new shape compiles the kernel (~1 s).
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tpu_kernels.testing import assert_matches, dimensions, no_kernel_if

# The `kernel` fixture returns the same built variant for every example.
PROPERTIES = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

FLOAT_DTYPES = (torch.float32, torch.bfloat16)
# The weights a grouped matmul or an experts layer reads: float (the activations' dtype), or one byte with scales.
WEIGHTS = ("float", "int8", "fp8")
INTEGER_DTYPES = (torch.int32, torch.int64, torch.int16, torch.uint8)
# Error relative to the largest reference value: float32 accumulates exactly enough for 1e-5; bfloat16
# rounds the inputs' products and the output (8-bit mantissa), and the experts layer its intermediate.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
LAYER_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2}


def random_tensor(generator: torch.Generator, shape, dtype=torch.float32, std: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=generator) * std).to(dtype)


def quantized_weights(generator, shape, scheme: str, out_axis: int, std: float = 0.3):
    """Random one-byte weights `[G, D1, D2]` (never all zero) and their float32 scales (the layout of
    `common/quant.py`)."""
    groups, rows, cols = shape
    if scheme == "int8":
        codes = torch.randint(-127, 128, shape, generator=generator).to(torch.int8)
        return codes, (0.5 + torch.rand(groups, shape[out_axis], generator=generator)) * std / 64
    codes = (torch.randn(shape, generator=generator) * 4).to(torch.float8_e4m3fn)
    return codes, (0.5 + torch.rand(groups, -(-rows // 128), -(-cols // 128), generator=generator)) * std / 4


def reference_gradients(out: torch.Tensor, inputs: list[torch.Tensor], d_out: torch.Tensor) -> list:
    """The reference's gradients of `inputs` (None: the output does not depend on that input at all)."""
    if not out.requires_grad:  # nothing was computed (an empty input): no input reaches the output
        return [None] * len(inputs)
    return list(torch.autograd.grad(out, inputs, d_out, allow_unused=True))


@st.composite
def group_sizes(draw, groups: int, rows: int) -> list[int]:
    """`groups` non-negative sizes summing to at most `rows` (empty groups and unused rows included)."""
    sizes, left = [], rows
    for _ in range(groups):
        size = draw(st.integers(0, left))
        sizes.append(size)
        left -= size
    return sizes


@st.composite
def ragged_dot_cases(draw):
    m, k, n, groups = draw(dimensions(m=[1, 2, 9], k=[1, 8], n=[1, 5], groups=[1, 3])).values()
    return dict(
        m=m, k=k, n=n, sizes=draw(group_sizes(groups, m)), sizes_dtype=draw(st.sampled_from(INTEGER_DTYPES)),
        dtype=draw(st.sampled_from(FLOAT_DTYPES)), weights=draw(st.sampled_from(WEIGHTS)),
        transpose_rhs=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
    )


def ragged_dot_inputs(kernel, case, dtype_of_float_weights=None):
    """(lhs, rhs, group_sizes, rhs_scales, rhs as float64 for the reference) of a drawn case."""
    generator = torch.Generator().manual_seed(case["seed"])
    m, k, n, dtype = case["m"], case["k"], case["n"], case["dtype"]
    shape = (len(case["sizes"]), n, k) if case["transpose_rhs"] else (len(case["sizes"]), k, n)
    lhs = random_tensor(generator, (m, k), dtype)
    sizes = torch.tensor(case["sizes"], dtype=torch.int64).to(case["sizes_dtype"])
    if case["weights"] == "float":
        rhs = random_tensor(generator, shape, dtype)
        return lhs, rhs, sizes, None, rhs.double()
    out_axis = 1 if case["transpose_rhs"] else 2
    rhs, scales = quantized_weights(generator, shape, case["weights"], out_axis)
    return lhs, rhs, sizes, scales, kernel.reference.dequantize_reference(rhs, scales, out_axis=out_axis)


EMPTY_RAGGED_DOT = dict(sizes_dtype=torch.int64, dtype=torch.float32, weights="float", transpose_rhs=False, seed=1)


@settings(PROPERTIES, max_examples=5)
@given(case=ragged_dot_cases())
@example(case=dict(EMPTY_RAGGED_DOT, m=0, k=8, n=5, sizes=[0, 0, 0]))  # no rows, all-zero sizes
@example(case=dict(EMPTY_RAGGED_DOT, m=4, k=8, n=5, sizes=[1, 3]))  # int64 sizes, as torch.bincount gives
@example(case=dict(EMPTY_RAGGED_DOT, m=0, k=8, n=5, sizes=[0], sizes_dtype=torch.uint8, dtype=torch.bfloat16,
                   weights="fp8", transpose_rhs=True))
def test_ragged_dot_matches_reference(kernel, case):
    lhs, rhs, sizes, scales, reference_rhs = ragged_dot_inputs(kernel, case)
    empty = 0 in (case["m"], case["k"], case["n"], len(case["sizes"]))
    with no_kernel_if(empty):
        out = kernel.ragged_dot(lhs, rhs, sizes, rhs_scales=scales, transpose_rhs=case["transpose_rhs"])
    expected = kernel.reference.ragged_dot_reference(lhs.double(), reference_rhs, sizes,
                                                     transpose_rhs=case["transpose_rhs"])
    assert out.dtype == lhs.dtype
    assert_matches(out, expected, TOLERANCE[case["dtype"]])


@pytest.mark.slow
@settings(PROPERTIES, max_examples=3)
@given(case=ragged_dot_cases().filter(lambda case: case["weights"] == "float"))
@example(case=dict(EMPTY_RAGGED_DOT, m=0, k=8, n=5, sizes=[0, 0]))  # no rows: d_rhs is zeros [G, K, N]
def test_ragged_dot_gradients_match_reference(kernel, case):
    lhs, rhs, sizes, _, _ = ragged_dot_inputs(kernel, case)
    generator = torch.Generator().manual_seed(case["seed"] + 1)
    d_out = random_tensor(generator, (case["m"], case["n"]), case["dtype"])
    lhs.requires_grad_(True)
    rhs.requires_grad_(True)
    empty = 0 in (case["m"], case["k"], case["n"], len(case["sizes"]))
    with no_kernel_if(empty):
        d_lhs, d_rhs = torch.autograd.grad(
            kernel.ragged_dot(lhs, rhs, sizes, transpose_rhs=case["transpose_rhs"]), (lhs, rhs), d_out)
    lhs64, rhs64 = (t.detach().double().requires_grad_(True) for t in (lhs, rhs))
    out64 = kernel.reference.ragged_dot_reference(lhs64, rhs64, sizes, transpose_rhs=case["transpose_rhs"])
    expected = reference_gradients(out64, [lhs64, rhs64], d_out.double())
    for name, grad, like, reference in (("d_lhs", d_lhs, lhs, expected[0]), ("d_rhs", d_rhs, rhs, expected[1])):
        assert grad.dtype == like.dtype, name
        assert_matches(grad, torch.zeros_like(like, dtype=torch.float64) if reference is None else reference,
                       TOLERANCE[case["dtype"]], name, floor=1.0)


@st.composite
def experts_cases(draw):
    tokens, top_k, hidden, intermediate, experts = draw(dimensions(
        tokens=[1, 2, 5], top_k=[1, 2], hidden=[1, 8], intermediate=[1, 4], experts=[1, 3])).values()
    activation = draw(st.sampled_from(("silu", "gelu", "gelu_tanh", "clamped_swiglu")))
    return dict(
        tokens=tokens, top_k=top_k, hidden=hidden, intermediate=intermediate, experts=experts,
        # Ids in [0, E]: E is an expert-parallel sentinel (another rank's expert).
        index=draw(st.lists(st.integers(0, experts), min_size=tokens * top_k, max_size=tokens * top_k)),
        index_dtype=draw(st.sampled_from(INTEGER_DTYPES)), dtype=draw(st.sampled_from(FLOAT_DTYPES)),
        weights=draw(st.sampled_from(WEIGHTS)), weights_transposed=draw(st.booleans()),
        interleaved=draw(st.booleans()), bias=draw(st.booleans()), activation=activation,
        seed=draw(st.integers(0, 2**16)),
    )


def experts_inputs(kernel, case):
    """(op arguments, op keyword arguments, the reference's float64 arguments) of a drawn experts layer."""
    generator = torch.Generator().manual_seed(case["seed"])
    tokens, top_k, hidden, intermediate, experts = (
        case[name] for name in ("tokens", "top_k", "hidden", "intermediate", "experts"))
    dtype, transposed = case["dtype"], case["weights_transposed"]
    gate_up_shape = (experts, hidden, 2 * intermediate) if transposed else (experts, 2 * intermediate, hidden)
    down_shape = (experts, intermediate, hidden) if transposed else (experts, hidden, intermediate)
    hidden_states = random_tensor(generator, (tokens, hidden), dtype)
    index = torch.tensor(case["index"], dtype=torch.int64).reshape(tokens, top_k).to(case["index_dtype"])
    routing_weights = torch.rand(tokens, top_k, generator=generator).to(dtype) + 0.1
    biases = [random_tensor(generator, (experts, 2 * intermediate), dtype, 0.3),
              random_tensor(generator, (experts, hidden), dtype, 0.3)] if case["bias"] else [None, None]
    out_axis = 2 if transposed else 1
    if case["weights"] == "float":
        gate_up, down = (random_tensor(generator, shape, dtype, 0.3) for shape in (gate_up_shape, down_shape))
        scales, reference_weights = {}, (gate_up.double(), down.double())
    else:
        (gate_up, gate_up_scales), (down, down_scales) = (
            quantized_weights(generator, shape, case["weights"], out_axis) for shape in (gate_up_shape, down_shape))
        scales = dict(gate_up_scales=gate_up_scales, down_scales=down_scales)
        reference_weights = (kernel.reference.dequantize_reference(gate_up, gate_up_scales, out_axis=out_axis),
                             kernel.reference.dequantize_reference(down, down_scales, out_axis=out_axis))
    gate = dict(activation=case["activation"], weights_transposed=transposed, interleaved=case["interleaved"])
    if case["activation"] == "clamped_swiglu":
        gate.update(alpha=1.702, limit=0.5)  # a low limit, so that the clamp takes part
    args = (hidden_states, index, routing_weights, gate_up, down, *biases)
    reference_args = (hidden_states.double(), index.to(torch.int64), routing_weights.double(), *reference_weights,
                      *(None if b is None else b.double() for b in biases))
    return args, dict(gate, **scales), reference_args, gate


def experts_are_empty(case) -> bool:
    return 0 in (case["tokens"], case["top_k"], case["hidden"], case["experts"], case["intermediate"])


EMPTY_EXPERTS = dict(top_k=2, hidden=8, intermediate=4, experts=3, index_dtype=torch.int64, dtype=torch.float32,
                     weights="float", weights_transposed=False, interleaved=False, bias=True, activation="silu", seed=3)


@settings(PROPERTIES, max_examples=5)
@given(case=experts_cases())
@example(case=dict(EMPTY_EXPERTS, tokens=0, index=[]))  # no tokens (an expert-parallel rank that got none)
@example(case=dict(EMPTY_EXPERTS, tokens=2, experts=0, index=[0, 0, 0, 0]))  # no local experts: all sentinels
@example(case=dict(EMPTY_EXPERTS, tokens=2, intermediate=0, index=[0, 3, 2, 1]))  # no intermediate: down biases
def test_gated_experts_matches_reference(kernel, case):
    args, options, reference_args, gate = experts_inputs(kernel, case)
    with no_kernel_if(experts_are_empty(case)):
        out = kernel.gated_experts(*args, **options)
    expected = kernel.reference.gated_experts_reference(*reference_args, **gate)
    assert out.dtype == case["dtype"]
    assert_matches(out, expected, LAYER_TOLERANCE[case["dtype"]])


@pytest.mark.slow
@settings(PROPERTIES, max_examples=2)
@given(case=experts_cases().filter(lambda case: case["weights"] == "float"))
@example(case=dict(EMPTY_EXPERTS, tokens=0, index=[]))
@example(case=dict(EMPTY_EXPERTS, tokens=2, intermediate=0, index=[0, 3, 2, 1]))
def test_gated_experts_gradients_match_reference(kernel, case):
    args, options, reference_args, gate = experts_inputs(kernel, case)
    hidden_states, index, routing_weights, *weights = args
    differentiable = [hidden_states, routing_weights, *(w for w in weights if w is not None)]
    for tensor in differentiable:
        tensor.requires_grad_(True)
    d_out = random_tensor(torch.Generator().manual_seed(case["seed"] + 1), hidden_states.shape, case["dtype"])
    with no_kernel_if(experts_are_empty(case)):
        grads = torch.autograd.grad(kernel.gated_experts(*args, **options), differentiable, d_out)
    reference_inputs = [t.detach().requires_grad_(True) if t is not None and t.is_floating_point() else t
                        for t in reference_args]
    differentiable64 = [t for t in reference_inputs if t is not None and t.is_floating_point()]
    expected = reference_gradients(kernel.reference.gated_experts_reference(*reference_inputs, **gate),
                                   differentiable64, d_out.double())
    names = ("d_hidden_states", "d_top_k_weights", "d_gate_up_proj", "d_down_proj", "d_gate_up_bias", "d_down_bias")
    for name, grad, like, reference in zip(names, grads, differentiable, expected):
        assert grad.dtype == like.dtype, name
        assert_matches(grad, torch.zeros_like(like, dtype=torch.float64) if reference is None else reference,
                       LAYER_TOLERANCE[case["dtype"]], name, floor=1.0)


def transformers_experts(kind: str, hidden: int, intermediate: int, experts: int, dtype) -> torch.nn.Module:
    """An experts module as transformers builds it: Qwen3-MoE's (SiLU: the fused op; ReLU: the composed
    torch path) or GPT-OSS's (transposed, interleaved, biases, clamped SwiGLU), with random weights."""
    from transformers import GptOssConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    if kind == "gpt_oss":
        config = GptOssConfig(hidden_size=hidden, intermediate_size=intermediate, num_local_experts=experts)
        module_type = GptOssExperts
    else:
        config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=experts,
                                hidden_act="silu" if kind == "qwen3_moe" else "relu")
        module_type = Qwen3MoeExperts
    config._experts_implementation = "eager"
    module = module_type(config)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(std=0.3)
    return module.to(dtype)


@settings(PROPERTIES, max_examples=3)
@given(kind=st.sampled_from(("qwen3_moe", "qwen3_moe_relu", "gpt_oss")),
       tokens=st.sampled_from([0, 1, 3]), top_k=st.sampled_from([0, 1, 2]), hidden=st.sampled_from([1, 8]),
       index_dtype=st.sampled_from(INTEGER_DTYPES), dtype=st.sampled_from(FLOAT_DTYPES),
       seed=st.integers(0, 2**16))
@example(kind="qwen3_moe", tokens=0, top_k=2, hidden=8, index_dtype=torch.int64, dtype=torch.float32, seed=0)
@example(kind="qwen3_moe_relu", tokens=0, top_k=2, hidden=8, index_dtype=torch.int64, dtype=torch.float32, seed=0)
@example(kind="qwen3_moe_relu", tokens=3, top_k=2, hidden=8, index_dtype=torch.uint8, dtype=torch.float32, seed=0)
def test_experts_forward_matches_transformers_eager(kernel, kind, tokens, top_k, hidden, index_dtype, dtype, seed):
    """The layer transformers calls, on its own experts modules, against their eager forward."""
    experts = 3
    generator = torch.Generator().manual_seed(seed)
    module = transformers_experts(kind, hidden, 4, experts, dtype)
    hidden_states = random_tensor(generator, (tokens, hidden), dtype)
    index = torch.randint(0, experts, (tokens, top_k), generator=generator)
    routing_weights = (torch.rand(tokens, top_k, generator=generator) + 0.1).to(dtype)
    with torch.no_grad(), no_kernel_if(0 in (tokens, top_k)):
        out = kernel.experts_forward(module, hidden_states, index.to(index_dtype), routing_weights)
    with torch.no_grad():
        expected = module.double()(hidden_states.double(), index, routing_weights.double())
    assert out.dtype == dtype
    assert_matches(out, expected, LAYER_TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [np.uint8, np.int64])
def test_jax_ragged_dot_takes_any_integer_group_sizes(kernel, interpret, dtype):
    """The JAX function counts rows in int32 whatever the sizes' dtype: uint8 sizes summing past 255 too, and
    int64 (what a torch tensor's `.numpy()` gives)."""
    generator = torch.Generator().manual_seed(5)
    lhs, rhs = random_tensor(generator, (300, 8)), random_tensor(generator, (2, 8, 16))
    sizes = [200, 100]
    out = interpret(lambda: kernel.gmm.kernel.grouped_matmul(jnp.asarray(lhs.numpy()), jnp.asarray(rhs.numpy()),
                                                        np.asarray(sizes, dtype)))
    expected = kernel.reference.ragged_dot_reference(lhs.double(), rhs.double(), torch.tensor(sizes))
    assert_matches(out, expected, TOLERANCE[torch.float32])
    with pytest.raises(TypeError, match="group_sizes must have an integer dtype"):
        kernel.gmm.kernel.grouped_matmul(jnp.asarray(lhs.numpy()), jnp.asarray(rhs.numpy()), jnp.asarray([2.0, 1.0]))
