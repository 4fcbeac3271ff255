"""Unit tests of config.py (tile selection) of the built variant: no kernel runs here."""

import importlib
import itertools

import jax.numpy as jnp
import pytest

MIB = 1 << 20


@pytest.fixture
def config(kernel):
    return kernel.config


def test_vmem_bytes_counts_double_buffered_padded_blocks_and_the_accumulator(config):
    tiles = config.TileConfig(64, 128, 256)
    # lhs, rhs and out double-buffered in bf16, the f32 accumulator once.
    expected = 2 * 64 * 128 * 2 + 2 * 128 * 256 * 2 + 2 * 64 * 256 * 2 + 64 * 256 * 4
    assert config.vmem_bytes(tiles, 100, 300, 512, jnp.bfloat16) == expected
    # Three group slots: three double-buffered rhs blocks.
    slots = config.TileConfig(64, 128, 256, groups_per_step=3)
    assert config.vmem_bytes(slots, 64, 300, 512, jnp.bfloat16) - expected == 2 * 2 * 128 * 256 * 2
    # An lhs block that is the whole array is single-buffered; 7 bf16 rows pad to 16.
    resident = config.TileConfig(7, 300, 128)
    padded_lhs = 16 * 384 * 2
    assert config.vmem_bytes(resident, 7, 300, 128, jnp.bfloat16) == (
        padded_lhs + 2 * 304 * 128 * 2 + 2 * 16 * 128 * 2 + 16 * 128 * 4
    )


def test_vmem_limit_adds_mosaic_scratch_within_bounds(config):
    small = config.TileConfig(8, 128, 128)
    assert config.vmem_limit(small, 8, 128, 128, jnp.float32) == 16 * MIB
    large = config.TileConfig(1024, 2048, 2048, chunk_m=128)
    needed = config.vmem_bytes(large, 1024, 2048, 2048, jnp.bfloat16)
    assert needed > 12 * MIB
    assert config.vmem_limit(large, 1024, 2048, 2048, jnp.bfloat16) == needed + 4 * MIB


def test_check_config_accepts_valid_tiles(config):
    config.check_config(config.TileConfig(32, 128, 128, chunk_m=16, groups_per_step=1), 100, 300, 200, jnp.bfloat16)
    config.check_config(config.TileConfig(40, 200, 160, groups_per_step=4), 40, 200, 160, jnp.float32)


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
        ((256, 128, 128, 8, 2), 256, 128, 128, jnp.float32, "more than 16 unrolled matmuls"),
        ((2048, 2048, 1024, 128), 4096, 2048, 1024, jnp.bfloat16, "Gi multiply-adds"),
        ((16, 8192, 8192), 1024, 8192, 8192, jnp.float32, "MiB of VMEM"),
    ],
)
def test_check_config_refuses_what_cannot_run(config, tiles, m, k, n, dtype, match):
    with pytest.raises(ValueError, match=match):
        config.check_config(config.TileConfig(*tiles), m, k, n, dtype)


def test_check_config_refuses_other_types(config):
    with pytest.raises(TypeError, match="must be a TileConfig"):
        config.check_config((32, 128, 128), 64, 128, 128, jnp.float32)


def test_resolve_makes_a_table_entry_concrete(config):
    entry = dict(tile_m="m", tile_k=2048, tile_n=1536, chunk_m=32, groups_per_step=3)
    assert config.resolve(entry, 75, 2048, 1536, jnp.bfloat16) == config.TileConfig(75, 2048, 1536, 32, 3)
    # Fewer rows than group slots: one slot.
    assert config.resolve(entry, 2, 2048, 1536, jnp.bfloat16).groups_per_step == 1
    # Chunks grow (to a sublane multiple) until slots x chunks stays within 16 matmuls; tiles cap at K and N.
    assert config.resolve(entry, 1000, 1024, 1024, jnp.bfloat16) == config.TileConfig(1000, 1024, 1024, 208, 3)
    # A chunk as large as the tile is no chunking; a fixed row tile below M drops the group slots.
    tiled = dict(tile_m=512, tile_k=2048, tile_n=1536, chunk_m=512, groups_per_step=2)
    assert config.resolve(tiled, 4096, 2048, 1536, jnp.bfloat16) == config.TileConfig(512, 2048, 1536, None, 1)


def test_tuned_config_takes_the_nearest_table_entry(config):
    # Qwen3-30B-A3B EP8 gate_up on v6e: the table's m=75 entry (16 groups) is nearest to m=80.
    tuned = config.tuned_config(80, 2048, 1536, jnp.bfloat16, "v6e", num_groups=16)
    assert tuned == config.TileConfig(80, 2048, 1536, 32, 3)
    # The nearest bucket in (log m, log groups): 128 groups pulls toward the 128-group entries.
    assert config.tuned_config(80, 2048, 1536, jnp.bfloat16, "v6e", num_groups=128).groups_per_step == 4
    assert config.tuned_config(80, 2048, 1000, jnp.bfloat16, "v6e") is None  # no entry for this N
    assert config.tuned_config(80, 2048, 1536, jnp.float32, "v6e") is None  # the table is bf16


def test_tuned_config_drops_an_entry_that_does_not_fit(config, monkeypatch):
    entry = dict(k=4096, n=8192, dtype="float32", m=1024, groups=8, tile_m="m", tile_k=4096, tile_n=8192,
                 chunk_m=128, groups_per_step=1)
    tile_table = importlib.import_module(f"{config.__package__}.tile_table")
    monkeypatch.setattr(tile_table, "TABLE", {"v6e": [entry]})
    assert config._table_entry(1024, 4096, 8192, 8, jnp.float32, "v6e") == entry
    assert config.tuned_config(1024, 4096, 8192, jnp.float32, "v6e", num_groups=8) is None


def test_ridge_rows_is_peak_flops_over_hbm_bandwidth(config):
    assert config.ridge_rows("v5e") == 240
    assert config.ridge_rows("v6e") == 560


def test_heuristic_keeps_decode_rows_resident_and_tiles_prefill(config):
    # Few rows per group (decode): one resident row tile in 128-row chunks.
    assert config.heuristic_config(512, 2048, 1536, jnp.bfloat16, "v6e", num_groups=128) == config.TileConfig(
        512, 2048, 1536, 128
    )
    # Many rows per group: 512-row tiles on v6e, 256 on v5e, in 128-row chunks.
    assert config.heuristic_config(65536, 2048, 1536, jnp.bfloat16, "v6e", num_groups=16).tile_m == 512
    assert config.heuristic_config(65536, 2048, 1536, jnp.bfloat16, "v5e", num_groups=16).tile_m == 256
    # Weights blocks stay within the generation's block budget (8 MiB on v5e): N is halved first.
    big = config.heuristic_config(64, 4096, 8192, jnp.bfloat16, "v5e", num_groups=8)
    assert big.tile_k * big.tile_n * 2 <= config.HEURISTIC_RHS_BLOCK_BYTES["v5e"]
    assert (big.tile_k, big.tile_n) == (4096, 1024)


def test_heuristic_always_fits(config):
    for generation, dtype, (m, k, n) in itertools.product(
        ("v5e", "v6e"),
        (jnp.bfloat16, jnp.float32),
        itertools.product((1, 7, 300, 5000), (96, 2048, 7168, 16384), (200, 2816, 16384)),
    ):
        tiles = config.heuristic_config(m, k, n, dtype, generation, num_groups=8)
        config.check_config(tiles, m, k, n, dtype)


def test_select_config_prefers_the_table_and_falls_back_to_the_heuristic(config):
    tuned = config.select_config(80, 2048, 1536, jnp.bfloat16, generation="v6e", num_groups=16)
    assert tuned == config.tuned_config(80, 2048, 1536, jnp.bfloat16, "v6e", num_groups=16)
    untuned = config.select_config(80, 1000, 1000, jnp.bfloat16, generation="v5e", num_groups=16)
    assert untuned == config.heuristic_config(80, 1000, 1000, jnp.bfloat16, "v5e", num_groups=16)


def test_select_config_uses_the_current_generation_and_refuses_unknown_ones(config, monkeypatch):
    # Off TPU the kernels tile as for v6e; TPU_KERNELS_GENERATION picks another supported one.
    shape = (65536, 1000, 1000, jnp.bfloat16)
    v6e = config.select_config(*shape, generation="v6e", num_groups=16)
    v5e = config.select_config(*shape, generation="v5e", num_groups=16)
    assert (v5e.tile_m, v6e.tile_m) == (256, 512)
    assert config.select_config(*shape, num_groups=16) == v6e
    monkeypatch.setenv("TPU_KERNELS_GENERATION", "v5e")
    assert config.select_config(*shape, num_groups=16) == v5e
    with pytest.raises(ValueError, match=r"generation must be one of \('v5e', 'v6e'\), got 'v5p'"):
        config.select_config(80, 2048, 1536, jnp.bfloat16, generation="v5p")
    with pytest.raises(ValueError, match="generation must be one of"):
        config.heuristic_config(80, 2048, 1536, jnp.bfloat16, "v4")
