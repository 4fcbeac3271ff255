"""The Pallas kernels themselves (kernel.py of the built variant), in TPU interpret mode.

Small blocks are forced so every case has several row blocks and a ragged last
one; uninitialised memory is NaN, so a garbage row leaking into a valid output
or into the weight gradient shows up as NaN.
"""

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax._src.pallas.mosaic.interpret import interpret_pallas_call
from jax.experimental.pallas import tpu as pltpu

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


@contextlib.contextmanager
def tpu_interpreter():
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")):
        yield
    assert not interpret_pallas_call.races.races_found, "the TPU interpreter found a data race"


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
    with tpu_interpreter():
        y = kernel.pallas_tpu.rms_norm(x, weight, eps=eps, offset=offset, block_rows=block_rows)
        fused_y, new_residual = kernel.pallas_tpu.fused_add_rms_norm(
            x, residual, weight, eps=eps, offset=offset, block_rows=block_rows
        )
        jax.block_until_ready((y, fused_y, new_residual))
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
    with tpu_interpreter():
        dx, dweight = kernel.pallas_tpu.rms_norm_backward(grad, x, weight, eps=eps, offset=offset, block_rows=block_rows)
        dsum, dweight_fused = kernel.pallas_tpu.fused_add_rms_norm_backward(
            grad, grad_residual, x, weight, eps=eps, offset=offset, block_rows=block_rows
        )
        jax.block_until_ready((dx, dweight, dsum, dweight_fused))
    assert dx.dtype == dsum.dtype == dtype and dweight.dtype == dweight_fused.dtype == dtype

    x_t = as_torch(x).requires_grad_()
    weight_t = as_torch(weight).requires_grad_()
    y = kernel.reference.rms_norm(x_t, weight_t, eps, offset)
    expected_dx, expected_dweight = torch.autograd.grad(y, (x_t, weight_t), as_torch(grad))
    assert_close(dx, expected_dx, dtype)
    assert_close(dweight, expected_dweight, dtype)
    assert_close(dsum, expected_dx + as_torch(grad_residual), dtype)
    assert_close(dweight_fused, expected_dweight, dtype)


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize(
    "kernel_name", ["rms_norm", "fused_add_rms_norm", "rms_norm_backward", "fused_add_rms_norm_backward"]
)
def test_select_config_aligns_blocks_and_fits_scoped_vmem(kernel, generation, kernel_name):
    k = kernel.kernel
    chip = k.GENERATIONS[generation]
    for rows in (1, 7, 64, 1000, 8192, 100_003):
        for hidden in (96, 200, 2048, 2816, 4096, 5120, 7168):
            for dtype in (jnp.float32, jnp.bfloat16):
                config = k.select_config(rows, hidden, dtype, generation, kernel=kernel_name)
                assert config.block_rows == rows or config.block_rows % k.sublane_multiple(dtype) == 0
                assert 1 <= config.block_rows <= rows
                assert config.vmem_limit_bytes is None
                used = k._vmem_bytes(config.block_rows, hidden, dtype, k.KERNELS[kernel_name])
                assert used <= chip.scoped_vmem_bytes * k.VMEM_BUDGET_FRACTION
                # Equal blocks: the ragged last block wastes less than one alignment unit per block.
                blocks = math.ceil(rows / config.block_rows)
                assert blocks * config.block_rows - rows < blocks * k.sublane_multiple(dtype)


def test_select_config_follows_the_generation(kernel):
    k = kernel.kernel
    v5e = k.select_config(8192, 4096, jnp.bfloat16, "v5e")
    v6e = k.select_config(8192, 4096, jnp.bfloat16, "v6e")
    assert v5e.block_rows < v6e.block_rows  # 16 MiB vs 32 MiB of scoped VMEM
    assert k.select_config(64, 4096, jnp.bfloat16, "v6e").block_rows == 64  # one full block: nothing to pipeline


def test_select_config_raises_the_vmem_limit_for_huge_rows_and_refuses_beyond_capacity(kernel):
    k = kernel.kernel
    config = k.select_config(64, 131_072, jnp.float32, "v5e", kernel="fused_add_rms_norm")
    assert config.block_rows == 8 and 16 * k.MIB < config.vmem_limit_bytes <= 96 * k.MIB
    with pytest.raises(ValueError, match="hidden=262144 is too large for fused_add_rms_norm on v5e"):
        k.select_config(64, 262_144, jnp.float32, "v5e", kernel="fused_add_rms_norm")


def test_bad_config_arguments_are_rejected(kernel):
    k = kernel.kernel
    with pytest.raises(ValueError, match="generation must be one of"):
        k.select_config(8, 128, jnp.float32, "v3")
    with pytest.raises(ValueError, match="kernel must be one of"):
        k.select_config(8, 128, jnp.float32, "v6e", kernel="layer_norm")
    with pytest.raises(ValueError, match="block_rows must be a multiple of 16"):
        k.rms_norm(jnp.ones((40, 128), jnp.bfloat16), jnp.ones((128,), jnp.bfloat16), eps=1e-6, block_rows=8)
    with pytest.raises(ValueError, match="weight shape"):
        k.rms_norm(jnp.ones((4, 128)), jnp.ones((64,)), eps=1e-6)
    with pytest.raises(TypeError, match="x must be float32 or bfloat16"):
        k.rms_norm(jnp.ones((4, 128), jnp.int32), jnp.ones((128,)), eps=1e-6)
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        k.rms_norm(jnp.ones((4, 128)), jnp.ones((128,)), eps=0.0)
