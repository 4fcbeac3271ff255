"""`tpu-kernels doctor --device cpu`: each kernel in interpret mode, eager and compiled, checked and counted; the
TorchTPU mode that needs a chip named as skipped."""

import json
import types

from tpu_kernels import cli
from tpu_kernels.integration import doctor


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


def test_torch_tpus_cache_statistics_are_read_by_their_numeric_fields():
    stats = types.SimpleNamespace(num_cache_hits=5, num_cache_misses=2, name="x", enabled=True)
    assert doctor._numbers(stats) == {"num_cache_hits": 5, "num_cache_misses": 2}
    assert doctor._numbers({"misses": 3, "label": "y"}) == {"misses": 3}
    assert doctor._changes({"misses": 3, "hits": 4}, {"misses": 5, "hits": 9}) == {"misses": 2, "hits": 5}
    # A second pass that hits the cache is fine; one that misses it, or compiles, is not.
    assert not doctor.recompiled({"num_cache_hits": 3, "num_cache_misses": 0, "jax_compiles": 2, "op_program": 0})
    assert doctor.recompiled({"num_cache_misses": 1}) and doctor.recompiled({"op_program": 1})
