"""ragged-dot-tpu's plans count the VMEM its kernels' block specs and scratch hold, as benchmarks.perf derives it.

Each kernel's plan lists its buffers (`config.Buffer`: block shapes, dtypes,
buffer counts); the VMEM limit a kernel asks for is their sum plus the values
it keeps beside them. Here the sum is checked against the replayed call:
every block spec and scratch operand the kernel builds, for plain, chunked,
multi-slot, transposed and quantized grouped matmuls, tgmm with and without
group chunks, and the fused kernel with I tiles, interleaved gates, biases
and one-byte weights.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import perf
from tpu_kernels.runtime.hardware import resolve_target

V6E = resolve_target("v6e")

S = jax.ShapeDtypeStruct


@pytest.fixture
def kernel(ragged_dot_kernel):
    return ragged_dot_kernel


def _replayed_vmem(fn, *args) -> int:
    [call] = perf.model_pallas_traffic(fn, *args)
    return call.vmem_bytes


def _planned_vmem(kernel, plan) -> int:
    return kernel.common.vmem.buffers_bytes(plan.buffers)


MATMUL_CASES = {
    # m, k, n, groups, rhs dtype, transpose_rhs, tiles (tile_m, tile_k, tile_n, chunk_m, groups_per_step), generation
    "resident-rows": (64, 256, 384, 4, "bfloat16", False, (64, 256, 384, None, 1), "v6e"),
    "row-tiles-in-chunks": (200, 256, 256, 4, "bfloat16", True, (64, 128, 128, 32, 1), "v6e"),
    "group-slots": (48, 128, 256, 6, "float32", False, (48, 128, 256, None, 3), "v6e"),
    "transposed-ragged-edges": (100, 200, 300, 3, "bfloat16", True, (112, 200, 300, None, 1), "v6e"),
    "int8": (64, 256, 256, 4, "int8", True, (64, 256, 256, None, 1), "v6e"),
    "fp8-dequantized": (64, 256, 384, 4, "float8_e4m3fn", False, (64, 256, 384, None, 2), "v6e"),
    # No dequantized blocks: the fp8 MXU takes the weights as they are.
    "fp8-on-the-fp8-mxu": (200, 384, 256, 4, "float8_e4m3fn", True, (64, 128, 256, 32, 1), "tpu7x"),
    # A bias row per group slot (`MatmulProblem.bias`), with int8 scales beside it.
    "biased-int8-slots": (48, 256, 384, 6, "int8", False, (48, 256, 384, None, 3), "v6e"),
}
BIASED = {"biased-int8-slots"}


@pytest.mark.parametrize("case", list(MATMUL_CASES))
def test_grouped_matmul_plan_counts_the_vmem_of_its_block_specs(kernel, case):
    m, k, n, groups, rhs_dtype, transpose_rhs, tiles, generation = MATMUL_CASES[case]
    problem = kernel.MatmulProblem(m, k, n, groups, "bfloat16" if rhs_dtype != "float32" else "float32",
                                   rhs_dtype, transpose_rhs=transpose_rhs, bias=case in BIASED)
    plan = kernel.gmm.plan.make(problem, resolve_target(generation), kernel.gmm.tiles.TileConfig(*tiles))
    assert plan.fp8_matmul == (case == "fp8-on-the-fp8-mxu")
    rhs_shape = (groups, n, k) if transpose_rhs else (groups, k, n)
    scheme = kernel.common.quant.scheme_of(rhs_dtype)
    scales = None if scheme is None else S(kernel.expected_scales_shape(scheme, rhs_shape,
                                                                         1 if transpose_rhs else 2), jnp.float32)
    sizes = np.full(groups, m // groups, np.int32)
    bias = S((groups, n), jnp.bfloat16) if case in BIASED else None

    def fn(lhs, rhs, sizes, scales, bias):
        return kernel.gmm.kernel.call(lhs, rhs, sizes, plan, scales, bias)

    replayed = _replayed_vmem(fn, S((m, k), problem.dtype), S(rhs_shape, rhs_dtype), sizes, scales, bias)
    assert _planned_vmem(kernel, plan) == replayed


@pytest.mark.parametrize("tiles", [(64, 128, 256, 32, False), (64, 256, 128, 16, True), (512, 256, 256, 128, False)])
def test_tgmm_plan_counts_the_vmem_of_its_block_specs(kernel, tiles):
    m, k, n, groups = 200, 256, 256, 5
    problem = kernel.TgmmProblem(m, k, n, groups, "bfloat16", "bfloat16")
    plan = kernel.tgmm.plan.make(problem, V6E, kernel.tgmm.tiles.TgmmConfig(*tiles))
    sizes = np.asarray([30, 0, 70, 60, 40], np.int32)
    fn = functools.partial(kernel.tgmm.kernel.call, plan=plan)
    assert _planned_vmem(kernel, plan) == _replayed_vmem(fn, S((m, k), jnp.bfloat16), S((m, n), jnp.bfloat16), sizes)


FUSED_CASES = {
    # tokens, hidden, intermediate, experts, weights dtype, weights_transposed, bias, gate, fused tiles, generation
    "whole-i": (16, 256, 128, 8, "bfloat16", False, False, dict(activation="silu"), None, "v6e"),
    "i-tiles": (20, 256, 256, 8, "bfloat16", False, True, dict(activation="silu"), (16, 128), "v6e"),
    "interleaved-transposed": (20, 256, 192, 8, "bfloat16", True, True,
                               dict(activation="clamped_swiglu", interleaved=True, alpha=1.702, limit=7.0), (16, 64),
                               "v6e"),
    "int8": (16, 256, 256, 8, "int8", False, False, dict(activation="silu"), (16, 128), "v6e"),
    "fp8-dequantized": (16, 256, 256, 8, "float8_e4m3fn", True, False, dict(activation="gelu"), None, "v6e"),
    # No dequantized blocks: the fp8 MXU takes the weights as they are.
    "fp8-on-the-fp8-mxu": (40, 256, 256, 8, "float8_e4m3fn", False, False, dict(activation="silu"), (16, 128, 1),
                           "tpu7x"),
    "fp8-on-the-fp8-mxu-slots": (40, 256, 256, 8, "float8_e4m3fn", False, False, dict(activation="silu"),
                                 (16, 256, 2), "tpu7x"),
}


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_plan_counts_the_vmem_of_its_block_specs(kernel, case):
    tokens, hidden, intermediate, experts, weights_dtype, transposed, bias, gate, tiles, generation = FUSED_CASES[case]
    top_k = 2
    gate_up = (experts, hidden, 2 * intermediate) if transposed else (experts, 2 * intermediate, hidden)
    down = (experts, intermediate, hidden) if transposed else (experts, hidden, intermediate)
    weights = [S(gate_up, weights_dtype), S(down, weights_dtype)]
    weights += [S((experts, 2 * intermediate), jnp.bfloat16), S((experts, hidden), jnp.bfloat16)] if bias else [None,
                                                                                                               None]
    scheme = kernel.common.quant.scheme_of(weights_dtype)
    if scheme is not None:
        out_axis = 2 if transposed else 1
        weights += [S(kernel.expected_scales_shape(scheme, shape, out_axis), jnp.float32) for shape in (gate_up,
                                                                                                      down)]
    expert_weights = kernel.problem.ExpertWeights(*weights)
    hidden_states = S((tokens, hidden), jnp.bfloat16)
    index = np.random.default_rng(0).integers(0, experts, (tokens, top_k)).astype(np.int32)
    routing = np.full((tokens, top_k), 0.5, np.float32)
    problem = kernel.problem.ExpertsProblem.of(hidden_states, index, routing, expert_weights,
                                               kernel.problem.Gate(**gate), weights_transposed=transposed)
    config = None if tiles is None else kernel.fused.tiles.FusedConfig(*tiles)
    plan = kernel.fused.plan.make(problem, resolve_target(generation), config)
    assert plan.fp8_matmul == case.startswith("fp8-on-the-fp8-mxu")

    def run(hidden_states, index, routing, *weights):
        read = kernel.problem.ExpertWeights(*weights).as_read(plan.orientation, weights_transposed=transposed)
        return kernel.fused.kernel.call(hidden_states, index, routing, read, plan)

    assert _planned_vmem(kernel, plan) == _replayed_vmem(run, hidden_states, index, routing, *weights)
