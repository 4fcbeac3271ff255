"""tpu_kernels.perf.fingerprint: the source fingerprint that keys cached grid replays."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_replay_fingerprint_covers_every_module_of_the_perf_package(tmp_path):
    """A replay's code is spread over tpu_kernels.perf's modules: an edit of any of them, a new module or a
    refitted constant changes the fingerprint; the calibrate harness and the collective model do not."""
    import shutil

    from tpu_kernels.perf.fingerprint import model_files, model_source_fingerprint, package_folder

    perf_folder = package_folder()
    assert perf_folder == ROOT / "tpu_kernels" / "perf"
    names = {path.name for path in model_files(perf_folder)}
    assert {"__init__.py", "xla_program.py", "model_constants.json"} <= names
    assert "calibration.py" not in names and "collectives.py" not in names
    copy = tmp_path / "perf"
    shutil.copytree(perf_folder, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert model_source_fingerprint(copy) == model_source_fingerprint()
    seen = {model_source_fingerprint(copy)}
    for change in ("xla_ragged_dot.py", "model_constants.json", "a_new_submodule.py"):
        with (copy / change).open("a") as file:
            file.write("\n")
        seen.add(model_source_fingerprint(copy))
    assert len(seen) == 4
    for ignored in ("calibration.py", "collectives.py"):
        (copy / ignored).write_text("# rewritten\n")
    assert model_source_fingerprint(copy) in seen
