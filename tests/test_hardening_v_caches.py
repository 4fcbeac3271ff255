"""Hardening V (issue 73): compiled-code caches (CC1, CC2) and folders made under any umask (CC3)."""

import contextlib
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

from tpu_kernels import compile_cache
from tpu_kernels.compile_cache import JAX_CACHE_MAX_BYTES, JAX_FOLDER, TORCH_TPU_CACHE_ENV, keep_compiled_programs
from tpu_kernels.disk_cache import UnsafeCacheError, cache_root, private_folder
from tpu_kernels.folders import make_private_dirs

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
def fresh_xdg(tmp_path, monkeypatch, jax_cache_settings):
    """XDG_CACHE_HOME naming a folder that does not exist yet (a fresh machine), jax's cache folder unset."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "fresh" / "cache"))
    monkeypatch.delenv(TORCH_TPU_CACHE_ENV, raising=False)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_MAX_SIZE", raising=False)
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_compilation_cache_max_size", -1)
    return tmp_path / "fresh"


@contextlib.contextmanager
def umask(value: int):
    previous = os.umask(value)
    try:
        yield
    finally:
        os.umask(previous)


def modes_from(top: Path, bottom: Path) -> dict[str, str]:
    return {str(p.relative_to(top.parent)): oct(stat.S_IMODE(p.stat().st_mode)) for p in (bottom, *bottom.parents)
            if p.is_relative_to(top)}


# -- CC3: every folder we make is 0700, parents included, whatever the umask ---------------------------------


@pytest.mark.parametrize("mask", [0o002, 0o000])
def test_kernelize_s_caches_are_made_private_on_a_fresh_machine_under_any_umask(fresh_xdg, mask):
    with umask(mask):
        caches = keep_compiled_programs()
    made = Path(caches.jax)
    assert made == cache_root(JAX_FOLDER)
    assert set(modes_from(fresh_xdg, made).values()) == {"0o700"}, modes_from(fresh_xdg, made)


def test_make_private_dirs_leaves_folders_that_exist_alone(tmp_path):
    (tmp_path / "there").mkdir(mode=0o755)
    with umask(0o000):
        made = make_private_dirs(tmp_path / "there" / "a" / "b")
    assert oct(stat.S_IMODE((tmp_path / "there").stat().st_mode)) == "0o755"
    assert set(modes_from(tmp_path / "there" / "a", made).values()) == {"0o700"}


# -- CC1: entries another user could have written are removed before the cache is used ------------------------


def plant_entries(folder: Path) -> dict[str, Path]:
    """One entry of each kind that fails the check, each with its partner file, and one good entry."""
    elsewhere = folder.parent / "elsewhere-program"
    elsewhere.write_bytes(b"another program")
    planted = {}
    for kind in ("link", "writable", "fifo", "folder", "no time"):
        key = f"jit_f-{kind.replace(' ', '_')}"
        cache, atime = folder / f"{key}-cache", folder / f"{key}-atime"
        if kind == "link":
            cache.symlink_to(elsewhere)
        elif kind == "writable":
            cache.write_bytes(b"program")
            cache.chmod(0o666)
        elif kind == "fifo":
            os.mkfifo(cache, 0o600)
        elif kind == "folder":
            cache.mkdir(mode=0o700)
        else:
            cache.write_bytes(b"program")
            cache.chmod(0o600)
        if kind != "no time":
            atime.write_bytes(b"\0" * 8)
            atime.chmod(0o600)
        planted[kind] = cache
    good = folder / "jit_good-1-cache"
    good.write_bytes(b"program")
    (folder / "jit_good-1-atime").write_bytes(b"\0" * 8)
    for path in (good, folder / "jit_good-1-atime"):
        path.chmod(0o600)
    planted["good"] = good
    return planted


def test_a_compile_cache_once_open_to_others_loses_what_they_could_have_put_in_it(fresh_xdg):
    folder = private_folder(cache_root(JAX_FOLDER))
    planted = plant_entries(folder)
    if os.geteuid() == 0:  # another user's file needs root to make
        foreign = folder / "jit_f-foreign-cache"
        foreign.write_bytes(b"program")
        foreign.chmod(0o644)
        os.chown(foreign, 65534, 65534)
        planted["foreign"] = foreign
    caches = keep_compiled_programs()
    assert jax.config.jax_compilation_cache_max_size == JAX_CACHE_MAX_BYTES
    for kind, cache in planted.items():
        partner = cache.with_name(cache.name.replace("-cache", "-atime"))
        if kind == "good":
            assert cache.exists() and partner.exists()
        else:
            assert not os.path.lexists(cache) and not os.path.lexists(partner), kind
            assert str(cache) in caches.removed, kind
    assert (folder.parent / "elsewhere-program").read_bytes() == b"another program"  # links are not followed


def test_a_lock_file_planted_as_a_link_is_removed_before_jax_would_truncate_its_target(fresh_xdg):
    folder = private_folder(cache_root(JAX_FOLDER))
    target = folder.parent / "precious"
    target.write_bytes(b"keep me")
    (folder / ".lockfile").symlink_to(target)
    keep_compiled_programs()
    assert target.read_bytes() == b"keep me" and not (folder / ".lockfile").is_symlink()


def test_a_refused_cache_folder_is_to_be_removed_not_chmodded(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafeCacheError) as refused:
        private_folder(shared)
    assert "Remove it" in str(refused.value) and "chmod go-w" not in str(refused.value)


def test_entries_written_under_umask_002_are_closed_to_others_at_exit(tmp_path):
    folder = make_private_dirs(tmp_path / "cache")
    entry = folder / "jit_f-1-cache"
    entry.write_bytes(b"program")
    entry.chmod(0o664)
    other = folder / "notes.txt"  # not a name jax reads: left as it is
    other.write_bytes(b"x")
    other.chmod(0o664)
    compile_cache._close_to_others(folder, compile_cache._jax_entries)
    assert oct(stat.S_IMODE(entry.stat().st_mode)) == "0o644"
    assert oct(stat.S_IMODE(other.stat().st_mode)) == "0o664"


# An executable of another program put under plus_one's key: main ran it (plus_one(1) == 1000).
CACHE_USER = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    from tpu_kernels.compile_cache import keep_compiled_programs
    keep_compiled_programs()

    def plus_one(x):
        return x + 1

    def thousand(x):
        return x * 0 + 1000

    print(int(jax.jit(plus_one)(jnp.int32(1))), int(jax.jit(thousand)(jnp.int32(1))))
""")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_program_planted_under_a_key_never_runs(tmp_path):
    xdg = tmp_path / "xdg"
    env = {**os.environ, "XDG_CACHE_HOME": str(xdg), "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO_ROOT)}
    for name in ("JAX_COMPILATION_CACHE_DIR", TORCH_TPU_CACHE_ENV, "JAX_COMPILATION_CACHE_MAX_SIZE"):
        env.pop(name, None)

    def run() -> str:
        done = subprocess.run([sys.executable, "-c", CACHE_USER], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.split()

    assert run() == ["2", "1000"]
    folder = xdg / "tpu-kernels" / JAX_FOLDER
    (plus_one,) = folder.glob("jit_plus_one-*-cache")
    (thousand,) = folder.glob("jit_thousand-*-cache")
    plus_one.unlink()
    plus_one.symlink_to(thousand)  # as another user could while the folder was open to them
    assert run() == ["2", "1000"]
    assert not plus_one.is_symlink()


# -- CC2: folders the user names get the same checks --------------------------------------------------------


def test_a_jax_cache_folder_the_user_named_is_refused_if_others_can_write_it(tmp_path, jax_cache_settings):
    shared = tmp_path / "shared-jax"
    shared.mkdir()
    shared.chmod(0o777)
    jax.config.update("jax_compilation_cache_dir", str(shared))
    with pytest.raises(UnsafeCacheError, match="jax_compilation_cache_dir"):
        keep_compiled_programs()


def test_a_jax_cache_folder_the_user_named_loses_planted_entries(tmp_path, jax_cache_settings, monkeypatch):
    monkeypatch.delenv(TORCH_TPU_CACHE_ENV, raising=False)
    theirs = make_private_dirs(tmp_path / "theirs-jax")
    planted = plant_entries(theirs)
    jax.config.update("jax_compilation_cache_dir", str(theirs))
    caches = keep_compiled_programs()
    assert "jax" not in caches.chosen_here
    assert not os.path.lexists(planted["link"]) and not os.path.lexists(planted["writable"])
    assert planted["good"].exists()


@pytest.mark.parametrize("problem", ["shared folder", "planted link"])
def test_a_torch_tpu_cache_folder_the_user_named_is_refused_with_what_to_do(tmp_path, jax_cache_settings,
                                                                           monkeypatch, problem):
    theirs = make_private_dirs(tmp_path / "theirs-torch-tpu")
    if problem == "shared folder":
        theirs.chmod(0o777)
    else:
        (theirs / "entry").symlink_to(tmp_path)
    monkeypatch.setenv(TORCH_TPU_CACHE_ENV, str(theirs))
    jax.config.update("jax_compilation_cache_dir", str(make_private_dirs(tmp_path / "jax")))
    with pytest.raises(UnsafeCacheError, match=TORCH_TPU_CACHE_ENV) as refused:
        keep_compiled_programs()
    assert "Remove" in str(refused.value)
