"""The combine kernel (`combine/kernel.py`): each token's live picks' rows, weighted and summed, against float64.

In TPU interpret mode with race detection and NaN-filled uninitialised
memory. The sorted rows a sentinel pick would name are NaN: a kernel that
read them, or multiplied a stale buffer row by a zero weight, would return
NaN.
"""

import jax.numpy as jnp
import pytest
import torch

from tpu_kernels.runtime.hardware import resolve_target

V5E, V6E = resolve_target("v5e"), resolve_target("v6e")

# tokens, top-k, hidden, the second projection's N tile, share of sentinel picks
CASES = {
    # Three token tiles, the last partial; one N tile.
    "partial-tile": (300, 3, 256, 256, 0.3),
    # Two N tiles per row, each packed apart; K off the sublanes.
    "two-n-tiles": (40, 5, 512, 256, 0.2),
    # Router masking's share: most picks another rank's, some tokens with none live.
    "mostly-sentinels": (150, 8, 256, 256, 0.9),
    # Every pick another rank's: nothing is copied, the sum is zero.
    "all-sentinels": (20, 2, 256, 256, 1.0),
    # Five tiles: on two cores, three and two, the second core's last step repeating its tile before.
    "odd-tiles": (600, 2, 256, 256, 0.5),
    # N tiles of 384 columns in 256 words (256 + 128 columns each).
    "wider-words": (40, 3, 768, 384, 0.3),
    # A partial last N tile of 128 columns: its words' high halves hold none.
    "partial-n-tile": (40, 3, 640, 256, 0.3),
    # ... of 64 columns, off the lanes (GPT-OSS's 2880 in tiles of 1024 ends in 832).
    "partial-n-tile-off-lanes": (40, 2, 320, 256, 0.3),
    # Tiles of 256 tokens (nine, the last partial; on v5p's two cores, 128). Most picks are sentinels: each
    # live pick is a copy, and copies are what makes the interpret mode's race checks slow at this size.
    "long-tiles": (2100, 2, 256, 256, 0.8),
}


def _packed(kernel, rows, tile_n, split):
    """The second projection's rows as it writes them: each N tile packed in `split` words."""
    values = jnp.asarray(rows.numpy())
    return jnp.concatenate([kernel.common.packed_rows.pack_rows(values[:, start : start + tile_n], split)
                            for start in range(0, values.shape[1], tile_n)], axis=1)


@pytest.mark.parametrize("generation", ["v6e", "v5p"])
@pytest.mark.parametrize("case", list(CASES))
def test_combine_sums_each_tokens_live_picks(kernel, interpret, to_jax, case, generation):
    tokens, top_k, hidden, tile_n, sentinels = CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    picks = tokens * top_k
    live = torch.rand(tokens, top_k, generator=generator) >= sentinels
    live_rows = int(live.sum())
    # Live picks take the sorted rows [0, live_rows) in a random order; sentinels point past them.
    position = torch.full((tokens, top_k), 0, dtype=torch.int64)
    position[live] = torch.randperm(live_rows, generator=generator)
    position[~live] = live_rows + torch.randint(0, picks - live_rows + 1, (int((~live).sum()),), generator=generator)
    position = position.clamp(max=picks - 1)
    rows = torch.randn(picks, hidden, generator=generator).to(torch.bfloat16).float()
    rows[live_rows:] = float("nan")
    weights = torch.rand(tokens, top_k, generator=generator)
    split = -(-tile_n // 256) * 128
    words = _packed(kernel, rows, tile_n, split)
    problem = kernel.problem.CombineProblem(tokens, top_k, hidden, "bfloat16", tile_n, split)
    plan = kernel.combine.plan.make(problem, resolve_target(generation))
    assert words.shape == (picks, plan.problem.words)
    # v5p's two cores split the token tiles, but a single tile is one core's.
    assert plan.cores == (2 if generation == "v5p" and tokens > plan.tile_t else 1)
    out = interpret(lambda: kernel.combine.kernel.call(
        words, to_jax(position), to_jax(weights), jnp.asarray(live.numpy()), plan), cores=plan.cores)
    expected = torch.einsum("tk,tkh->th", torch.where(live, weights, 0.0).double(),
                            torch.where(live[..., None], rows[position].double(), 0.0))
    assert out.shape == (tokens, hidden)
    assert not out.isnan().any()
    assert (out.double() - expected).abs().max().item() <= 1e-2 * max(expected.abs().max().item(), 1.0)


@pytest.mark.parametrize("tokens, top_k, hidden, generation, tile_t", [
    (2048, 8, 2048, "v6e", 256),  # 512 would leave 4 tiles
    (8192, 8, 2048, "v6e", 512),
    (8192, 8, 2048, "v5p", 256),  # 512 passes half of v5p's budget
    (8192, 8, 7168, "v6e", 128),  # DeepSeek-V3's rows under router masking: 256 would too
    (300, 8, 2048, "v6e", 128),
    (5, 8, 2048, "v6e", 8),
])
def test_the_token_tile_leaves_each_core_enough_tiles_and_fits_vmem(kernel, tokens, top_k, hidden, generation, tile_t):
    problem = kernel.problem.CombineProblem(tokens, top_k, hidden, "bfloat16", 2048, 1024)
    plan = kernel.combine.plan.make(problem, resolve_target(generation))
    assert plan.tile_t == tile_t


def test_packed_rows_round_to_bf16_and_unpack_exactly(kernel):
    values = jnp.asarray(torch.randn(16, 512).numpy())
    first, second = kernel.common.packed_rows.unpack_rows(kernel.common.packed_rows.pack_rows(values))
    rounded = values.astype(jnp.bfloat16).astype(jnp.float32)
    assert (first == rounded[:, :256]).all() and (second == rounded[:, 256:]).all()


@pytest.mark.parametrize("change, why", [
    (dict(dtype="float32", rhs_dtype="float32"), "f32 rows"),
    (dict(n=128), "an N tile of one 128-lane block"),
])
def test_packed_plan_refuses_what_it_cannot_pack(kernel, change, why):
    fields = dict(m=64, k=128, n=512, groups=4, dtype="bfloat16", rhs_dtype="bfloat16", transpose_rhs=False,
                  zero_rows_past_groups=False) | change
    problem = kernel.MatmulProblem(**fields)
    tiles = kernel.gmm.tiles.TileConfig(16, 128, fields["n"], None, 1)
    assert kernel.gmm.plan.packed_plan(kernel.gmm.plan.make(problem, V6E, tiles), V6E) is None, why


def test_packed_plan_widens_one_n_tile_off_the_lanes(kernel):
    """GPT-OSS's down projection, one N tile of 2880 columns: packed as one partial tile of 2944 (1536 words), its
    blocks' VMEM counted at that width."""
    problem = kernel.MatmulProblem(256, 2880, 2880, 4, "bfloat16", "bfloat16", transpose_rhs=False,
                                   zero_rows_past_groups=False)
    tiles = kernel.gmm.tiles.TileConfig(128, 2880, 2880, None, 1)
    plan = kernel.gmm.plan.make(problem, V6E, tiles)
    packed = kernel.gmm.plan.packed_plan(plan, V6E)
    assert (plan.tile_n, packed.tile_n, packed.out_split) == (2880, 2944, 1536)
    widened = kernel.gmm.tiles.matmul_buffers(tiles._replace(tile_n=2944), problem._replace(n=2944))
    assert packed.buffers == widened and packed.vmem_limit_bytes > plan.vmem_limit_bytes
    assert packed.problem.n == 2880 and packed.problem.packed_out


@pytest.mark.parametrize("generation, cores", [("v5e", 1), ("v6e", 1), ("tpu7x", 1), ("v5p", 2)])
def test_the_combine_kernel_splits_its_tiles_over_the_cores(kernel, generation, cores):
    problem = kernel.problem.ExpertsProblem(2048, 8, 2048, 768, 16, "bfloat16", "bfloat16", "float32", False, False,
                                    kernel.problem.Gate("silu"))
    plan = kernel.plan.plan_experts(problem, resolve_target(generation), fused=False)
    assert plan.forward_down.problem.packed_out and plan.combine.cores == cores


@pytest.mark.parametrize("n, tile_n, split", [(512, 256, 128), (768, 384, 256), (2816, 1408, 768), (2880, 1024, 512)])
def test_packed_plan_splits_each_n_tile_on_whole_lanes(kernel, n, tile_n, split):
    """Half the tile rounded up to 128 lanes: Gemma 4's down tiles of 1408 columns (v5p) in 768 words, 640 paired;
    GPT-OSS's 2880 in tiles of 1024, the last partial (v5e)."""
    problem = kernel.MatmulProblem(256, 128, n, 4, "bfloat16", "bfloat16", transpose_rhs=False,
                                   zero_rows_past_groups=False)
    plan = kernel.gmm.plan.make(problem, V5E, kernel.gmm.tiles.TileConfig(128, 128, tile_n, None, 1))
    packed = kernel.gmm.plan.packed_plan(plan, V5E)
    assert packed.out_split == split
    assert packed.vmem_limit_bytes - plan.vmem_limit_bytes == 2 * 128 * (4 * split - 2 * tile_n)
