"""benchmarks/moe_layer.py's on-disk cache: an analysis cached before the model changed is not reused."""

import importlib.util
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_moe_layer():
    spec = importlib.util.spec_from_file_location("moe_layer", ROOT / "benchmarks" / "moe_layer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("moe_layer", module)
    spec.loader.exec_module(module)
    return module


def test_cache_keys_change_when_the_model_code_changes(tmp_path, monkeypatch):
    moe_layer = load_moe_layer()
    for source in moe_layer.MODEL_SOURCES:
        (tmp_path / source).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / source, tmp_path / source)
    monkeypatch.setattr(moe_layer, "ROOT", tmp_path)
    before = moe_layer.Cache(None).key("replay", "the same jaxpr")
    assert moe_layer.Cache(None).key("replay", "the same jaxpr") == before
    with open(tmp_path / "tpu_kernels" / "perf.py", "a") as perf:
        perf.write("\n# a changed model\n")
    assert moe_layer.Cache(None).key("replay", "the same jaxpr") != before
