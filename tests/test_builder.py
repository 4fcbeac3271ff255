"""The builder: Hub kernel layout, metadata kernels accepts, digests, reproducibility, namespaces."""

import shutil
import subprocess
import sys
from pathlib import Path

import kernels
import pytest
import torch
from kernels._rust import Digest, DigestAlgorithm, DigestValidationError, Metadata

from tpu_kernels.distribution.builder import KernelSource, build_kernel_repo

from .conftest import REPO_ROOT

REPO = REPO_ROOT / "kernel_repos" / "ragged-dot-tpu"


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return build_kernel_repo(REPO, tmp_path_factory.mktemp("out"))


def test_layout_and_metadata(built):
    assert (built / "README.md").read_bytes() == (REPO / "CARD.md").read_bytes()
    ids = set()
    for backend in ("cpu", "tpu"):
        variant = built / "build" / f"torch-{backend}"
        metadata = Metadata.read_from_file(variant / "metadata.json")
        assert metadata.name.python_name == "ragged_dot_tpu" and metadata.version == 1
        assert str(metadata.backend.backend_type) == backend
        assert metadata.python_depends == []
        # Every file is covered by the digest, and the digest matches the files.
        metadata.digest.validate(Digest.hash_variant(DigestAlgorithm.SHA256, variant))
        assert {"__init__.py", "_ops.py", "_binding.py", "_hardware.py", "pallas_gmm.py"} <= set(metadata.digest.files)
        assert (variant / "_binding.py").read_bytes() == (REPO_ROOT / "tpu_kernels" / "runtime" / "binding.py").read_bytes()
        ids.add(metadata.id)
    assert len(ids) == 2, "each variant has its own op namespace"


def test_digest_catches_a_changed_byte(built, tmp_path):
    variant = tmp_path / "torch-cpu"
    shutil.copytree(built / "build" / "torch-cpu", variant)
    pallas_gmm_py = variant / "pallas_gmm.py"
    data = bytearray(pallas_gmm_py.read_bytes())
    data[100] ^= 1
    pallas_gmm_py.write_bytes(bytes(data))
    metadata = Metadata.read_from_file(variant / "metadata.json")
    with pytest.raises(DigestValidationError, match="pallas_gmm.py"):
        metadata.digest.validate(Digest.hash_variant(DigestAlgorithm.SHA256, variant))


def test_build_is_reproducible(built, tmp_path):
    again = build_kernel_repo(REPO, tmp_path)
    assert _tree_bytes(again) == _tree_bytes(built)


def test_two_builds_of_different_sources_load_side_by_side(tmp_path):
    # Both sources differ from the repo's own, so plain `kernels` loading them here registers no op of the
    # build every other test loads (a second copy of one build would re-register its ops in this process).
    builds = {}
    for marker in ("one", "two"):
        changed_repo = tmp_path / marker / "ragged-dot-tpu"
        shutil.copytree(REPO, changed_repo, ignore=shutil.ignore_patterns("__pycache__"))
        reference = changed_repo / "torch-ext" / "ragged_dot_tpu" / "reference.py"
        reference.write_text(reference.read_text() + f"\nBUILD_MARKER = {marker!r}\n")
        builds[marker] = build_kernel_repo(changed_repo, tmp_path / marker / "out")

    first = kernels.get_local_kernel(builds["one"], backend="cpu")
    second = kernels.get_local_kernel(builds["two"], backend="cpu")
    assert first.__name__ != second.__name__
    assert (first.reference.BUILD_MARKER, second.reference.BUILD_MARKER) == ("one", "two")
    lhs, rhs = torch.randn(5, 96), torch.randn(2, 96, 128)
    sizes = torch.tensor([2, 3], dtype=torch.int32)
    torch.testing.assert_close(first.ragged_dot(lhs, rhs, sizes), second.ragged_dot(lhs, rhs, sizes))


def test_not_a_kernel_repo_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no build.toml"):
        KernelSource.open(tmp_path)


@pytest.mark.multiprocess
def test_builder_finds_the_binding_without_importing_it():
    """Importing the binding loads jax and torch and may switch jax to the CPU platform."""
    code = "import sys, tpu_kernels.distribution.builder; print([m for m in ('jax', 'torch', 'tpu_kernels.runtime.binding') if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
