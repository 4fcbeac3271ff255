"""The kernel repos' committed records of ahead-of-time compiles (tpu_kernels.aot_record): what they cover, and
that a stale, foreign or forged record makes the tests compile."""

import json

import pytest

from tpu_kernels import aot, disk_cache
from tpu_kernels.aot import compile_kernel
from tpu_kernels.aot_record import EMPTY, AotRecord, shapes_text

from .conftest import REPO_ROOT
from .test_aot import _fake_kernel

pytestmark = pytest.mark.aot


@pytest.fixture
def compiled(monkeypatch):
    """The lowered programs compiled from here on, in order."""
    programs = []
    compile_program = aot._compile_program
    monkeypatch.setattr(aot, "_compile_program", lambda lowered: programs.append(lowered) or compile_program(lowered))
    return programs


def _recorded(kernel, generations=("v5e",)):
    results = compile_kernel(kernel, "fake", list(generations), cache_dir=None)
    return EMPTY.updated(aot.compile_fingerprint(kernel), results), results


def test_a_record_covers_its_compiles_but_one_which_is_compiled_again(tmp_path, compiled):
    kernel = _fake_kernel(tmp_path, "1" * 8, oversized=False)
    record, first = _recorded(kernel)
    path = tmp_path / "aot_record.json"
    record.write(path)
    assert AotRecord.read(path) == record
    del compiled[:]
    second = compile_kernel(kernel, "fake", ["v5e"], cache_dir=None, record=AotRecord.read(path))
    assert [(r.label, r.compiled, r.flops) for r in second] == [(r.label, r.compiled, r.flops) for r in first]
    # "small" and "small again" share their one kernel: whichever is spot-checked compiles it, once.
    (checked,) = [r for r in second if r.spot_check]
    assert not checked.recorded and len(compiled) == 1
    assert all(r.recorded for r in second if r.compiled and not r.spot_check)
    # A target the record does not list ("no kernel" failed, a failure is never recorded) is still tried.
    assert not {r.label: r for r in second}["no kernel"].compiled


def test_a_failure_is_never_recorded():
    passed = aot.CompileResult("fake", "small", "v5e", True, 1.0, 2.0, None, shapes="8x128 float32")
    failed = aot.CompileResult("fake", "too big", "v5e", False, 1.0, None, "vmem", shapes="16384x8192 float32")
    fingerprint = {"kernel": "1" * 64}
    assert EMPTY.updated(fingerprint, [passed, failed]).compiled == {"v5e": {"small": {"shapes": "8x128 float32",
                                                                                      "flops": 2.0}}}


def _all_compiled_again(kernel, record):
    results = compile_kernel(kernel, "fake", ["v5e"], cache_dir=None, record=record)
    return not any(r.recorded for r in results) and [r.label for r in results if r.compiled] == ["small",
                                                                                                 "small again"]


def test_a_record_of_other_sources_or_compilers_covers_nothing(tmp_path, monkeypatch, compiled):
    record, _ = _recorded(_fake_kernel(tmp_path, "3" * 8, oversized=False))
    # The kernel changed (its variant's content digest): every target compiles.
    assert _all_compiled_again(_fake_kernel(tmp_path, "4" * 8, oversized=False), record)
    # The same kernel under another jax, jaxlib or libtpu: every target compiles.
    kernel = _fake_kernel(tmp_path, "5" * 8, oversized=False)
    record, _ = _recorded(kernel)
    versions = disk_cache.library_versions()
    monkeypatch.setattr(aot, "library_versions", lambda: versions.replace("jaxlib=", "jaxlib=0.0.1+"))
    assert _all_compiled_again(kernel, record)


def test_a_record_for_another_generation_or_shape_covers_nothing(tmp_path, compiled):
    kernel = _fake_kernel(tmp_path, "7" * 8, oversized=False)
    record, _ = _recorded(kernel)
    assert not any(r.recorded for r in compile_kernel(kernel, "fake", ["v6e"], cache_dir=None, record=record))
    resized = {label: {**entry, "shapes": "16x128 float32"} for label, entry in record.compiled["v5e"].items()}
    assert _all_compiled_again(kernel, AotRecord(record.fingerprint, {"v5e": resized}))


def test_a_forged_record_makes_every_target_compile(tmp_path, compiled):
    """A record claiming what the compiler does not reproduce (here: flops it never reported, and a compile of
    the oversized block that fails) is dropped: every target compiles, and the failure is reported."""
    kernel = _fake_kernel(tmp_path, "6" * 8)
    claims = {label: {"shapes": shapes_text(avals), "flops": 1e12}
              for label, _, avals in aot.load_compile_targets(kernel).compile_targets("v5e") if label != "no kernel"}
    forged = AotRecord(aot.compile_fingerprint(kernel), {"v5e": claims})
    results = {r.label: r for r in compile_kernel(kernel, "fake", ["v5e"], cache_dir=None, record=forged)}
    assert not any(r.recorded for r in results.values())
    assert not results["too big"].compiled and results["small"].compiled


def test_a_record_that_is_not_one_covers_nothing(tmp_path):
    path = tmp_path / "aot_record.json"
    assert AotRecord.read(path) is None
    for text in ("{", "[]", json.dumps({"fingerprint": {}}), json.dumps({"fingerprint": {}, "compiled": []})):
        path.write_text(text)
        assert AotRecord.read(path) is None


def test_check_writes_the_record_the_tests_read(tmp_path, monkeypatch):
    """`tpu-kernels check --record` on a copy of rmsnorm-tpu: the record covers each v5e target it compiled."""
    import shutil

    from tpu_kernels.cli import main

    repo = tmp_path / "rmsnorm-tpu"
    shutil.copytree(REPO_ROOT / "kernel_repos" / "rmsnorm-tpu", repo, ignore=shutil.ignore_patterns("aot_record.json"))
    assert main(["check", str(repo), "--skip-tests", "--tpu", "v5e", "--no-cache", "--record",
                 "--out", str(tmp_path / "build")]) == 0
    record = AotRecord.read(repo / "aot_record.json")
    assert list(record.compiled) == ["v5e"] and record.compiled["v5e"]
    from tpu_kernels.distribution.loader import get_local_kernel

    module = get_local_kernel(tmp_path / "build" / "rmsnorm-tpu", backend="cpu")
    results = compile_kernel(module, "rmsnorm-tpu", ["v5e"], cache_dir=None, record=record)
    assert sum(r.spot_check for r in results) == 1 and all(r.recorded or r.spot_check for r in results)
