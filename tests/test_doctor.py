"""`tpu-kernels doctor --device cpu`: each kernel in interpret mode, eager and compiled, checked and counted; the
TorchTPU mode that needs a chip named as skipped."""

import json
import os
import subprocess
import sys
import types

import pytest

from tpu_kernels import cli
from tpu_kernels.integration import doctor

from .conftest import REPO_ROOT
from .torch_tpu_modes_probe import CHIPLESS_ENVIRONMENT


def test_doctor_on_the_cpu_checks_every_kernel_and_names_what_it_skipped(kernel_builds, tmp_path, capsys):
    out = tmp_path / "report.json"
    repos = [f"--repo={kind}={kernel_builds[repo]}" for kind, repo in (
        ("experts", "ragged-dot-tpu"), ("rmsnorm", "rmsnorm-tpu"), ("attention", "attention-tpu"))]
    assert cli.main(["doctor", "--device", "cpu", *repos, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["device"] == "cpu" and report["skipped_modes"] == ["deferred_and_fused"]
    assert set(report["kernels"]) == {"ragged_dot", "rms_norm", "flash_attention"}
    assert {"torch", "jax", "transformers"} <= set(report["versions"])
    for name, entry in report["kernels"].items():
        modes = entry["modes"]
        assert modes["deferred_and_fused"] == {"status": "skipped", "reason": doctor.NEEDS_A_TPU}
        for mode in ("strict_eager", "compiled"):
            warm_up, second = modes[mode]["passes"]
            assert modes[mode]["status"] == "ok" and not modes[mode]["second_pass_compiled"], (name, mode)
            assert second["compiled"]["op_program"] == 0 and second["relative_error"] <= doctor.TOLERANCE
        assert modes["strict_eager"]["passes"][0]["compiled"]["op_program"] == 1  # the warm-up compiled the kernel
    assert "flash_attention  strict_eager: ok  deferred_and_fused: skipped  compiled: ok" in capsys.readouterr().out


def test_a_wrong_result_and_a_failing_mode_are_reported_not_raised(kernel_builds, monkeypatch):
    from tpu_kernels.distribution.loader import get_local_kernel

    kernel = get_local_kernel(kernel_builds["rmsnorm-tpu"], backend="cpu")
    wrong = doctor.Case("rmsnorm", "rms_norm", doctor._rms_norm_inputs, lambda k, x, w: k.rms_norm(x, w, 1e-6) * 2,
                        lambda k, x, w: k.reference.rms_norm(x, w, 1e-6), "_rms_norm_op")
    counter = doctor._Counter("cpu")
    monkeypatch.setattr(doctor, "_mode_runner", lambda mode, device, fn: fn if mode == "strict_eager" else (
        (lambda *a: 1 / 0) if mode == "compiled" else None))
    try:
        modes = doctor.run_case(wrong, kernel, "cpu", counter)
    finally:
        counter.close()
    assert modes["strict_eager"]["status"] == "mismatch" and modes["strict_eager"]["passes"][0]["relative_error"] > 0.5
    assert modes["compiled"] == {"status": "error", "error": "ZeroDivisionError: division by zero", "passes": []}


# What torch_tpu 0.2.0's `torch.tpu._get_cache_stats()` returns (a `PerfStats`), its fields as read without a chip
# (tests/doctor_tpu_probe.py reads them from the real object).
PERF_STATS_FIELDS = ("num_cache_hits", "num_cache_reqs", "num_compilations", "peak_compilation_host_memory_bytes")


def _perf_stats(hits, requests, compilations, peak):
    return types.SimpleNamespace(**dict(zip(PERF_STATS_FIELDS, (hits, requests, compilations, peak))), name="x",
                                 enabled=True)


def test_torch_tpus_cache_statistics_are_read_as_counts_misses_and_a_peak():
    assert doctor._numbers(_perf_stats(5, 7, 2, 1000)) == dict(zip(PERF_STATS_FIELDS, (5, 7, 2, 1000)))
    assert doctor._numbers({"num_cache_hits": 3, "label": "y"}) == {"num_cache_hits": 3}
    warm_up = doctor._changes(doctor._numbers(_perf_stats(0, 0, 0, 0)), doctor._numbers(_perf_stats(1, 4, 3, 900)))
    assert warm_up == {"num_cache_hits": 1, "num_cache_reqs": 4, "num_compilations": 3, "num_cache_misses": 3,
                       "peak_compilation_host_memory_bytes": 900} and doctor.recompiled(warm_up)
    # A second pass that only hits the cache compiled nothing, whatever the compile memory's high-water mark says.
    hits_only = doctor._changes(doctor._numbers(_perf_stats(1, 4, 3, 900)), doctor._numbers(_perf_stats(5, 8, 3, 950)))
    assert hits_only["num_cache_misses"] == 0 and hits_only["peak_compilation_host_memory_bytes"] == 950
    assert not doctor.recompiled(hits_only)
    assert doctor.recompiled(doctor._changes({"num_cache_reqs": 4, "num_cache_hits": 1},
                                             {"num_cache_reqs": 5, "num_cache_hits": 1}))  # a miss
    assert doctor.recompiled({"op_program": 1}) and not doctor.recompiled({"jax_compiles": 2, "op_program": 0})


def test_a_second_pass_that_compiled_is_named_in_the_summary(monkeypatch, tmp_path, capsys):
    passes = [{"relative_error": 0.0, "compiled": {}}] * 2
    report = {"ok": True, "kernels": {"rms_norm": {"modes": {
        "strict_eager": {"status": "ok", "passes": passes, "second_pass_compiled": True},
        "compiled": {"status": "ok", "passes": passes, "second_pass_compiled": False}}}}}
    monkeypatch.setattr(doctor, "doctor", lambda device, repos, trust: report)
    assert doctor.doctor_main(["--device", "tpu", "--out", str(tmp_path / "r.json")]) == 0
    assert "strict_eager: ok (compiled again on the second pass)  compiled: ok\n" in capsys.readouterr().out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_tpu_branch_runs_on_torch_tpus_device_up_to_the_chip(kernel_builds):
    """`doctor("tpu")` in a process where torch_tpu registered its device without a chip (tests/doctor_tpu_probe.py):
    the kernels load as their TPU builds, with the direct launch; each mode's runner puts the call in its TorchTPU
    mode (or the "tpu" compile backend); the cache statistics are read from torch_tpu's own object; and every case
    reports the missing chip as an error of each mode, skipping none. What needs the chip is listed in
    docs/binding.md."""
    environment = {**os.environ, **CHIPLESS_ENVIRONMENT, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO_ROOT)}
    builds = [str(kernel_builds[repo]) for repo in ("ragged-dot-tpu", "rmsnorm-tpu", "attention-tpu")]
    done = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "doctor_tpu_probe.py"), *builds],
                          env=environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    probed = json.loads(done.stdout.strip().splitlines()[-1])
    assert probed["modes_set"] == {"strict_eager": "DEFER_NEVER", "deferred_and_fused": "DEFER_AND_FUSE"}
    assert probed["compile_options"] == {"backend": "tpu", "dynamic": False, "fullgraph": True}
    assert sorted(probed["stats"]) == sorted(PERF_STATS_FIELDS)
    report = probed["report"]
    assert report["device"] == "tpu" and report["chip"] and report["skipped_modes"] == [] and not report["ok"]
    assert set(report["kernels"]) == {"ragged_dot", "rms_norm", "flash_attention"}
    for entry in report["kernels"].values():
        assert entry["module"].startswith("_") and "_tpu_" in entry["module"] and entry["direct_launch"]
        assert set(entry["modes"]) == set(doctor.MODES)
        for result in entry["modes"].values():
            assert result["status"] == "error" and "PjRt client" in result["error"], result
