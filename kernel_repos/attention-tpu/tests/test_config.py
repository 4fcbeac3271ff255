"""Unit tests of the tile selection (flash/tiles.py, flash_backward/tiles.py, common/vmem.py) of the built variant:
no kernel runs here."""

import jax.numpy as jnp
import pytest

MIB = 1 << 20
QWEN3_DECODE = dict(q_heads=32, kv_heads=4, q_len=1, head_dim=128, dtype=jnp.bfloat16)


def test_vmem_bytes_of_a_prefill_and_a_decode_step(kernel):
    # Prefill: 2 query heads x 64 rows, block_kv 200 (lanes pad to 256), f32, a bool (int8) mask.
    prefill = kernel.flash.tiles.vmem_bytes(decode=False, group=2, block_q=64, block_kv=200, kv_heads_per_step=1,
                                            head_dim=64, itemsize=4, mask_itemsize=1)
    q_and_out = 2 * 2 * 2 * 64 * 64 * 4
    scratch = 2 * 64 * (64 + 256) * 4
    kv = 2 * 2 * 200 * 64 * 4
    temporaries = 4 * 64 * 256 * 4
    mask = 2 * 64 * 256 * 1
    lse = 2 * 2 * 8 * 128 * 4  # [group, 1, block_q] rows: 1 pads to 8 sublanes, 64 to 128 lanes
    assert prefill == q_and_out + scratch + kv + temporaries + mask + lse
    # Decode: the group's 4 query rows pad to 8 sublanes; two KV heads per step; no mask.
    decode = kernel.flash.tiles.vmem_bytes(decode=True, group=4, block_q=1, block_kv=1024, kv_heads_per_step=2,
                                           head_dim=128, itemsize=2, mask_itemsize=0)
    lse = 2 * 2 * 8 * 128 * 4  # [KV heads, group, 1]
    assert decode == (2 * 2 * 2 * 8 * 128 * 2) + 2 * 8 * (128 + 256) * 4 + 2 * 2 * 2 * 1024 * 128 * 2 + 4 * 8 * 1024 * 4 + lse
    # q read queries-minor: the group's query blocks transposed into a scratch of rows.
    queries_minor = kernel.flash.tiles.vmem_bytes(decode=False, group=2, block_q=128, block_kv=256, kv_heads_per_step=1,
                                                  head_dim=64, itemsize=2, mask_itemsize=0, queries_minor=True)
    row_major = kernel.flash.tiles.vmem_bytes(decode=False, group=2, block_q=128, block_kv=256, kv_heads_per_step=1,
                                              head_dim=64, itemsize=2, mask_itemsize=0)
    assert queries_minor - row_major == 2 * 128 * 64 * 2


def test_vmem_limit_takes_the_margin_and_mosaic_scratch_within_bounds(kernel):
    assert kernel.vmem_limit(1 * MIB, "v6e") == 16 * MIB
    assert kernel.vmem_limit(20 * MIB, "v6e") == 30 * MIB + 4 * MIB
    assert kernel.vmem_limit(90 * MIB, "v6e") == 100 * MIB
    # 64 MiB of VMEM per core: at most 56 MiB asked for.
    assert kernel.vmem_limit(20 * MIB, "tpu7x") == 30 * MIB + 8 * MIB
    assert kernel.vmem_limit(40 * MIB, "v5p") == 56 * MIB


def test_vmem_budget_bounds_tile_size_below_what_fits(kernel):
    # What fits with the margin: (100 - 4) / 1.5 MiB on v5e and v6e, (56 - 4) / 1.5 on v5p, (56 - 8) / 1.5 on TPU7x.
    assert [kernel.vmem_budget(g) >> 20 for g in ("v5e", "v5p", "v6e", "tpu7x")] == [24, 24, 32, 24]


def test_is_decode(kernel):
    assert kernel.flash.tiles.is_decode(1) and not kernel.flash.tiles.is_decode(2)


def test_heuristic_respects_limits(kernel):
    """Tiles are full-extent or aligned, decode steps span KV heads, oversized shapes shrink."""
    for generation in ("v5e", "v5p", "v6e", "tpu7x"):
        shape = dict(mask_dtype=None, generation=generation)
        prefill = kernel.flash.tiles.heuristic_config(q_heads=8, kv_heads=1, q_len=300, kv_len=1000, head_dim=128,
                                          dtype=jnp.float32, **shape)
        assert prefill.block_q == 300 and (prefill.block_kv == 1000 or prefill.block_kv % 128 == 0)
        assert prefill.kv_heads_per_step == 1
        decode = kernel.flash.tiles.heuristic_config(kv_len=1000, **QWEN3_DECODE, **shape)
        assert (decode.block_q, decode.block_kv, decode.kv_heads_per_step) == (1, 1000, 4)
        long_decode = kernel.flash.tiles.heuristic_config(kv_len=32768, **QWEN3_DECODE, **shape)
        assert long_decode.block_kv == kernel.flash.tiles.PREFERRED_TILES[generation][2]
        # A step moves at most DECODE_STEP_BYTES of K and V.
        step_bytes = 2 * long_decode.kv_heads_per_step * long_decode.block_kv * 128 * 2
        assert step_bytes <= kernel.flash.tiles.DECODE_STEP_BYTES[generation] and 4 % long_decode.kv_heads_per_step == 0
    # 16 query heads per KV head, D=256, float32: v5e's smaller budget forces smaller query blocks.
    large = kernel.flash.tiles.heuristic_config(q_heads=64, kv_heads=4, q_len=8192, kv_len=8192, head_dim=256,
                                                dtype=jnp.float32, mask_dtype=None, generation="v5e")
    assert large.block_q in (128, 256) and large.block_kv % 128 == 0
    plain = kernel.flash.tiles.heuristic_config(q_heads=8, kv_heads=1, q_len=8192, kv_len=8192, head_dim=128,
                                                dtype=jnp.bfloat16, mask_dtype=None, generation="v5e")
    assert (plain.block_q, plain.block_kv) == kernel.flash.tiles.PREFERRED_TILES["v5e"][:2]
    assert large.block_q < plain.block_q


def test_prefill_blocks_under_a_sliding_window_span_at_most_two_windows(kernel):
    """GPT-OSS-20B's window of 128: (256, 256) blocks, not the preferred (512, 512|1024); a window of 1024 keeps the
    preferred tiles; decode keeps its long key blocks; `select` passes the problem's window."""
    gpt_oss = dict(q_heads=64, kv_heads=8, q_len=4096, kv_len=4096, head_dim=64, dtype=jnp.bfloat16, mask_dtype=None)
    for generation in ("v5e", "v5p", "v6e", "tpu7x"):
        windowed = kernel.flash.tiles.heuristic_config(**gpt_oss, generation=generation, sliding_window=128)
        assert (windowed.block_q, windowed.block_kv) == (256, 256)
        wide = kernel.flash.tiles.heuristic_config(**gpt_oss, generation=generation, sliding_window=1024)
        unbounded = kernel.flash.tiles.heuristic_config(**gpt_oss, generation=generation)
        assert (wide.block_q, wide.block_kv) == (unbounded.block_q, unbounded.block_kv)
        decode = kernel.flash.tiles.heuristic_config(**{**gpt_oss, "q_len": 1}, generation=generation,
                                                     sliding_window=128)
        assert decode.block_kv == kernel.flash.tiles.PREFERRED_TILES[generation][2]
        problem = kernel.Problem.of_shape(**{k: v for k, v in gpt_oss.items() if k != "mask_dtype"},
                                          sliding_window=100)
        selected = kernel.flash.tiles.select(problem, generation)
        assert (selected.block_q, selected.block_kv) == (256, 256)


def test_heuristic_working_set_fits_the_budget_and_sets_the_limit(kernel):
    for generation in ("v5e", "v5p", "v6e", "tpu7x"):
        for mask_dtype in (None, jnp.int8, jnp.float32):
            chosen = kernel.flash.tiles.heuristic_config(q_heads=32, kv_heads=4, q_len=4096, kv_len=4096, head_dim=128,
                                             dtype=jnp.bfloat16, mask_dtype=mask_dtype, generation=generation)
            working_set = kernel.flash.tiles.vmem_bytes(
                decode=False, group=8, block_q=chosen.block_q, block_kv=chosen.block_kv, kv_heads_per_step=1,
                head_dim=128, itemsize=2, mask_itemsize=0 if mask_dtype is None else jnp.dtype(mask_dtype).itemsize,
            )
            assert working_set <= kernel.vmem_budget(generation)
            assert chosen.vmem_limit_bytes == kernel.vmem_limit(working_set, generation)


def test_head_dim_512_takes_its_own_preferred_tiles_within_the_budget(kernel):
    """Gemma-4's global layers: prefill and both backward kernels take the head_dim-512 tiles, decode the usual
    ones; every working set fits the budget."""
    gemma_4_global = dict(q_heads=16, kv_heads=2, head_dim=512)
    for generation in ("v5e", "v5p", "v6e", "tpu7x"):
        preferred = kernel.flash.tiles.PREFERRED_TILES_BY_HEAD_DIM[512][generation]
        for q_len, blocks in ((8192, preferred[:2]), (1, (1, preferred[2]))):
            problem = kernel.Problem.of_shape(q_len=q_len, kv_len=32768, dtype=jnp.bfloat16, batch=64,
                                              **gemma_4_global)
            chosen = kernel.flash.tiles.select(problem, generation)
            assert (chosen.block_q, chosen.block_kv) == blocks
            working_set = kernel.flash.tiles.vmem_bytes(
                decode=q_len == 1, group=8, block_q=chosen.block_q, block_kv=chosen.block_kv,
                kv_heads_per_step=chosen.kv_heads_per_step, head_dim=512, itemsize=2, mask_itemsize=0)
            assert working_set <= kernel.vmem_budget(generation)
        assert preferred[2] == kernel.flash.tiles.PREFERRED_TILES[generation][2]
        training = kernel.Problem.of_shape(q_len=8192, kv_len=8192, dtype=jnp.bfloat16, **gemma_4_global)
        backward = kernel.flash_backward.tiles.select(training, generation)
        preferred_backward = kernel.flash_backward.tiles.PREFERRED_BACKWARD_TILES_BY_HEAD_DIM[512][generation]
        assert (backward.dq.block_q, backward.dq.block_kv) == preferred_backward["dq"]
        assert (backward.dkv.block_q, backward.dkv.block_kv) == preferred_backward["dkv"]


def test_head_dim_64_over_more_than_64_positions_reads_q_k_v_sequence_minor_in_whole_lane_tiles(kernel):
    """Where XLA stores K and V keys-minor (`sequence_minor_by_default`), the forward reads them so, its KV blocks multiples of
    128 (past the keys' end where the keys are fewer); a config whose block is the whole shorter key length reads
    them row-major, as do head_dim 128 and 64 keys or fewer. Likewise a prefill's q (and its output) by its query
    blocks; decode reads q row-major."""
    sequence_minor = kernel.sequence_minor_by_default
    assert sequence_minor(65, 64) and sequence_minor(1000, 64) and sequence_minor(4097, 64)
    assert sequence_minor(32768, 64)
    assert not (sequence_minor(64, 64) or sequence_minor(17, 64) or sequence_minor(4096, 128)
                or sequence_minor(100, 256))
    gpt_oss = dict(q_heads=64, kv_heads=8, head_dim=64, dtype=jnp.bfloat16)
    for generation in ("v5e", "v5p", "v6e", "tpu7x"):
        for q_len, kv_len in ((1, 4096), (1, 1000), (4096, 4096), (300, 300), (65, 1000)):
            plan = kernel.flash.plan.make(kernel.Problem.of_shape(q_len=q_len, kv_len=kv_len, **gpt_oss), generation)
            assert plan.keys_minor and plan.block_kv % 128 == 0, (generation, q_len, kv_len, plan)
            assert plan.queries_minor == (q_len > 1) and plan.block_q % 128 == (q_len == 1), plan
        short = kernel.flash.plan.make(kernel.Problem.of_shape(q_len=64, kv_len=64, **gpt_oss), generation)
        assert not (short.keys_minor or short.queries_minor)
    problem = kernel.Problem.of_shape(q_len=1, kv_len=300, **gpt_oss)
    assert kernel.flash.plan.make(problem, config=kernel.AttentionConfig(1, 128, 16 * MIB)).keys_minor
    assert not kernel.flash.plan.make(problem, config=kernel.AttentionConfig(1, 300, 16 * MIB)).keys_minor
    prefill = kernel.Problem.of_shape(q_len=300, kv_len=300, **gpt_oss)
    assert kernel.flash.plan.make(prefill, config=kernel.AttentionConfig(128, 128, 16 * MIB)).queries_minor
    assert not kernel.flash.plan.make(prefill, config=kernel.AttentionConfig(300, 128, 16 * MIB)).queries_minor
    qwen3 = kernel.Problem.of_shape(kv_len=4096, **QWEN3_DECODE)
    assert not kernel.flash.plan.make(qwen3, "v6e").keys_minor
    qwen3_prefill = kernel.Problem.of_shape(**dict(QWEN3_DECODE, q_len=4096), kv_len=4096)
    assert not kernel.flash.plan.make(qwen3_prefill, "v6e").queries_minor


def test_check_config(kernel):
    kernel.flash.tiles.check_config(kernel.AttentionConfig(128, 128, 16 * MIB), q_len=300, kv_len=1000, kv_heads=2)
    kernel.flash.tiles.check_config(kernel.AttentionConfig(300, 1000, 16 * MIB), q_len=300, kv_len=1000, kv_heads=2)
    for bad, match in [
        # Query blocks hold the log-sum-exp rows with positions along lanes: multiples of 128.
        (kernel.AttentionConfig(64, 128, 16 * MIB), "block_q must be a multiple of 128"),
        (kernel.AttentionConfig(128, 100, 16 * MIB), "block_kv must be a multiple of 128"),
        (kernel.AttentionConfig(128, 128, 16 * MIB, kv_heads_per_step=3), "kv_heads_per_step must divide"),
        (kernel.AttentionConfig(128, 128, 16 * MIB, kv_heads_per_step=0), "kv_heads_per_step must divide"),
    ]:
        with pytest.raises(ValueError, match=match):
            kernel.flash.tiles.check_config(bad, q_len=300, kv_len=1000, kv_heads=2)
    # Decode ignores block_q (the rows of a step are query heads).
    kernel.flash.tiles.check_config(kernel.AttentionConfig(12, 128, 16 * MIB), q_len=1, kv_len=1000, kv_heads=2)


def test_tuned_tiles_override_the_heuristic_and_are_checked(kernel, monkeypatch):
    shape = dict(kv_len=4096, mask_dtype=None, **QWEN3_DECODE)
    key = kernel.flash.tiles.TunedKey("v6e", 32, 4, 1, 4096, 128, "bfloat16", None)
    assert kernel.flash.tiles.tuned_config(**shape, generation="v6e") is None
    monkeypatch.setitem(kernel.flash.tiles.TUNED_TILES, key,
                        kernel.flash.tiles.ForwardTiles(block_q=1, block_kv=2048, kv_heads_per_step=2))
    # The tiles are the table's; the VMEM limit follows from them.
    working_set = kernel.flash.tiles.vmem_bytes(decode=True, group=8, block_q=1, block_kv=2048, kv_heads_per_step=2,
                                                head_dim=128, itemsize=2, mask_itemsize=0)
    tuned = kernel.AttentionConfig(1, 2048, kernel.vmem_limit(working_set, "v6e"), kv_heads_per_step=2)
    assert kernel.flash.tiles.select(kernel.Problem.of_shape(**shape), "v6e") == tuned
    assert kernel.flash.tiles.select(kernel.Problem.of_shape(**shape), "v5e") != tuned
    monkeypatch.setitem(kernel.flash.tiles.TUNED_TILES, key, kernel.flash.tiles.ForwardTiles(1, 2048,
                                                                                             kv_heads_per_step=3))
    with pytest.raises(ValueError, match="kv_heads_per_step"):
        kernel.flash.tiles.select(kernel.Problem.of_shape(**shape), "v6e")


def test_select_uses_the_current_generation_and_refuses_unknown_ones(kernel, monkeypatch):
    shape = dict(q_heads=8, kv_heads=1, q_len=8192, kv_len=8192, head_dim=128, dtype=jnp.bfloat16)
    v5e, v6e = (kernel.flash.tiles.select(kernel.Problem.of_shape(**shape), g) for g in ("v5e", "v6e"))
    assert v5e != v6e
    assert kernel.flash.tiles.select(kernel.Problem.of_shape(**shape)) == v6e  # off TPU: v6e's tiles
    monkeypatch.setenv("TPU_KERNELS_GENERATION", "v5e")
    assert kernel.flash.tiles.select(kernel.Problem.of_shape(**shape)) == v5e
    with pytest.raises(ValueError, match=r"generation must be one of \('v5e', 'v5p', 'v6e', 'tpu7x'\), got 'v2'"):
        kernel.flash.tiles.select(kernel.Problem.of_shape(**shape), "v2")


TRAINING_SHAPES = {
    "qwen3-30b-a3b": dict(q_heads=32, kv_heads=4, head_dim=128),
    "gemma-4 sliding": dict(q_heads=16, kv_heads=8, head_dim=256),
    "gpt-oss": dict(q_heads=64, kv_heads=8, head_dim=64),
    "gemma-4 global": dict(q_heads=16, kv_heads=2, head_dim=512),
}


@pytest.mark.parametrize("model", list(TRAINING_SHAPES))
def test_backward_tiles_fit_the_budget(kernel, model):
    shape = TRAINING_SHAPES[model]
    for generation in ("v5e", "v5p", "v6e", "tpu7x"):
        for dtype, mask_dtype in ((jnp.bfloat16, None), (jnp.bfloat16, jnp.int8), (jnp.float32, jnp.float32)):
            problem = kernel.Problem.of_shape(q_len=8192, kv_len=8192, dtype=dtype, mask_dtype=mask_dtype, **shape)
            chosen = kernel.flash_backward.tiles.select(problem, generation)
            kernel.flash_backward.tiles.check_backward_config(chosen, q_len=8192, kv_len=8192,
                                                              kv_heads=shape["kv_heads"])
            for kernel_name, tiles in (("dq", chosen.dq), ("dkv", chosen.dkv)):
                step = dict(group=shape["q_heads"] // shape["kv_heads"], block_q=tiles.block_q,
                            block_kv=tiles.block_kv, head_dim=shape["head_dim"])
                sequence_minor = kernel.flash_backward.tiles.reads_sequence_minor(
                    q_len=8192, kv_len=8192, head_dim=shape["head_dim"], block_q=tiles.block_q,
                    block_kv=tiles.block_kv)
                assert sequence_minor == (shape["head_dim"] == 64), (generation, kernel_name, tiles)

                def working_set(heads):
                    return kernel.flash_backward.tiles.backward_vmem_bytes(
                        kernel=kernel_name, kv_heads_per_step=heads, itemsize=jnp.dtype(dtype).itemsize,
                        mask_itemsize=0 if mask_dtype is None else jnp.dtype(mask_dtype).itemsize,
                        sequence_minor=sequence_minor, **step,
                    )

                heads = tiles.kv_heads_per_step
                assert working_set(heads) <= kernel.vmem_budget(generation), (generation, kernel_name, tiles)
                assert tiles.vmem_limit_bytes == kernel.vmem_limit(working_set(heads), generation)
                # Enough KV heads per step that the step outweighs its overhead, or as many as fit.
                seconds = kernel.flash_backward.tiles.backward_step_seconds(kernel_name, kv_heads_per_step=heads,
                                                                            generation=generation, **step)
                more = [h for h in range(heads + 1, shape["kv_heads"] + 1) if shape["kv_heads"] % h == 0]
                assert (seconds >= kernel.flash_backward.tiles.STEP_OVERHEAD_MULTIPLE * 0.35e-6 or not more
                        or working_set(more[0]) > kernel.vmem_budget(generation)), (generation, kernel_name, tiles)
    qwen3 = kernel.Problem.of_shape(q_len=8192, kv_len=8192, dtype=jnp.bfloat16, **TRAINING_SHAPES["qwen3-30b-a3b"])
    plain = kernel.flash_backward.tiles.select(qwen3, "v6e")
    preferred = kernel.flash_backward.tiles.PREFERRED_BACKWARD_TILES["v6e"]
    assert (plain.dq.block_q, plain.dq.block_kv) == preferred["dq"]
    assert (plain.dkv.block_q, plain.dkv.block_kv) == preferred["dkv"]


def test_backward_tiles_shrink_for_short_windows(kernel):
    """GPT-OSS's window of 128: blocks past a few windows would mostly compute masked pairs."""
    gpt_oss = dict(q_heads=64, kv_heads=8, q_len=8192, kv_len=8192, head_dim=64, dtype=jnp.bfloat16)
    for generation in ("v5e", "v5p", "v6e", "tpu7x"):
        chosen = kernel.flash_backward.tiles.select(kernel.Problem.of_shape(sliding_window=128, **gpt_oss), generation)
        cap = kernel.flash_backward.tiles.WINDOW_BLOCK_FACTOR[generation] * 128
        assert max(chosen.dq.block_q, chosen.dq.block_kv, chosen.dkv.block_q, chosen.dkv.block_kv) <= cap
        # Non-causal windows see keys on both sides without bound: no cap.
        without_window = kernel.flash_backward.tiles.select(kernel.Problem.of_shape(**gpt_oss), generation)
        both_sides = kernel.Problem.of_shape(sliding_window=128, causal=False, **gpt_oss)
        assert kernel.flash_backward.tiles.select(both_sides, generation) == without_window


def test_backward_tiles_of_short_sequences_are_whole(kernel):
    problem = kernel.Problem.of_shape(q_heads=4, kv_heads=2, q_len=45, kv_len=300, head_dim=64, dtype=jnp.float32)
    chosen = kernel.flash_backward.tiles.select(problem, "v5e")
    assert (chosen.dq.block_q, chosen.dkv.block_q) == (45, 45)
    assert chosen.dq.block_kv in (300, 256) and chosen.dkv.block_kv in (300, 256)


def test_check_backward_config(kernel):
    good = kernel.AttentionConfig(128, 256, 16 * MIB, kv_heads_per_step=2)
    kernel.flash_backward.tiles.check_backward_config(kernel.flash_backward.tiles.BackwardConfig(dq=good, dkv=good),
                                                      q_len=300, kv_len=1000, kv_heads=4)
    for bad, match in [
        (kernel.flash_backward.tiles.BackwardConfig(dq=kernel.AttentionConfig(100, 256, MIB), dkv=good),
         "dq.block_q must be a multiple"),
        (kernel.flash_backward.tiles.BackwardConfig(dq=good, dkv=kernel.AttentionConfig(128, 200, MIB)),
         "dkv.block_kv must be a multiple"),
        (kernel.flash_backward.tiles.BackwardConfig(dq=good, dkv=kernel.AttentionConfig(128, 256, MIB, 3)),
         "dkv.kv_heads_per_step must divide"),
    ]:
        with pytest.raises(ValueError, match=match):
            kernel.flash_backward.tiles.check_backward_config(bad, q_len=300, kv_len=1000, kv_heads=4)
