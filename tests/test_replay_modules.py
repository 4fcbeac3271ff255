"""Cached grid replays are keyed by the source of `perf.REPLAY_MODULES`: the list must hold every module the replay runs."""

import ast
import importlib
import inspect

from benchmarks import perf
from benchmarks.perf import program_replay


def _perf_modules_imported_by(module) -> set[str]:
    """Modules of benchmarks.perf that `module` imports at its top level."""
    found = set()
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [alias.name for alias in node.names]
            found.update(f"benchmarks.perf.{name}" for name in names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks.perf."):
            found.add(node.module)
    return found


def test_replay_modules_hold_everything_the_replay_imports_within_perf():
    listed = {module.__name__ for module in perf.REPLAY_MODULES}
    assert program_replay.__name__ in listed
    reached, frontier = set(), [program_replay.__name__]
    while frontier:
        name = frontier.pop()
        if name in reached:
            continue
        reached.add(name)
        frontier.extend(_perf_modules_imported_by(importlib.import_module(name)))
    # chip holds the fitted constants, read when a replay is priced, never while it runs.
    assert reached - {"benchmarks.perf.chip"} <= listed, reached - listed


def test_the_cache_key_of_a_replay_changes_with_the_replay_source(tmp_path, monkeypatch):
    from tpu_kernels import disk_cache
    from benchmarks.perf import calibration

    before = calibration.AnalysisCache(tmp_path).replay_code
    source_of = inspect.getsource
    edited = perf.REPLAY_MODULES[-1]
    monkeypatch.setattr(disk_cache.inspect, "getsource", lambda obj: source_of(obj) + ("#" if obj is edited else ""))
    assert calibration.AnalysisCache(tmp_path).replay_code != before
