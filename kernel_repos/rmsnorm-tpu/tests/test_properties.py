"""Properties of every op and layer this kernel exports, against the plain reference (`reference.py`).

Each test draws shapes in which any dimension may be 0 or 1, both dtypes of x
and of the weight, both weight conventions (offset 0 and 1) and random (never
zero) values, runs the built kernel (TPU interpret mode, race detection on)
and compares with the reference, gradients included. An empty input must give
its result without any Pallas kernel: `pallas_call` fails while it runs. The
next edge case goes here: a value in a strategy, or an `@example`.

Examples stay few and tiny: every new shape compiles the kernel.
"""

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tpu_kernels.testing import assert_matches, dimensions, no_kernel_if

# The `kernel` fixture returns the same built variant for every example.
PROPERTIES = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

FLOAT_DTYPES = (torch.float32, torch.bfloat16)
EPS = 1e-6
# Error relative to the largest reference value: float32 sums the row in another order; bfloat16 rounds
# the output (8-bit mantissa).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
GRADIENT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def reference_gradients(out: torch.Tensor, inputs: list[torch.Tensor], d_out: torch.Tensor) -> list:
    """The reference's gradients of `inputs`; zeros where the output does not depend on an input."""
    if out.requires_grad:
        grads = torch.autograd.grad(out, inputs, d_out, allow_unused=True)
    else:
        grads = [None] * len(inputs)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs)]


@st.composite
def norm_cases(draw):
    """x [*leading, hidden]: no leading dim, one or two of them."""
    leading = draw(st.integers(0, 2))
    shape = draw(dimensions(**{f"leading_{i}": [1, 3] for i in range(leading)}, hidden=[1, 5, 128])).values()
    return dict(
        shape=tuple(shape), dtype=draw(st.sampled_from(FLOAT_DTYPES)),
        weight_dtype=draw(st.sampled_from(FLOAT_DTYPES)), offset=draw(st.sampled_from([0.0, 1.0])),
        fused=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
    )


def norm_inputs(case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(case["seed"])
    x, residual = (torch.randn(case["shape"], generator=generator).to(case["dtype"]) for _ in range(2))
    return x, residual, torch.randn(case["shape"][-1:], generator=generator).to(case["weight_dtype"])


def run_op(kernel, case, x, residual, weight) -> tuple[torch.Tensor, ...]:
    if case["fused"]:
        return kernel.fused_add_rms_norm(x, residual, weight, EPS, offset=case["offset"])
    return (kernel.rms_norm(x, weight, EPS, offset=case["offset"]),)


def run_reference(kernel, case, x, residual, weight) -> tuple[torch.Tensor, ...]:
    if case["fused"]:
        return kernel.reference.fused_add_rms_norm(x, residual, weight, EPS, case["offset"])
    return (kernel.reference.rms_norm(x, weight, EPS, case["offset"]),)


def is_empty(case) -> bool:
    return 0 in case["shape"]


EMPTY = dict(dtype=torch.float32, weight_dtype=torch.float32, offset=0.0, seed=0)


@settings(PROPERTIES, max_examples=8)
@given(case=norm_cases())
@example(case=dict(EMPTY, shape=(0, 64), fused=False))  # no rows
@example(case=dict(EMPTY, shape=(2, 0, 64), fused=True))  # no rows among several leading dims
@example(case=dict(EMPTY, shape=(3, 0), fused=False))  # hidden size 0
def test_norms_match_reference(kernel, case):
    x, residual, weight = norm_inputs(case)
    with no_kernel_if(is_empty(case)):
        outputs = run_op(kernel, case, x, residual, weight)
    for name, out, expected in zip(("y", "x + residual"), outputs, run_reference(kernel, case, x, residual, weight)):
        assert out.dtype == x.dtype, name
        assert_matches(out, expected, TOLERANCE[case["dtype"]], name)


@settings(PROPERTIES, max_examples=5)
@given(case=norm_cases())
@example(case=dict(EMPTY, shape=(0, 64), fused=False))  # the weight still gets its (zero) gradient
@example(case=dict(EMPTY, shape=(0, 64), fused=True))
def test_norm_gradients_match_reference(kernel, case):
    x, residual, weight = norm_inputs(case)
    inputs = [x, residual, weight] if case["fused"] else [x, weight]
    for tensor in inputs:
        tensor.requires_grad_(True)
    generator = torch.Generator().manual_seed(case["seed"] + 1)
    d_outputs = [torch.randn(case["shape"], generator=generator).to(case["dtype"]) for _ in range(1 + case["fused"])]
    with no_kernel_if(is_empty(case)):
        grads = torch.autograd.grad(run_op(kernel, case, x, residual, weight), inputs, d_outputs)
    inputs64 = [t.detach().double().requires_grad_(True) for t in (x, residual, weight)]
    outputs64 = run_reference(kernel, case, *inputs64)
    total = sum((out * d.double()).sum() for out, d in zip(outputs64, d_outputs))
    expected = reference_gradients(total, inputs64 if case["fused"] else [inputs64[0], inputs64[2]],
                                   torch.ones((), dtype=torch.float64))
    names = ("d_x", "d_residual", "d_weight") if case["fused"] else ("d_x", "d_weight")
    # bfloat16 anywhere rounds what every gradient is made of (the fused sum x + residual, the weight).
    precision = torch.bfloat16 if torch.bfloat16 in (case["dtype"], case["weight_dtype"]) else torch.float32
    for name, grad, like, reference in zip(names, grads, inputs, expected):
        assert grad.dtype == like.dtype, name
        assert_matches(grad, reference, GRADIENT_TOLERANCE[precision], name, floor=1.0)


@settings(PROPERTIES, max_examples=4)
@given(case=norm_cases())
@example(case=dict(EMPTY, shape=(0, 64), fused=False))
def test_layers_match_the_transformers_norms_they_replace(kernel, case):
    """`RMSNorm` on a Llama-style norm and `RMSNormZeroCentered` on a Gemma-style one: the modules' own forward."""
    x, _, weight = norm_inputs(case)
    layer, module = ((kernel.layers.RMSNormZeroCentered, GemmaRMSNorm(weight.shape[0], eps=EPS)) if case["offset"]
                     else (kernel.layers.RMSNorm, LlamaRMSNorm(weight.shape[0], eps=EPS)))
    with torch.no_grad():
        module.weight.copy_(weight)
        module.to(case["weight_dtype"])
        with no_kernel_if(is_empty(case)):
            out = layer.forward(module, x)
        expected = type(module).forward(module, x)
    assert out.dtype == expected.dtype
    precision = torch.bfloat16 if torch.bfloat16 in (case["dtype"], case["weight_dtype"]) else torch.float32
    assert_matches(out, expected, TOLERANCE[precision])
