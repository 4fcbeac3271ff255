"""The on-disk cache of compiles and replays: what it cannot read back is a miss, never an error."""

import pickle
import sys
import types

from tpu_kernels.disk_cache import DiskCache


def test_a_stored_value_comes_back_and_counts_as_a_hit(tmp_path):
    cache = DiskCache(tmp_path)
    assert cache.put("compile-a", {"hlo": "text", "flops": 3.0}) == {"hlo": "text", "flops": 3.0}
    assert cache.get("compile-a") == {"hlo": "text", "flops": 3.0}
    assert cache.get("compile-b") is None
    assert (cache.hits, cache.misses) == (1, 1)


def test_an_entry_of_a_class_that_moved_away_is_a_miss(tmp_path, monkeypatch):
    # An entry written when the class lived in a module this package no longer has.
    module = types.ModuleType("tpu_kernels_moved_away")

    class CompiledText:
        pass

    CompiledText.__module__ = module.__name__
    CompiledText.__qualname__ = "CompiledText"
    module.CompiledText = CompiledText
    monkeypatch.setitem(sys.modules, module.__name__, module)
    (tmp_path / "compile-old.pkl").write_bytes(pickle.dumps(CompiledText()))
    monkeypatch.delitem(sys.modules, module.__name__)

    cache = DiskCache(tmp_path)
    assert cache.get("compile-old") is None
    assert (cache.hits, cache.misses) == (0, 1)


def test_a_truncated_entry_is_a_miss_and_is_replaced(tmp_path):
    (tmp_path / "replay-x.pkl").write_bytes(pickle.dumps(list(range(100)))[:20])
    cache = DiskCache(tmp_path)
    assert cache.get("replay-x") is None
    cache.put("replay-x", [1, 2])
    assert cache.get("replay-x") == [1, 2]


def test_without_a_folder_nothing_is_kept(tmp_path):
    cache = DiskCache(None)
    assert cache.put("k", 1) == 1
    assert cache.get("k") is None


def test_a_cache_is_empty_until_it_holds_an_entry(tmp_path):
    assert DiskCache(None).is_empty()
    cache = DiskCache(tmp_path / "c")
    assert cache.is_empty()
    cache.put("k", 1)
    assert not cache.is_empty()
    assert not DiskCache(tmp_path / "c").is_empty()
