"""Hostile input and races against the chain that runs Hub code: the loader's digest check on a real
cache, lock files, concurrent uploads and kernelize, all against a `tpu_kernels.distribution.hub` server on loopback.

Tampering is done the way a hand (or an attacker with write access to the cache) would: in the
snapshot folder that huggingface_hub filled, after a plain download and before the first import.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from huggingface_hub import HfApi, RepoFile
from kernels import Metadata

from tpu_kernels.distribution.digest import KernelIntegrityError, git_blob_id
from tpu_kernels.distribution.loader import VariantNotFoundError, get_kernel, get_locked_kernel, load_kernel
from tpu_kernels.distribution.publish import upload_kernel

from .conftest import REPO_ROOT
from .loader_support import FAST_SUBPROCESS_ENV, REPO, TOKEN, TRUSTED, make_build, publish, run_python, subprocess_env

pytestmark = pytest.mark.usefixtures("local_agent_registry")

CPU_VARIANT = "torch-cpu"


def download(hub, cache: Path, commit: str, repo_id: str = REPO) -> Path:
    """The cpu variant of `commit` in `cache`, fetched with huggingface_hub alone (nothing imported)."""
    snapshot = HfApi(endpoint=hub.url).snapshot_download(
        repo_id, repo_type="kernel", revision=commit, cache_dir=cache, allow_patterns=[f"build/{CPU_VARIANT}/*"])
    return Path(snapshot) / "build" / CPU_VARIANT


def digest_following_links(variant: Path) -> dict[str, str]:
    """The digest's files mapping for `variant` as it reads through the cache's links (what a forger computes)."""
    return {path.relative_to(variant).as_posix(): base64.b64encode(hashlib.sha256(path.read_bytes()).digest()).decode()
            for path in sorted(variant.rglob("*")) if path.is_file() and path.name != "metadata.json"}


def write_through_link(path: Path, text: str) -> None:
    """Edit a cached file in place, as an editor that follows links does: its blob changes, its link stays."""
    assert path.is_symlink()
    path.write_text(text)


def tree_listing(folder: Path) -> list[tuple]:
    """Everything under `folder` without following links: (path, kind, link target, bytes)."""
    listing = []
    for root, dirs, files in os.walk(folder):
        for name in sorted(dirs + files):
            path = Path(root) / name
            relative = path.relative_to(folder).as_posix()
            if path.is_symlink():
                listing.append((relative, "link", os.readlink(path), path.read_bytes() if path.is_file() else None))
            elif path.is_dir():
                listing.append((relative, "folder", None, None))
            else:
                listing.append((relative, "file", None, path.read_bytes()))
    return sorted(listing)


# -- the digest check covers exactly what gets imported ------------------------------------------


def test_a_linked_folder_shadowing_a_module_is_refused(hub, client, tmp_path):
    publication = publish(hub, make_build(tmp_path, answer=5))
    variant = download(hub, client, publication.build_oid)
    elsewhere = tmp_path / "elsewhere" / "pkg"
    elsewhere.mkdir(parents=True)
    (elsewhere / "__init__.py").write_text("VALUE = 666\n")
    # A package folder wins over the module `_value.py` at import.
    (variant / "_value").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(KernelIntegrityError, match=r"_value: symbolic link .*elsewhere/pkg") as refused:
        get_kernel(REPO, version=1)
    assert variant / "_value" in refused.value.files


def test_a_sourceless_package_is_refused(hub, client, tmp_path):
    """`.pyc` files are outside kernels' digest, yet `_value/__init__.pyc` imports in place of `_value.py`."""
    publication = publish(hub, make_build(tmp_path, answer=5))
    variant = download(hub, client, publication.build_oid)
    package = variant / "_value"
    package.mkdir()
    bytecode = compile("VALUE = 666\n", str(package / "__init__.py"), "exec")
    import importlib._bootstrap_external as bootstrap

    (package / "__init__.pyc").write_bytes(bootstrap._code_to_timestamp_pyc(bytecode, 0, 0))
    with pytest.raises(KernelIntegrityError) as refused:
        get_kernel(REPO, version=1)
    assert "_value/__init__.pyc: not in the digest" in str(refused.value)
    assert "_value/: folder holding no file of the digest" in str(refused.value)


def test_a_file_link_out_of_the_cache_is_refused_even_with_the_right_content(hub, client, tmp_path):
    publication = publish(hub, make_build(tmp_path, answer=5))
    variant = download(hub, client, publication.build_oid)
    copy = tmp_path / "value-copy.py"
    copy.write_bytes((variant / "_value.py").read_bytes())
    (variant / "_value.py").unlink()
    (variant / "_value.py").symlink_to(copy)
    with pytest.raises(KernelIntegrityError, match=r"_value.py: symbolic link .*, not the cache's link to a blob"):
        get_kernel(REPO, version=1)


def test_a_linked_folder_on_the_way_to_the_variant_is_refused(hub, client, tmp_path):
    publication = publish(hub, make_build(tmp_path, answer=5))
    variant = download(hub, client, publication.build_oid)
    moved = tmp_path / "moved-variant"
    shutil.copytree(variant, moved)  # plain files with the same bytes
    shutil.rmtree(variant)
    variant.symlink_to(moved, target_is_directory=True)
    with pytest.raises(KernelIntegrityError, match="is a symbolic link"):
        get_kernel(REPO, version=1)


def test_a_variant_without_digest_is_refused(hub, client, tmp_path):
    build = make_build(tmp_path, answer=5, backends=("cpu",), digest=False)
    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo(REPO, repo_type="kernel")
    api.create_branch(REPO, repo_type="kernel", branch="v1")
    api.upload_folder(repo_id=REPO, repo_type="kernel", folder_path=build, revision="v1")
    with pytest.raises(KernelIntegrityError, match="has no digest"):
        get_kernel(REPO, version=1)


def test_a_digest_removed_from_the_cached_metadata_is_refused(hub, client, tmp_path):
    publication = publish(hub, make_build(tmp_path, answer=5))
    variant = download(hub, client, publication.build_oid)
    metadata = json.loads((variant / "metadata.json").read_text())
    del metadata["digest"]
    write_through_link(variant / "metadata.json", json.dumps(metadata))
    write_through_link(variant / "_value.py", "VALUE = 666\n")
    with pytest.raises(KernelIntegrityError, match="metadata.json was changed in the cache"):
        get_kernel(REPO, version=1)


def forge_consistently(variant: Path) -> None:
    """Edit the code and metadata.json's digest of it together, in place: the digest check alone passes."""
    write_through_link(variant / "_value.py", "VALUE = 666\n")
    metadata = json.loads((variant / "metadata.json").read_text())
    metadata["digest"]["files"] = digest_following_links(variant)
    write_through_link(variant / "metadata.json", json.dumps(metadata))


@pytest.mark.multiprocess
def test_code_and_digest_edited_together_are_refused_online_and_offline(hub, client, tmp_path):
    publication = publish(hub, make_build(tmp_path, answer=5))
    assert get_kernel(REPO, version=1).answer() == 5  # also records refs/v1 for the offline load
    variant = client / "kernels--trusted-org--answer" / "snapshots" / publication.build_oid / "build" / CPU_VARIANT
    forge_consistently(variant)
    # Upstream behaviour, through kernels' private digest type: its own check (what its loader runs) passes this.
    from kernels._rust import Digest, DigestAlgorithm

    Metadata.read_from_file(variant / "metadata.json").digest.validate(
        Digest.hash_variant(DigestAlgorithm.SHA256, variant))

    result = subprocess.run(
        [sys.executable, "-c", "from tpu_kernels.distribution.loader import get_kernel; "
         f"get_kernel({REPO!r}, version=1)"],
        env=subprocess_env(hub, client, tmp_path, HF_HUB_OFFLINE="1", **FAST_SUBPROCESS_ENV),
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0
    assert "KernelIntegrityError" in result.stderr and "metadata.json was changed in the cache" in result.stderr

    with pytest.raises(KernelIntegrityError, match="metadata.json was changed in the cache") as refused:
        get_kernel(REPO, revision=publication.build_oid)
    assert refused.value.files == [variant / "metadata.json"]


def test_metadata_relinked_to_a_forged_blob_is_refused_online(hub, client, tmp_path):
    """A new blob named after its own content passes a content-vs-name check: the Hub's id does not."""
    publication = publish(hub, make_build(tmp_path, answer=5))
    variant = download(hub, client, publication.build_oid)
    blobs = client / "kernels--trusted-org--answer" / "blobs"
    (variant / "_value.py").unlink()
    (variant / "_value.py").write_text("VALUE = 666\n")
    metadata = json.loads((variant / "metadata.json").read_text())
    metadata["digest"]["files"] = digest_following_links(variant)
    forged = json.dumps(metadata).encode()
    (blobs / git_blob_id(forged)).write_bytes(forged)
    (variant / "metadata.json").unlink()
    (variant / "metadata.json").symlink_to(f"../../../../blobs/{git_blob_id(forged)}")
    with pytest.raises(KernelIntegrityError, match="but the Hub serves blob"):
        get_kernel(REPO, version=1)


def test_a_forced_download_leaves_what_a_first_download_leaves(hub, client, tmp_path):
    publication = publish(hub, make_build(tmp_path, answer=5))
    variant = download(hub, client, publication.build_oid)
    fresh = download(hub, tmp_path / "fresh-cache", publication.build_oid)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "pkg").mkdir(parents=True)
    (elsewhere / "pkg" / "__init__.py").write_text("VALUE = 666\n")
    (variant / "_value").symlink_to(elsewhere / "pkg", target_is_directory=True)
    (variant / "stray" / "deeper").mkdir(parents=True)
    (variant / "stray" / "deeper" / "x.py").write_text("X = 1\n")
    write_through_link(variant / "__init__.py", "raise SystemExit\n")
    (variant / "metadata.json").unlink()
    (variant / "metadata.json").symlink_to(tmp_path / "elsewhere" / "metadata.json")
    (tmp_path / "elsewhere" / "metadata.json").write_bytes((fresh / "metadata.json").read_bytes())
    with pytest.raises(KernelIntegrityError):
        get_kernel(REPO, version=1)
    assert not variant.exists()  # dropped on refusal, the links in it removed, never followed
    assert get_kernel(REPO, version=1).answer() == 5
    assert tree_listing(variant) == tree_listing(fresh)
    assert (elsewhere / "pkg" / "__init__.py").read_text() == "VALUE = 666\n"

    write_through_link(variant / "metadata.json", "{}")
    with pytest.raises(KernelIntegrityError, match="metadata.json was changed in the cache"):
        get_kernel(REPO, version=1)
    assert get_kernel(REPO, version=1, force_download=True).answer() == 5
    assert tree_listing(variant) == tree_listing(fresh)


# -- lock files ----------------------------------------------------------------------------------


def lock_project(hub, cache: Path, tmp_path: Path) -> Path:
    """`kernels lock` (the unmodified CLI) on a project that depends on REPO version 1; the lock file."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        f'[project]\nname = "app"\nversion = "0.1"\n\n[tool.kernels.dependencies]\n"{REPO}" = 1\n')
    kernels_cli = Path(sys.executable).parent / "kernels"
    result = subprocess.run([str(kernels_cli), "lock", str(project)], capture_output=True, text=True, timeout=300,
                            env=subprocess_env(hub, cache, tmp_path, **FAST_SUBPROCESS_ENV))
    assert result.returncode == 0, result.stderr[-3000:]
    return project / "kernels.lock"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_lock_file_pins_the_commit_for_kernels_and_for_us(hub, client, tmp_path):
    locked = publish(hub, make_build(tmp_path, answer=1, backends=("cpu",)))
    lockfile = lock_project(hub, tmp_path / "lock-cache", tmp_path)
    assert locked.build_oid in lockfile.read_text()
    publish(hub, make_build(tmp_path, answer=2, backends=("cpu",)))  # v1 moves on
    assert get_kernel(REPO, version=1).answer() == 2

    unmodified = run_python(f"""
        import json
        from pathlib import Path
        import kernels
        lockfile = Path({str(lockfile)!r})
        online = kernels.get_locked_kernel({REPO!r}, lockfile=lockfile).answer()
        cached = kernels.load_kernel({REPO!r}, lockfile=lockfile).answer()
        print(json.dumps([online, cached]))
    """, subprocess_env(hub, tmp_path / "unmodified-cache", tmp_path, **FAST_SUBPROCESS_ENV))
    assert unmodified == [1, 1]



@pytest.mark.multiprocess
def test_our_lock_loads_check_digests(hub, client, tmp_path):
    locked = publish(hub, make_build(tmp_path, answer=1, backends=("cpu",)))
    lockfile = lock_project(hub, tmp_path / "lock-cache", tmp_path)
    publish(hub, make_build(tmp_path, answer=2, backends=("cpu",)))
    with pytest.raises(FileNotFoundError):
        load_kernel(REPO, lockfile=lockfile)  # never downloads
    assert get_locked_kernel(REPO, lockfile=lockfile).answer() == 1
    requests_before = hub.request_count
    assert load_kernel(REPO, lockfile=lockfile).answer() == 1
    assert hub.request_count == requests_before

    variant = client / "kernels--trusted-org--answer" / "snapshots" / locked.build_oid / "build" / CPU_VARIANT
    forge_consistently(variant)
    with pytest.raises(KernelIntegrityError, match="metadata.json was changed in the cache"):
        load_kernel(REPO, lockfile=lockfile)
    with pytest.raises(KernelIntegrityError, match="metadata.json was changed in the cache"):
        get_locked_kernel(REPO, lockfile=lockfile)
    assert not variant.exists()  # an online refusal drops what it refused
    assert get_locked_kernel(REPO, lockfile=lockfile).answer() == 1


# -- uploads -------------------------------------------------------------------------------------


def build_files(build: Path) -> dict[str, str]:
    """Repo path -> git blob id of every file an upload of `build` publishes."""
    return {path.relative_to(build).as_posix(): git_blob_id(path.read_bytes())
            for path in sorted(build.rglob("*")) if path.is_file()}


def remote_files(api: HfApi, revision: str) -> dict[str, str]:
    head = api.repo_info(REPO, repo_type="kernel", revision=revision).sha
    tree = api.list_repo_tree(REPO, repo_type="kernel", revision=head, recursive=True)
    return {entry.path: entry.blob_id for entry in tree if isinstance(entry, RepoFile)}


def test_an_upload_raced_by_another_lands_whole(hub, client, tmp_path, monkeypatch):
    publish(hub, make_build(tmp_path, answer=0, extra="first"))
    ours, rival = make_build(tmp_path, answer=1, extra="ours"), make_build(tmp_path, answer=2, extra="rival")
    real_create_commit = HfApi.create_commit
    raced = []

    def create_commit_after_a_rival(self, repo_id, *args, **kwargs):
        if kwargs.get("revision") == "v1" and not raced:
            raced.append(True)
            publish(hub, rival)  # lands between our reading v1 and our commit
        return real_create_commit(self, repo_id, *args, **kwargs)

    monkeypatch.setattr(HfApi, "create_commit", create_commit_after_a_rival)
    publication = publish(hub, ours)
    api = HfApi(endpoint=hub.url)
    assert raced
    assert remote_files(api, "v1") == build_files(ours)
    assert remote_files(api, publication.build_oid) == build_files(ours)
    assert remote_files(api, "main") == {"README.md": build_files(ours)["README.md"]}


@pytest.mark.multiprocess
def test_six_concurrent_uploads_each_land_whole_or_fail_clearly(hub, tmp_path):
    builds = [make_build(tmp_path, answer=index, extra=f"build{index}") for index in range(6)]
    expected = [build_files(build) for build in builds]
    api = HfApi(endpoint=hub.url)
    observed, stop = [], threading.Event()

    def watch_v1():
        while not stop.is_set():
            try:
                observed.append(remote_files(api, "v1"))
            except Exception as error:  # v1 not created yet
                if "404" not in str(error) and "not found" not in str(error).lower():
                    observed.append(error)

    watcher = threading.Thread(target=watch_v1)
    watcher.start()
    env = subprocess_env(hub, tmp_path / "cache", tmp_path, HF_TOKEN=TOKEN, **FAST_SUBPROCESS_ENV)
    uploads = [
        subprocess.Popen([sys.executable, "-m", "tpu_kernels.cli", "upload", str(build), "--repo-id", REPO],
                         env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for build in builds
    ]
    outputs = [upload.communicate(timeout=600) for upload in uploads]
    stop.set()
    watcher.join()

    landed = 0
    for index, (upload, (stdout, stderr)) in enumerate(zip(uploads, outputs)):
        if upload.returncode != 0:
            assert "upload failed:" in stderr and "Traceback" not in stderr, stderr[-3000:]
            continue
        landed += 1
        commit = re.search(r"build on v1: .*?([0-9a-f]{40})", stdout).group(1)
        assert remote_files(api, commit) == expected[index], stdout
    assert landed >= 1
    final = remote_files(api, "v1")
    assert final in expected
    assert remote_files(api, "main") == {"README.md": final["README.md"]}
    assert observed and all(tree in expected for tree in observed), [
        tree if not isinstance(tree, dict) else sorted(tree) for tree in observed if tree not in expected][:3]
    staging = [b.name for b in api.list_repo_refs(REPO, repo_type="kernel").branches if b.name.startswith("upload-")]
    assert staging == []


def test_a_build_with_an_extra_file_is_not_uploaded(hub, tmp_path):
    build = make_build(tmp_path, answer=1)
    (build / "build" / "torch-cpu" / "_planted").mkdir()
    (build / "build" / "torch-cpu" / "_planted" / "__init__.pyc").write_bytes(b"\0")
    with pytest.raises(KernelIntegrityError, match="Rebuild before uploading"):
        upload_kernel(build, REPO, endpoint=hub.url, token=TOKEN)


# -- the digest format ---------------------------------------------------------------------------


def test_the_digest_is_the_one_kernels_verify_reads(tmp_path):
    # Checks upstream behaviour, so it reaches kernels' private digest type: kernels' own verification
    # (`Digest.hash_variant` + `validate`, what its loader runs) must accept the digest our builder writes.
    from kernels._rust import Digest, DigestAlgorithm

    from tpu_kernels.distribution.builder import build_kernel_repo

    built = build_kernel_repo(REPO_ROOT / "kernel_repos" / "rmsnorm-tpu", tmp_path)
    for variant in sorted((built / "build").iterdir()):
        metadata = Metadata.read_from_file(variant / "metadata.json")
        rehashed = Digest.hash_variant(DigestAlgorithm.SHA256, variant)
        assert metadata.digest.files == rehashed.files
        metadata.digest.validate(rehashed)  # kernels verify's own comparison


def test_blob_ids_are_git_blob_ids():
    assert git_blob_id(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"  # `git hash-object` of it


# -- kernelize: integrity and trust always raise; fallback only when a kernel cannot serve ---------


@pytest.fixture(scope="module")
def tiny_model():
    from .test_kernelize import _tiny_model

    return _tiny_model


def experts_from(repo: str) -> dict:
    return {"experts": repo, "rmsnorm": None, "attention": None}


def test_kernelize_raises_a_tampered_kernel_even_with_fallback(hub, client, tmp_path, tiny_model):
    from tpu_kernels import kernelize

    publication = publish(hub, make_build(tmp_path, answer=5))
    variant = download(hub, client, publication.build_oid)
    write_through_link(variant / "_value.py", "VALUE = 666\n")
    model = tiny_model("qwen3_moe")
    with pytest.raises(KernelIntegrityError, match="_value.py"):
        kernelize(model, repos=experts_from(f"{REPO}@1"), use_fallback=True)
    assert not hasattr(model, "tpu_kernels_report")


def test_kernelize_raises_an_untrusted_publisher_even_with_fallback(hub, client, tmp_path, tiny_model):
    from tpu_kernels import kernelize

    publish(hub, make_build(tmp_path, answer=5), repo_id="someone/answer")
    with pytest.raises(ValueError, match="not from a trusted publisher"):
        kernelize(tiny_model("qwen3_moe"), repos=experts_from("someone/answer@1"), use_fallback=True)


def test_kernelize_falls_back_only_when_the_kernel_cannot_serve(hub, client, tmp_path, tiny_model):
    from tpu_kernels import kernelize

    publish(hub, make_build(tmp_path, answer=5, backends=("tpu",)))
    model = kernelize(tiny_model("qwen3_moe"), repos=experts_from(f"{REPO}@1"))
    (entry,) = [e for e in model.tpu_kernels_report.entries if e.kind == "experts"]
    assert not entry.replaced and entry.reason.startswith("the kernel has no build for this system")
    with pytest.raises(VariantNotFoundError):
        kernelize(tiny_model("qwen3_moe"), repos=experts_from(f"{REPO}@1"), use_fallback=False)
    with pytest.raises(ValueError, match="Version 7 not found"):
        kernelize(tiny_model("qwen3_moe"), repos=experts_from(f"{REPO}@7"))


def test_rmsnorm_from_the_hub_cache_is_replaced(hub, client, tmp_path, tiny_model):
    import torch

    from tpu_kernels import kernelize
    from tpu_kernels.distribution.builder import build_kernel_repo

    repo = f"{TRUSTED}/rmsnorm-tpu"
    publish(hub, build_kernel_repo(REPO_ROOT / "kernel_repos" / "rmsnorm-tpu", tmp_path / "build"), repo_id=repo)
    model = tiny_model("qwen3_moe")
    prompt = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        eager = model(prompt).logits
        kernelize(model, repos={"experts": None, "rmsnorm": f"{repo}@1", "attention": None})
        ours = model(prompt).logits
    (entry,) = model.tpu_kernels_report.replaced("rmsnorm")
    assert entry.source == f"{repo}@1" and len(entry.modules) == 9
    modules = dict(model.named_modules())
    assert all(modules[name].forward.__func__.__module__.startswith("_rmsnorm_tpu_cpu_") for name in entry.modules)
    assert (ours - eager).abs().max().item() <= 1e-4


def test_a_local_build_is_verified_before_kernelize_imports_it(tmp_path, tiny_model):
    from tpu_kernels import kernelize

    build = make_build(tmp_path, answer=5)
    (build / "build" / CPU_VARIANT / "_value.py").write_text("VALUE = 666\n")
    with pytest.raises(KernelIntegrityError, match="Rebuild it"):
        kernelize(tiny_model("qwen3_moe"), repos=experts_from(str(build)))


def test_the_upload_commit_names_its_parent(hub, tmp_path, monkeypatch):
    """Every commit an upload makes carries parent_commit: the Hub refuses it if the branch moved."""
    parents = []
    real_create_commit = HfApi.create_commit

    def recording(self, repo_id, *args, **kwargs):
        parents.append((kwargs.get("revision"), kwargs.get("parent_commit")))
        return real_create_commit(self, repo_id, *args, **kwargs)

    monkeypatch.setattr(HfApi, "create_commit", recording)
    publish(hub, make_build(tmp_path, answer=1))
    publish(hub, make_build(tmp_path, answer=2))
    assert len(parents) == 4 and all(parent is not None for _, parent in parents), parents
    # an unchanged build and card make no commit
    build = make_build(tmp_path, answer=3)
    publish(hub, build)
    count = len(parents)
    publish(hub, build)
    assert len(parents) == count
