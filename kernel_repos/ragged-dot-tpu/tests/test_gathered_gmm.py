"""The grouped matmul that copies its rows from their tokens (`MatmulProblem.gathered`) against a float64 reference.

Every case runs in TPU interpret mode with race detection and NaN-filled
uninitialised memory: each sorted row is multiplied as its token's row, rows
past the groups (sentinel picks, whose tokens are never copied) are never
written, and a window's copies land in the buffer the next step reads while
the other one is being multiplied.
"""

import jax.numpy as jnp
import pytest
import torch

from tpu_kernels.runtime.hardware import resolve_target

V6E = resolve_target("v6e")

# tokens, k, n, group sizes, rows past the groups, tiles (tile_m, tile_k, tile_n, chunk_m, slots), dtype
CASES = {
    # Row tiles shared by groups, an empty group, N in two tiles with a partial one (its rows copied again).
    "row-tiles": (29, 96, 200, [20, 0, 25, 10], 25, (16, 96, 128, None, 1), "bfloat16"),
    # Chunks laid from each group's first row, windows of the tile and one chunk, carried across tiles.
    "chunks": (41, 96, 128, [5, 37, 0, 40], 62, (48, 96, 128, 16, 1), "bfloat16"),
    # Groups of a few rows, several on one row tile (steps that keep the window and copy nothing).
    "small-groups": (17, 96, 128, [3, 0, 1, 7, 0, 2, 5, 1], 31, (16, 96, 128, None, 1), "bfloat16"),
    # float32 rows copied as they are; K off the lanes.
    "float32": (23, 72, 96, [9, 0, 14, 6], 11, (16, 72, 96, None, 1), "float32"),
    # Every pick another rank's: nothing is copied, nothing written.
    "all-sentinels": (8, 96, 128, [0, 0, 0], 40, (16, 96, 128, None, 1), "bfloat16"),
    # One row tile past the groups after the last live one; a window ends inside the live rows.
    "tail-window": (50, 96, 128, [33, 31], 30, (32, 96, 128, 16, 1), "bfloat16"),
    # One row tile over all rows (decode-sized calls): one buffer, copied once.
    "one-tile": (13, 96, 128, [4, 0, 9, 11], 6, (32, 96, 128, None, 1), "bfloat16"),
}
# K whose halves would take an MXU pass more than K whole: the row splits at the MXU width past half
# (`gmm.plan.gathered_plan`), its words wider than half a row and its second part's columns off the lanes.
MXU_SPLITS = {
    # v5e's 128-wide MXU: halves of 144 take 2 + 2 passes, 256 + 32 columns 2 + 1.
    "v5e-288": ("v5e", 288, False, 256),
    # Read transposed, halves of 160 are off the lanes: 256 + 64 on v6e.
    "v6e-320-transposed": ("v6e", 320, True, 256),
}


def _reference(tokens, row_token, weights, sizes, transpose_rhs, bias=None):
    out, start = [], 0
    for group, size in enumerate(sizes):
        rhs = weights[group].double()
        rhs = rhs.T if transpose_rhs else rhs
        rows = tokens[row_token[start : start + size].long()].double() @ rhs
        out.append(rows if bias is None else rows + bias[group].double())
        start += size
    return torch.cat(out)


def _call(kernel, interpret, to_jax, case, transpose_rhs, *, bias=False, k=None, seed=0, generation="v6e"):
    num_tokens, case_k, n, sizes, past, tiles, dtype = CASES[case]
    k = k or case_k
    groups, live = len(sizes), sum(sizes)
    m = live + past
    problem = kernel.MatmulProblem(m, k, n, groups, dtype, dtype, transpose_rhs=transpose_rhs,
                                   zero_rows_past_groups=False, bias=bias)
    tile_config = kernel.gmm.tiles.TileConfig(*tiles)._replace(tile_k=k)
    target = resolve_target(generation)
    plan = kernel.gmm.plan.gathered_plan(kernel.gmm.plan.make(problem, target, tile_config), target)
    assert plan is not None and plan.problem.gathered
    generator = torch.Generator().manual_seed(seed + len(case) + transpose_rhs)
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    tokens = torch.randn(num_tokens, k, generator=generator).to(torch_dtype)
    # Sorted picks name tokens in any order, a token several times; past the groups an out-of-range token, which
    # a copy would fault on.
    row_token = torch.cat([torch.randint(0, num_tokens, (live,), generator=generator),
                           torch.full((past,), 10**6)]).int()
    shape = (groups, n, k) if transpose_rhs else (groups, k, n)
    weights = (torch.randn(shape, generator=generator) * k**-0.5).to(torch_dtype)
    bias_rows = (torch.randn(groups, n, generator=generator) + 2.0).to(torch_dtype) if bias else None
    out = interpret(lambda: kernel.gmm.kernel.call(
        to_jax(tokens), to_jax(weights), jnp.asarray(sizes, jnp.int32), plan, bias=to_jax(bias_rows),
        row_token=to_jax(row_token)))
    assert out.shape == (m, n)
    expected = _reference(tokens, row_token, weights, sizes, transpose_rhs, bias_rows)
    return out, expected, live, plan


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_gathered_schedules_match_reference(kernel, interpret, to_jax, case, transpose_rhs):
    # Read transposed, a bf16 row splits on the weights block's lanes: K halves of 128.
    k = 256 if transpose_rhs and CASES[case][-1] == "bfloat16" else None
    out, expected, live, _ = _call(kernel, interpret, to_jax, case, transpose_rhs, k=k)
    tolerance = 1e-5 if CASES[case][-1] == "float32" else 1e-2
    if live:
        assert ((out[:live].double() - expected).abs().max() / expected.abs().max()).item() <= tolerance
    # The rest of the last live row tile holds zeros; the tiles past it are never written.
    # (Without a live row the one empty work item writes the first tile.)
    tile_m = CASES[case][5][0]
    tile_end = max(-(-live // tile_m), 1) * tile_m
    assert (out[live:tile_end] == 0).all()
    assert out[tile_end:].isnan().all(), "row tiles past the groups are never written"


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gathered_rows_take_the_bias(kernel, interpret, to_jax, transpose_rhs):
    out, expected, live, _ = _call(kernel, interpret, to_jax, "chunks", transpose_rhs, bias=True,
                                   k=256 if transpose_rhs else None)
    assert ((out[:live].double() - expected).abs().max() / expected.abs().max()).item() <= 1e-2


@pytest.mark.parametrize("split", list(MXU_SPLITS))
@pytest.mark.parametrize("case", ["chunks", "tail-window"])
def test_rows_split_at_the_mxu_width_match_reference(kernel, interpret, to_jax, case, split):
    generation, k, transpose_rhs, expected_split = MXU_SPLITS[split]
    out, expected, live, plan = _call(kernel, interpret, to_jax, case, transpose_rhs, k=k, generation=generation)
    assert plan.gather_split == expected_split
    assert ((out[:live].double() - expected).abs().max() / expected.abs().max()).item() <= 1e-2


@pytest.mark.parametrize("generation, k, transpose_rhs, split", [
    ("v6e", 2048, False, 1024),  # Qwen3: halves on every tiling and pass
    ("v5e", 2880, False, 1536),  # GPT-OSS: 2 x 1440 would take 24 passes of 128, 1536 + 1344 take 23
    ("v6e", 2880, False, 1440),  # ... 2 x 6 passes of 256, as 2880 whole
    ("v6e", 2880, True, 1536),  # ... read transposed, 1440 is off the lanes
    ("v6e", 2816, False, 1536),  # Gemma 4: 2 x 1408 would take 12 passes of 256, 1536 + 1280 take 11
    ("v5e", 2816, False, 1408),  # ... 2 x 11 passes of 128, as 2816 whole
])
def test_a_row_splits_where_its_parts_cost_no_mxu_pass(kernel, generation, k, transpose_rhs, split):
    problem = kernel.MatmulProblem(4096, k, 1536, 16, "bfloat16", "bfloat16", transpose_rhs=transpose_rhs,
                                   zero_rows_past_groups=False)
    plan = kernel.gmm.plan.make(problem, resolve_target(generation), kernel.gmm.tiles.TileConfig(256, k, 512, None, 1))
    gathered = kernel.gmm.plan.gathered_plan(plan, resolve_target(generation))
    assert gathered.gather_split == split
    # The copies' two buffers of 256-row windows hold words wider than half a row by (split - K / 2) each.
    assert gathered.vmem_limit_bytes - plan.vmem_limit_bytes == 2 * 256 * 4 * (split - k // 2)


def test_token_rows_pack_into_words_and_back(kernel):
    """bf16 rows as words: column j in the low half, column K/2 + j in the high half, every bit kept."""
    tokens = jnp.asarray(torch.randn(5, 64).numpy(), jnp.bfloat16).at[0, 3].set(jnp.nan).at[1, 40].set(-0.0)
    words = kernel.common.packed_rows.pack_rows(tokens)
    assert words.shape == (5, 32) and words.dtype == jnp.int32
    bits = jnp.asarray(tokens).view(jnp.uint16).astype(jnp.int32)
    assert (words & 0xFFFF == bits[:, :32]).all()
    assert ((words >> 16) & 0xFFFF == bits[:, 32:]).all()
    # Split past half: the second part zero-padded to the first's width.
    words = kernel.common.packed_rows.pack_rows(tokens, 40)
    assert words.shape == (5, 40)
    assert (words & 0xFFFF == bits[:, :40]).all()
    assert ((words[:, :24] >> 16) & 0xFFFF == bits[:, 40:]).all() and (words[:, 24:] >> 16 == 0).all()


@pytest.mark.parametrize("change, why", [
    (dict(rhs_dtype="int8"), "one-byte weights"),
    (dict(k=200), "K in several tiles"),
    (dict(k=80), "K halves of 40 rows, off bf16's 16-row tiling, and K within one MXU pass"),
    (dict(k=192, transpose_rhs=True), "K halves of 96 lanes, and K within one 256-wide MXU pass"),
])
def test_gathered_plan_refuses_what_it_cannot_copy(kernel, change, why):
    fields = dict(m=64, k=96, n=128, groups=4, dtype="bfloat16", rhs_dtype="bfloat16", transpose_rhs=False,
                  zero_rows_past_groups=False) | change
    problem = kernel.MatmulProblem(**fields)
    tiles = kernel.gmm.tiles.TileConfig(16, min(fields["k"], 128), 128, None, 1)
    assert kernel.gmm.plan.gathered_plan(kernel.gmm.plan.make(problem, V6E, tiles), V6E) is None, why


def test_a_gathered_plan_takes_row_tokens_and_only_it(kernel):
    problem = kernel.MatmulProblem(64, 96, 128, 2, "bfloat16", "bfloat16", transpose_rhs=False)
    plan = kernel.gmm.plan.make(problem, V6E, kernel.gmm.tiles.TileConfig(16, 96, 128, None, 1))
    gathered = kernel.gmm.plan.gathered_plan(plan, V6E)
    tokens, weights, sizes = jnp.ones((8, 96), jnp.bfloat16), jnp.ones((2, 96, 128), jnp.bfloat16), jnp.array([3, 5])
    with pytest.raises(ValueError, match="gathers its rows"):
        kernel.gmm.kernel.call(tokens, weights, sizes, gathered)
    with pytest.raises(ValueError, match="takes sorted rows"):
        kernel.gmm.kernel.call(tokens, weights, sizes, plan, row_token=jnp.zeros(64, jnp.int32))


@pytest.mark.parametrize("hidden", [256, 640, 2880])
@pytest.mark.parametrize("options", [
    dict(activation="silu"),
    dict(activation="clamped_swiglu", interleaved=True, alpha=1.702, limit=7.0, weights_transposed=True),
])
def test_the_grouped_layer_copies_its_rows_in_the_kernels(kernel, interpret, to_jax, random_picks, options, hidden):
    """The experts layer without a gradient gathers in its first kernel (gated or not, biased or not) and sums each
    token's picks in the combine kernel, and matches the reference, with a third of the picks other ranks'
    sentinels. H = 640: token rows split at 512 (halves of 320 would take an extra pass of v6e's 256-wide MXU),
    the second projection's 640 columns packed in 384 words (256 paired). H = 2880 (GPT-OSS's): the second
    projection's one N tile off the lanes widened to 2944 columns, its 64 past H never summed."""
    tokens, intermediate, experts, top_k = 45, 48, 6, 3
    gate = dict(weights_transposed=False) | options
    generator = torch.Generator().manual_seed(11)
    index, weights = random_picks(generator, tokens, experts, top_k, 0.3)
    if gate["weights_transposed"]:
        projections = (torch.randn(experts, hidden, 2 * intermediate, generator=generator) * 0.2,
                       torch.randn(experts, intermediate, hidden, generator=generator) * 0.2)
    else:
        projections = (torch.randn(experts, 2 * intermediate, hidden, generator=generator) * 0.2,
                       torch.randn(experts, hidden, intermediate, generator=generator) * 0.2)
    biases = ((torch.randn(experts, 2 * intermediate, generator=generator),
               torch.randn(experts, hidden, generator=generator)) if options.get("interleaved") else ())
    layer = (torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16), index, weights,
             *(p.to(torch.bfloat16) for p in projections), *(b.to(torch.bfloat16) for b in biases))
    problem, _ = kernel.problem.describe_experts(*map(to_jax, layer), **gate)
    plan = kernel.plan.plan_experts(problem, V6E, fused=False)
    assert plan.forward_gate_up.problem.gathered
    assert plan.forward_down.problem.packed_out and plan.combine is not None
    if hidden == 640:
        assert (plan.forward_gate_up.gather_split, plan.forward_down.out_split) == (512, 384)
    if hidden == 2880:
        packed = (plan.forward_down.tile_n, plan.forward_down.out_split, plan.combine.problem.tile_n)
        assert packed == (2944, 1536, 2944)
    out = interpret(lambda: kernel.experts_layer(*map(to_jax, layer), **gate, fused=False, generation="v6e"))
    expected = kernel.reference.gated_experts_reference(*(t.float() if t.is_floating_point() else t for t in layer),
                                                        **gate)
    assert ((out.double() - expected).abs().max() / expected.abs().max()).item() <= 2e-2
