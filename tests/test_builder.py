"""The builder: Hub kernel layout, metadata kernels accepts, digests, reproducibility, namespaces."""

import shutil
import subprocess
import sys
from pathlib import Path

import kernels
import pytest
import torch
# Private, to check upstream behaviour: kernels' own digest of a variant (what its loader checks) agrees with ours.
from kernels._rust import Digest, DigestAlgorithm, DigestValidationError

from tpu_kernels.distribution.build_toml import BuildToml, BuildTomlError, read_build_toml
from tpu_kernels.distribution.builder import SHIPPED_MODULES, KernelSource, build_kernel_repo
from tpu_kernels.distribution.digest import verify_variant

from .conftest import REPO_ROOT

REPO = REPO_ROOT / "kernel_repos" / "ragged-dot-tpu"
KERNEL_NAMES = ("ragged-dot-tpu", "rmsnorm-tpu", "attention-tpu")
# Each kernel's table of tuned tiles (tpu_kernels/runtime/tuning.py), in its package.
TUNED_TABLES = {"ragged-dot-tpu": "gmm/tuned_tiles.json", "rmsnorm-tpu": "norm/tuned_tiles.json",
                "attention-tpu": "flash/tuned_tiles.json"}


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
        metadata = kernels.Metadata.read_from_file(variant / "metadata.json")
        assert metadata.name.python_name == "ragged_dot_tpu" and metadata.version == 1
        assert str(metadata.backend.backend_type) == backend
        assert metadata.python_depends == []
        # Every file is covered by the digest, and the digest matches the files.
        metadata.digest.validate(Digest.hash_variant(DigestAlgorithm.SHA256, variant))
        assert {"__init__.py", "_ops.py", "_binding.py", "_hardware.py", "_tuning.py", "gmm/kernel.py",
                "symbols.json"} <= set(metadata.digest.files)
        assert (variant / "_binding.py").read_bytes() == (REPO_ROOT / "tpu_kernels" / "runtime" / "binding.py").read_bytes()
        ids.add(metadata.id)
    assert len(ids) == 2, "each variant has its own op namespace"


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_every_build_carries_its_tuned_table_and_the_shared_modules_under_its_digest(name, tmp_path):
    source = KernelSource.open(REPO_ROOT / "kernel_repos" / name)
    built = build_kernel_repo(source.root, tmp_path)
    table = TUNED_TABLES[name]
    for backend in ("cpu", "tpu"):
        variant = built / "build" / f"torch-{backend}"
        assert (variant / table).read_bytes() == (source.package_dir / table).read_bytes()
        assert {table, *SHIPPED_MODULES} <= set(kernels.Metadata.read_from_file(variant / "metadata.json").digest.files)
        verify_variant(variant)  # what publish and the loader check


def test_the_build_carries_the_benchmarks_and_their_harness_in_the_package(built):
    assert [path.name for path in (built / "benchmarks").iterdir()] == ["benchmark.py"]
    assert (built / "benchmarks" / "benchmark.py").read_bytes() == (REPO / "benchmarks" / "benchmark.py").read_bytes()
    harness = (REPO_ROOT / "tpu_kernels" / "runtime" / "benchmark_harness.py").read_bytes()
    for backend in ("cpu", "tpu"):
        assert (built / "build" / f"torch-{backend}" / "_benchmark_harness.py").read_bytes() == harness


@pytest.mark.parametrize("changed", ["gmm/kernel.py", "symbols.json"])
def test_digest_catches_a_changed_byte(built, tmp_path, changed):
    variant = tmp_path / "torch-cpu"
    shutil.copytree(built / "build" / "torch-cpu", variant)
    path = variant / changed
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    metadata = kernels.Metadata.read_from_file(variant / "metadata.json")
    with pytest.raises(DigestValidationError, match=changed):
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


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_kernels_own_parser_takes_our_build_toml_without_a_warning(name, capfd):
    # Upstream behaviour: kernels 0.19's build.toml parser is private (kernels._rust.Build), so the builder reads
    # the file itself; this checks that kernel-builder's format, as kernels reads it, takes ours as it is. The
    # parser prints its edition-upgrade warning from Rust, on file descriptor 2.
    from kernels._rust import Backend, Build

    source = KernelSource.open(REPO_ROOT / "kernel_repos" / name)
    build = Build.open(source.root)
    assert build.general.backends == [Backend.from_str(backend) for backend in source.backends]
    assert capfd.readouterr() == ("", "")


def test_kernels_parser_warns_on_edition_5_which_ours_refuses_saying_what_to_change(tmp_path, capfd):
    from kernels._rust import Build  # upstream behaviour, as above: what an edition 5 file costs a user

    repo = tmp_path / "old-kernel"
    shutil.copytree(REPO, repo, ignore=shutil.ignore_patterns("__pycache__"))
    build_toml = repo / "build.toml"
    build_toml.write_text(build_toml.read_text().replace("edition = 6", "edition = 5"))
    Build.open(repo)
    assert "edition 5 format; upgrading to edition 6" in capfd.readouterr().err
    with pytest.raises(BuildTomlError, match=r"edition 5 is an older format: set `edition = 6` in \[general\]"):
        KernelSource.open(repo)


VALID_BUILD_TOML = """[general]
edition = 6
name = "my-kernel"
version = 2
license = "apache-2.0"
backends = ["cpu", "tpu"]

[general.hub]
repo-id = "org/my-kernel"

[torch-noarch]
"""


@pytest.mark.parametrize("change, error", [
    (("edition = 6\n", ""), "has no `edition`: add `edition = 6`"),
    (("edition = 6", "edition = 7"), "edition 7 is newer"),
    (('license = "apache-2.0"\n', ""), "lacks `license`"),
    (("version = 2", "version = true"), "version True is not a non-negative integer"),
    (('name = "my-kernel"', 'name = "My_Kernel"'), "'My_Kernel' is not a kernel name"),
    (('["cpu", "tpu"]', '["cpu", "cuda"]'), "backends 'cuda' not supported: tpu-kernels builds cpu and tpu"),
    (('["cpu", "tpu"]', "[]"), "not a non-empty list"),
    (('["cpu", "tpu"]', '["cpu", "cpu"]'), "names a backend twice"),
    (('license = "apache-2.0"', 'license = "apache-2.0"\nupstream = "https://x"'), "unknown key in \\[general\\] 'upstream'"),
    (('repo-id = "org/my-kernel"', 'repo-id = "org/my-kernel"\nbranch = "main"'), "unknown key in \\[general.hub\\] 'branch'"),
    (('repo-id = "org/my-kernel"', 'repo-id = "my-kernel"'), "repo-id 'my-kernel' is not ORG/NAME"),
    (("[torch-noarch]\n", ""), "no \\[torch-noarch\\] table"),
    (("[torch-noarch]\n", '[torch-noarch]\npyext = ["py"]\n'), "takes no option"),
    (("[torch-noarch]\n", "[torch-noarch]\n[torch]\n"), "unknown top-level table 'torch'"),
    (("[general]", "[general"), "not valid TOML"),
])
def test_build_toml_is_checked_field_by_field(tmp_path, change, error):
    assert read_build_toml(_write_build_toml(tmp_path, VALID_BUILD_TOML)) == BuildToml(
        name="my-kernel", version=2, license="apache-2.0", backends=("cpu", "tpu"), repo_id="org/my-kernel")
    with pytest.raises(BuildTomlError, match=error):
        read_build_toml(_write_build_toml(tmp_path, VALID_BUILD_TOML.replace(*change)))


def _write_build_toml(folder: Path, text: str) -> Path:
    (folder / "build.toml").write_text(text)
    return folder / "build.toml"


@pytest.mark.multiprocess
def test_builder_finds_the_binding_without_importing_it():
    """Importing the binding loads jax and torch and may switch jax to the CPU platform."""
    code = "import sys, tpu_kernels.distribution.builder; print([m for m in ('jax', 'torch', 'tpu_kernels.runtime.binding') if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_the_build_command_says_what_is_wrong_with_build_toml_in_one_line(tmp_path, capsys):
    from tpu_kernels.cli import main

    repo = tmp_path / "rmsnorm-tpu"
    shutil.copytree(REPO_ROOT / "kernel_repos" / "rmsnorm-tpu", repo)
    build_toml = repo / "build.toml"
    build_toml.write_text(build_toml.read_text().replace("edition = 6", "edition = 5"))
    assert main(["build", str(repo), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tpu-kernels build: ") and "set `edition = 6`" in err and "Traceback" not in err
