"""The grouped matmul with the experts' gate in its epilogue (plan.gated_plan) against a float64 reference.

Every case runs in TPU interpret mode with race detection and NaN-filled
uninitialised memory: rows past the groups are never written (NaN), every
row of a group comes out gated.
"""

import jax
import jax.numpy as jnp
import pytest
import torch

from tpu_kernels.runtime.hardware import resolve_target

V5E, V6E = resolve_target("v5e"), resolve_target("v6e")

ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "gelu": torch.nn.functional.gelu,
}
# GPT-OSS's clamped SwiGLU (transformers' GptOssExperts._apply_gate on gate and up apart).
GPT_OSS_GATE = dict(activation="clamped_swiglu", alpha=1.702, limit=7.0)


def _clamped_swiglu(gate, up, alpha, limit):
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)

# m, k, intermediate, group sizes, the ungated gate_up's tiles (tile_m, tile_k, tile_n over 2I, chunk_m, slots)
CASES = {
    # One N tile: all 2I columns as one block, split after the matmul; odd K in one tile, an empty group, rows
    # past the groups.
    "one-n-tile": (40, 72, 128, [9, 0, 14, 6], (40, 72, 256, None, 1)),
    # The same with I off the 128 lanes (Gemma 4's 704 is 5.5 x 128).
    "odd-intermediate": (40, 72, 48, [9, 0, 14, 6], (40, 72, 96, None, 1)),
    # Two N tiles of the intermediate (gate blocks 0-1, up blocks 2-3), K in three tiles with a tail.
    "n-and-k-tiles": (64, 300, 256, [20, 0, 25, 10], (32, 128, 256, None, 1)),
    # Row chunks carried across row tiles, with K tiles; one N tile.
    "chunks": (100, 256, 128, [5, 37, 0, 40], (48, 128, 256, 16, 1)),
    # The same in two N tiles.
    "chunks-n-tiles": (100, 256, 256, [5, 37, 0, 40], (48, 128, 256, 16, 1)),
    # Three group slots per step; idle slots in the last step.
    "groups-per-step": (40, 128, 128, [5, 0, 12, 7, 0, 9], (40, 128, 256, None, 3)),
    # No rows in any group: one empty item.
    "all-groups-empty": (24, 128, 128, [0, 0, 0], (24, 128, 256, None, 2)),
}


def _gated_reference(lhs, rhs, sizes, transpose_rhs, activation, bias=None, alpha=1.0, limit=float("inf"),
                     interleaved=False):
    """Per group: activation(lhs @ gate + its bias) * (lhs @ up + its bias) in float64 (clamped SwiGLU: as
    GPT-OSS), gate the first half of rhs's 2I columns (interleaved: the even ones)."""
    out, start = [], 0
    for group, size in enumerate(sizes.tolist()):
        weights = rhs[group].double()
        weights = weights.T if transpose_rhs else weights
        projected = lhs[start : start + size].double() @ weights
        if bias is not None:
            projected = projected + bias[group].double()
        gate, up = (projected[:, 0::2], projected[:, 1::2]) if interleaved else projected.chunk(2, dim=1)
        if activation == "clamped_swiglu":
            out.append(_clamped_swiglu(gate, up, alpha, limit))
        else:
            out.append(ACTIVATIONS[activation](gate) * up)
        start += size
    return torch.cat(out)


def _gated(kernel, m, k, intermediate, groups, dtype, transpose_rhs, tiles, activation="silu", bias=False,
           **gate_options):
    problem = kernel.MatmulProblem(m, k, 2 * intermediate, groups, dtype, dtype, transpose_rhs=transpose_rhs,
                                   zero_rows_past_groups=False, bias=bias)
    # v5e: its 128-wide MXU takes 128-column halves without padding.
    plan = kernel.gmm.plan.make(problem, V5E, kernel.gmm.tiles.TileConfig(*tiles))
    return kernel.gmm.plan.gated_plan(plan, kernel.problem.Gate(activation, **gate_options), V5E)


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
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
    out = interpret(lambda: kernel.gmm.kernel.call(to_jax(lhs), to_jax(rhs), jnp.asarray(sizes.numpy()), plan))
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


# Interleaved gate and up columns (GPT-OSS): m, k, intermediate, group sizes, the ungated gate_up's tiles, and the
# gated plan's N tile (output columns).
INTERLEAVED_CASES = {
    # One N tile of I = 48 (off the lanes): one chunk of 96 interleaved columns.
    "one-n-tile": (40, 72, 48, [9, 0, 14, 6], (40, 72, 96, None, 1), 48),
    # One N tile of I = 200: a chunk of 256 columns and one of 144.
    "one-n-tile-two-chunks": (40, 72, 200, [9, 0, 14, 6], (40, 72, 400, None, 1), 200),
    # Three N tiles of 128 pairs, the last holding 44 (its block's other columns are garbage, NaN in the
    # interpreter); K in three tiles with a tail.
    "n-and-k-tiles-partial": (64, 300, 300, [20, 0, 25, 10], (32, 128, 256, None, 1), 128),
    # gate_up's 384-column tile (192 pairs) rounded up to 256 lanes of output: two N tiles of I = 500 (rounded
    # down, four of 128 would compute as many columns).
    "half-rounded-to-lanes": (64, 128, 500, [20, 0, 25, 10], (32, 128, 384, None, 1), 256),
    # Row chunks carried across row tiles, two N tiles, the last partial.
    "chunks-n-tiles": (100, 256, 160, [5, 37, 0, 40], (48, 128, 256, 16, 1), 128),
    # Three group slots per step; idle slots in the last step.
    "groups-per-step": (40, 128, 256, [5, 0, 12, 7, 0, 9], (40, 128, 256, None, 3), 128),
}


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(INTERLEAVED_CASES))
def test_interleaved_gate_matches_reference(kernel, interpret, to_jax, case, dtype, transpose_rhs):
    """GPT-OSS's interleaved columns with biases and its clamped SwiGLU, gated in the epilogue."""
    m, k, intermediate, group_sizes, tiles, tile_n = INTERLEAVED_CASES[case]
    dtype_name = "float32" if dtype == torch.float32 else "bfloat16"
    plan = _gated(kernel, m, k, intermediate, len(group_sizes), dtype_name, transpose_rhs, tiles, bias=True,
                  interleaved=True, **GPT_OSS_GATE)
    assert plan is not None and plan.problem.n == intermediate and plan.tile_n == tile_n
    generator = torch.Generator().manual_seed(len(case) + 3)
    lhs = torch.randn(m, k, generator=generator).to(dtype)
    shape = (len(group_sizes), 2 * intermediate, k) if transpose_rhs else (len(group_sizes), k, 2 * intermediate)
    # Scaled so that the clamp at 7 cuts some of the gate and up values.
    rhs = (torch.randn(shape, generator=generator) * 4 * k**-0.5).to(dtype)
    bias = torch.randn(len(group_sizes), 2 * intermediate, generator=generator) * 3
    sizes = torch.tensor(group_sizes, dtype=torch.int32)
    out = interpret(lambda: kernel.gmm.kernel.call(to_jax(lhs), to_jax(rhs), jnp.asarray(sizes.numpy()), plan,
                                                   bias=to_jax(bias)))
    rows = sum(group_sizes)
    assert out.shape == (m, intermediate)
    expected = _gated_reference(lhs, rhs, sizes, transpose_rhs, "clamped_swiglu", bias, interleaved=True,
                                **{name: GPT_OSS_GATE[name] for name in ("alpha", "limit")})
    error = ((out[:rows].double() - expected).abs().max() / expected.abs().max()).item()
    assert error <= (1e-5 if dtype == torch.float32 else 3e-2)
    first_untouched = -(-rows // plan.tile_m) * plan.tile_m
    assert torch.isnan(out[first_untouched:]).all()


# Biases with the gate: each group's gate and up bias added before GPT-OSS's clamped SwiGLU, in one N tile (one
# bias block of 2I) and in several (each tile's gate and up bias blocks apart), with K tiles, chunks, slots.
BIAS_CASES = ("one-n-tile", "n-and-k-tiles", "chunks-n-tiles", "groups-per-step")


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("case", BIAS_CASES)
def test_gated_with_biases_matches_reference(kernel, interpret, to_jax, case, transpose_rhs):
    m, k, intermediate, group_sizes, tiles = CASES[case]
    plan = _gated(kernel, m, k, intermediate, len(group_sizes), "float32", transpose_rhs, tiles, bias=True,
                  **GPT_OSS_GATE)
    assert plan is not None and plan.problem.bias
    generator = torch.Generator().manual_seed(len(case) + 7)
    lhs = torch.randn(m, k, generator=generator)
    shape = (len(group_sizes), 2 * intermediate, k) if transpose_rhs else (len(group_sizes), k, 2 * intermediate)
    # Scaled so that the clamp at 7 cuts some of the gate and up values.
    rhs = torch.randn(shape, generator=generator) * 4 * k**-0.5
    bias = torch.randn(len(group_sizes), 2 * intermediate, generator=generator) * 3
    sizes = torch.tensor(group_sizes, dtype=torch.int32)
    out = interpret(lambda: kernel.gmm.kernel.call(to_jax(lhs), to_jax(rhs), jnp.asarray(sizes.numpy()), plan,
                                                   bias=to_jax(bias)))
    rows = sum(group_sizes)
    expected = _gated_reference(lhs, rhs, sizes, transpose_rhs, "clamped_swiglu", bias, **{
        name: GPT_OSS_GATE[name] for name in ("alpha", "limit")})
    assert ((out[:rows].double() - expected).abs().max() / expected.abs().max()).item() <= 1e-5
    projected = torch.cat([lhs[sum(group_sizes[:g]) : sum(group_sizes[: g + 1])].double()
                           @ (rhs[g].double().T if transpose_rhs else rhs[g].double()) + bias[g].double()
                           for g in range(len(group_sizes))])
    assert (projected.abs() > GPT_OSS_GATE["limit"]).any(), "inputs must reach the clamp"


def test_the_gate_stays_in_xla_where_the_epilogue_cannot_take_it(kernel):
    """gated_plan refuses one-byte weights in several N tiles; concatenated, halves that do not divide I, are off
    the 128 lanes or pad the MXU past the whole tile. Biases and interleaved columns it takes."""
    gate = kernel.problem.Gate("silu")

    def gate_up(n, tile_n, generation="v5e", bias=False):
        problem = kernel.MatmulProblem(64, 128, n, 4, "bfloat16", "bfloat16", transpose_rhs=False, bias=bias)
        tiles = kernel.gmm.tiles.TileConfig(64, 128, tile_n, None, 1)
        return kernel.gmm.plan.make(problem, resolve_target(generation), tiles)

    def gated(n, tile_n, generation="v5e", gate=gate, bias=False):
        return kernel.gmm.plan.gated_plan(gate_up(n, tile_n, generation, bias), gate, resolve_target(generation))

    assert gated(512, 256).tile_n == 128  # two N tiles of I = 256
    interleaved = gate._replace(interleaved=True)
    assert gated(512, 256, gate=interleaved).tile_n == 128
    # Interleaved, halves need not divide I (I = 160: 128 and 32 pairs), nor is v6e's MXU padded (one block).
    assert gated(320, 256, gate=interleaved).tile_n == 128
    assert gated(512, 256, generation="v6e", gate=interleaved).tile_n == 128
    # gate_up's 384-column tile, 192 pairs, is rounded to 256 lanes of output: I = 512 in two N tiles, not 128
    # lanes in four.
    assert gated(1024, 384, gate=interleaved).tile_n == 256
    int8 = gate_up(512, 256)
    int8 = int8._replace(problem=int8.problem._replace(rhs_dtype="int8"))
    assert kernel.gmm.plan.gated_plan(int8, interleaved, V5E) is None
    assert gated(512, 256, bias=True).tile_n == 128
    # One-byte weights: gated in one N tile (the block's scales whole), not in halves.
    for n, tile_n, expected in ((512, 256, None), (512, 512, 256)):
        int8 = gate_up(n, tile_n)
        int8 = kernel.gmm.plan.gated_plan(int8._replace(problem=int8.problem._replace(rhs_dtype="int8")), gate, V5E)
        assert (int8 and int8.tile_n) == expected
    # Half of a 256-column tile does not divide I = 160 (2I = 320); a 192-column half of I = 384 is off the lanes.
    assert gated(320, 256) is None
    assert gated(768, 384) is None
    # v6e's 256-wide MXU pads each 128-column half to 256: twice the whole tile's MXU work.
    assert gated(512, 256, generation="v6e") is None
    # One N tile takes any I: all 2I columns as one block (I = 96, off the lanes).
    assert gated(192, 192, generation="v6e").tile_n == 96


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
    assert kernel.plan.plan_experts(problem, V6E, fused=False).forward_gate_up.problem.gate is not None
    out = interpret(lambda: kernel.experts_layer(*map(to_jax, layer), **gate, fused=False, generation="v6e"))
    expected = kernel.reference.gated_experts_reference(*layer, **gate)
    assert ((out.double() - expected).abs().max() / expected.abs().max()).item() <= 1e-5


# GPT-OSS's layer laid out as the checkpoint has it (interleaved gate and up, I = 72 off the lanes) and as
# kernelize once laid it out (concatenated, I = 128): (interleaved, intermediate, seed).
GPT_OSS_LAYOUTS = {"interleaved": (True, 72, 13), "concatenated": (False, 128, 11)}


@pytest.mark.parametrize("layout", list(GPT_OSS_LAYOUTS))
def test_the_grouped_gpt_oss_layer_gates_its_biased_rows_in_the_kernel(kernel, interpret, to_jax, random_picks,
                                                                       layout):
    """GPT-OSS's layer (transposed weights, biases, clamped SwiGLU): the grouped path without a gradient adds
    the gate_up bias and gates in the first kernel, in either layout (sentinel picks included)."""
    interleaved, intermediate, seed = GPT_OSS_LAYOUTS[layout]
    tokens, hidden, experts, top_k = 37, 64, 6, 3
    generator = torch.Generator().manual_seed(seed)
    index, weights = random_picks(generator, tokens, experts, top_k, 0.3)
    layer = (torch.randn(tokens, hidden, generator=generator), index, weights,
             torch.randn(experts, hidden, 2 * intermediate, generator=generator) * 0.6,
             torch.randn(experts, intermediate, hidden, generator=generator) * 0.2,
             torch.randn(experts, 2 * intermediate, generator=generator) * 3,
             torch.randn(experts, hidden, generator=generator))
    gate = dict(weights_transposed=True, interleaved=interleaved, **GPT_OSS_GATE)
    problem, _ = kernel.problem.describe_experts(*map(to_jax, layer), **gate)
    first = kernel.plan.plan_experts(problem, V6E, fused=False).forward_gate_up
    assert first.problem.gate == kernel.problem.Gate(interleaved=interleaved, **GPT_OSS_GATE) and first.problem.bias
    out = interpret(lambda: kernel.experts_layer(*map(to_jax, layer), **gate, fused=False, generation="v6e"))
    expected = kernel.reference.gated_experts_reference(*layer, **gate)
    assert ((out.double() - expected).abs().max() / expected.abs().max()).item() <= 1e-5


@pytest.mark.parametrize(("generation", "tile_n"), [("v5e", 512), ("v6e", 1024)])
def test_gpt_oss_20b_gates_in_its_first_kernel_in_whole_lanes(kernel, generation, tile_n):
    """At GPT-OSS-20B's prefill shape (I = 2880, 22.5 lanes) the first kernel's output tiles are whole lanes:
    gate_up's half tile (576 pairs on v5e, 960 on v6e) rounded to the lanes that compute the fewest columns."""
    tokens, hidden, intermediate, experts, top_k = 2048, 2880, 2880, 32, 4
    arrays = [((tokens, hidden), "bfloat16"), ((tokens, top_k), "int32"), ((tokens, top_k), "bfloat16"),
              ((experts, hidden, 2 * intermediate), "bfloat16"), ((experts, intermediate, hidden), "bfloat16"),
              ((experts, 2 * intermediate), "bfloat16"), ((experts, hidden), "bfloat16")]
    layer = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in arrays]
    gate = dict(weights_transposed=True, interleaved=True, **GPT_OSS_GATE)
    problem, _ = kernel.problem.describe_experts(*layer, **gate)
    first = kernel.plan.plan_experts(problem, resolve_target(generation), fused=False).forward_gate_up
    assert first.problem.gate is not None and first.problem.n == intermediate and first.tile_n == tile_n
