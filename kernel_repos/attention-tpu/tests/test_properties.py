"""Properties of every op and layer this kernel exports, against the plain reference (`reference.py`).

Each test draws shapes in which any of batch, query heads, query and key
length may be 0 or 1, GQA groups, head dims of q and k equal to v's or not
(latent attention's), both dtypes, every masking option the op
takes (causal, offsets as an int or an integer tensor of any dtype, key
lengths, a sliding window, a bool or additive mask, softcap, sinks) and random
(never zero) values, runs the built kernel (TPU interpret mode, race detection
on) and compares with the float64 reference, gradients included. An empty
input must give its result without any Pallas kernel: `pallas_call` fails
while it runs. The next edge case goes here: a value in a strategy, or an
`@example`.

Examples stay few and tiny: every new shape and option set compiles the kernels (~1 s).
"""

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tpu_kernels.testing import assert_matches, dimensions, no_kernel_if

# The `kernel` fixture returns the same built variant for every example.
PROPERTIES = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

FLOAT_DTYPES = (torch.float32, torch.bfloat16)
INTEGER_DTYPES = (torch.int32, torch.int64, torch.int16)
# Error relative to the largest reference value: float32's online softmax against float64; bfloat16
# rounds the inputs' products and the output (8-bit mantissa).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@st.composite
def attention_cases(draw):
    batch, q_len, kv_len = draw(dimensions(batch=[1, 2], q_len=[1, 3, 9], kv_len=[1, 5, 17])).values()
    kv_heads, group = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    offset = draw(st.sampled_from(["default", "int", "tensor"]))
    return dict(
        batch=batch, kv_heads=kv_heads, q_heads=kv_heads * group, q_len=q_len, kv_len=kv_len,
        head_dims=draw(st.sampled_from([(64, 64), (128, 128), (96, 64), (192, 128)])),
        dtype=draw(st.sampled_from(FLOAT_DTYPES)),
        causal=draw(st.booleans()), offset=offset, offset_dtype=draw(st.sampled_from(INTEGER_DTYPES)),
        kv_lengths=draw(st.booleans()), sliding_window=draw(st.sampled_from([None, 1, 4])),
        softcap=draw(st.sampled_from([None, 5.0])), mask=draw(st.sampled_from([None, "bool", "additive"])),
        sinks=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
    )


def attention_inputs(case) -> tuple[list[torch.Tensor], dict]:
    """([query, key, value, sinks or None], the keyword options) of a drawn case."""
    generator = torch.Generator().manual_seed(case["seed"])
    batch, q_len, kv_len, dtype = case["batch"], case["q_len"], case["kv_len"], case["dtype"]

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    head_dim, v_head_dim = case["head_dims"]
    tensors = [randn(batch, case["q_heads"], q_len, head_dim), randn(batch, case["kv_heads"], kv_len, head_dim),
               randn(batch, case["kv_heads"], kv_len, v_head_dim), randn(case["q_heads"]) if case["sinks"] else None]
    options = dict(causal=case["causal"], sliding_window=case["sliding_window"], softcap=case["softcap"])
    if case["offset"] == "int":
        options["q_offset"] = int(torch.randint(0, kv_len + 1, (), generator=generator))
    elif case["offset"] == "tensor":
        options["q_offset"] = torch.randint(0, kv_len + 1, (batch,), generator=generator).to(case["offset_dtype"])
    if case["kv_lengths"]:
        options["kv_lengths"] = torch.randint(0, kv_len + 1, (batch,), generator=generator).to(case["offset_dtype"])
    if case["mask"] is not None:
        attend = torch.rand(batch, 1, q_len, kv_len, generator=generator) < 0.7
        if case["mask"] == "bool":
            options["attention_mask"] = attend
        else:  # additive: random biases, and the dtype's minimum where a key is masked out
            bias = torch.randn(batch, 1, q_len, kv_len, generator=generator).to(dtype)
            options["attention_mask"] = bias.masked_fill(~attend, torch.finfo(dtype).min)
    return tensors, options


def is_empty(case) -> bool:
    return 0 in (case["batch"], case["q_heads"], case["q_len"], case["kv_len"])


def reference(kernel, query, key, value, sinks, options) -> torch.Tensor:
    return kernel.reference.reference_attention(query, key, value, sinks=sinks, **options)


EMPTY = dict(kv_heads=2, q_heads=4, head_dims=(96, 64), dtype=torch.float32, causal=True, offset="default",
             offset_dtype=torch.int64, kv_lengths=False, sliding_window=None, softcap=None, mask=None, sinks=False,
             seed=0)


@pytest.mark.slow
@settings(PROPERTIES, max_examples=5)
@given(case=attention_cases())
@example(case=dict(EMPTY, batch=0, q_len=3, kv_len=5))  # batch 0, as scaled_dot_product_attention takes it
@example(case=dict(EMPTY, batch=2, q_len=0, kv_len=5, offset="tensor", kv_lengths=True))  # no queries
@example(case=dict(EMPTY, batch=2, q_len=3, kv_len=0, sinks=True, mask="bool"))  # no keys: zeros
@example(case=dict(EMPTY, batch=2, q_heads=0, q_len=3, kv_len=5))  # no query heads
def test_flash_attention_matches_reference(kernel, case):
    (query, key, value, sinks), options = attention_inputs(case)
    with no_kernel_if(is_empty(case)):
        out = kernel.flash_attention(query, key, value, sinks=sinks, **options)
    expected = reference(kernel, query.double(), key.double(), value.double(),
                         None if sinks is None else sinks.double(), options)
    assert out.dtype == case["dtype"]
    assert_matches(out, expected, TOLERANCE[case["dtype"]])


@pytest.mark.slow
@settings(PROPERTIES, max_examples=3)
@given(case=attention_cases())
@example(case=dict(EMPTY, batch=0, q_len=3, kv_len=5, sinks=True))
@example(case=dict(EMPTY, batch=2, q_len=0, kv_len=5, sinks=True))  # no queries: dk, dv, d_sinks zero
@example(case=dict(EMPTY, batch=2, q_len=3, kv_len=0, sinks=True))  # no keys: dq, d_sinks zero
def test_flash_attention_gradients_match_reference(kernel, case):
    (query, key, value, sinks), options = attention_inputs(case)
    inputs = [t for t in (query, key, value, sinks) if t is not None]
    for tensor in inputs:
        tensor.requires_grad_(True)
    d_out = torch.randn(*query.shape[:3], value.shape[3],
                        generator=torch.Generator().manual_seed(case["seed"] + 1)).to(case["dtype"])
    with no_kernel_if(is_empty(case)):
        grads = torch.autograd.grad(kernel.flash_attention(query, key, value, sinks=sinks, **options), inputs, d_out)
    inputs64 = [t.detach().double().requires_grad_(True) for t in inputs]
    out64 = reference(kernel, *inputs64[:3], inputs64[3] if sinks is not None else None, options)
    expected = torch.autograd.grad(out64, inputs64, d_out.double(), allow_unused=True)
    for name, grad, like, reference_grad in zip(("dq", "dk", "dv", "d_sinks"), grads, inputs, expected):
        assert grad.dtype == like.dtype, name
        reference_grad = torch.zeros_like(like, dtype=torch.float64) if reference_grad is None else reference_grad
        assert_matches(grad, reference_grad, TOLERANCE[case["dtype"]], name, floor=1.0)


class _Attention(torch.nn.Module):
    """What transformers' attention modules offer the attention function."""

    is_causal = True
    sliding_window = None
    attn_logit_softcapping = None


@settings(PROPERTIES, max_examples=3)
@given(case=attention_cases().filter(lambda case: case["mask"] != "additive" and case["offset"] == "default"))
@example(case=dict(EMPTY, batch=0, q_len=3, kv_len=3))
@example(case=dict(EMPTY, batch=2, q_len=0, kv_len=0, mask="bool"))
def test_attention_forward_matches_reference(kernel, case):
    """The function transformers calls ([B, S, Hq, D] out), with its boolean mask or none (causal)."""
    (query, key, value, sinks), options = attention_inputs(case)
    mask = options.get("attention_mask")
    with no_kernel_if(is_empty(case)):
        out, weights = kernel.attention_forward(_Attention(), query, key, value, mask, s_aux=sinks)
    if mask is None:  # sdpa's conventions for a skipped mask: causal from the top left for several queries
        causal = case["q_len"] > 1
        expected_options = dict(causal=causal, q_offset=0 if causal else case["kv_len"] - case["q_len"])
    else:
        expected_options = dict(causal=False, attention_mask=mask)
    expected = reference(kernel, query.double(), key.double(), value.double(),
                         None if sinks is None else sinks.double(), expected_options)
    assert weights is None and out.dtype == case["dtype"]
    assert_matches(out, expected.transpose(1, 2), TOLERANCE[case["dtype"]])
