"""int4 weights (two per byte, uint8) with per-output-channel scales: packing, grouped matmuls and ops (experts
layers of int4 weights run with the other schemes' in test_quantized.py).

Every kernel case runs in TPU interpret mode with race detection and
NaN-filled uninitialised memory, against a float64 reference on the unpacked
weights. The packed dim is whole packed blocks (64 rows); the other dims are
odd, K and N in tiles with tails, groups empty, picks sentinels, and both
packed axes occur (XLA's swapped layout packs D2).
"""

import jax.numpy as jnp
import pytest
import torch

from tpu_kernels.runtime.hardware import resolve_target

V6E = resolve_target("v6e")


def _relative_error(out, expected):
    return ((out.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("shape", [(2, 64, 8), (3, 192, 200), (1, 128, 64), (2, 256, 192)])
def test_pack_unpack_round_trip_and_nibble_layout(kernel, quantized_weights, shape):
    """Unpacking gives the codes back; byte r of a 64-row block holds row r (low nibble) and row r + 32 (high)
    along the packed axis (D2 where XLA swaps the last two dims: [1, 128, 64] and [2, 256, 192])."""
    generator = torch.Generator().manual_seed(sum(shape))
    packed, _, codes = quantized_weights(kernel, "int4", shape, 2, generator)
    axis = kernel.int4_packed_axis(shape)
    assert axis == (2 if shape[1] % 128 == 0 and shape[2] % 128 else 1)
    assert packed.dtype == torch.uint8 and packed.shape[axis] == shape[axis] // 2
    assert torch.equal(kernel.common.quant.unpack_int4(packed, shape[3 - axis], 3 - axis), codes)
    first = packed.select(axis, 0).to(torch.int32)
    low, high = ((first & 0xF) ^ 8) - 8, ((first >> 4) ^ 8) - 8
    assert torch.equal(low, codes.select(axis, 0).to(torch.int32))
    assert torch.equal(high, codes.select(axis, 32).to(torch.int32))


def test_pack_refuses_what_it_cannot_pack(kernel):
    with pytest.raises(ValueError, match="multiple of 64"):
        kernel.pack_int4(torch.zeros(2, 96, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        kernel.pack_int4(torch.full((1, 64, 8), 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="integer"):
        kernel.pack_int4(torch.zeros(1, 64, 8))


RAGGED_CASES = {
    # m, packed dim (N read transposed, else K), the other dim, group_sizes, tiles (None: the heuristic's)
    # The other dim off the lanes; empty groups; rows past the groups.
    "odd-other-dim": (40, 192, 200, [5, 0, 20, 7], None),
    # K and N in tiles with tails: a partial last packed block row of tiles.
    "tiles": (100, 320, 300, [20, 0, 45, 15], (32, 128, 128, None, 1)),
    # Two group slots per step with row chunks: each slot unpacks its own group's block.
    "slots-chunks": (40, 192, 136, [9, 14, 0, 6], (40, 128, 128, 16, 2)),
}


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("case", list(RAGGED_CASES))
def test_ragged_dot_matches_unpacked_reference(kernel, interpret, to_jax, quantized_weights, case, transpose_rhs):
    m, packed_dim, other, group_sizes, tiles = RAGGED_CASES[case]
    k, n = (other, packed_dim) if transpose_rhs else (packed_dim, other)
    generator = torch.Generator().manual_seed(len(case))
    lhs = torch.randn(m, k, generator=generator)
    shape = (len(group_sizes), n, k) if transpose_rhs else (len(group_sizes), k, n)
    out_axis = 1 if transpose_rhs else 2
    rhs, scales, codes = quantized_weights(kernel, "int4", shape, out_axis, generator)
    assert kernel.int4_packed_axis(shape) == 1
    sizes = torch.tensor(group_sizes, dtype=torch.int32)
    config = None if tiles is None else kernel.gmm.tiles.TileConfig(*tiles)
    out = interpret(lambda: kernel.gmm.kernel.grouped_matmul(to_jax(lhs), to_jax(rhs),
                                                             jnp.asarray(group_sizes, jnp.int32), to_jax(scales),
                                                             transpose_rhs=transpose_rhs, config=config))
    weights = codes.double() * scales.double().unsqueeze(3 - out_axis)
    assert torch.equal(kernel.reference.dequantize_reference(rhs, scales, out_axis=out_axis), weights)
    expected = kernel.reference.ragged_dot_reference(lhs.double(), weights, sizes, transpose_rhs=transpose_rhs)
    assert not torch.isnan(out).any()
    assert _relative_error(out, expected) <= 1e-5
    rows = sum(group_sizes)
    assert torch.equal(out[rows:], torch.zeros_like(out[rows:]))


def test_ragged_dot_reads_weights_packed_along_d2_swapped(kernel, interpret, to_jax, quantized_weights):
    """rhs [G, 256, 192] (transpose_rhs: N = 256): XLA stores it 192-major, so int4 packs D2 (K) and the kernel
    reads the swapped view."""
    generator = torch.Generator().manual_seed(5)
    shape, group_sizes = (3, 256, 192), [7, 0, 12]
    lhs = torch.randn(24, 192, generator=generator)
    rhs, scales, codes = quantized_weights(kernel, "int4", shape, 1, generator)
    assert kernel.int4_packed_axis(shape) == 2 and tuple(rhs.shape) == (3, 256, 96)
    out = interpret(lambda: kernel.gmm.kernel.grouped_matmul(to_jax(lhs), to_jax(rhs),
                                                             jnp.asarray(group_sizes, jnp.int32), to_jax(scales),
                                                             transpose_rhs=True))
    expected = kernel.reference.ragged_dot_reference(lhs.double(), codes.double() * scales.double().unsqueeze(2),
                                                     torch.tensor(group_sizes), transpose_rhs=True)
    assert _relative_error(out[:19], expected[:19]) <= 1e-5


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gated_gate_up_takes_int4_weights_in_one_n_tile(kernel, interpret, to_jax, quantized_weights, transpose_rhs):
    """The first projection with the gate in its epilogue on int4 weights: all 2I columns one block, unpacked
    once, scaled per column before the gate."""
    m, intermediate, group_sizes = 40, 96, [9, 0, 14, 6]
    k = 136 if transpose_rhs else 192  # packed along 2I (read transposed), else along K
    generator = torch.Generator().manual_seed(11)
    lhs = torch.randn(m, k, generator=generator)
    shape = (len(group_sizes), 2 * intermediate, k) if transpose_rhs else (len(group_sizes), k, 2 * intermediate)
    out_axis = 1 if transpose_rhs else 2
    rhs, scales, _ = quantized_weights(kernel, "int4", shape, out_axis, generator)
    problem = kernel.MatmulProblem(m, k, 2 * intermediate, len(group_sizes), "float32", "uint8",
                                   transpose_rhs=transpose_rhs, zero_rows_past_groups=False)
    plan = kernel.gmm.plan.make(problem, V6E, kernel.gmm.tiles.TileConfig(40, k, 2 * intermediate, None, 1))
    plan = kernel.gmm.plan.gated_plan(plan, kernel.problem.Gate("silu"), V6E)
    assert plan.tile_n == plan.problem.n == intermediate
    out = interpret(lambda: kernel.gmm.kernel.call(
        to_jax(lhs), to_jax(rhs), jnp.asarray(group_sizes, jnp.int32), plan, to_jax(scales)))
    weights = kernel.reference.dequantize_reference(rhs, scales, out_axis=out_axis)
    projected = kernel.reference.ragged_dot_reference(lhs.double(), weights, torch.tensor(group_sizes),
                                                      transpose_rhs=transpose_rhs)
    gate, up = projected.chunk(2, dim=1)
    rows = sum(group_sizes)
    assert _relative_error(out[:rows], (torch.nn.functional.silu(gate) * up)[:rows]) <= 1e-5


def test_torch_ops_take_int4_weights(kernel, quantized_weights, quantized_layer, dequantized_layer):
    """The checked torch ops, end to end: ragged_dot and gated_experts with packed int4 weights and their scales."""
    generator = torch.Generator().manual_seed(3)
    lhs = torch.randn(12, 192, generator=generator).bfloat16()
    rhs, scales, codes = quantized_weights(kernel, "int4", (3, 192, 200), 2, generator)
    sizes = torch.tensor([5, 0, 7], dtype=torch.int32)
    out = kernel.ragged_dot(lhs, rhs, sizes, rhs_scales=scales)
    expected = kernel.reference.ragged_dot_reference(lhs.double(), codes.double() * scales.double().unsqueeze(1),
                                                     sizes)
    assert out.dtype == torch.bfloat16
    assert _relative_error(out.float(), expected) <= 1e-2
    layer = quantized_layer(kernel, "int4", 5, 128, 64, 4, 2, transposed=False, bias=False,
                            dtype=torch.bfloat16)
    hidden, index, weights, gate_up, down, _, _, gate_up_scales, down_scales = layer
    out = kernel.gated_experts(hidden, index, weights, gate_up, down, activation="silu", weights_transposed=False,
                               gate_up_scales=gate_up_scales, down_scales=down_scales)
    expected = kernel.reference.gated_experts_reference(*dequantized_layer(kernel, layer, False), activation="silu",
                                                        weights_transposed=False)
    assert out.dtype == torch.bfloat16
    assert _relative_error(out.float(), expected) <= 2e-2


def test_torch_ops_refuse_int4_weights_packed_wrong(kernel, quantized_weights):
    generator = torch.Generator().manual_seed(4)
    lhs = torch.randn(8, 192)
    rhs, scales, _ = quantized_weights(kernel, "int4", (2, 192, 200), 2, generator)
    sizes = torch.tensor([4, 4])
    with pytest.raises(ValueError, match="no packing of its shape"):
        kernel.ragged_dot(torch.randn(8, 100), rhs, sizes, rhs_scales=scales)
    with pytest.raises(ValueError, match=r"one per output channel"):
        kernel.ragged_dot(lhs, rhs, sizes, rhs_scales=scales[:, :100])
    with pytest.raises(ValueError, match="needs rhs_scales"):
        kernel.ragged_dot(lhs, rhs, sizes)
    # K = 96 along the packed axis: not whole 64-row blocks.
    with pytest.raises(ValueError, match="multiple of 64"):
        kernel.ragged_dot(torch.randn(8, 96), torch.zeros(2, 48, 200, dtype=torch.uint8), sizes,
                          rhs_scales=torch.ones(2, 200))
    hidden = torch.randn(4, 128)
    index, weights = torch.zeros(4, 1, dtype=torch.int64), torch.ones(4, 1)
    gate_up = kernel.pack_int4(torch.ones(2, 128, 128, dtype=torch.int8))
    down = kernel.pack_int4(torch.ones(2, 128, 64, dtype=torch.int8))
    with pytest.raises(ValueError, match="no packing of its shape"):
        kernel.gated_experts(torch.randn(4, 64), index, weights, gate_up, down, activation="silu",
                             weights_transposed=False, gate_up_scales=torch.ones(2, 128),
                             down_scales=torch.ones(2, 128))
    out = kernel.gated_experts(hidden, index, weights, gate_up, down, activation="silu", weights_transposed=False,
                               gate_up_scales=torch.ones(2, 128), down_scales=torch.ones(2, 128))
    assert out.shape == hidden.shape
