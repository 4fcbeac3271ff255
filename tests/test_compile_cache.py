"""Compiled programs kept for the next process (tpu_kernels.compile_cache): where, what is kept, what is not."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from tpu_kernels.compile_cache import JAX_FOLDER, TORCH_TPU_CACHE_ENV, TORCH_TPU_FOLDER, keep_compiled_programs
from tpu_kernels.disk_cache import UnsafeCacheError

PROBE = Path(__file__).with_name("compile_cache_probe.py")
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def jax_cache_settings():
    """jax's cache settings restored after the test (nothing compiles meanwhile, so jax never opens the folder)."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_compilation_cache_max_size")
    saved = {name: getattr(jax.config, name) for name in names}
    yield
    for name, value in saved.items():
        jax.config.update(name, value)


@pytest.fixture
def private_xdg(tmp_path, monkeypatch):
    root = tmp_path / "xdg"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_CACHE_HOME", str(root))
    monkeypatch.delenv(TORCH_TPU_CACHE_ENV, raising=False)
    return root


def test_both_caches_kept_in_private_folders_below_the_cache_root(private_xdg, jax_cache_settings, monkeypatch):
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    jax.config.update("jax_compilation_cache_dir", None)
    caches = keep_compiled_programs()
    jax_folder = private_xdg / "tpu-kernels" / JAX_FOLDER
    torch_tpu_folder = private_xdg / "tpu-kernels" / TORCH_TPU_FOLDER
    assert (caches.jax, caches.torch_tpu, caches.chosen_here) == (
        str(jax_folder), str(torch_tpu_folder), ("jax", "torch_tpu"))
    assert jax.config.jax_compilation_cache_dir == str(jax_folder)
    assert os.environ[TORCH_TPU_CACHE_ENV] == str(torch_tpu_folder)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    assert {oct(p.stat().st_mode & 0o777) for p in (jax_folder, torch_tpu_folder)} == {"0o700"}


def test_folders_the_user_chose_are_left_alone(private_xdg, tmp_path, jax_cache_settings, monkeypatch):
    monkeypatch.setenv(TORCH_TPU_CACHE_ENV, str(tmp_path / "theirs-torch-tpu"))
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs-jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.5)
    caches = keep_compiled_programs()
    assert (caches.jax, caches.torch_tpu, caches.chosen_here) == (
        str(tmp_path / "theirs-jax"), str(tmp_path / "theirs-torch-tpu"), ())
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 2.5
    assert not (private_xdg / "tpu-kernels").exists()


def test_a_cache_root_others_can_write_is_refused(tmp_path, jax_cache_settings, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared))
    jax.config.update("jax_compilation_cache_dir", None)
    with pytest.raises(UnsafeCacheError, match="other users"):
        keep_compiled_programs()
    assert jax.config.jax_compilation_cache_dir is None


def _probe(xdg: Path) -> dict:
    env = {**os.environ, "XDG_CACHE_HOME": str(xdg), "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO_ROOT)}
    env.pop(TORCH_TPU_CACHE_ENV, None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    done = subprocess.run([sys.executable, str(PROBE)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.aot
@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_second_process_compiles_only_what_jax_cannot_keep(private_xdg):
    """Two processes, one cache. The CPU path: every program without host callbacks is read back by the second
    process; the Pallas kernel in interpret mode (host callbacks) is the one program compiled again. AOT for v6e:
    the second process finds the first one's entry (the same key) but cannot load it without a real TPU client,
    and compiles again (why precompiling on a machine without a TPU warms nothing)."""
    first, second = _probe(private_xdg), _probe(private_xdg)
    cpu, cpu_again = first["cpu"], second["cpu"]
    assert cpu["cache hits"] == 0 and cpu["cache writes"] == cpu["backend compiles"] - 1 > 0, cpu
    assert cpu_again["cache hits"] == cpu["cache writes"] and cpu_again["cache writes"] == 0, (cpu, cpu_again)
    assert cpu_again["backend compiles"] - cpu_again["cache hits"] == 1, cpu_again
    aot, aot_again = first["aot"], second["aot"]
    assert (aot["backend compiles"], aot["cache writes"], aot["unread entries"]) == (1, 1, []), aot
    assert (aot_again["backend compiles"], aot_again["cache hits"], aot_again["cache writes"]) == (1, 0, 1), aot_again
    assert len(aot_again["unread entries"]) == 1 and "PjRtCompiler must be constructed with a Client" in (
        aot_again["unread entries"][0]), aot_again
