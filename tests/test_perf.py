"""The matmul and pipeline model against hand counts and the compiler's own cost analysis: a tiled matmul's traffic
and flops, the roofline, the MXU's per-pass pricing, the time a pipeline hides, megacore's split, the VMEM fit at
the compiler's limit, vector work and the rates it is priced at. The grid replay itself: test_perf_replay.py."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from benchmarks import perf
from tpu_kernels.aot import compile_for

from .perf_kernels import (BF16, BK, BM, BN, MASK_X, MASK_Y, MATMUL, K, M, N, X, Y, masked_matmul, tiled_matmul,
                           tiled_matmul_kernel)

V6E_STEP_S = perf.grid_step_s("v6e")  # the calibrated step cost the model charges by default
V6E_HBM_BYTES_PER_S = 1.64e12 * perf.FITTED_RATES.hbm_fraction("v6e")  # the peak at the share v6e's copies reach
# The scaling book's per-pass rule, a weights load never hidden by a short pass (the mechanism under test).
WHOLE_WEIGHT_LOADS = dataclasses.replace(perf.FITTED_RATES, mxu_weight_load_fraction=1.0)


@pytest.fixture(scope="module")
def matmul_traffic():
    [call] = perf.model_pallas_traffic(MATMUL, X, Y)
    return call


def test_tiled_matmul_bytes_equal_the_hand_count(matmul_traffic):
    gm, gn, gk = M // BM, N // BN, K // BK
    x, y, out = matmul_traffic.operands
    assert matmul_traffic.grid == (gm, gn, gk)
    assert matmul_traffic.steps == gm * gn * gk
    # k is the fastest axis, so x's block (i, k) and y's (k, j) change at every step.
    assert (x.transfers, x.distinct_blocks) == (gm * gn * gk, gm * gk)
    assert x.hbm_bytes == gm * gn * gk * BM * BK * BF16 == N // BN * M * K * BF16
    assert y.hbm_bytes == gm * gn * gk * BK * BN * BF16 == M // BM * K * N * BF16
    # The output block (i, j) stays put over k and is written once.
    assert (out.transfers, out.hbm_bytes, out.revisits) == (gm * gn, M * N * BF16, 0)
    assert matmul_traffic.hbm_bytes == (N // BN * M * K + M // BM * K * N + M * N) * BF16
    # Double-buffered bf16 blocks plus the f32 accumulator.
    assert matmul_traffic.vmem_bytes == 2 * (BM * BK + BK * BN + BM * BN) * BF16 + BM * BN * 4
    assert matmul_traffic.dimension_semantics == ("parallel", "parallel", "arbitrary")


@pytest.mark.aot
def test_tiled_matmul_flops_agree_with_compile_only_cost_analysis(matmul_traffic):
    assert matmul_traffic.dots_exact
    assert matmul_traffic.flops == 2 * M * N * K
    assert matmul_traffic.cost_estimate.flops == matmul_traffic.flops
    pallas_cost = compile_for(MATMUL, [X, Y], "v6e").cost_analysis()
    xla_dot_cost = compile_for(jnp.dot, [X, Y], "v6e").cost_analysis()
    assert pallas_cost["flops"] == matmul_traffic.flops
    assert xla_dot_cost["flops"] == matmul_traffic.flops
    # The shapes are multiples of v6e's 256-wide MXU: no padding to add.
    assert matmul_traffic.mxu_flops("v6e") == matmul_traffic.flops


def test_roofline_is_max_of_hbm_and_mxu_time_plus_step_overhead(matmul_traffic):
    v6e = perf.tpu_generation("v6e")
    assert (v6e.hbm_bytes_per_s, v6e.bf16_flops_per_s, v6e.mxu_size) == (1.64e12, 9.2e14, 256)
    min_bytes = (M * K + K * N + M * N) * BF16
    modelled = perf.roofline(matmul_traffic, "v6e", min_bytes=min_bytes)
    hbm_s = matmul_traffic.hbm_bytes / V6E_HBM_BYTES_PER_S
    mxu_s = 2 * M * N * K / 9.2e14
    assert modelled.hbm_bound_s == pytest.approx(hbm_s)
    assert modelled.compute_bound_s == pytest.approx(mxu_s)
    assert modelled.overhead_s == pytest.approx(matmul_traffic.steps * V6E_STEP_S)
    assert modelled.time_s == pytest.approx(max(hbm_s, mxu_s) + matmul_traffic.steps * V6E_STEP_S)
    assert modelled.pct_of_roofline == pytest.approx(100 * (min_bytes / 1.64e12) / modelled.time_s)
    assert modelled.fits_vmem
    # v5e: a 128-wide MXU, so the same 256-blocks need no padding there either.
    v5e = perf.roofline(matmul_traffic, "v5e")
    assert v5e.compute_bound_s == pytest.approx(2 * M * N * K / 1.97e14)
    assert v5e.hbm_bound_s == pytest.approx(matmul_traffic.hbm_bytes / 8.2e11)


def test_mxu_charges_each_weights_tile_at_least_the_mxu_size_in_rows():
    # 8 rows x (384 x 128): the weights are 3 tiles of 128 x 128 on v5e, 2 x 1 tiles of 256 x 256 on v6e
    # (k padded to 512, n to 256). Each pass loads one weights tile, which takes mxu_size cycles, so
    # 8 streamed rows cost as much as 128 (v5e) or 256 (v6e): per-pass model, perf's docstring.
    x = jax.ShapeDtypeStruct((8, 384), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((384, 128), jnp.bfloat16)
    [call] = perf.model_pallas_traffic(functools.partial(tiled_matmul, bm=8, bk=128, bn=128), x, y)
    assert call.flops == 2 * 8 * 384 * 128
    v5e, v6e = perf.tpu_generation("v5e"), perf.tpu_generation("v6e")
    # The grid has 3 k-steps of one (8, 128) @ (128, 128) matmul each: one pass per step.
    assert call.mxu_flops("v5e", WHOLE_WEIGHT_LOADS) == 3 * (2 * 128 * 128 * 128)
    assert call.mxu_flops("v6e", WHOLE_WEIGHT_LOADS) == 3 * (2 * 256 * 256 * 256)


def test_mxu_rows_past_the_mxu_size_stream_at_one_row_per_cycle_padded_to_sublanes():
    # 300 rows: more than one weights load per pass, so the pass costs its rows, padded to 8 sublanes.
    shape = perf.DotShape(batch=1, m=300, k=384, n=640, lhs_dtype="bfloat16", rhs_dtype="bfloat16",
                          precision="DEFAULT", count=2)
    v5e, v6e = perf.tpu_generation("v5e"), perf.tpu_generation("v6e")
    assert shape.mxu_flops(v5e) == 2 * (3 * 5) * (2 * 304 * 128 * 128)  # passes: k 384 = 3 x 128, n 640 = 5 x 128
    assert shape.mxu_flops(v6e) == 2 * (2 * 3) * (2 * 304 * 256 * 256)  # k padded to 512 = 2 x 256, n to 768 = 3 x 256


def test_row_chunks_below_the_mxu_size_cost_a_full_pass_each():
    # The same 256 rows as one matmul, or as eight 32-row chunks against the same weights tile:
    # each chunk reloads the weights, so on v6e chunking costs 8x the MXU time; on v5e 4x (128 / 32).
    whole = perf.DotShape(1, 256, 256, 256, "bfloat16", "bfloat16", "DEFAULT", count=1)
    chunks = perf.DotShape(1, 32, 256, 256, "bfloat16", "bfloat16", "DEFAULT", count=8)
    assert whole.flops == chunks.flops
    v5e, v6e = perf.tpu_generation("v5e"), perf.tpu_generation("v6e")
    assert chunks.mxu_flops(v6e, WHOLE_WEIGHT_LOADS) == 8 * whole.mxu_flops(v6e, WHOLE_WEIGHT_LOADS)
    assert chunks.mxu_flops(v5e, WHOLE_WEIGHT_LOADS) == 4 * whole.mxu_flops(v5e, WHOLE_WEIGHT_LOADS)


def test_hbm_fraction_scales_only_the_transfer_time_and_is_checked(matmul_traffic):
    full = perf.roofline(matmul_traffic, "v6e", min_bytes=1000, hbm_fraction=1.0)
    slower = perf.roofline(matmul_traffic, "v6e", min_bytes=1000, hbm_fraction=0.85)
    assert slower.hbm_bound_s == pytest.approx(full.hbm_bound_s / 0.85)
    assert slower.compute_bound_s == full.compute_bound_s
    assert slower.roofline_s == full.roofline_s  # the floor is the peak bandwidth's
    assert slower.pipelined_time_s > full.pipelined_time_s
    with pytest.raises(ValueError, match="hbm_fraction"):
        perf.roofline(matmul_traffic, "v6e", hbm_fraction=0.0)


def test_operands_placed_on_chip_move_no_hbm_bytes(matmul_traffic):
    x_position = next(i for i, op in enumerate(matmul_traffic.operands) if op.role == "input")
    on_chip = perf.with_operands_on_chip(matmul_traffic, [x_position], "prefetched into VMEM by XLA")
    assert on_chip.hbm_bytes == matmul_traffic.hbm_bytes - matmul_traffic.operands[x_position].hbm_bytes
    assert on_chip.operands[x_position].fetched_per_step.sum() == 0
    assert "prefetched into VMEM by XLA" in on_chip.notes[-1]
    assert perf.roofline(on_chip, "v6e").pipelined_time_s < perf.roofline(matmul_traffic, "v6e").pipelined_time_s


def test_pipelined_time_charges_the_compute_no_transfer_hides():
    block_on = np.array([1, 0, 0, 1], np.int32)
    [call] = perf.model_pallas_traffic(masked_matmul, block_on, MASK_X, MASK_Y)
    modelled = perf.roofline(call, "v6e", rates=WHOLE_WEIGHT_LOADS)
    # Per step: x and y blocks arrive for the next step; the f32 output leaves after the last.
    step_fetch = (128 * 128 + 128 * 256) * BF16
    assert call.hbm_bytes == block_on.nbytes + 4 * step_fetch + 128 * 256 * 4
    # On v6e the (128, 128) @ (128, 256) block is one pass of the 256-wide MXU (k padded to 256),
    # and its 128 rows cost the 256 cycles of loading the weights tile.
    block_compute_s = 2 * 256 * 256 * 256 / 9.2e14
    assert block_compute_s < step_fetch / V6E_HBM_BYTES_PER_S  # every step but the last hides its compute under DMA
    assert modelled.time_s == pytest.approx(call.hbm_bytes / V6E_HBM_BYTES_PER_S + 4 * V6E_STEP_S)
    assert modelled.pipelined_time_s == pytest.approx(modelled.time_s + block_compute_s)


def test_unknown_generation_and_empty_traffic_are_refused():
    with pytest.raises(ValueError, match="generation"):
        perf.tpu_generation("v99")
    with pytest.raises(ValueError, match="traffic"):
        perf.roofline([], "v6e")
    with pytest.raises(TypeError, match="fn"):
        perf.model_pallas_traffic(None)


def _buffers_and_scratch(x, *, scratch_mib):
    """A copy kernel whose double-buffered blocks and scratch take a known number of MiB of VMEM."""
    rows, cols = x.shape
    scratch_rows = scratch_mib * 2**20 // (cols * 4)

    def kernel(x_ref, o_ref, scratch_ref):
        scratch_ref[...] = jnp.broadcast_to(x_ref[0:1, :], scratch_ref.shape)
        o_ref[...] = x_ref[...] + scratch_ref[scratch_rows - 1 : scratch_rows, :]

    spec = pl.BlockSpec((rows // 2, cols), lambda i: (i, 0))
    return pl.pallas_call(
        kernel,
        grid=(2,),
        in_specs=[spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        scratch_shapes=[pltpu.VMEM((scratch_rows, cols), jnp.float32)],
    )(x)


@pytest.mark.aot
@pytest.mark.parametrize("generation", ["v5e", "v5p", "v6e"])
@pytest.mark.parametrize("scratch_mib, fits", [(4, True), (5, False)])
def test_vmem_fit_agrees_with_the_compiler_at_the_default_scoped_limit(generation, scratch_mib, fits):
    # Four block buffers (input and output, double-buffered) that leave 4 MiB of the generation's default
    # scoped VMEM limit, plus the scratch: 4 MiB fills the limit exactly, 5 MiB is one over.
    limit_mib = perf.tpu_generation(generation).default_scoped_vmem_bytes // 2**20
    block_mib = (limit_mib - 4) // 4
    x = jax.ShapeDtypeStruct((2 * block_mib * 2**20 // 512, 128), jnp.float32)
    kernel = functools.partial(_buffers_and_scratch, scratch_mib=scratch_mib)
    [call] = perf.model_pallas_traffic(kernel, x)
    assert call.vmem_bytes == (4 * block_mib + scratch_mib) * 2**20
    assert perf.roofline(call, generation).fits_vmem is fits
    if fits:
        compile_for(kernel, [x], generation)
    else:
        with pytest.raises(Exception, match="CompileTimeScopedVmemOom"):
            compile_for(kernel, [x], generation)


def _packed_pairs_scratch(x, *, scratch_mib):
    """A copy kernel with a bf16 scratch of [n, 2, 128] (two rows, as RPA v3 keeps its K/V pairs) of `scratch_mib`."""
    pairs = scratch_mib * 2**20 // (2 * 128 * 2)

    def kernel(x_ref, o_ref, scratch_ref):
        scratch_ref[pairs - 1] = x_ref[0:2, :].astype(jnp.bfloat16)
        o_ref[...] = x_ref[...] + scratch_ref[pairs - 1, 0:1, :].astype(jnp.float32)

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          scratch_shapes=[pltpu.VMEM((pairs, 2, 128), jnp.bfloat16)])(x)


def test_scratch_with_fewer_rows_than_a_native_tile_is_padded_to_a_tile_of_its_own_height():
    scratch = perf.grid_replay.scratch_vmem_bytes
    # The compiler's allocation of RPA v3's K/V buffer: bf16[2,16384,5,2,128]{...:T(2,128)(2,1)}, 80 MiB.
    assert scratch((2, 16384, 5, 2, 128), jnp.bfloat16) == 80 * 2**20
    assert scratch((7, 3, 100), jnp.float32) == 7 * 4 * 128 * 4
    assert scratch((12, 130), jnp.bfloat16) == 16 * 256 * 2  # two tiles of 8 rows
    assert scratch((2, 128), jnp.int8) == 4 * 128  # one 32-bit word packs 4 rows
    assert scratch((40, 130), jnp.bfloat16) == 48 * 256 * 2  # whole native tiles, as padded_vmem_bytes
    [call] = perf.model_pallas_traffic(functools.partial(_packed_pairs_scratch, scratch_mib=3),
                                       jax.ShapeDtypeStruct((8, 128), jnp.float32))
    assert call.scratch_vmem_bytes == 3 * 2**20


@pytest.mark.aot
@pytest.mark.parametrize("scratch_mib, fits", [(24, True), (40, False)])
def test_fit_of_a_scratch_of_two_row_tiles_agrees_with_the_compiler(scratch_mib, fits):
    # v6e's default scoped limit is 32 MiB: 24 MiB of [n, 2, 128] bf16 compiles (padded to 16 rows it would be
    # 192 MiB), 40 MiB does not.
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    kernel = functools.partial(_packed_pairs_scratch, scratch_mib=scratch_mib)
    [call] = perf.model_pallas_traffic(kernel, x)
    assert perf.roofline(call, "v6e").fits_vmem is fits
    if fits:
        compile_for(kernel, [x], "v6e")
    else:
        with pytest.raises(Exception, match="CompileTimeScopedVmemOom"):
            compile_for(kernel, [x], "v6e")


def test_megacore_splits_the_first_parallel_dimension_of_more_than_one_index():
    # v5p: one device is two TensorCores; the tiled matmul's grid (2, 3, 4) is parallel in its first two
    # dimensions, so each core runs one of the two row halves (12 steps each).
    [call] = perf.model_pallas_traffic(MATMUL, X, Y)
    halves = call.core_steps("v5p")
    assert [len(steps) for steps in halves] == [call.steps // 2] * 2
    assert call.core_steps("v5e") == [pytest.approx(np.arange(call.steps))]
    one_core = dataclasses.replace(call, megacore_core=None)
    split, whole = perf.roofline(call, "v5p"), perf.roofline(one_core, "v5p")
    assert split.pipelined_time_s == pytest.approx(whole.pipelined_time_s / 2, rel=0.1)
    assert split.steps == whole.steps  # the busier core's steps are what the overhead charges
    assert split.overhead_s == pytest.approx(whole.overhead_s / 2)


def test_a_grid_without_a_parallel_dimension_stays_on_one_core():
    def sequential(x, y):
        m, k = x.shape
        n = y.shape[1]
        return pl.pallas_call(
            tiled_matmul_kernel, grid=(m // BM, n // BN, k // BK),
            in_specs=[pl.BlockSpec((BM, BK), lambda i, j, kk: (i, kk)), pl.BlockSpec((BK, BN), lambda i, j, kk: (kk, j))],
            out_specs=pl.BlockSpec((BM, BN), lambda i, j, kk: (i, j)),
            scratch_shapes=[pltpu.VMEM((BM, BN), jnp.float32)],
            out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary", "arbitrary")),
        )(x, y)

    [call] = perf.model_pallas_traffic(sequential, X, Y)
    assert call.megacore_core is None and len(call.core_steps("v5p")) == 1


def test_vector_work_counts_register_elements_and_leaves_mxu_accumulation_out():
    def softmax_rows(x):
        def kernel(x_ref, o_ref):
            row = x_ref[...]
            shifted = row - jnp.max(row, axis=-1, keepdims=True)
            o_ref[...] = jnp.exp(shifted)

        return pl.pallas_call(
            kernel, grid=(x.shape[0] // 16,), in_specs=[pl.BlockSpec((16, 64), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((16, 64), lambda i: (i, 0)), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        )(x)

    [call] = perf.model_pallas_traffic(softmax_rows, jax.ShapeDtypeStruct((64, 64), jnp.float32))
    # A [16, 64] f32 block fills 16 x 128 register elements: the max (reduce) and the subtract on the VPU,
    # the exp on the transcendental unit.
    assert call.vector_per_step.tolist() == [2 * 16 * 128] * 4
    assert call.transcendental_per_step.tolist() == [16 * 128] * 4
    seconds = call.vector_seconds_per_step("v5e")
    clock = perf.core_clock_hz("v5e")
    expected = 2 * 16 * 128 / (perf.FITTED_RATES.vector_elements_per_cycle * clock) + \
        16 * 128 / (perf.FITTED_RATES.transcendental_elements_per_cycle * clock)
    assert seconds == pytest.approx([expected] * 4)
    # `acc += dot(...)` is the MXU's accumulation: the tiled matmul's only vector work is its f32 -> bf16 store.
    [matmul] = perf.model_pallas_traffic(MATMUL, X, Y)
    gk = K // BK
    per_output_tile = BM * BN  # the cast at the last k step
    assert matmul.vector_per_step.sum() == (M // BM) * (N // BN) * per_output_tile
    assert matmul.transcendental_per_step.sum() == 0
    assert gk > 1


def test_rates_are_a_value_passed_in_and_other_rates_leave_the_fitted_pricing_alone(matmul_traffic):
    fitted = perf.roofline(matmul_traffic, "v6e")
    # One register element per cycle makes the f32 -> bf16 store of each output tile outlast its matmuls.
    slow_vector_unit = dataclasses.replace(perf.FITTED_RATES, vector_elements_per_cycle=1.0)
    slower = perf.roofline(matmul_traffic, "v6e", rates=slow_vector_unit)
    assert slower.compute_bound_s > fitted.compute_bound_s
    assert slower.pipelined_time_s > fitted.pipelined_time_s
    assert perf.roofline(matmul_traffic, "v6e") == fitted


def test_the_calibrated_mxu_hides_most_of_a_weights_load_under_a_short_pass():
    # The per-pass rule with a weights load hidden but for mxu_weight_load_fraction of mxu_size cycles
    # (fitted on TPU7x's 128-row tiles): 8 rows on v6e cost max(8, 0.125 * 256) = 32 rows.
    shape = perf.DotShape(1, 8, 256, 256, "bfloat16", "bfloat16", "DEFAULT", count=1)
    v6e = perf.tpu_generation("v6e")
    rows = max(8, math.ceil(perf.FITTED_RATES.mxu_weight_load_fraction * 256))
    assert shape.mxu_flops(v6e) == 2 * rows * 256 * 256
