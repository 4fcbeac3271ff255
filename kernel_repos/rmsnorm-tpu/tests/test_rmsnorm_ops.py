"""The public torch API of the built torch-cpu variant: results, gradients, errors, torch.compile."""

import math

import pytest
import torch

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def random_tensor(seed: int, shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max() / expected.float().abs().max())


# (shape, dtype, offset): every edge hidden size; rows from 1 up, also with several leading dims.
CASES = [
    ((1, 2048), torch.bfloat16, 0.0),
    ((3, 4096), torch.float32, 1.0),
    ((2, 3, 5120), torch.bfloat16, 1.0),
    ((5, 7168), torch.bfloat16, 0.0),
    ((4, 2816), torch.float32, 0.0),
    ((13, 200), torch.float32, 0.0),
    ((2, 9, 96), torch.bfloat16, 1.0),
]


@pytest.mark.parametrize(("shape", "dtype", "offset"), CASES)
def test_rms_norm_and_fused_add_rms_norm_match_the_reference(kernel, shape, dtype, offset):
    x, residual = random_tensor(0, shape, dtype), random_tensor(1, shape, dtype)
    weight = random_tensor(2, shape[-1:], dtype)
    eps = 1e-6

    y = kernel.rms_norm(x, weight, eps, offset=offset)
    fused_y, new_residual = kernel.fused_add_rms_norm(x, residual, weight, eps, offset=offset)

    expected_y = kernel.reference.rms_norm(x, weight, eps, offset)
    expected_fused_y, expected_residual = kernel.reference.fused_add_rms_norm(x, residual, weight, eps, offset)
    for actual, expected in ((y, expected_y), (fused_y, expected_fused_y), (new_residual, expected_residual)):
        assert actual.dtype == dtype and actual.shape == shape
        assert relative_error(actual, expected) <= TOLERANCE[dtype]


def test_weight_may_be_float32_under_bfloat16_activations(kernel):
    x = random_tensor(3, (6, 256), torch.bfloat16)
    weight = random_tensor(4, (256,))
    y = kernel.rms_norm(x, weight, 1e-5)
    assert y.dtype == torch.bfloat16
    assert relative_error(y, kernel.reference.rms_norm(x, weight, 1e-5)) <= TOLERANCE[torch.bfloat16]


def test_no_rows_gives_an_empty_result(kernel):
    y = kernel.rms_norm(torch.empty(0, 128), random_tensor(5, (128,)), 1e-6)
    assert y.shape == (0, 128)


@pytest.mark.parametrize(("dtype", "offset"), [(torch.float32, 0.0), (torch.float32, 1.0), (torch.bfloat16, 1.0)])
def test_gradients_match_autograd_of_the_reference(kernel, dtype, offset):
    shape, eps = (3, 5, 200), 1e-5
    inputs = [random_tensor(seed, s, dtype) for seed, s in ((6, shape), (7, shape), (8, shape[-1:]))]
    grad_y, grad_residual = random_tensor(9, shape, dtype), random_tensor(10, shape, dtype)

    def gradients(rms_norm, fused_add_rms_norm):
        x, residual, weight = (t.clone().requires_grad_() for t in inputs)
        y = rms_norm(x, weight, eps, offset=offset)
        plain = torch.autograd.grad(y, (x, weight), grad_y)
        x, residual, weight = (t.clone().requires_grad_() for t in inputs)
        fused_y, new_residual = fused_add_rms_norm(x, residual, weight, eps, offset=offset)
        fused = torch.autograd.grad((fused_y, new_residual), (x, residual, weight), (grad_y, grad_residual))
        return plain + fused

    actual = gradients(kernel.rms_norm, kernel.fused_add_rms_norm)
    expected = gradients(
        lambda x, w, eps, offset: kernel.reference.rms_norm(x, w, eps, offset),
        lambda x, r, w, eps, offset: kernel.reference.fused_add_rms_norm(x, r, w, eps, offset),
    )
    for name, a, e in zip(("dx", "dweight", "fused dx", "fused dresidual", "fused dweight"), actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape, name
        assert relative_error(a, e) <= TOLERANCE[dtype], name


def test_torch_compile_traces_the_ops_and_their_backward_in_one_graph(kernel):
    inputs = [random_tensor(11, (4, 128)), random_tensor(12, (4, 128)), random_tensor(13, (128,))]

    def block(x, residual, weight):
        y, new_residual = kernel.fused_add_rms_norm(x, residual, weight, 1e-6)
        return kernel.rms_norm(y * 2.0, weight, 1e-6, offset=1.0) + new_residual

    def value_and_gradients(fn):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        return (out.detach(), *torch.autograd.grad(out.sum(), leaves))

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    for actual, expected in zip(value_and_gradients(compiled), value_and_gradients(block)):
        assert torch.equal(actual, expected)


def _bad_calls():
    x = random_tensor(14, (4, 64))
    weight = random_tensor(15, (64,))
    return [
        (lambda k: k.rms_norm(x, random_tensor(16, (32,)), 1e-6), ValueError, r"weight must have shape \[64\]"),
        (lambda k: k.rms_norm(x, weight.reshape(8, 8), 1e-6), ValueError, r"weight must have shape \[64\]"),
        (lambda k: k.rms_norm(x.long(), weight, 1e-6), TypeError, "x must be torch.float32 or torch.bfloat16, got "),
        (lambda k: k.rms_norm(x.half(), weight, 1e-6), TypeError, "x must be torch.float32 or .* got torch.float16"),
        (lambda k: k.rms_norm(x.double(), weight, 1e-6), TypeError, "got torch.float64"),
        (lambda k: k.rms_norm(x, weight.int(), 1e-6), TypeError, "weight must be torch.float32 or torch.bfloat16"),
        (lambda k: k.rms_norm(x, weight.to("meta"), 1e-6), ValueError, "weight is on meta but x is on cpu"),
        (lambda k: k.rms_norm(x.numpy(), weight, 1e-6), TypeError, "x must be a torch.Tensor, got ndarray"),
        (lambda k: k.rms_norm(torch.tensor(1.0), weight, 1e-6), ValueError, "x must have at least one dimension"),
        (lambda k: k.rms_norm(x, weight, 0.0), ValueError, "eps must be a finite number > 0, got 0.0"),
        (lambda k: k.rms_norm(x, weight, -1e-6), ValueError, "eps must be a finite number > 0"),
        (lambda k: k.rms_norm(x, weight, math.nan), ValueError, "eps must be a finite number > 0, got nan"),
        (lambda k: k.rms_norm(x, weight, torch.tensor(1e-6)), TypeError, "eps must be a Python float, got Tensor"),
        (lambda k: k.rms_norm(x, weight, 1e-6, offset=math.inf), ValueError, "offset must be a finite number"),
        (lambda k: k.fused_add_rms_norm(x, x[:2], weight, 1e-6), ValueError, "residual must match x"),
        (lambda k: k.fused_add_rms_norm(x, x.bfloat16(), weight, 1e-6), ValueError, "residual must match x"),
        (lambda k: k.fused_add_rms_norm(x, x.long(), weight, 1e-6), TypeError, "residual must be torch.float32"),
        (lambda k: k.fused_add_rms_norm(x, x, weight, 0), ValueError, "eps must be a finite number > 0"),
    ]


@pytest.mark.parametrize(("call", "error", "message"), _bad_calls())
def test_bad_input_raises_a_clear_error(kernel, call, error, message):
    with pytest.raises(error, match=message):
        call(kernel)


# A 3-dim x keeps the bucket of its rows ([2, 8, D]: 16, not 16 x 8). A 4-dim x is per-head ([B, tokens, heads,
# D]): its tokens are bucketed, times its heads (3 heads: 16 tokens at the edge of their bucket, 17 past it). Its
# transposed view ([B, heads, tokens, D], as Gemma 3 normalises q and k) has the same bucket, with one head or at a
# decode step's one token too; the result keeps x's layout, as the module's own forward does.
@pytest.mark.parametrize(("leading", "transposed", "bucket"), [
    ((1,), False, 16), ((2, 8), False, 16), ((17,), False, 32), ((1, 16, 3), False, 48), ((1, 17, 3), False, 96),
    ((1, 17, 3), True, 96), ((1, 17, 1), True, 32), ((1, 1, 3), True, 48)])
def test_rows_are_padded_to_their_bucket_without_changing_results_or_gradients(kernel, monkeypatch, leading,
                                                                               transposed, bucket):
    shape, eps = (*leading, 128), 1e-6

    def laid_out(seed, shape):
        tensor = random_tensor(seed, shape)
        return tensor.transpose(-3, -2) if transposed and tensor.dim() == 4 else tensor

    inputs = [laid_out(seed, s) for seed, s in ((17, shape), (18, shape), (19, shape[-1:]))]
    shape = inputs[0].shape
    grad_y, grad_residual = random_tensor(20, shape), random_tensor(21, shape)

    def results_and_gradients(rms_norm, fused_add_rms_norm):
        x, residual, weight = (t.clone().requires_grad_() for t in inputs)
        y = rms_norm(x, weight, eps, offset=1.0)
        fused_y, new_residual = fused_add_rms_norm(x, residual, weight, eps, offset=1.0)
        outputs = (y, fused_y, new_residual)
        return [t.detach() for t in outputs] + list(
            torch.autograd.grad(outputs, (x, residual, weight), (grad_y, grad_y, grad_residual)))

    expected = results_and_gradients(
        lambda x, w, eps, offset: kernel.reference.rms_norm(x, w, eps, offset),
        lambda x, r, w, eps, offset: kernel.reference.fused_add_rms_norm(x, r, w, eps, offset))
    seen_rows = []
    for name in ("_rms_norm_op", "_fused_add_rms_norm_op"):
        op = getattr(kernel.ops, name)
        monkeypatch.setattr(kernel.ops, name, lambda x, *args, op=op: seen_rows.append(x.shape) or op(x, *args))
    actual = results_and_gradients(kernel.rms_norm, kernel.fused_add_rms_norm)
    assert set(seen_rows) == {(bucket, 128)}
    for name, a, e in zip(("y", "fused y", "residual", "dx", "dresidual", "dweight"), actual, expected):
        assert a.shape == e.shape, name
        assert relative_error(a, e) <= 1e-5, name
    assert [y.is_contiguous() for y in actual[:3]] == [y.is_contiguous() for y in expected[:3]]
