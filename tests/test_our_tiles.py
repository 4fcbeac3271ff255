"""moe_layer --tune-ours: the candidates our grouped matmul is searched over, and the table it writes."""

import json

from tpu_kernels.bench.moe_layer import our_tiles


def test_candidates_start_at_the_heuristic_and_all_run(ragged_dot_kernel):
    config = ragged_dot_kernel.config
    # Qwen3-30B-A3B's gate_up at 2048 tokens on one chip: 16384 picks over 128 experts.
    key = config.TunedKey("v6e", 16384, 2048, 1536, 128, "bfloat16", "bfloat16", True)
    found = our_tiles.candidates(ragged_dot_kernel, key, "v6e")
    heuristic = config.heuristic_config(key.m, key.k, key.n, key.dtype, "v6e", key.groups, key.rhs_dtype, True)
    assert found[0] == heuristic and len(set(found)) == len(found) > 4
    assert {tiles.tile_m for tiles in found} >= {256, 512, 1024}
    for tiles in found:
        config.check_config(tiles, key.m, key.k, key.n, key.dtype, key.rhs_dtype, True, generation="v6e")


def test_the_table_is_sorted_data_the_kernel_reads(ragged_dot_kernel, tmp_path):
    config = ragged_dot_kernel.config
    keys = [config.TunedKey("v6e", 16384, 2048, 1536, 128, "bfloat16", "bfloat16", True),
            config.TunedKey("v5e", 16384, 768, 2048, 128, "bfloat16", "bfloat16", True)]
    entries = [{"key": key._asdict(), "tiles": [1024, key.k, 512, 256, 1]} for key in keys]
    path = tmp_path / our_tiles.TABLE
    path.parent.mkdir(parents=True)
    our_tiles.write_table(tmp_path, entries)
    written = json.loads(path.read_text())["entries"]
    assert [entry["key"]["generation"] for entry in written] == ["v5e", "v6e"]
    assert {config.TunedKey(**entry["key"]): config.TileConfig(*entry["tiles"]) for entry in written} == {
        key: config.TileConfig(1024, key.k, 512, 256, 1) for key in keys}
