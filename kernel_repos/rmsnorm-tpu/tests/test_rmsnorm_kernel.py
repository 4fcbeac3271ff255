"""The Pallas kernels themselves (norm/kernel.py of the built variant, through its JAX functions), in TPU
interpret mode.

Small blocks are forced so every case has several row blocks and a ragged last
one; uninitialised memory is NaN, so a garbage row leaking into a valid output
or into the weight gradient shows up as NaN.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tpu_kernels.runtime.hardware import resolve_target
from tpu_kernels.testing import interpret

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def random_array(key: int, shape, dtype) -> jax.Array:
    return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


def as_torch(array: jax.Array) -> torch.Tensor:
    return torch.from_numpy(np.array(array.astype(jnp.float32)))


def assert_close(actual: jax.Array, expected: torch.Tensor, dtype) -> None:
    actual = as_torch(actual)
    assert not actual.isnan().any(), "NaN in a valid output: uninitialised rows leaked"
    error = (actual - expected.float()).abs().max() / expected.float().abs().max()
    assert error <= TOLERANCE[dtype], f"relative error {error:.2e} > {TOLERANCE[dtype]:.0e}"


# (leading shape, hidden, dtype, block_rows, offset): rows = prod(leading shape), never a multiple of block_rows.
FORWARD_CASES = [
    ((37,), 200, jnp.float32, 8, 0.0),
    ((3, 11), 96, jnp.bfloat16, 16, 1.0),
    ((20,), 2816, jnp.bfloat16, 16, 0.0),
    ((9,), 5120, jnp.float32, 8, 1.0),
]


@pytest.mark.parametrize(("leading", "hidden", "dtype", "block_rows", "offset"), FORWARD_CASES)
def test_forward_kernels_on_ragged_row_blocks(kernel, leading, hidden, dtype, block_rows, offset):
    shape = (*leading, hidden)
    x, residual = random_array(0, shape, dtype), random_array(1, shape, dtype)
    weight = random_array(2, (hidden,), dtype)
    eps = 1e-6
    y = interpret(lambda: kernel.norm.kernel.rms_norm_forward(x, weight, eps=eps, offset=offset, block_rows=block_rows))
    fused_y, new_residual = interpret(lambda: kernel.norm.kernel.fused_add_rms_norm_forward(
        x, residual, weight, eps=eps, offset=offset, block_rows=block_rows
    ))
    assert y.dtype == fused_y.dtype == new_residual.dtype == dtype and y.shape == shape

    assert_close(y, kernel.reference.rms_norm(as_torch(x), as_torch(weight), eps, offset), dtype)
    expected_sum = x.astype(jnp.float32) + residual.astype(jnp.float32)
    assert_close(new_residual, as_torch(expected_sum), dtype)
    # The kernel normalises the sum rounded to the input dtype, like the unfused decoder layer.
    rounded_sum = as_torch(expected_sum.astype(dtype))
    assert_close(fused_y, kernel.reference.rms_norm(rounded_sum, as_torch(weight), eps, offset), dtype)


BACKWARD_CASES = [
    ((37,), 200, jnp.float32, 8, 0.0),
    ((3, 11), 96, jnp.bfloat16, 16, 1.0),
]


@pytest.mark.parametrize(("leading", "hidden", "dtype", "block_rows", "offset"), BACKWARD_CASES)
def test_backward_kernels_on_ragged_row_blocks(kernel, leading, hidden, dtype, block_rows, offset):
    shape = (*leading, hidden)
    x, grad, grad_residual = (random_array(k, shape, dtype) for k in (3, 4, 5))
    weight = random_array(6, (hidden,), dtype)
    eps = 1e-5
    dx, dweight = interpret(lambda: kernel.norm.kernel.rms_norm_backward(
        grad, x, weight, eps=eps, offset=offset, block_rows=block_rows
    ))
    dsum, dweight_fused = interpret(lambda: kernel.norm.kernel.fused_add_rms_norm_backward(
        grad, grad_residual, x, weight, eps=eps, offset=offset, block_rows=block_rows
    ))
    assert dx.dtype == dsum.dtype == dtype and dweight.dtype == dweight_fused.dtype == dtype

    x_t = as_torch(x).requires_grad_()
    weight_t = as_torch(weight).requires_grad_()
    y = kernel.reference.rms_norm(x_t, weight_t, eps, offset)
    expected_dx, expected_dweight = torch.autograd.grad(y, (x_t, weight_t), as_torch(grad))
    assert_close(dx, expected_dx, dtype)
    assert_close(dweight, expected_dweight, dtype)
    assert_close(dsum, expected_dx + as_torch(grad_residual), dtype)
    assert_close(dweight_fused, expected_dweight, dtype)


def test_explicit_block_rows_are_checked(kernel):
    with pytest.raises(ValueError, match="block_rows must be a multiple of 16"):
        kernel.norm.kernel.rms_norm_forward(jnp.ones((40, 128), jnp.bfloat16), jnp.ones((128,), jnp.bfloat16), eps=1e-6,
                                   block_rows=8)


@pytest.mark.parametrize("block_rows", [16, 1024])
def test_explicit_block_rows_ask_for_the_vmem_limit_they_need(kernel, block_rows):
    """A caller's row block, larger or smaller than the selected one, gets its own block's limit, as a tuned
    entry does: a larger block under the selected block's limit would overflow it on the chip."""
    rows, hidden, dtype = 4096, 2048, jnp.bfloat16
    x, weight = jnp.ones((rows, hidden), dtype), jnp.ones((hidden,), dtype)
    jaxpr = str(jax.make_jaxpr(lambda x, weight: kernel.norm.kernel.rms_norm_forward(
        x, weight, eps=1e-6, generation="v6e", block_rows=block_rows))(x, weight))
    v6e = resolve_target("v6e")
    needed = kernel.norm.tiles.vmem_limit(kernel.norm.tiles.vmem_bytes(block_rows, hidden, dtype, "rms_norm"), v6e)
    selected = kernel.norm.tiles.select(kernel.NormProblem("rms_norm", rows, hidden, "bfloat16"), v6e)
    assert selected.block_rows not in (16, 1024)
    assert f"vmem_limit_bytes={needed}" in jaxpr
