"""Unit tests of the tile selection (each kernel's tiles.py) and of the rule that picks the experts layer's
kernel (plan.py), in the built variant: no kernel runs here."""

import functools
import itertools

import jax
import jax.numpy as jnp
import pytest
from tpu_kernels import testing
from tpu_kernels.runtime.hardware import resolve_target

V5E, V5P, V6E, TPU7X = resolve_target("v5e"), resolve_target("v5p"), resolve_target("v6e"), resolve_target("tpu7x")

MIB = 1 << 20


def _matmul(kernel, m: int, k: int, n: int, dtype=jnp.bfloat16, groups: int = 1, rhs_dtype=None,
            transpose_rhs: bool = False):
    """`lhs[m, k] x rhs[groups, k, n]` in `dtype` (weights too unless `rhs_dtype`), as a `MatmulProblem`."""
    dtype = jnp.dtype(dtype).name
    rhs_dtype = dtype if rhs_dtype is None else jnp.dtype(rhs_dtype).name
    return kernel.MatmulProblem(m, k, n, groups, dtype, rhs_dtype, transpose_rhs)


def test_vmem_bytes_counts_double_buffered_padded_blocks_and_the_accumulator(kernel):
    tiles = kernel.gmm.tiles.TileConfig(64, 128, 256)
    # lhs, rhs and out double-buffered in bf16, the f32 accumulator once.
    expected = 2 * 64 * 128 * 2 + 2 * 128 * 256 * 2 + 2 * 64 * 256 * 2 + 64 * 256 * 4
    assert kernel.gmm.tiles.vmem_bytes(tiles, _matmul(kernel, 100, 300, 512)) == expected
    # Three group slots: three double-buffered rhs blocks.
    slots = kernel.gmm.tiles.TileConfig(64, 128, 256, groups_per_step=3)
    assert kernel.gmm.tiles.vmem_bytes(slots, _matmul(kernel, 64, 300, 512)) - expected == 2 * 2 * 128 * 256 * 2
    # An lhs block that is the whole array is single-buffered; 7 bf16 rows pad to 16.
    resident = kernel.gmm.tiles.TileConfig(7, 300, 128)
    padded_lhs = 16 * 384 * 2
    assert kernel.gmm.tiles.vmem_bytes(resident, _matmul(kernel, 7, 300, 128)) == (
        padded_lhs + 2 * 304 * 128 * 2 + 2 * 16 * 128 * 2 + 16 * 128 * 4
    )


def test_vmem_limit_adds_mosaic_scratch_within_bounds(kernel):
    small = kernel.gmm.tiles.TileConfig(8, 128, 128)
    assert kernel.gmm.tiles.vmem_limit(small, _matmul(kernel, 8, 128, 128, jnp.float32), V6E) == 16 * MIB
    large = kernel.gmm.tiles.TileConfig(1024, 2048, 2048, chunk_m=128)
    needed = kernel.gmm.tiles.vmem_bytes(large, _matmul(kernel, 1024, 2048, 2048))
    assert needed > 12 * MIB
    assert kernel.gmm.tiles.vmem_limit(large, _matmul(kernel, 1024, 2048, 2048), V6E) == needed + 4 * MIB


def test_check_config_accepts_valid_tiles(kernel):
    kernel.gmm.tiles.check_config(kernel.gmm.tiles.TileConfig(32, 128, 128, chunk_m=16, groups_per_step=1),
                                  _matmul(kernel, 100, 300, 200), V6E)
    kernel.gmm.tiles.check_config(kernel.gmm.tiles.TileConfig(40, 200, 160, groups_per_step=4),
                                  _matmul(kernel, 40, 200, 160, jnp.float32), V6E)


@pytest.mark.parametrize(
    "tiles,m,k,n,dtype,match",
    [
        ((24, 128, 128), 100, 128, 128, jnp.bfloat16, "tile_m=24 must be a multiple of 16"),
        ((32, 100, 128), 100, 300, 128, jnp.float32, "tile_k=100 must be a multiple of 128"),
        ((32, 128, 200), 100, 128, 300, jnp.float32, "tile_n=200 must be a multiple of 128"),
        ((0, 128, 128), 100, 128, 128, jnp.float32, "tile_m must be a positive int"),
        ((64, 128, 128, 12), 100, 128, 128, jnp.float32, "chunk_m=12 must be a multiple of 8"),
        ((64, 128, 128, 0), 100, 128, 128, jnp.float32, "chunk_m must be a positive int"),
        ((64, 128, 128, None, 5), 64, 128, 128, jnp.float32, "groups_per_step must be at most 4"),
        ((32, 128, 128, None, 2), 64, 128, 128, jnp.float32, "needs one row tile"),
        ((256, 128, 128, 8, 2), 256, 128, 128, jnp.float32, "more than 16 matmuls per grid step"),
        ((2048, 2048, 1024, 256), 4096, 2048, 1024, jnp.bfloat16, "Gi multiply-adds"),
        ((16, 8192, 8192), 1024, 8192, 8192, jnp.float32, "MiB of VMEM"),
    ],
)
def test_check_config_refuses_what_cannot_run(kernel, tiles, m, k, n, dtype, match):
    with pytest.raises(ValueError, match=match):
        kernel.gmm.tiles.check_config(kernel.gmm.tiles.TileConfig(*tiles), _matmul(kernel, m, k, n, dtype),
                                      V6E)


def test_check_config_refuses_other_types(kernel):
    with pytest.raises(TypeError, match="must be a TileConfig"):
        kernel.gmm.tiles.check_config((32, 128, 128), _matmul(kernel, 64, 128, 128, jnp.float32), V6E)


def test_ridge_rows_is_peak_flops_over_hbm_bandwidth(kernel):
    assert kernel.gmm.tiles.ridge_rows(V5E) == 240
    assert kernel.gmm.tiles.ridge_rows(V6E) == 560


def test_heuristic_keeps_decode_rows_resident_and_tiles_prefill(kernel):
    # Few rows per group (decode): one resident row tile in chunks of the MXU width (256 on v6e, 128 on v5e).
    decode = _matmul(kernel, 512, 2048, 1536, groups=128)
    assert kernel.gmm.tiles.heuristic_config(decode, V6E) == kernel.gmm.tiles.TileConfig(512, 2048, 1536, 256)
    assert kernel.gmm.tiles.heuristic_config(decode, V5E).chunk_m == 128
    # Many rows per group: 512-row tiles.
    prefill = _matmul(kernel, 65536, 2048, 1536, groups=16)
    assert kernel.gmm.tiles.heuristic_config(prefill, V6E) == kernel.gmm.tiles.TileConfig(512, 2048, 1536, 256)
    assert kernel.gmm.tiles.heuristic_config(prefill, V5E) == kernel.gmm.tiles.TileConfig(512, 2048, 1536, 128)
    # Weights blocks stay within the generation's block budget (8 MiB on v5e): N is halved first.
    big = kernel.gmm.tiles.heuristic_config(_matmul(kernel, 64, 4096, 8192, groups=8), V5E)
    assert big.tile_k * big.tile_n * 2 <= kernel.gmm.tiles.HEURISTIC_RHS_BLOCK_BYTES["v5e"]
    assert (big.tile_k, big.tile_n) == (4096, 1024)


def test_heuristic_n_tiles_waste_no_mxu_pass_they_can_avoid(kernel):
    # GPT-OSS's gate_up (K 2880, N 5760) on v5e: halving N in multiples of 256 gave 8 tiles of 768, the last one
    # half empty (48 passes of 128 columns); 5 tiles of 1152 take the 45 that N needs, in fewer grid steps.
    gate_up = kernel.gmm.tiles.heuristic_config(_matmul(kernel, 16384, 2880, 5760, groups=32), V5E)
    assert gate_up.tile_n == 1152
    # down (N 2880 = 22.5 x 128): 24 passes is the least any fitting tiling takes; 3 tiles of 1024 instead of 4 of 768.
    down = _matmul(kernel, 16384, 2880, 2880, groups=32)
    assert kernel.gmm.tiles.heuristic_config(down, V5E).tile_n == 1024
    # A whole N that fits the block budget stays whole, aligned or not.
    assert kernel.gmm.tiles.heuristic_config(down, V6E).tile_n == 2880
    assert kernel.gmm.tiles.n_tile(1408, 4096, 128) == 1408


@pytest.mark.parametrize("n, max_cols, mxu", [(5760, 1456, 128), (2880, 1456, 128), (5760, 2912, 256), (7168, 2048, 128),
                                              (4096, 585, 128), (16384, 1024, 256)])
@pytest.mark.parametrize("cores", [1, 2])
def test_n_tile_takes_the_fewest_passes_of_the_tiles_it_considers(kernel, n, max_cols, mxu, cores):
    """Passes on the busier core: with two cores, each takes whole N tiles, one of them the odd one."""
    def passes(tile):
        return -(-(-(-n // tile)) // cores) * -(-tile // mxu)

    chosen = kernel.gmm.tiles.n_tile(n, max_cols, mxu, cores)
    widest = max(256, max_cols // 128 * 128)
    assert chosen % 128 == 0 and widest // 2 <= chosen <= widest
    assert passes(chosen) == min(passes(t) for t in range(128, widest + 1, 128) if t >= widest // 2)


def test_megacore_n_tiles_balance_the_cores(kernel):
    """GPT-OSS on v5p: 6 tiles of 1024 (3 per core, 24 passes each) for gate_up's 5760 columns, not 5 of 1152 (45
    passes in all, the fewest, but 27 on one core); 4 of 768 for down's 2880, not 3 of 1024."""
    assert kernel.gmm.tiles.n_tile(5760, 1456, 128) == 1152
    assert kernel.gmm.tiles.n_tile(5760, 1456, 128, cores=2) == 1024
    gate_up = _matmul(kernel, 32768, 2880, 5760, groups=32, transpose_rhs=True)
    assert kernel.gmm.tiles.heuristic_config(gate_up, V5P).tile_n == 1024
    assert kernel.gmm.tiles.heuristic_config(gate_up._replace(n=2880), V5P).tile_n == 768


def test_heuristic_always_fits(kernel):
    for generation, dtype, (m, k, n) in itertools.product(
        ("v5e", "v6e"),
        (jnp.bfloat16, jnp.float32),
        itertools.product((1, 7, 300, 5000), (96, 2048, 7168, 16384), (200, 2816, 16384)),
    ):
        problem = _matmul(kernel, m, k, n, dtype, groups=8)
        target = resolve_target(generation)
        kernel.gmm.tiles.check_config(kernel.gmm.tiles.heuristic_config(problem, target), problem, target)


def test_select_is_the_heuristic_unless_the_shape_is_tuned(kernel, monkeypatch):
    problem = _matmul(kernel, 80, 1000, 1000, groups=16)
    assert kernel.gmm.tiles.select(problem, V5E) == kernel.gmm.tiles.heuristic_config(problem, V5E)
    key = kernel.gmm.tiles.TunedKey("v5e", 80, 1000, 1000, 16, "bfloat16", "bfloat16", True)
    tuned = kernel.gmm.tiles.TileConfig(80, 512, 256, 16)
    monkeypatch.setitem(kernel.gmm.tiles.TUNED_TILES, key, tuned)
    transposed = problem._replace(transpose_rhs=True)
    assert kernel.gmm.tiles.select(transposed, V5E) == tuned
    # Another generation, orientation or shape keeps the heuristic; an entry that cannot run is refused.
    assert kernel.gmm.tiles.select(problem, V5E) != tuned
    monkeypatch.setitem(kernel.gmm.tiles.TUNED_TILES, key, kernel.gmm.tiles.TileConfig(80, 100, 256))
    with pytest.raises(ValueError, match="tile_k=100 must be a multiple of 128"):
        kernel.gmm.tiles.select(transposed, V5E)


def test_megacore_heuristic_tiles_give_each_core_an_n_tile(kernel):
    """v5p's two cores split the grouped matmul's N tiles (its parallel axis): at least two where N allows."""
    for m, k, n in ((16384, 2048, 1536), (16384, 768, 2048), (16384, 704, 2816), (512, 256, 512)):
        problem = _matmul(kernel, m, k, n, groups=128, transpose_rhs=True)
        v5p = kernel.gmm.tiles.heuristic_config(problem, V5P)
        assert -(-n // v5p.tile_n) >= 2, (m, k, n, v5p)
        assert kernel.gmm.tiles.heuristic_config(problem, V5E).tile_n >= v5p.tile_n
    # Up to 256 columns stay one tile (`n_tile`'s narrowest).
    assert kernel.gmm.tiles.heuristic_config(_matmul(kernel, 512, 256, 256, groups=8), V5P).tile_n == 256


def _tgmm(kernel, m: int, k: int, n: int, groups: int = 1):
    """The weights' gradient of `lhs[m, k]`, `rhs[m, n]` in bf16, as a `TgmmProblem`."""
    return kernel.TgmmProblem(m, k, n, groups, "bfloat16", "bfloat16")


def test_megacore_tgmm_tiles_give_each_core_an_output_block(kernel):
    """v5p's two cores split tgmm's parallel axes (N tiles, then K tiles): a weights' gradient that would be one
    output block per group is cut in two along the dimension whose re-read costs less (N re-reads lhs [m, k])."""
    for m, k, n in ((65536, 2048, 1536), (65536, 768, 2048), (65536, 2816, 1408), (65536, 704, 2816)):
        v6e = kernel.tgmm.tiles.select(_tgmm(kernel, m, k, n, groups=128), V6E)
        v5p = kernel.tgmm.tiles.select(_tgmm(kernel, m, k, n, groups=128), V5P)
        assert (v6e.tile_k, v6e.tile_n) == (k, n)
        blocks = (-(-k // v5p.tile_k), -(-n // v5p.tile_n))
        assert blocks == ((1, 2) if k <= n else (2, 1)), (m, k, n, v5p)
        assert v5p.tile_k % 128 == 0 or v5p.tile_k == k
    # 128 columns stay one block.
    assert kernel.tgmm.tiles.select(_tgmm(kernel, 4096, 128, 128), V5P).tile_n == 128


def test_the_shipped_tuned_tiles_run_and_are_selected(kernel):
    """tuned_tiles.json (written by tpu-kernels' moe_layer --tune-ours): every entry is a legal config on its
    generation, differs from the heuristic and is what gmm.tiles.select returns for its shape."""
    assert kernel.gmm.tiles.TUNED_TILES, "the package ships its tuned tiles"
    for key, tiles in kernel.gmm.tiles.TUNED_TILES.items():
        problem = kernel.MatmulProblem(key.m, key.k, key.n, key.groups, key.dtype, key.rhs_dtype, key.transpose_rhs)
        kernel.gmm.tiles.check_config(tiles, problem, resolve_target(key.generation))
        assert tiles != kernel.gmm.tiles.heuristic_config(problem, resolve_target(key.generation))
        assert kernel.gmm.tiles.select(problem, resolve_target(key.generation)) == tiles


def test_the_jax_functions_resolve_their_generation_once_and_refuse_unknown_ones(kernel):
    """At 65536 rows in 16 groups the grouped matmul's row chunks differ between v5e and v6e."""
    problem = _matmul(kernel, 65536, 1000, 1000, groups=16)
    assert (kernel.gmm.tiles.select(problem, V5E).chunk_m, kernel.gmm.tiles.select(problem, V6E).chunk_m) == (128, 256)
    arrays = (jax.ShapeDtypeStruct((problem.m, problem.k), jnp.bfloat16),
              jax.ShapeDtypeStruct((problem.groups, problem.k, problem.n), jnp.bfloat16),
              jax.ShapeDtypeStruct((problem.groups,), jnp.int32))
    differentiable = functools.partial(kernel.backward.differentiable_ragged_dot, transpose_rhs=False,
                                       zero_rows_past_groups=True)
    testing.assert_generation_resolved_once(arrays, kernel.gmm.kernel.grouped_matmul, differentiable)


def test_a_tile_over_all_rows_holds_whole_chunks(kernel):
    # 129 rows in 128-row chunks: a 256-row tile (a partial edge block) of two chunks.
    rows = _matmul(kernel, 129, 256, 256)
    whole = kernel.gmm.tiles.TileConfig(4096, 256, 256, chunk_m=128)
    assert kernel.gmm.tiles.row_tile_rows(whole, rows) == 256
    assert kernel.gmm.tiles.row_chunks(whole, rows) == 2
    # Without chunks: the rows rounded up to the sublane tile.
    assert kernel.gmm.tiles.row_tile_rows(kernel.gmm.tiles.TileConfig(4096, 256, 256), rows) == 144
    assert kernel.gmm.tiles.row_tile_rows(kernel.gmm.tiles.TileConfig(4096, 256, 256),
                                          _matmul(kernel, 129, 256, 256, jnp.float32)) == 136
    # A fixed tile keeps its size; one chunk per tile without chunking.
    assert kernel.gmm.tiles.row_tile_rows(kernel.gmm.tiles.TileConfig(64, 256, 256), rows) == 64
    assert kernel.gmm.tiles.row_chunks(kernel.gmm.tiles.TileConfig(64, 256, 256), rows) == 1
    assert kernel.gmm.tiles.row_chunks(kernel.gmm.tiles.TileConfig(512, 256, 256, 128),
                                       _matmul(kernel, 4096, 256, 256)) == 4


def test_expected_active_groups(kernel):
    assert kernel.common.routing.expected_active_groups(1, 128) == pytest.approx(1.0)
    assert kernel.common.routing.expected_active_groups(8, 128) == pytest.approx(128 * (1 - (127 / 128) ** 8))
    assert kernel.common.routing.expected_active_groups(100000, 16) == pytest.approx(16.0)


MODELS = {
    # hidden, intermediate, experts (per rank), layout
    "qwen3-30b-a3b": (2048, 768, 128, dict(weights_transposed=False, interleaved=False, has_bias=False)),
    "gemma-4-26b-a4b": (2816, 704, 128, dict(weights_transposed=False, interleaved=False, has_bias=False)),
    "gpt-oss-20b": (2880, 2880, 32, dict(weights_transposed=True, interleaved=True, has_bias=True)),
}


def _experts_problem(kernel, tokens: int, hidden: int, intermediate: int, experts: int, dtype, layout: dict,
                     weights_dtype=None):
    """One pick per token (a rank's call under EP dispatch holds one row per pick it received), a SiLU gate."""
    dtype = jnp.dtype(dtype).name
    weights_dtype = dtype if weights_dtype is None else jnp.dtype(weights_dtype).name
    return kernel.problem.ExpertsProblem(tokens, 1, hidden, intermediate, experts, dtype, weights_dtype, "float32",
                                 layout["weights_transposed"], layout["has_bias"],
                                 kernel.problem.Gate("silu", layout["interleaved"]))


def _model_problem(kernel, name: str, tokens: int, dtype=jnp.bfloat16, experts: int | None = None, **layout):
    hidden, intermediate, model_experts, model_layout = MODELS[name]
    return _experts_problem(kernel, tokens, hidden, intermediate, experts or model_experts, dtype,
                            model_layout | layout)


def test_fused_config_of_real_models(kernel):
    # Rows: T on the sublane grid, in chunks of at most 64; I whole where the weights fit.
    # Qwen3 at EP8 (16 experts a rank), 256 tokens: two experts per step on v6e (experts_per_step_saving).
    qwen3 = functools.partial(_model_problem, kernel, "qwen3-30b-a3b")
    assert kernel.fused.tiles.select(qwen3(256, experts=16), V6E) == kernel.fused.tiles.FusedConfig(64, 768, 2)
    assert kernel.fused.tiles.select(qwen3(1), V6E) == kernel.fused.tiles.FusedConfig(16, 768)
    assert kernel.fused.tiles.select(qwen3(1, jnp.float32), V6E) == kernel.fused.tiles.FusedConfig(8, 768)
    assert kernel.fused.tiles.select(qwen3(100), V6E) == kernel.fused.tiles.FusedConfig(64, 768, 4)
    # A forced fused call of 2100 tokens keeps 128-row chunks: the kernel loops over as many as the rows fill.
    assert kernel.fused.tiles.select(qwen3(2100, experts=16), V6E).chunk_rows == 128
    # GPT-OSS-20B: two 50 MB experts do not fit; I/2 = 1440 makes 2880-column gate_up blocks (not on the lane
    # grid), I/3 = 960 fits and is aligned.
    gpt_oss = _model_problem(kernel, "gpt-oss-20b", 256)
    fused = kernel.fused.tiles.select(gpt_oss, V6E)
    assert fused == kernel.fused.tiles.FusedConfig(64, 960)
    # v6e's budget: 100 MiB less Mosaic's scratch.
    assert kernel.fused.tiles.fused_vmem_bytes(fused, gpt_oss) <= 96 * MIB
    # Every generation: decode of every model fits the fused kernel (v5p: a 52 MiB budget, TPU7x 48).
    for generation in ("v5e", "v5p", "v6e", "tpu7x"):
        for name in MODELS:
            for tokens in (1, 8, 64, 256):
                problem = _model_problem(kernel, name, tokens)
                fused = kernel.fused.tiles.select(problem, resolve_target(generation))
                assert fused is not None, (generation, name, tokens)
                kernel.fused.tiles.check_fused_config(fused, problem, resolve_target(generation))
                budget = {"v5p": 52, "tpu7x": 48}.get(generation, 96) * MIB
                assert kernel.fused.tiles.fused_vmem_bytes(fused, problem) <= budget


def test_experts_per_step_where_the_model_says_it_pays(kernel):
    qwen3 = functools.partial(_model_problem, kernel, "qwen3-30b-a3b", experts=16)
    intermediate = MODELS["qwen3-30b-a3b"][1]
    # Below MULTI_EXPERT_MIN_TOKENS an empty slot is likely (its first fetch wasted): one expert per step.
    assert kernel.fused.tiles.select(qwen3(kernel.fused.tiles.MULTI_EXPERT_MIN_TOKENS - 1), V6E).experts_per_step == 1
    # TPU7x: two of Qwen3's experts per step fit its 48 MiB budget at 256 tokens, three do not.
    assert kernel.fused.tiles.select(qwen3(256), TPU7X).experts_per_step == 2
    three = kernel.fused.tiles.FusedConfig(64, intermediate, 3)
    assert kernel.fused.tiles.fused_vmem_bytes(three, qwen3(256)) > 48 * MIB
    # v6e, Qwen3 at EP8, 256 tokens: each expert's 64-row chunk computes in 0.8 us against its 5.7 us fetch;
    # two experts per step save 8 steps (2.8 us) for one more chunk at the last step; four, which fit too, would
    # save 12 steps (4.2 us) for three more (2.4 us).
    fused = kernel.fused.tiles.FusedConfig(64, intermediate)
    savings = [kernel.fused.tiles.experts_per_step_saving(fused._replace(experts_per_step=n), qwen3(256), V6E)
               for n in (1, 2, 4)]
    assert savings[0] == 0.0 and savings[1] > savings[2] > 0
    assert kernel.fused.tiles.select(qwen3(256), V6E).experts_per_step == 2


def test_fused_vmem_bytes_counts_blocks_scratch_and_one_chunk(kernel):
    fused = kernel.fused.tiles.FusedConfig(16, 128)
    f32 = 4
    expected = (
        2 * 8 * 256 * f32  # hidden and out, resident (one buffer each), T=5 rows padded to 8
        + 8 * 256 * f32  # out accumulator
        + 2 * 8 * 128 * f32  # the routing (ids and weights), resident, 5 x K padded to 8 x 128
        + 2 * 8 * 128 * f32  # the expert's weight and rank per token as [5, 1] columns, padded
        + 8 * 128 * f32  # the [5, 5] triangle that counts the ranks, padded
        + 2 * 256 * 256 * f32  # gate_up block, I whole: 2I = 256 columns
        + 2 * 128 * 256 * f32  # down block
        + 16 * 256 * f32 + 16 * 256 * f32  # one chunk's gate_up and down values
    )
    layout = dict(weights_transposed=False, interleaved=False, has_bias=False)

    def vmem(**changed):
        problem = _experts_problem(kernel, 5, 256, 128, 8, jnp.float32, layout | changed)
        return kernel.fused.tiles.fused_vmem_bytes(fused, problem)

    assert vmem() == expected
    assert vmem(has_bias=True) - expected == 2 * (8 * 256 * f32 + 8 * 256 * f32)  # 8 experts' biases, twice
    assert vmem(interleaved=True) - expected == 256 * 128 * f32  # gate_up^T of one chunk, 16 lanes padded to 128


def _check_fused(kernel, fused, tokens: int, generation: str | None = None, hidden: int = 512,
                 intermediate: int = 256, experts: int = 8, weights_dtype=None, **layout):
    layout = dict(weights_transposed=False, interleaved=False, has_bias=False) | layout
    problem = _experts_problem(kernel, tokens, hidden, intermediate, experts, jnp.bfloat16, layout, weights_dtype)
    kernel.fused.tiles.check_fused_config(kernel.fused.tiles.FusedConfig(*fused), problem, resolve_target(generation))


@pytest.mark.parametrize(
    "fused,tokens,layout,match",
    [
        ((12, 128), 16, {}, "chunk_rows=12 must be a multiple of 16"),
        ((16, 64), 16, {}, "tile_i=64 must be I=256 or divide it"),  # down [E, H, I]: I tiles on lanes
        ((16, 64), 16, dict(weights_transposed=True), "tile_i=64 must be I=256"),  # gate_up [E, H, 2I]: lanes
        ((16, 0), 16, {}, "tile_i must be a positive int"),
        ((16, 128, 2), 16, {}, "experts_per_step=2 needs the whole I"),
        ((16, 256, 0), 16, {}, "experts_per_step must be a positive int"),
        ((16, 128, 1, 2), 16, dict(generation="v6e"), "cores_per_expert=2: v6e has 1 TensorCore"),
        ((16, 128, 1, 3), 16, dict(generation="v5p"), "cores_per_expert=3: v5p has 2 TensorCore"),
        ((16, 256, 1, 2), 16, dict(generation="v5p"), "cores_per_expert=2 needs at least as many I tiles"),
    ],
)
def test_check_fused_config_refuses_what_cannot_run(kernel, fused, tokens, layout, match):
    with pytest.raises(ValueError, match=match):
        _check_fused(kernel, fused, tokens, **layout)


def test_fused_chunks_are_a_loop_not_a_bound(kernel):
    """The kernel loops over an expert's chunks, so many chunks (300 tokens in 16-row chunks, of 4 experts a
    step) are no reason to refuse a config."""
    _check_fused(kernel, (16, 128), 300)
    _check_fused(kernel, (16, 256, 4), 80)


def test_v5p_cores_share_experts_where_the_busier_core_saves(kernel):
    """Split by experts, one active expert leaves a core idle and three put two on one core; shared, each core
    streams its I tiles of every expert. Sixteen active experts split evenly: the experts stay apart."""
    intermediate = MODELS["qwen3-30b-a3b"][1]
    qwen3 = functools.partial(_model_problem, kernel, "qwen3-30b-a3b", experts=16)
    apart = kernel.fused.tiles.FusedConfig(16, intermediate)
    shared = kernel.fused.tiles.FusedConfig(16, intermediate // 2, cores_per_expert=2)

    def seconds(fused, tokens):
        return kernel.fused.tiles.busier_core_seconds(fused, qwen3(tokens), V5P)

    assert seconds(shared, 1) < 0.6 * seconds(apart, 1)
    assert seconds(shared, 4) < seconds(apart, 4)
    picked = kernel.fused.tiles.select(qwen3(1), V5P)
    assert picked.cores_per_expert == 2 and picked.tile_i == intermediate // 2
    assert kernel.fused.tiles.select(qwen3(256), V5P).cores_per_expert == 1
    assert kernel.fused.tiles.select(qwen3(1), V6E).cores_per_expert == 1


def test_tile_i_alignment_per_layout(kernel):
    # Interleaved, transposed: gate_up [E, H, 2I] cut at 2 x 64 = 128 lanes, down [E, I, H] at 64 sublanes.
    _check_fused(kernel, (16, 64), 16, weights_transposed=True, interleaved=True)
    # With biases, the gate_up bias [E, 2I] is cut on lanes too: still 128.
    _check_fused(kernel, (16, 64), 16, weights_transposed=True, interleaved=True, has_bias=True)
    # Concatenated, transposed, biases: gate and up bias blocks of 64 lanes are not aligned.
    with pytest.raises(ValueError, match="tile_i=64"):
        _check_fused(kernel, (16, 64), 16, weights_transposed=True, has_bias=True)


def test_an_ep_dispatch_rank_at_decode_batch_256_takes_the_fused_kernel(kernel):
    # Qwen3-30B-A3B, batch 256, top-8 dispatched over 8 ranks: 256 rows per rank on average, 301 on the busiest.
    hidden, intermediate, experts, layout = MODELS["qwen3-30b-a3b"]
    problem = _experts_problem(kernel, 301, hidden, intermediate, experts // 8, "bfloat16", layout)
    assert kernel.plan.fused_path_config(problem, V6E) is not None


def test_the_fused_path_is_for_decode_sized_calls_that_fit(kernel):
    hidden, intermediate, experts, layout = MODELS["qwen3-30b-a3b"]
    decode = _experts_problem(kernel, kernel.plan.FUSED_MAX_TOKENS, hidden, intermediate, experts, "bfloat16", layout)
    assert kernel.plan.fused_path_config(decode, V6E) is not None
    assert kernel.plan.fused_path_config(decode._replace(tokens=kernel.plan.FUSED_MAX_TOKENS + 1), V6E) is None
    # An expert whose weights fit in no I tiling (I prime, 16384 x 16383 f32): the grouped matmuls.
    layout = dict(weights_transposed=False, interleaved=False, has_bias=False)
    prime = _experts_problem(kernel, 8, 16384, 16381, 4, "float32", layout)
    assert kernel.fused.tiles.select(prime, V6E) is None
    assert kernel.plan.fused_path_config(prime, V6E) is None


def test_gpt_oss_fp8_on_tpu7x_takes_partial_i_tiles_of_whole_scale_blocks(kernel):
    """I = 2880 has no divisor on the 128-wide fp8 scale blocks and its whole fp8 expert does not fit TPU7x's
    budget double-buffered, so the fp8 MXU path cuts it in two tiles of 1536 (the last one 1344 columns); elsewhere,
    or in bf16, the tiles divide I (960) and fp8 is dequantized."""
    hidden, intermediate = MODELS["gpt-oss-20b"][:2]
    fp8 = jnp.float8_e4m3fn
    gpt_oss = functools.partial(_model_problem, kernel, "gpt-oss-20b")
    for tokens in (1, 64, 256):
        problem = gpt_oss(tokens)._replace(weights_dtype=jnp.dtype(fp8).name)
        picked = kernel.fused.tiles.select(problem, TPU7X)
        assert picked.tile_i == 1536 and kernel.fused.tiles.i_tiles(picked, intermediate) == 2
        assert kernel.fused.tiles.fused_feeds_fp8_mxu(picked, problem, TPU7X)
        for generation, other_problem in (("v6e", problem), ("tpu7x", gpt_oss(tokens))):
            other = kernel.fused.tiles.select(other_problem, resolve_target(generation))
            assert intermediate % other.tile_i == 0 and other.tile_i % 128
    shape = dict(hidden=hidden, intermediate=intermediate, experts=4, weights_transposed=True, interleaved=True,
                 has_bias=True)
    # Concatenated gate/up (the up block's offset counts whole tiles), bf16, and v6e keep tiles that divide I.
    for refused in (dict(shape, interleaved=False, weights_dtype=fp8, generation="tpu7x"),
                    dict(shape, generation="tpu7x"), dict(shape, weights_dtype=fp8, generation="v6e")):
        with pytest.raises(ValueError, match=r"tile_i=1536 must be I=2880 or divide it"):
            _check_fused(kernel, (16, 1536), 1, **refused)
    with pytest.raises(ValueError, match=r"tile_i=1000 must be I=2880, a multiple of 128 below it,"):
        _check_fused(kernel, (16, 1000), 1, **shape, weights_dtype=fp8, generation="tpu7x")
