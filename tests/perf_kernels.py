"""Pallas kernels that both perf model test modules replay and price (test_perf.py, test_perf_replay.py): a tiled
matmul and a matmul whose k-blocks pl.when switches on, with the shapes the tests give them."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BF16 = 2  # bytes


def tiled_matmul_kernel(x_ref, y_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def tiled_matmul(x, y, *, bm, bk, bn):
    m, k = x.shape
    _, n = y.shape
    return pl.pallas_call(
        tiled_matmul_kernel,
        grid=(m // bm, n // bn, k // bk),
        in_specs=[
            pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=2 * m * n * k, transcendentals=0, bytes_accessed=0),
    )(x, y)


M, K, N = 512, 1024, 768
BM, BK, BN = 256, 256, 256
X = jax.ShapeDtypeStruct((M, K), jnp.bfloat16)
Y = jax.ShapeDtypeStruct((K, N), jnp.bfloat16)
MATMUL = functools.partial(tiled_matmul, bm=BM, bk=BK, bn=BN)


def masked_matmul(block_on, x, y, *, gate_on_data=False):
    """x @ y over the k-blocks that are switched on: by `block_on` (scalar prefetch) or by x's data."""
    m, k = x.shape
    n = y.shape[1]
    bk = 128

    def kernel(on_ref, x_ref, y_ref, o_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        switched_on = x_ref[0, 0] > 0 if gate_on_data else on_ref[pl.program_id(0)] == 1

        @pl.when(switched_on)
        def _():
            o_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(k // bk,),
        in_specs=[pl.BlockSpec((m, bk), lambda s, on: (0, s)), pl.BlockSpec((bk, n), lambda s, on: (s, 0))],
        out_specs=pl.BlockSpec((m, n), lambda s, on: (0, 0)),
    )
    return pl.pallas_call(kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32))(
        block_on, x, y
    )


MASK_X = jax.ShapeDtypeStruct((128, 512), jnp.bfloat16)
MASK_Y = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
BLOCK_FLOPS = 2 * 128 * 128 * 256
