"""moe_layer --tune-ours: the candidates our grouped matmul is searched over, and the table it writes."""

import json

import pytest

from benchmarks.studies.moe_layer import our_tiles
from tpu_kernels.runtime.hardware import resolve_target

V6E = resolve_target("v6e")

from tpu_kernels.runtime.tuning import tuned_tiles


@pytest.fixture
def kernel(ragged_dot_kernel):
    return ragged_dot_kernel


def test_candidates_start_at_the_heuristic_and_all_run(kernel):
    # Qwen3-30B-A3B's gate_up at 2048 tokens on one chip: 16384 picks over 128 experts.
    key = kernel.gmm.tiles.TunedKey("v6e", 16384, 2048, 1536, 128, "bfloat16", "bfloat16", True)
    found = our_tiles.candidates(kernel, key, "v6e")
    problem = kernel.MatmulProblem(key.m, key.k, key.n, key.groups, key.dtype, key.rhs_dtype, key.transpose_rhs)
    heuristic = kernel.gmm.tiles.heuristic_config(problem, V6E)
    assert found[0] == heuristic and len(set(found)) == len(found) > 4
    assert {tiles.tile_m for tiles in found} >= {256, 512, 1024}
    # K whole (the heuristic's) and halved down to 512.
    assert {tiles.tile_k for tiles in found} == {2048, 1024, 512}
    for tiles in found:
        kernel.gmm.tiles.check_config(tiles, problem, V6E)


def test_the_table_is_sorted_data_the_kernel_reads(kernel, tmp_path):
    """A search replaces the entries of the keys it searched (a winner, or none: back to the heuristic) and keeps
    every other."""
    keys = [kernel.gmm.tiles.TunedKey("v6e", 16384, 2048, 1536, 128, "bfloat16", "bfloat16", True),
            kernel.gmm.tiles.TunedKey("v5e", 16384, 768, 2048, 128, "bfloat16", "bfloat16", True),
            kernel.gmm.tiles.TunedKey("v5e", 2048, 768, 2048, 16, "bfloat16", "bfloat16", True)]
    path = tmp_path / our_tiles.TABLE
    path.parent.mkdir(parents=True)
    earlier = [{"key": key._asdict(), "tiles": kernel.gmm.tiles.TileConfig(256, key.k, 256)._asdict()}
               for key in keys[1:]]
    path.write_text(json.dumps({"entries": earlier}))
    entries = [{"key": key._asdict(), "tiles": kernel.gmm.tiles.TileConfig(1024, key.k, 512, 256)._asdict()}
               for key in keys[:2]]
    our_tiles.write_table(tmp_path, entries, [key._asdict() for key in keys[:2]])
    written = json.loads(path.read_text())["entries"]
    assert [entry["key"]["generation"] for entry in written] == ["v5e", "v5e", "v6e"]
    assert tuned_tiles(written, kernel.gmm.tiles.TunedKey, kernel.gmm.tiles.TileConfig) == {
        keys[0]: kernel.gmm.tiles.TileConfig(1024, 2048, 512, 256, 1),
        keys[1]: kernel.gmm.tiles.TileConfig(1024, 768, 512, 256, 1),
        keys[2]: kernel.gmm.tiles.TileConfig(256, 768, 256, None, 1)}
    our_tiles.write_table(tmp_path, [], [keys[2]._asdict()])
    assert [kernel.gmm.tiles.TunedKey(**entry["key"])
            for entry in json.loads(path.read_text())["entries"]] == keys[1::-1]


def test_tuned_as_sets_exactly_the_entries_then_restores_the_shipped_table(kernel):
    shipped = dict(kernel.gmm.tiles.TUNED_TILES)
    key = kernel.gmm.tiles.TunedKey("v6e", 777, 2048, 1536, 5, "bfloat16", "bfloat16", True)
    tiles = kernel.gmm.tiles.TileConfig(256, 2048, 512)
    with our_tiles.tuned_as(kernel, [{"key": key._asdict(), "tiles": tiles._asdict()}]):
        assert kernel.gmm.tiles.TUNED_TILES == {key: kernel.gmm.tiles.TileConfig(256, 2048, 512, None, 1)}
    assert kernel.gmm.tiles.TUNED_TILES == shipped
    with our_tiles.tuned_as(kernel, []):
        assert kernel.gmm.tiles.TUNED_TILES == {}
    assert kernel.gmm.tiles.TUNED_TILES == shipped


def test_the_layer_keeps_only_the_entries_that_make_it_faster(monkeypatch):
    gate_up, down = {"label": "gate_up"}, {"label": "down"}
    # The layer's figure per set of tuned projections: down alone helps; gate_up slows the layer (XLA placed
    # fewer operands in VMEM) although it won standalone.
    layer = {(): 100.0, ("gate_up",): 103.0, ("down",): 96.0, ("gate_up", "down"): 99.0}
    monkeypatch.setattr(our_tiles, "layer_us",
                        lambda built, cache, compiler, case, generation, entries: layer[
                            tuple(e["label"] for e in entries)])
    kept = our_tiles.kept_in_layer(None, None, None, None, "v6e", [gate_up, down])
    assert kept == [{"label": "down", "layer_us": 96.0, "layer_heuristic_us": 100.0}]
    layer[("down",)] = 100.0
    layer[("gate_up", "down")] = 100.5
    assert our_tiles.kept_in_layer(None, None, None, None, "v6e", [gate_up, down]) == []
    assert our_tiles.kept_in_layer(None, None, None, None, "v6e", []) == []
