"""Hardening V (issue 73, AN3): the LOCAL_KERNELS entries kernelize records name this process's private copies,
which go when it exits; a child process must not inherit them (another user could put a folder at that path
once the copies are gone, and the child would import it)."""

import os
import subprocess
import sys
import types

import pytest

from tpu_kernels.distribution.loader import kernels_names

PRINT_ENTRIES = "import os; print(os.environ.get('LOCAL_KERNELS', '<unset>'))"


def record(tmp_path, monkeypatch, users: str | None) -> tuple[str, str]:
    if users is None:
        monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    else:
        monkeypatch.setenv("LOCAL_KERNELS", users)
    variant = tmp_path / "tpu-kernels-verified-x" / "copy" / "build" / "torch-cpu"
    name = kernels_names.served_name(types.ModuleType("_answer_cpu_0123"), "org/answer", "a" * 40, variant)
    return name, f"{name}={variant}"


@pytest.mark.multiprocess
def test_a_child_process_starts_without_this_process_s_entries(tmp_path, monkeypatch):
    for users in (None, "org/theirs=/their/build"):
        name, entry = record(tmp_path, monkeypatch, users)
        assert entry in os.environ["LOCAL_KERNELS"].split(":")  # kernels, in this process, resolves the name
        from kernels._internals.load import _parse_local_kernel_overrides

        assert str(_parse_local_kernel_overrides(os.environ["LOCAL_KERNELS"])[name]) == entry.partition("=")[2]
        child = subprocess.run([sys.executable, "-c", PRINT_ENTRIES], capture_output=True, text=True, timeout=60)
        assert child.stdout.strip() == (users or "<unset>"), child


@pytest.mark.multiprocess
def test_a_forked_child_drops_this_process_s_entries(tmp_path, monkeypatch):
    _, entry = record(tmp_path, monkeypatch, "org/theirs=/their/build")
    reading, writing = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it sees, and leave without running the parent's exit handlers
        os.write(writing, os.environ.get("LOCAL_KERNELS", "<unset>").encode())
        os._exit(0)
    os.close(writing)
    seen = os.read(reading, 1 << 16).decode()
    os.close(reading)
    os.waitpid(pid, 0)
    assert seen == "org/theirs=/their/build"
    assert entry in os.environ["LOCAL_KERNELS"].split(":")
