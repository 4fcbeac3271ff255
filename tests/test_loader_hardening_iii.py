"""The loader's part of the third hardening round: a build whose metadata names another backend than its variant,
the private copies a killed process leaves behind, and refused bytes that must not stay in the cache."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest

from tpu_kernels.distribution.digest import KernelIntegrityError
from tpu_kernels.distribution.loader import get_local_kernel, private_copies
from tpu_kernels.distribution.publish import KernelBuild

from .conftest import REPO_ROOT
from .loader_support import FAST_SUBPROCESS_ENV, make_build


def _relabel(build, variant: str, backend: str) -> None:
    path = build / "build" / variant / "metadata.json"
    metadata = json.loads(path.read_text())
    metadata["backend"] = {"type": backend}
    path.write_text(json.dumps(metadata))  # metadata.json is outside its own digest: the digest still holds


@pytest.mark.parametrize("backend", ["cuda", "tpu"])
def test_a_cpu_variant_whose_metadata_names_another_backend_is_refused(tmp_path, backend):
    build = make_build(tmp_path, answer=5)
    _relabel(build, "torch-cpu", backend)
    with pytest.raises(KernelIntegrityError, match=f"says backend '{backend}', not 'cpu'"):
        KernelBuild.open(build)
    with pytest.raises(KernelIntegrityError, match=f"says backend '{backend}', not 'cpu'"):
        get_local_kernel(build, backend="cpu")


@pytest.mark.multiprocess
def test_the_copies_of_a_killed_process_are_removed_by_the_next_load(tmp_path, private_temp):
    build = make_build(tmp_path, answer=5)
    killed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(f"""
            import os, signal
            from tpu_kernels.distribution.loader import get_local_kernel
            assert get_local_kernel({str(build)!r}, backend="cpu").answer() == 5
            os.kill(os.getpid(), signal.SIGKILL)  # no exit handler runs
        """)],
        env={**os.environ, "TMPDIR": str(private_temp), **FAST_SUBPROCESS_ENV}, cwd=REPO_ROOT, timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL
    (abandoned,) = private_temp.glob("tpu-kernels-verified-*")
    live = private_temp / "tpu-kernels-verified-live"
    live.mkdir(mode=0o700)
    with open(live / ".owner.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a process that still runs holds its lock

        assert get_local_kernel(build, backend="cpu").answer() == 5
        assert not abandoned.exists() and live.exists()


def test_a_later_private_root_keeps_the_earlier_one_locked(tmp_path, private_temp, monkeypatch):
    """Copies made before a change of TMPDIR stay in use: their root must stay locked, or the next process's
    clean-up would delete it under this one."""
    build = make_build(tmp_path, answer=5)
    assert get_local_kernel(build, backend="cpu").answer() == 5
    (first,) = private_temp.glob("tpu-kernels-verified-*")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(elsewhere))
    monkeypatch.setattr(private_copies, "_private_root", None)
    get_local_kernel(make_build(tmp_path, answer=6), backend="cpu")
    with open(first / ".owner.lock") as lock, pytest.raises(BlockingIOError):
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    private_copies._remove_abandoned_roots(private_temp, keep=None)
    assert first.exists()
