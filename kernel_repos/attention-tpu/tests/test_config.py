"""Unit tests of the tile selection (flash/tiles.py, flash_backward/tiles.py, common/vmem.py) of the built variant:
no kernel runs here. The selectors take a generation's facts, resolved once (`resolve_target`)."""

import jax
import jax.numpy as jnp
import pytest
from tpu_kernels import testing
from tpu_kernels.runtime.hardware import SUPPORTED_GENERATIONS, resolve_target

MIB = 1 << 20
QWEN3_DECODE = dict(q_heads=32, kv_heads=4, q_len=1, head_dim=128, dtype=jnp.bfloat16)
TARGETS = [resolve_target(generation) for generation in SUPPORTED_GENERATIONS]
V5E, V6E = resolve_target("v5e"), resolve_target("v6e")


def test_vmem_bytes_of_a_prefill_and_a_decode_step(kernel):
    tiles = kernel.flash.tiles.ForwardTiles
    # Prefill: 2 query heads x 64 rows, block_kv 200 (lanes pad to 256), f32, a bool (int8) mask.
    prefill_problem = kernel.Problem.of_shape(q_heads=2, kv_heads=1, q_len=300, kv_len=1000, head_dim=64,
                                              dtype=jnp.float32, mask_dtype=jnp.bool_)
    prefill = kernel.flash.tiles.vmem_bytes(prefill_problem, tiles(64, 200))
    q_and_out = 2 * 2 * 2 * 64 * 64 * 4
    scratch = 2 * 64 * (64 + 256) * 4
    kv = 2 * 2 * 200 * 64 * 4
    temporaries = 4 * 64 * 256 * 4
    mask = 2 * 64 * 256 * 1
    lse = 2 * 2 * 8 * 128 * 4  # [group, 1, block_q] rows: 1 pads to 8 sublanes, 64 to 128 lanes
    assert prefill == q_and_out + scratch + kv + temporaries + mask + lse
    # Decode: the group's 4 query rows pad to 8 sublanes; two KV heads per step; no mask.
    decode_problem = kernel.Problem.of_shape(q_heads=8, kv_heads=2, q_len=1, kv_len=4096, head_dim=128,
                                             dtype=jnp.bfloat16)
    decode = kernel.flash.tiles.vmem_bytes(decode_problem, tiles(1, 1024, 2))
    lse = 2 * 2 * 8 * 128 * 4  # [KV heads, group, 1]
    assert decode == (2 * 2 * 2 * 8 * 128 * 2) + 2 * 8 * (128 + 256) * 4 + 2 * 2 * 2 * 1024 * 128 * 2 + 4 * 8 * 1024 * 4 + lse
    # q read queries-minor (XLA stores 65 or more positions so at head_dim 64): the group's query blocks transposed
    # into a scratch of rows.
    queries_minor, row_major = (kernel.flash.tiles.vmem_bytes(
        kernel.Problem.of_shape(q_heads=2, kv_heads=1, q_len=q_len, kv_len=256, head_dim=64, dtype=jnp.bfloat16),
        tiles(128, 256)) for q_len in (65, 64))
    assert queries_minor - row_major == 2 * 128 * 64 * 2


def test_vmem_limit_takes_the_margin_and_mosaic_scratch_within_bounds(kernel):
    assert kernel.vmem_limit(1 * MIB, V6E) == 16 * MIB
    assert kernel.vmem_limit(20 * MIB, V6E) == 30 * MIB + 4 * MIB
    assert kernel.vmem_limit(90 * MIB, V6E) == 100 * MIB
    # 64 MiB of VMEM per core: at most 56 MiB asked for.
    assert kernel.vmem_limit(20 * MIB, resolve_target("tpu7x")) == 30 * MIB + 8 * MIB
    assert kernel.vmem_limit(40 * MIB, resolve_target("v5p")) == 56 * MIB


def test_vmem_budget_bounds_tile_size_below_what_fits(kernel):
    # What fits with the margin: (100 - 4) / 1.5 MiB on v5e and v6e, (56 - 4) / 1.5 on v5p, (56 - 8) / 1.5 on TPU7x.
    assert [kernel.vmem_budget(target) >> 20 for target in TARGETS] == [24, 24, 32, 24]


def test_is_decode(kernel):
    assert kernel.flash.tiles.is_decode(1) and not kernel.flash.tiles.is_decode(2)


def test_heuristic_respects_limits(kernel):
    """Tiles are full-extent or aligned, decode steps span KV heads, oversized shapes shrink."""
    heuristic = kernel.flash.tiles.heuristic_config
    for target in TARGETS:
        prefill = heuristic(kernel.Problem.of_shape(q_heads=8, kv_heads=1, q_len=300, kv_len=1000, head_dim=128,
                                                    dtype=jnp.float32), target)
        assert prefill.block_q == 300 and (prefill.block_kv == 1000 or prefill.block_kv % 128 == 0)
        assert prefill.kv_heads_per_step == 1
        decode = heuristic(kernel.Problem.of_shape(kv_len=1000, **QWEN3_DECODE), target)
        assert (decode.block_q, decode.block_kv, decode.kv_heads_per_step) == (1, 1000, 4)
        long_decode = heuristic(kernel.Problem.of_shape(kv_len=32768, **QWEN3_DECODE), target)
        assert long_decode.block_kv == kernel.flash.tiles.PREFERRED_TILES[target.name][2]
        # A step moves at most DECODE_STEP_BYTES of K and V.
        step_bytes = 2 * long_decode.kv_heads_per_step * long_decode.block_kv * 128 * 2
        assert step_bytes <= kernel.flash.tiles.DECODE_STEP_BYTES[target.name]
        assert 4 % long_decode.kv_heads_per_step == 0
    # 16 query heads per KV head, D=256, float32: v5e's smaller budget forces smaller query blocks.
    large = heuristic(kernel.Problem.of_shape(q_heads=64, kv_heads=4, q_len=8192, kv_len=8192, head_dim=256,
                                              dtype=jnp.float32), V5E)
    assert large.block_q in (128, 256) and large.block_kv % 128 == 0
    plain = heuristic(kernel.Problem.of_shape(q_heads=8, kv_heads=1, q_len=8192, kv_len=8192, head_dim=128,
                                              dtype=jnp.bfloat16), V5E)
    assert (plain.block_q, plain.block_kv) == kernel.flash.tiles.PREFERRED_TILES["v5e"][:2]
    assert large.block_q < plain.block_q


def test_prefill_blocks_under_a_sliding_window_span_at_most_two_windows(kernel):
    """GPT-OSS-20B's window of 128: (256, 256) blocks, not the preferred (512, 512|1024); a window of 1024 keeps the
    preferred tiles; decode keeps its long key blocks; `select` takes the problem's window."""
    gpt_oss = dict(q_heads=64, kv_heads=8, q_len=4096, kv_len=4096, head_dim=64, dtype=jnp.bfloat16)

    def heuristic(target, **shape):
        return kernel.flash.tiles.heuristic_config(kernel.Problem.of_shape(**{**gpt_oss, **shape}), target)

    for target in TARGETS:
        windowed = heuristic(target, sliding_window=128)
        assert (windowed.block_q, windowed.block_kv) == (256, 256)
        wide, unbounded = heuristic(target, sliding_window=1024), heuristic(target)
        assert (wide.block_q, wide.block_kv) == (unbounded.block_q, unbounded.block_kv)
        decode = heuristic(target, q_len=1, sliding_window=128)
        assert decode.block_kv == kernel.flash.tiles.PREFERRED_TILES[target.name][2]
        selected = kernel.flash.tiles.select(kernel.Problem.of_shape(**gpt_oss, sliding_window=100), target)
        assert (selected.block_q, selected.block_kv) == (256, 256)


def test_heuristic_working_set_fits_the_budget_and_sets_the_limit(kernel):
    for target in TARGETS:
        for mask_dtype in (None, jnp.int8, jnp.float32):
            problem = kernel.Problem.of_shape(q_heads=32, kv_heads=4, q_len=4096, kv_len=4096, head_dim=128,
                                              dtype=jnp.bfloat16, mask_dtype=mask_dtype)
            chosen = kernel.flash.tiles.heuristic_config(problem, target)
            working_set = kernel.flash.tiles.vmem_bytes(
                problem, kernel.flash.tiles.ForwardTiles(chosen.block_q, chosen.block_kv))
            assert working_set <= kernel.vmem_budget(target)
            assert chosen.vmem_limit_bytes == kernel.vmem_limit(working_set, target)


def test_head_dim_512_takes_its_own_preferred_tiles_within_the_budget(kernel):
    """Gemma-4's global layers: prefill and both backward kernels take the head_dim-512 tiles, decode the usual
    ones; every working set fits the budget."""
    gemma_4_global = dict(q_heads=16, kv_heads=2, head_dim=512)
    for target in TARGETS:
        preferred = kernel.flash.tiles.PREFERRED_TILES_BY_HEAD_DIM[512][target.name]
        for q_len, blocks in ((8192, preferred[:2]), (1, (1, preferred[2]))):
            problem = kernel.Problem.of_shape(q_len=q_len, kv_len=32768, dtype=jnp.bfloat16, batch=64,
                                              **gemma_4_global)
            chosen = kernel.flash.tiles.select(problem, target)
            assert (chosen.block_q, chosen.block_kv) == blocks
            working_set = kernel.flash.tiles.vmem_bytes(problem, kernel.flash.tiles.ForwardTiles(
                chosen.block_q, chosen.block_kv, chosen.kv_heads_per_step))
            assert working_set <= kernel.vmem_budget(target)
        assert preferred[2] == kernel.flash.tiles.PREFERRED_TILES[target.name][2]
        training = kernel.Problem.of_shape(q_len=8192, kv_len=8192, dtype=jnp.bfloat16, **gemma_4_global)
        backward = kernel.flash_backward.tiles.select(training, target)
        preferred_backward = kernel.flash_backward.tiles.PREFERRED_BACKWARD_TILES_BY_HEAD_DIM[512][target.name]
        assert (backward.dq.block_q, backward.dq.block_kv) == preferred_backward["dq"]
        assert (backward.dkv.block_q, backward.dkv.block_kv) == preferred_backward["dkv"]


def test_head_dim_64_over_more_than_64_positions_reads_q_k_v_sequence_minor_in_whole_lane_tiles(kernel):
    """Where XLA stores K and V keys-minor (`sequence_minor_by_default`), the forward reads them so, its KV blocks
    multiples of 128 (past the keys' end where the keys are fewer); a config whose block is the whole shorter key
    length reads them row-major, as do head_dim 128 and 64 keys or fewer. Likewise a prefill's q (and its output) by
    its query blocks; decode reads q row-major."""
    sequence_minor = kernel.common.layout.sequence_minor_by_default
    assert sequence_minor(65, 64) and sequence_minor(1000, 64) and sequence_minor(4097, 64)
    assert sequence_minor(32768, 64)
    assert not (sequence_minor(64, 64) or sequence_minor(17, 64) or sequence_minor(4096, 128)
                or sequence_minor(100, 256))
    gpt_oss = dict(q_heads=64, kv_heads=8, head_dim=64, dtype=jnp.bfloat16)
    for target in TARGETS:
        for q_len, kv_len in ((1, 4096), (1, 1000), (4096, 4096), (300, 300), (65, 1000)):
            plan = kernel.flash.plan.make(kernel.Problem.of_shape(q_len=q_len, kv_len=kv_len, **gpt_oss), target)
            minor = plan.sequence_minor
            assert minor.k and minor.v and plan.block_kv % 128 == 0, (target.name, q_len, kv_len, plan)
            assert minor.q == minor.out == (q_len > 1) and plan.block_q % 128 == (q_len == 1), plan
        short = kernel.flash.plan.make(kernel.Problem.of_shape(q_len=64, kv_len=64, **gpt_oss), target)
        assert not any(short.sequence_minor)

    def plan(problem, *blocks):
        return kernel.flash.plan.make(problem, V6E, kernel.AttentionConfig(*blocks, 16 * MIB))

    problem = kernel.Problem.of_shape(q_len=1, kv_len=300, **gpt_oss)
    assert plan(problem, 1, 128).sequence_minor.k and not plan(problem, 1, 300).sequence_minor.k
    prefill = kernel.Problem.of_shape(q_len=300, kv_len=300, **gpt_oss)
    assert plan(prefill, 128, 128).sequence_minor.q and not plan(prefill, 300, 128).sequence_minor.q
    qwen3 = kernel.Problem.of_shape(kv_len=4096, **QWEN3_DECODE)
    assert not any(kernel.flash.plan.make(qwen3, V6E).sequence_minor)
    qwen3_prefill = kernel.Problem.of_shape(**dict(QWEN3_DECODE, q_len=4096), kv_len=4096)
    assert not any(kernel.flash.plan.make(qwen3_prefill, V6E).sequence_minor)


def test_check_config(kernel):
    problem = kernel.Problem.of_shape(q_heads=4, kv_heads=2, q_len=300, kv_len=1000, head_dim=128, dtype=jnp.float32)
    kernel.flash.tiles.check_config(kernel.AttentionConfig(128, 128, 16 * MIB), problem)
    kernel.flash.tiles.check_config(kernel.AttentionConfig(300, 1000, 16 * MIB), problem)
    for bad, match in [
        # Query blocks hold the log-sum-exp rows with positions along lanes: multiples of 128.
        (kernel.AttentionConfig(64, 128, 16 * MIB), "block_q must be a multiple of 128"),
        (kernel.AttentionConfig(128, 100, 16 * MIB), "block_kv must be a multiple of 128"),
        (kernel.AttentionConfig(128, 128, 16 * MIB, kv_heads_per_step=3), "kv_heads_per_step must divide"),
        (kernel.AttentionConfig(128, 128, 16 * MIB, kv_heads_per_step=0), "kv_heads_per_step must divide"),
    ]:
        with pytest.raises(ValueError, match=match):
            kernel.flash.tiles.check_config(bad, problem)
    # Decode ignores block_q (the rows of a step are query heads).
    decode = kernel.Problem.of_shape(q_heads=4, kv_heads=2, q_len=1, kv_len=1000, head_dim=128, dtype=jnp.float32)
    kernel.flash.tiles.check_config(kernel.AttentionConfig(12, 128, 16 * MIB), decode)


def test_tuned_tiles_override_the_heuristic_and_are_checked(kernel, monkeypatch):
    problem = kernel.Problem.of_shape(kv_len=4096, **QWEN3_DECODE)
    key = kernel.flash.tiles.TunedKey("v6e", 32, 4, 1, 4096, 128, 128, "bfloat16", None)
    assert kernel.flash.tiles.tuned_config(problem, V6E) is None
    tiles = kernel.flash.tiles.ForwardTiles(block_q=1, block_kv=2048, kv_heads_per_step=2)
    monkeypatch.setitem(kernel.flash.tiles.TUNED_TILES, key, tiles)
    # The tiles are the table's; the VMEM limit follows from them.
    working_set = kernel.flash.tiles.vmem_bytes(problem, tiles)
    tuned = kernel.AttentionConfig(1, 2048, kernel.vmem_limit(working_set, V6E), kv_heads_per_step=2)
    assert kernel.flash.tiles.select(problem, V6E) == tuned
    assert kernel.flash.tiles.select(problem, V5E) != tuned
    monkeypatch.setitem(kernel.flash.tiles.TUNED_TILES, key, kernel.flash.tiles.ForwardTiles(1, 2048,
                                                                                             kv_heads_per_step=3))
    with pytest.raises(ValueError, match="kv_heads_per_step"):
        kernel.flash.tiles.select(problem, V6E)


def test_the_jax_functions_resolve_their_generation_once_and_refuse_unknown_ones(kernel):
    """At a decode step of 8192 keys the forward's tiles differ between v5e and v6e."""
    q = jax.ShapeDtypeStruct((1, 8, 8192, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1, 8192, 128), jnp.bfloat16)
    testing.assert_generation_resolved_once((q, kv, kv), kernel.flash.kernel.flash_attention_forward,
                                            kernel.flash.kernel.differentiable_flash_attention)


TRAINING_SHAPES = {
    "qwen3-30b-a3b": dict(q_heads=32, kv_heads=4, head_dim=128),
    "gemma-4 sliding": dict(q_heads=16, kv_heads=8, head_dim=256),
    "gpt-oss": dict(q_heads=64, kv_heads=8, head_dim=64),
    "gemma-4 global": dict(q_heads=16, kv_heads=2, head_dim=512),
}


@pytest.mark.parametrize("model", list(TRAINING_SHAPES))
def test_backward_tiles_fit_the_budget(kernel, model):
    shape = TRAINING_SHAPES[model]
    for target in TARGETS:
        for dtype, mask_dtype in ((jnp.bfloat16, None), (jnp.bfloat16, jnp.int8), (jnp.float32, jnp.float32)):
            problem = kernel.Problem.of_shape(q_len=8192, kv_len=8192, dtype=dtype, mask_dtype=mask_dtype, **shape)
            chosen = kernel.flash_backward.tiles.select(problem, target)
            kernel.flash_backward.tiles.check_backward_config(chosen, problem)
            for kernel_name, tiles in (("dq", chosen.dq), ("dkv", chosen.dkv)):
                blocks = dict(block_q=tiles.block_q, block_kv=tiles.block_kv)
                sequence_minor = kernel.common.layout.sequence_minor_reads(problem, tiles.block_q, tiles.block_kv)
                assert all(sequence_minor) == any(sequence_minor) == (shape["head_dim"] == 64), (target.name, tiles)

                def working_set(heads):
                    return kernel.flash_backward.tiles.backward_vmem_bytes(kernel_name, problem,
                                                                           kv_heads_per_step=heads, **blocks)

                heads = tiles.kv_heads_per_step
                assert working_set(heads) <= kernel.vmem_budget(target), (target.name, kernel_name, tiles)
                assert tiles.vmem_limit_bytes == kernel.vmem_limit(working_set(heads), target)
                # Enough KV heads per step that the step outweighs its overhead, or as many as fit.
                seconds = kernel.flash_backward.tiles.backward_step_seconds(kernel_name, problem, target,
                                                                            kv_heads_per_step=heads, **blocks)
                more = [h for h in range(heads + 1, shape["kv_heads"] + 1) if shape["kv_heads"] % h == 0]
                assert (seconds >= kernel.flash_backward.tiles.STEP_OVERHEAD_MULTIPLE * 0.35e-6 or not more
                        or working_set(more[0]) > kernel.vmem_budget(target)), (target.name, kernel_name, tiles)
    qwen3 = kernel.Problem.of_shape(q_len=8192, kv_len=8192, dtype=jnp.bfloat16, **TRAINING_SHAPES["qwen3-30b-a3b"])
    plain = kernel.flash_backward.tiles.select(qwen3, V6E)
    preferred = kernel.flash_backward.tiles.PREFERRED_BACKWARD_TILES["v6e"]
    assert (plain.dq.block_q, plain.dq.block_kv) == preferred["dq"]
    assert (plain.dkv.block_q, plain.dkv.block_kv) == preferred["dkv"]


def test_backward_tiles_shrink_for_short_windows(kernel):
    """GPT-OSS's window of 128: blocks past a few windows would mostly compute masked pairs."""
    gpt_oss = dict(q_heads=64, kv_heads=8, q_len=8192, kv_len=8192, head_dim=64, dtype=jnp.bfloat16)
    for target in TARGETS:
        chosen = kernel.flash_backward.tiles.select(kernel.Problem.of_shape(sliding_window=128, **gpt_oss), target)
        cap = kernel.flash_backward.tiles.WINDOW_BLOCK_FACTOR[target.name] * 128
        assert max(chosen.dq.block_q, chosen.dq.block_kv, chosen.dkv.block_q, chosen.dkv.block_kv) <= cap
        # Non-causal windows see keys on both sides without bound: no cap.
        without_window = kernel.flash_backward.tiles.select(kernel.Problem.of_shape(**gpt_oss), target)
        both_sides = kernel.Problem.of_shape(sliding_window=128, causal=False, **gpt_oss)
        assert kernel.flash_backward.tiles.select(both_sides, target) == without_window


def test_backward_tiles_of_short_sequences_are_whole(kernel):
    problem = kernel.Problem.of_shape(q_heads=4, kv_heads=2, q_len=45, kv_len=300, head_dim=64, dtype=jnp.float32)
    chosen = kernel.flash_backward.tiles.select(problem, V5E)
    assert (chosen.dq.block_q, chosen.dkv.block_q) == (45, 45)
    assert chosen.dq.block_kv in (300, 256) and chosen.dkv.block_kv in (300, 256)


def test_check_backward_config(kernel):
    good = kernel.AttentionConfig(128, 256, 16 * MIB, kv_heads_per_step=2)
    problem = kernel.Problem.of_shape(q_heads=8, kv_heads=4, q_len=300, kv_len=1000, head_dim=128, dtype=jnp.float32)
    kernel.flash_backward.tiles.check_backward_config(kernel.flash_backward.tiles.BackwardConfig(dq=good, dkv=good),
                                                      problem)
    for bad, match in [
        (kernel.flash_backward.tiles.BackwardConfig(dq=kernel.AttentionConfig(100, 256, MIB), dkv=good),
         "dq.block_q must be a multiple"),
        (kernel.flash_backward.tiles.BackwardConfig(dq=good, dkv=kernel.AttentionConfig(128, 200, MIB)),
         "dkv.block_kv must be a multiple"),
        (kernel.flash_backward.tiles.BackwardConfig(dq=good, dkv=kernel.AttentionConfig(128, 256, MIB, 3)),
         "dkv.kv_heads_per_step must divide"),
    ]:
        with pytest.raises(ValueError, match=match):
            kernel.flash_backward.tiles.check_backward_config(bad, problem)


# Latent attention's layers (`compile_targets.EXPANDED_LATENT_HEADS`, `LATENT_HEADS`): query heads, KV heads, (D, Dv)
# of its expanded and absorbed forms.
LATENT_SHAPES = {
    "deepseek-v3 tp8 expanded": (16, 16, (192, 128)),
    "glm-4.7-flash expanded": (20, 20, (256, 256)),
    "deepseek-v3 tp8 absorbed": (16, 1, (576, 512)),
}


@pytest.mark.parametrize("model", list(LATENT_SHAPES))
def test_latent_attention_tiles_fit_and_read_each_array_as_stored(kernel, model):
    """Prefill, decode (also the absorbed form's 128 query heads on one chip) and training: tiles within the budget,
    q and k read sequence-minor where XLA stores them so (D 192 and 576 over 4096 positions), v and the output
    apart (128, 256, 512: row-major)."""
    q_heads, kv_heads, (head_dim, v_head_dim) = LATENT_SHAPES[model]
    sequence_minor = kernel.common.layout.sequence_minor_by_default
    shapes = [(q_heads, 4096, 4096), (q_heads, 1, 4096), (q_heads, 1, 32768)]
    if kv_heads == 1:
        shapes.append((128, 1, 4096))
    for target in TARGETS:
        for heads, q_len, kv_len in shapes:
            problem = kernel.Problem.of_shape(q_heads=heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len,
                                              head_dim=head_dim, v_head_dim=v_head_dim, dtype=jnp.bfloat16)
            plan = kernel.flash.plan.make(problem, target)
            tiles = kernel.flash.tiles.ForwardTiles(plan.block_q, plan.block_kv, plan.heads_per_step)
            assert kernel.flash.tiles.vmem_bytes(problem, tiles) <= kernel.vmem_budget(target), (target.name, tiles)
            prefill = q_len > 1
            assert tuple(plan.sequence_minor) == (prefill and sequence_minor(q_len, head_dim),
                                                  sequence_minor(kv_len, head_dim), sequence_minor(kv_len, v_head_dim),
                                                  prefill and sequence_minor(q_len, v_head_dim)), (target.name, plan)
        training = kernel.Problem.of_shape(q_heads=q_heads, kv_heads=kv_heads, q_len=4096, kv_len=4096,
                                           head_dim=head_dim, v_head_dim=v_head_dim, dtype=jnp.bfloat16)
        chosen = kernel.flash_backward.tiles.select(training, target)
        for name, tiles in (("dq", chosen.dq), ("dkv", chosen.dkv)):
            working_set = kernel.flash_backward.tiles.backward_vmem_bytes(
                name, training, block_q=tiles.block_q, block_kv=tiles.block_kv,
                kv_heads_per_step=tiles.kv_heads_per_step)
            assert working_set <= kernel.vmem_budget(target), (target.name, name, tiles)
    assert sequence_minor(4096, 192) and sequence_minor(4096, 576) and not sequence_minor(4096, 128)
