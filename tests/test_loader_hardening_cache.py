"""What an attacker gets through the loader's cache: bytecode planted in a read-only cache, the private
copies the loader imports from (refused in a temporary folder others can change), and a blob swapped
between the digest check and the import.

Reads of a read-only folder are checked the way a user who is not root meets them: when the tests run
as root, the loads run in a subprocess without the capability that lets root write anywhere.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from importlib import _bootstrap_external
from pathlib import Path

import pytest

from tpu_kernels.distribution.digest import KernelIntegrityError
from tpu_kernels.distribution.loader import get_kernel, get_local_kernel, private_copies

from .conftest import REPO_ROOT
from .loader_support import (FAST_SUBPROCESS_ENV, REPO, cached_variant, forget_loaded_kernels, make_build, publish,
                             subprocess_env)

pytestmark = pytest.mark.usefixtures("local_agent_registry")


def lock_file(path: Path, repo_id: str, commit: str) -> Path:
    """A lock file in the format `kernels lock` writes (the test of that format runs the real CLI)."""
    path.write_text(json.dumps([{"dependency": {"repo-id": repo_id, "version": 1}, "lock": {"commit": commit}}]))
    return path


# -- found 1: planted bytecode in a read-only cache ------------------------------------------------------


def plant_bytecode(variant: Path, marker: Path) -> None:
    """Unchecked-hash bytecode (PEP 552: Python runs it whatever the source holds) for each module of the
    variant: it records that it ran and answers 666."""
    folder = variant / "__pycache__"
    folder.mkdir()
    forged = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\nVALUE = 666\ndef answer():\n    return 666\n"
    for module in ("__init__", "_value"):
        code = compile(forged, str(variant / f"{module}.py"), "exec")
        pyc = _bootstrap_external._code_to_hash_pyc(code, importlib.util.source_hash(b""), checked=False)
        (folder / f"{module}.{sys.implementation.cache_tag}.pyc").write_bytes(pyc)


def set_folder_modes(root: Path, mode: int) -> None:
    for folder, _, _ in os.walk(root):
        os.chmod(folder, mode)


def run_python_as_a_user(code: str, env: dict) -> dict:
    """`run_python`, as a user whom file modes bind: as root, without the capabilities that let root write
    into read-only folders, read any file, or change files of others."""
    as_a_user = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: file modes would not bind")
        as_a_user = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]
    result = subprocess.run([*as_a_user, sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-5000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


LOADS_FROM_A_PLANTED_CACHE = """
    import json, sys
    from kernels._internals import importer  # no public way to unload: each load below must import anew
    import tpu_kernels.distribution.loader as loader
    from tpu_kernels.distribution.loader import private_copies

    def answer(load):
        ids = {{loaded.metadata.id for loaded in importer._loaded_kernels.values()}}
        for name in [name for name in sys.modules if name.split(".")[0] in ids]:
            del sys.modules[name]
        importer._loaded_kernels.clear()
        importer._loaded_kernel_metadata.clear()
        private_copies._PRIVATE_COPIES.clear()
        try:
            return load().answer()
        except Exception as error:
            return f"{{type(error).__name__}}: {{error}}"

    loads = {{
        "version": lambda: loader.get_kernel({repo!r}, version=1),
        "commit": lambda: loader.get_kernel({repo!r}, revision={commit!r}),
        "lock file": lambda: loader.{lock_loader}({repo!r}, lockfile={lockfile!r}),
    }}
    if {force!r}:
        loads["force_download"] = lambda: loader.get_kernel({repo!r}, version=1, force_download=True)
    print(json.dumps({{name: answer(load) for name, load in loads.items()}}))
"""


@pytest.mark.multiprocess
def test_planted_bytecode_in_a_read_only_cache_never_runs_and_force_download_repairs_it(hub, client, tmp_path):
    publication = publish(hub, make_build(tmp_path, answer=5))
    assert get_kernel(REPO, version=1).answer() == 5  # the cache a first load leaves, refs/v1 included
    lockfile = str(lock_file(tmp_path / "kernels.lock", REPO, publication.build_oid))
    variant = cached_variant(client, publication.build_oid)
    marker = tmp_path / "planted-code-ran"
    plant_bytecode(variant, marker)
    repo_cache = client / "kernels--trusted-org--answer"
    set_folder_modes(repo_cache, 0o555)  # as a restored cache archive leaves it
    try:
        results = {}
        for offline in (True, False):
            code = LOADS_FROM_A_PLANTED_CACHE.format(
                repo=REPO, commit=publication.build_oid, lockfile=lockfile, force=not offline,
                lock_loader="load_kernel" if offline else "get_locked_kernel")
            env = subprocess_env(hub, client, tmp_path, **FAST_SUBPROCESS_ENV, **({"HF_HUB_OFFLINE": "1"} if offline else {}))
            result = run_python_as_a_user(code, env)
            results.update({f"{'offline' if offline else 'online'}, {name}": value for name, value in result.items()})
    finally:
        set_folder_modes(repo_cache, 0o755)
    assert results == {
        "offline, version": 5, "offline, commit": 5, "offline, lock file": 5,
        "online, version": 5, "online, commit": 5, "online, lock file": 5, "online, force_download": 5,
    }
    assert not marker.exists()
    assert not (variant / "__pycache__").exists()  # force_download left what a first download leaves


@pytest.mark.multiprocess
@pytest.mark.skipif(os.geteuid() != 0, reason="making a cache folder someone else's needs root")
def test_force_download_on_someone_elses_read_only_cache_says_so(hub, client, tmp_path):
    publication = publish(hub, make_build(tmp_path, answer=5))
    assert get_kernel(REPO, version=1).answer() == 5
    snapshot = client / "kernels--trusted-org--answer" / "snapshots" / publication.build_oid
    for folder, _, _ in os.walk(snapshot):
        os.chown(folder, 65534, 65534)
        os.chmod(folder, 0o555)
    try:
        result = run_python_as_a_user(f"""
            import json
            from tpu_kernels.distribution.loader import get_kernel
            try:
                get_kernel({REPO!r}, version=1, force_download=True)
            except Exception as error:
                print(json.dumps([type(error).__name__, str(error)]))
        """, subprocess_env(hub, client, tmp_path, **FAST_SUBPROCESS_ENV))
    finally:
        for folder, _, _ in os.walk(snapshot):
            os.chown(folder, 0, 0)
            os.chmod(folder, 0o755)
    kind, message = result
    assert kind == "CacheNotWritableError"
    assert "owned by user 65534" in message and str(snapshot) in message


def test_the_copies_are_refused_in_a_temporary_folder_others_can_change(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # world-writable, not sticky: another user could rename our folder away
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    monkeypatch.setattr(private_copies, "_private_root", None)
    with pytest.raises(KernelIntegrityError, match="can be changed by other users"):
        get_local_kernel(make_build(tmp_path, answer=5), backend="cpu")


def test_a_loaded_kernel_runs_from_a_private_copy_without_bytecode(tmp_path):
    build = make_build(tmp_path, answer=5)
    module = get_local_kernel(build, backend="cpu")
    copy = Path(module.__file__).parent
    assert copy.name == "torch-cpu" and not copy.is_relative_to(build)
    root = copy.parents[2]  # <root>/<copy>/build/torch-cpu
    assert root.name.startswith("tpu-kernels-verified-") and stat.S_IMODE(root.stat().st_mode) == 0o700
    assert sorted(path.name for path in copy.iterdir()) == ["__init__.py", "_value.py", "metadata.json"]
    assert get_local_kernel(build, backend="cpu") is module  # the same bytes: the same module


# -- found 2: a blob swapped between the digest check and the import ---------------------------------------


# Run in its own process, so that it acts while the loader runs (a thread would wait for the GIL).
BLOB_SWAPPER = r"""
import ctypes, os, select, struct, sys, tempfile, time
from pathlib import Path

IN_CLOSE_NOWRITE = 0x10
blob, good_file, bad_file = (Path(arg) for arg in sys.argv[1:4])
good, bad = good_file.read_bytes(), bad_file.read_bytes()
libc = ctypes.CDLL(None, use_errno=True)
watch = libc.inotify_init1(os.O_NONBLOCK)
if watch < 0 or libc.inotify_add_watch(watch, os.fsencode(blob.parent), IN_CLOSE_NOWRITE) < 0:
    raise OSError(ctypes.get_errno(), "inotify")


def stage(content):
    fd, name = tempfile.mkstemp(dir=blob.parent, prefix=".swap-")
    os.write(fd, content)
    os.close(fd)
    return name


def closed_reads_of_the_blob():
    count = 0
    while select.select([watch], [], [], 0)[0]:
        data, offset = os.read(watch, 1 << 16), 0
        while offset < len(data):
            length = struct.unpack_from("iIII", data, offset)[3]
            count += data[offset + 16: offset + 16 + length].rstrip(b"\0") == blob.name.encode()
            offset += 16 + length
    return count


armed, reads, swaps, holds_good, staged = False, 0, 0, True, {}
while True:
    ready = select.select([watch, sys.stdin], [], [])[0]
    if watch in ready:
        new_reads = closed_reads_of_the_blob()  # the swapper never reads the blob: only the loader's reads count
        if armed:
            for _ in range(new_reads):
                reads += 1
                if reads == 1:  # right after the digest check read it
                    os.replace(staged[bad], blob)
                    holds_good, swaps = False, swaps + 1
                elif reads == 2:
                    os.replace(staged[good], blob)
                    holds_good = True
    if sys.stdin in ready:
        command = sys.stdin.readline().strip()
        if command == "arm":
            closed_reads_of_the_blob()
            staged = {content: stage(content) for content in (bad, good)}
            armed, reads = True, 0
        elif command == "disarm":
            time.sleep(0.01)
            armed = False
            if not holds_good:
                os.replace(staged[good], blob)
                holds_good = True
            for name in staged.values():
                Path(name).unlink(missing_ok=True)
        else:
            break
        print(swaps, flush=True)
"""


@contextlib.contextmanager
def blob_swapper(blob: Path, good: bytes, bad: bytes, folder: Path):
    """A process that swaps `blob` for `bad` right after its next read and back after the one after, each
    time it is armed; yields `swap_next(armed: bool) -> swaps so far`."""
    (folder / "good").write_bytes(good)
    (folder / "bad").write_bytes(bad)
    swapper = subprocess.Popen([sys.executable, "-c", BLOB_SWAPPER, str(blob), str(folder / "good"), str(folder / "bad")],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def command(armed: bool) -> int:
        swapper.stdin.write("arm\n" if armed else "disarm\n")
        swapper.stdin.flush()
        return int(swapper.stdout.readline())

    try:
        yield command
    finally:
        swapper.stdin.close()
        swapper.wait(timeout=30)


@pytest.mark.multiprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify")
def test_a_blob_swapped_between_the_check_and_the_import_never_runs(hub, client, tmp_path):
    publication = publish(hub, make_build(tmp_path, answer=5))
    commit = publication.build_oid
    assert get_kernel(REPO, revision=commit).answer() == 5
    blob = (cached_variant(client, commit) / "_value.py").resolve()
    marker = tmp_path / "swapped-code-ran"
    swapped = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\nVALUE = 666\n".encode()
    ran, refused, attempts = 0, 0, 50
    with blob_swapper(blob, blob.read_bytes(), swapped, tmp_path) as swapper:
        for _ in range(attempts):
            forget_loaded_kernels()
            swapper(True)
            try:
                value = get_kernel(REPO, revision=commit).answer()
            except KernelIntegrityError:
                refused += 1
            else:
                assert value in (5, 666)
            swaps = swapper(False)
            if marker.exists():
                ran += 1
                marker.unlink()
    print(f"swapped code ran {ran} of {attempts} attempts ({swaps} swaps, {refused} refused)")
    assert swaps == attempts  # the blob was swapped right after the check's read, every time
    assert (ran, refused) == (0, 0)
