"""The grouped matmul with a bias row per group (`MatmulProblem.bias`) against a float64 reference.

Every case runs in TPU interpret mode with race detection and NaN-filled
uninitialised memory: each group's rows come out with its own bias, rows past
the groups are never written (NaN), and row tiles shared by groups get each
group's bias on its rows only.
"""

import jax.numpy as jnp
import pytest
import torch

from tpu_kernels.runtime.hardware import resolve_target

V6E = resolve_target("v6e")

# m, k, n, group sizes, tiles (tile_m, tile_k, tile_n, chunk_m, slots), weights
CASES = {
    # One tile over odd K and N; an empty group; rows past the groups.
    "one-tile": (40, 72, 96, [9, 0, 14, 6], (40, 72, 96, None, 1), "bfloat16"),
    # Row tiles shared by groups, K in three tiles with a tail, N in two tiles with a partial one.
    "row-k-n-tiles": (64, 300, 200, [20, 0, 25, 10], (16, 128, 128, None, 1), "bfloat16"),
    # Row chunks carried across row tiles (the bias goes with each tile's rows, not the carried products).
    "chunks": (100, 256, 128, [5, 37, 0, 40], (48, 128, 128, 16, 1), "bfloat16"),
    # Three group slots per step; idle slots in the last step.
    "groups-per-step": (40, 128, 128, [5, 0, 12, 7, 0, 9], (40, 128, 128, None, 3), "bfloat16"),
    # No rows in any group: one empty item, no bias anywhere.
    "all-groups-empty": (24, 128, 128, [0, 0, 0], (24, 128, 128, None, 2), "bfloat16"),
    # int8 weights: the per-column scales multiply the products, not the bias.
    "int8": (48, 128, 128, [11, 0, 20, 9], (16, 128, 128, None, 1), "int8"),
}


def _reference(lhs, weights, scales, bias, sizes, transpose_rhs):
    out, start = [], 0
    for group, size in enumerate(sizes):
        rhs = weights[group].double()
        rhs = rhs.T if transpose_rhs else rhs
        scale = 1.0 if scales is None else scales[group].double()
        out.append(lhs[start : start + size].double() @ rhs * scale + bias[group].double())
        start += size
    return torch.cat(out)


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_biased_schedules_match_reference(kernel, interpret, to_jax, case, transpose_rhs):
    m, k, n, group_sizes, tiles, weights_dtype = CASES[case]
    groups = len(group_sizes)
    problem = kernel.MatmulProblem(m, k, n, groups, "bfloat16", weights_dtype, transpose_rhs=transpose_rhs,
                                   zero_rows_past_groups=False, bias=True)
    plan = kernel.gmm.plan.make(problem, V6E, kernel.gmm.tiles.TileConfig(*tiles))
    generator = torch.Generator().manual_seed(len(case) + transpose_rhs)
    lhs = torch.randn(m, k, generator=generator).to(torch.bfloat16)
    shape = (groups, n, k) if transpose_rhs else (groups, k, n)
    scales = None
    if weights_dtype == "int8":
        weights = torch.randint(-127, 128, shape, generator=generator, dtype=torch.int8)
        scales = torch.rand(groups, n, generator=generator) * k**-0.5 / 64 + 1e-3
    else:
        weights = (torch.randn(shape, generator=generator) * k**-0.5).to(torch.bfloat16)
    bias = (torch.randn(groups, n, generator=generator) + 2.0).to(torch.bfloat16)
    out = interpret(lambda: kernel.gmm.kernel.call(
        to_jax(lhs), to_jax(weights), jnp.asarray(group_sizes, jnp.int32), plan,
        None if scales is None else to_jax(scales), to_jax(bias)))
    rows = sum(group_sizes)
    assert out.shape == (m, n)
    if rows:
        expected = _reference(lhs, weights, scales, bias, group_sizes, transpose_rhs)
        error = ((out[:rows].double() - expected).abs().max() / expected.abs().max()).item()
        assert error <= 1e-2
        # Without the bias every row would be off by about 2 (the bias's mean): the bias is there, once.
        unbiased = _reference(lhs, weights, scales, torch.zeros_like(bias), group_sizes, transpose_rhs)
        assert ((out[:rows].double() - unbiased).abs().mean() > 1.0).item()
    first_untouched = max(-(-rows // plan.tile_m), 1) * plan.tile_m
    assert torch.isnan(out[first_untouched:]).all()


def test_a_bias_is_taken_only_by_a_plan_that_has_one(kernel, to_jax):
    problem = kernel.MatmulProblem(16, 128, 128, 2, "bfloat16", "bfloat16", transpose_rhs=False)
    plan = kernel.gmm.plan.make(problem, V6E)
    lhs, rhs = jnp.ones((16, 128), jnp.bfloat16), jnp.ones((2, 128, 128), jnp.bfloat16)
    sizes = jnp.asarray([8, 8], jnp.int32)
    with pytest.raises(ValueError, match="has no bias, got one"):
        kernel.gmm.kernel.call(lhs, rhs, sizes, plan, bias=jnp.ones((2, 128), jnp.bfloat16))
    biased = kernel.gmm.plan.make(problem._replace(bias=True), V6E)
    with pytest.raises(ValueError, match="takes a bias, got none"):
        kernel.gmm.kernel.call(lhs, rhs, sizes, biased)
