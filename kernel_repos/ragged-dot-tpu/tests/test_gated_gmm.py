"""The grouped matmul with the experts' gate in its epilogue (plan.gated_plan) against a float64 reference.

Every case runs in TPU interpret mode with race detection and NaN-filled
uninitialised memory: rows past the groups are never written (NaN), every
row of a group comes out gated.
"""

import jax.numpy as jnp
import pytest
import torch

ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "gelu": torch.nn.functional.gelu,
}

# m, k, intermediate, group sizes, the ungated gate_up's tiles (tile_m, tile_k, tile_n over 2I, chunk_m, slots)
CASES = {
    # One N tile (the whole 2I), odd K in one tile, an empty group, rows past the groups.
    "one-n-tile": (40, 72, 128, [9, 0, 14, 6], (40, 72, 256, None, 1)),
    # I off the 128 lanes (Gemma 4's 704 is 5.5 x 128): only weights read [2I, K] block it, in whole sublane tiles.
    "odd-intermediate": (40, 72, 48, [9, 0, 14, 6], (40, 72, 96, None, 1)),
    # Two N tiles of the intermediate (gate blocks 0-1, up blocks 2-3), K in three tiles with a tail.
    "n-and-k-tiles": (64, 300, 256, [20, 0, 25, 10], (32, 128, 256, None, 1)),
    # Row chunks carried across row tiles, with K tiles.
    "chunks": (100, 256, 128, [5, 37, 0, 40], (48, 128, 256, 16, 1)),
    # Three group slots per step; idle slots in the last step.
    "groups-per-step": (40, 128, 128, [5, 0, 12, 7, 0, 9], (40, 128, 256, None, 3)),
    # No rows in any group: one empty item.
    "all-groups-empty": (24, 128, 128, [0, 0, 0], (24, 128, 256, None, 2)),
}


def _gated_reference(lhs, rhs, sizes, transpose_rhs, activation):
    """Per group: activation(lhs @ gate) * (lhs @ up) in float64, gate the first half of rhs's 2I columns."""
    out, start = [], 0
    for group, size in enumerate(sizes.tolist()):
        weights = rhs[group].double()
        weights = weights.T if transpose_rhs else weights
        projected = lhs[start : start + size].double() @ weights
        gate, up = projected.chunk(2, dim=1)
        out.append(ACTIVATIONS[activation](gate) * up)
        start += size
    return torch.cat(out)


def _gated(kernel, m, k, intermediate, groups, dtype, transpose_rhs, tiles, activation="silu"):
    problem = kernel.problem.MatmulProblem(m, k, 2 * intermediate, groups, dtype, dtype, transpose_rhs=transpose_rhs,
                                           zero_rows_past_groups=False)
    plan = kernel.plan.plan_ragged_dot(problem, "v6e", kernel.config.TileConfig(*tiles))
    return kernel.plan.gated_plan(plan, kernel.problem.Gate(activation), has_bias=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case,transpose_rhs", [(case, transpose) for case in CASES for transpose in (False, True)
                                                if transpose or case != "odd-intermediate"])
def test_gated_schedules_match_reference(kernel, interpret, to_jax, case, dtype, transpose_rhs):
    m, k, intermediate, group_sizes, tiles = CASES[case]
    activation = "gelu_tanh" if transpose_rhs else "silu"
    dtype_name = "float32" if dtype == torch.float32 else "bfloat16"
    plan = _gated(kernel, m, k, intermediate, len(group_sizes), dtype_name, transpose_rhs, tiles, activation)
    assert plan is not None and plan.problem.n == intermediate and plan.tile_n == tiles[2] // 2
    generator = torch.Generator().manual_seed(len(case))
    lhs = torch.randn(m, k, generator=generator).to(dtype)
    shape = (len(group_sizes), 2 * intermediate, k) if transpose_rhs else (len(group_sizes), k, 2 * intermediate)
    rhs = (torch.randn(shape, generator=generator) * k**-0.5).to(dtype)
    sizes = torch.tensor(group_sizes, dtype=torch.int32)
    out = interpret(lambda: kernel.pallas_gmm.grouped_matmul(to_jax(lhs), to_jax(rhs), jnp.asarray(sizes.numpy()),
                                                             None, plan))
    rows = sum(group_sizes)
    assert out.shape == (m, intermediate)
    if rows:
        expected = _gated_reference(lhs, rhs, sizes, transpose_rhs, activation)
        error = ((out[:rows].double() - expected).abs().max() / expected.abs().max()).item()
        assert error <= (1e-5 if dtype == torch.float32 else 2e-2)
    # Row tiles no group reaches are never written: the interpreter leaves them NaN. Without any row, the one
    # empty item writes its tile's zeros, gated (zeros).
    first_untouched = max(-(-rows // plan.tile_m), 1) * plan.tile_m
    assert torch.isnan(out[first_untouched:]).all()
    if not rows:
        assert torch.equal(out[:first_untouched], torch.zeros_like(out[:first_untouched]))


def test_the_gate_stays_in_xla_where_the_epilogue_cannot_take_it(kernel):
    """gated_plan refuses interleaved columns, biases, one-byte weights and half tiles Mosaic cannot block."""
    gate = kernel.problem.Gate("silu")
    assert _gated(kernel, 64, 128, 128, 4, "bfloat16", True, (64, 128, 256, None, 1)) is not None
    problem = kernel.problem.MatmulProblem(64, 128, 256, 4, "bfloat16", "bfloat16", transpose_rhs=False)
    plan = kernel.plan.plan_ragged_dot(problem, "v6e", kernel.config.TileConfig(64, 128, 256, None, 1))
    assert kernel.plan.gated_plan(plan, gate._replace(interleaved=True), has_bias=False) is None
    assert kernel.plan.gated_plan(plan, gate, has_bias=True) is None
    int8 = problem._replace(rhs_dtype="int8")
    assert kernel.plan.gated_plan(plan._replace(problem=int8), gate, has_bias=False) is None
    # Half of a 256-column tile does not divide I = 160 (2I = 320).
    narrow = kernel.plan.plan_ragged_dot(problem._replace(n=320), "v6e", kernel.config.TileConfig(64, 128, 256, None, 1))
    assert kernel.plan.gated_plan(narrow, gate, has_bias=False) is None
    # I = 96 in one tile: a 96-lane block of weights [K, 2I] is neither 128 lanes nor the whole 192, which
    # Mosaic refuses; read transposed ([2I, K]) the 96 rows are a whole number of sublane tiles.
    lanes = problem._replace(n=192)
    config = kernel.config.TileConfig(64, 128, 192, None, 1)
    assert kernel.plan.gated_plan(kernel.plan.plan_ragged_dot(lanes, "v6e", config), gate, has_bias=False) is None
    transposed = kernel.plan.plan_ragged_dot(lanes._replace(transpose_rhs=True), "v6e", config)
    assert kernel.plan.gated_plan(transposed, gate, has_bias=False).tile_n == 96


@pytest.mark.parametrize("options", [dict(activation="silu"), dict(activation="gelu")])
def test_the_grouped_layer_gates_in_the_kernel_and_matches_the_reference(kernel, interpret, to_jax, random_picks,
                                                                         options):
    """The experts layer's grouped path without a gradient runs the gated kernel (sentinel picks included)."""
    tokens, hidden, intermediate, experts, top_k = 37, 64, 48, 6, 3
    generator = torch.Generator().manual_seed(5)
    index, weights = random_picks(generator, tokens, experts, top_k, 0.3)
    layer = (torch.randn(tokens, hidden, generator=generator), index, weights,
             torch.randn(experts, 2 * intermediate, hidden, generator=generator) * 0.2,
             torch.randn(experts, hidden, intermediate, generator=generator) * 0.2)
    gate = dict(weights_transposed=False, **options)
    problem, _ = kernel.problem.describe_experts(*map(to_jax, layer), **gate)
    assert kernel.plan.plan_experts(problem, "v6e", fused=False).gated_gate_up is not None
    out = interpret(lambda: kernel.moe.experts_layer(*map(to_jax, layer), **gate, fused=False))
    expected = kernel.reference.gated_experts_reference(*layer, **gate)
    assert ((out.double() - expected).abs().max() / expected.abs().max()).item() <= 1e-5
