"""Shared by the loader tests (publish and load through a local Hub, integrity, hardening, kernelize): a
synthetic built kernel, publishing it, and clients pointed at the Hub, in this process or in subprocesses;
and forgetting a loaded synthetic kernel, so that one process can load it again.
The `hub` and `client` fixtures (conftest.py) are built from these."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

from huggingface_hub import constants

from tpu_kernels.distribution.digest import digest_field
from tpu_kernels.distribution.publish import upload_kernel

TOKEN = "test-token-" + os.urandom(4).hex()
TRUSTED = "trusted-org"
REPO = f"{TRUSTED}/answer"
REPO_ROOT = Path(__file__).resolve().parents[1]
# Synthetic kernels need no TPU runtime; skipping torch_tpu's autoload halves a
# subprocess's start-up and does not change the backend `kernels` picks here (cpu).
FAST_SUBPROCESS_ENV = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}


def make_build(
    root: Path, answer: int, *, version: int = 1, backends=("cpu", "tpu"), name="answer", extra: str | None = None,
    digest: bool = True,
) -> Path:
    """A built kernel in the layout of `tpu-kernels build`: `answer()` returns `answer`.

    `extra` adds a module of that name to each variant (builds with different file sets);
    `digest=False` leaves the digest out of metadata.json.
    """
    build = root / f"{name}-{answer}-{uuid.uuid4().hex[:6]}" / name
    (build / "benchmarks").mkdir(parents=True)
    (build / "README.md").write_text(f"---\nlicense: apache-2.0\ntags: [kernels]\n---\n# {name} answering {answer}\n")
    (build / "benchmarks" / "benchmark_answer.py").write_text("ROUNDS = 3\n")
    for backend in backends:
        variant = build / "build" / f"torch-{backend}"
        variant.mkdir(parents=True)
        (variant / "_value.py").write_text(f"VALUE = {answer}\n")
        (variant / "__init__.py").write_text("from ._value import VALUE\n\n\ndef answer():\n    return VALUE\n")
        if extra is not None:
            (variant / f"_{extra}.py").write_text(f"NAME = {extra!r}\n")
        metadata = {
            "name": name,
            "id": f"_{name}_{backend}_{uuid.uuid4().hex[:10]}",
            "version": version,
            "license": "apache-2.0",
            "python-depends": [],
            "backend": {"type": backend},
        }
        if digest:
            metadata["digest"] = digest_field(variant)
        (variant / "metadata.json").write_text(json.dumps(metadata))
    return build


def point_clients_at(monkeypatch, url: str, cache: Path) -> None:
    """huggingface_hub and kernels in this process, as if HF_ENDPOINT=url and KERNELS_CACHE=cache (kernels
    reads KERNELS_CACHE at each call)."""
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("KERNELS_CACHE", str(cache))
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)


def publish(hub, build: Path, repo_id: str = REPO, version: int | None = None):
    return upload_kernel(build, repo_id, version=version, endpoint=hub.url, token=TOKEN)


def subprocess_env(hub, cache: Path, tmp_path: Path, **extra: str) -> dict:
    env = {key: value for key, value in os.environ.items()
           if key not in ("HF_TOKEN", "LOCAL_KERNELS", "HF_HUB_OFFLINE", "KERNELS_CACHE")}
    env.update(HF_ENDPOINT=hub.url, KERNELS_CACHE=str(cache), HF_HOME=str(tmp_path / "hf-home"), **extra)
    return env


def run_python(code: str, env: dict, timeout: float = 300) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON line last."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-5000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def cached_variant(cache: Path, commit: str, repo_id: str = REPO, variant: str = "torch-cpu") -> Path:
    """Where huggingface_hub keeps a downloaded variant; loaded kernels run from a private copy of it."""
    return cache / f"kernels--{repo_id.replace('/', '--')}" / "snapshots" / commit / "build" / variant


def forget_loaded_kernels() -> None:
    """Make the next load of a test kernel (`make_build`'s "answer") import again: its entries in kernels'
    registries of imported kernels, and our copies of it. The project's kernels that other tests of this process
    loaded stay imported: importing one again would register its torch ops a second time.

    kernels has no public way to unload a kernel, so this reaches its private registries (kernels 0.19's
    `_internals.importer`): only to let one test process import the same build twice."""
    from kernels._internals import importer

    from tpu_kernels.distribution.loader import private_copies

    forgotten = {path: loaded for path, loaded in importer._loaded_kernels.items()
                 if loaded.metadata.name.python_name == "answer"}
    ids = {loaded.metadata.id for loaded in forgotten.values()}
    for name in [name for name in sys.modules if name.split(".")[0] in ids]:  # submodules too
        del sys.modules[name]
    for path in forgotten:
        del importer._loaded_kernels[path]
    for kernel_id in ids:
        importer._loaded_kernel_metadata.pop(kernel_id, None)
    for key, copy in list(private_copies._PRIVATE_COPIES.items()):
        if any(path.is_relative_to(copy) for path in forgotten):
            del private_copies._PRIVATE_COPIES[key]
