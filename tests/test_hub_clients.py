"""The local Hub with the real clients, unmodified: the `kernels` and `hf` CLIs (subprocesses) and
the HfApi calls a kernel publisher makes (this process), against one server for the module that
holds the three built kernel repos. What the server does not support must be refused with a 400
that says so, never with a 404 a client reads as a missing repo, file or revision."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import LFSFileInfo, RepoFile
from huggingface_hub.utils import get_session, hf_raise_for_status

from tpu_kernels.distribution.publish import upload_kernel

from .hub_support import BIN, CLI_TIMEOUT, KERNEL_NAMES, TOKEN, TRUSTED, cli_env, published_fixture, run_cli

published = published_fixture("hub-clients")


@pytest.fixture(scope="module")
def env(published, tmp_path_factory) -> dict[str, str]:
    return cli_env(published.url, tmp_path_factory.mktemp("cli-user"))


@pytest.fixture(scope="module")
def api(published) -> HfApi:
    return HfApi(endpoint=published.url, token=TOKEN)


@pytest.fixture(scope="module")
def anonymous(published) -> HfApi:
    return HfApi(endpoint=published.url, token=False)


def small_build(folder: Path, answer: int) -> Path:
    """A build-shaped folder: README.md and one variant."""
    variant = folder / "build" / "torch-cpu"
    variant.mkdir(parents=True)
    (folder / "README.md").write_text(f"# answer {answer}\n")
    (variant / "__init__.py").write_text("from ._value import VALUE\n")
    (variant / "_value.py").write_text(f"VALUE = {answer}\n")
    return folder


def run_python(code: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`python -c code args` as a user of this Hub runs it; it must succeed."""
    result = subprocess.run([str(BIN / "python"), "-c", code, *args], env=env, capture_output=True, text=True,
                            timeout=CLI_TIMEOUT, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def local_files(folder: Path) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(folder.rglob("*"))
            if path.is_file() and ".cache" not in path.parts}


# -- the kernels CLI and API -----------------------------------------------------------------------


@pytest.mark.multiprocess
def test_kernels_variants_lists_each_version_with_its_variants(published, env, api):
    # It lists the tree at revision `refs/heads/v<N>`: this was a 404 "Invalid rev id".
    repo = f"{TRUSTED}/ragged-dot-tpu"
    api.create_branch(repo, repo_type="kernel", branch="v2", revision="v1")
    variants = ("torch-cpu compatible, preferred ✅\n"
                "torch-tpu: backend (tpu) does not match system backend (cpu) and is not universal")
    expected = f"Version 1:\n\n{variants}\nVersion 2:\n\n{variants}".split()
    assert run_cli("kernels", "variants", "--all-versions", repo, env=env).stdout.split() == expected
    # `kernels versions`, deprecated in kernels 0.19, still answers the same.
    versions = run_cli("kernels", "versions", repo, env=env)
    assert versions.stdout.split() == expected
    assert "`kernels versions` is deprecated" in versions.stderr
    api.delete_branch(repo, repo_type="kernel", branch="v2")


VARIANT_CHOICE = """
import json, sys, types
import kernels, torch

def decisions(**kwargs):
    return [[decision.variant.variant_str, isinstance(decision, kernels.VariantAccepted)]
            for decision in kernels.get_kernel_variants(sys.argv[1], version=1, **kwargs)]

choice = {"this host": decisions()}
try:
    decisions(backend="tpu")
except ValueError as error:
    choice["backend=tpu here"] = str(error)
# What kernels 0.19 reads to detect a TPU host; torch_tpu sets it so on one.
torch.accelerator.current_accelerator = lambda *args, **kwargs: types.SimpleNamespace(type="tpu")
choice["a TPU host"] = decisions()
print(json.dumps(choice))
"""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_kernels_takes_the_cpu_variant_here_and_the_tpu_variant_on_a_tpu_host(published, env):
    result = run_python(VARIANT_CHOICE, f"{TRUSTED}/attention-tpu", env=env)
    assert json.loads(result.stdout) == {
        "this host": [["torch-cpu", True], ["torch-tpu", False]],
        # Off a TPU host kernels accepts no TPU backend, even asked for.
        "backend=tpu here": "Invalid backend 'tpu', system supported backends: cpu",
        "a TPU host": [["torch-tpu", True], ["torch-cpu", False]],
    }


GET_KERNEL = """
import json, sys
import kernels, torch

repo = sys.argv[1]
refused = []
for trust in (False, ["someone/else"]):
    try:
        kernels.get_kernel(repo, version=1, trust_remote_code=trust)
    except ValueError as error:
        refused.append(str(error))
kernel = kernels.get_kernel(repo, version=1, trust_remote_code=[repo])
x, weight = torch.randn(4, 256), torch.randn(256)
error = (kernel.rms_norm(x, weight, 1e-6) - kernel.reference.rms_norm(x, weight, 1e-6, 0.0)).abs().max()
print(json.dumps({"refused": refused, "variant": kernel.__file__.split("/")[-2], "error": float(error)}))
"""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_kernels_get_kernel_loads_an_allowed_repo_of_an_untrusted_publisher_quietly(published, env, tmp_path):
    env = {**env, "KERNELS_CACHE": str(tmp_path / "kernels-cache")}
    repo = "someone/rmsnorm-tpu"
    upload_kernel(published.builds["rmsnorm-tpu"], repo, endpoint=published.url, token=TOKEN)
    # The one notice left is torch_tpu's, when it is imported on a host without tcmalloc: its own message says
    # to silence it so. No progress bars: they are not warnings.
    quiet = {**env, "PYTHONWARNINGS": "ignore:<TorchTpu/Performance/TcMalloc/", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    result = run_python(GET_KERNEL, repo, env=quiet)
    assert result.stderr == ""
    loaded = json.loads(result.stdout)
    untrusted = (f"Kernel repository '{repo}' is not from a trusted publisher. Set trust_remote_code=True or add the "
                 "repository ID to the trust_remote_code allowlist to allow loading kernels from untrusted sources.")
    assert loaded["refused"] == [untrusted, untrusted]
    assert loaded["variant"] == "torch-cpu" and loaded["error"] < 1e-5

    # The cache holds v1 of that repo with the one variant get_kernel fetched.
    cached = json.loads(run_cli("kernels", "cache", "ls", "--json", env=env).stdout)
    assert [(entry["repo_id"], [(version["version"], version["variants"]) for version in entry["versions"]])
            for entry in cached["repos"]] == [(repo, [("v1", ["torch-cpu"])])]


# What attention-tpu's build exports (its `__all__` functions), as `kernels describe-api` lists them.
ATTENTION_FUNCTIONS = ["supports_head_dims", "attention_forward", "attention_mask", "flash_attention",
                       "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "ragged_paged_attention",
                       "ragged_varlen_attention", "latent_attention", "latent_attention_forward", "serve_latent",
                       "latent_refusal"]


@pytest.mark.multiprocess
def test_kernels_describe_api_lists_what_a_published_build_exports(published, env):
    repo = f"{TRUSTED}/rmsnorm-tpu"
    lines = [line for line in run_cli("kernels", "describe-api", repo, env=env).stdout.splitlines() if line.strip()]
    assert lines == [f"Repository: {repo}", "Revision: v1", "Variant: torch-cpu", "Functions:", "  fused_add_rms_norm",
                     "  rms_norm", "Layers:", "  RMSNorm  has_backward=True  can_torch_compile=True",
                     "  RMSNormZeroCentered  has_backward=True  can_torch_compile=True"]

    repo = f"{TRUSTED}/attention-tpu"
    described = json.loads(run_cli("kernels", "describe-api", repo, "--version", "1", "--json", env=env).stdout)
    symbols = json.loads((published.builds["attention-tpu"] / "build" / "torch-cpu" / "symbols.json").read_text())
    assert described == {**symbols, "repo_id": repo, "revision": "v1", "variant": "torch-cpu"}
    assert [function["name"] for function in described["functions"]] == ATTENTION_FUNCTIONS


@pytest.mark.multiprocess
@pytest.mark.slow
def test_kernels_describe_api_of_an_untrusted_publisher_needs_trust_remote_code(published, env, api):
    repo = "someone/attention-tpu"
    upload_kernel(published.builds["attention-tpu"], repo, endpoint=published.url, token=TOKEN)
    refused = run_cli("kernels", "describe-api", repo, env=env, returncode=1)
    assert f"Kernel repository '{repo}' is not from a trusted publisher" in refused.stderr
    trusted = run_cli("kernels", "describe-api", repo, "--trust-remote-code", "--json", env=env)
    assert [function["name"] for function in json.loads(trusted.stdout)["functions"]] == ATTENTION_FUNCTIONS


@pytest.mark.multiprocess
@pytest.mark.slow
def test_kernels_info_by_version_branch_tag_and_full_ref_name(published, env, api):
    repo = f"{TRUSTED}/rmsnorm-tpu"
    api.create_tag(repo, repo_type="kernel", tag="info-tag", revision="v1")
    for selector in (["--version", "1"], ["--revision", "refs/heads/v1"], ["--revision", "refs/tags/info-tag"]):
        info = json.loads(run_cli("kernels", "info", repo, "--json", *selector, env=env).stdout)
        assert (info["name"], info["version"], info["backends"]) == ("rmsnorm-tpu", 1, ["cpu", "tpu"]), selector


@pytest.mark.multiprocess
@pytest.mark.slow
def test_kernels_lock_then_download_pins_the_published_commits(published, env, tmp_path):
    env = {**env, "KERNELS_CACHE": str(tmp_path / "kernels-cache")}
    project = tmp_path / "project"
    project.mkdir()
    dependencies = "".join(f'"{TRUSTED}/{name}" = 1\n' for name in KERNEL_NAMES)
    (project / "pyproject.toml").write_text(
        f'[project]\nname = "app"\nversion = "0.1"\n\n[tool.kernels.dependencies]\n{dependencies}')
    run_cli("kernels", "lock", str(project), env=env)
    locks = {entry["dependency"]["repo-id"]: entry["lock"]["commit"]
             for entry in json.loads((project / "kernels.lock").read_text())}
    assert locks == published.commits

    cache = Path(env["KERNELS_CACHE"])
    run_cli("kernels", "download", str(project), env=env)
    snapshots = {name: cache / f"kernels--{TRUSTED}--{name}" / "snapshots" / locks[f"{TRUSTED}/{name}"] / "build"
                 for name in KERNEL_NAMES}
    for name, snapshot in snapshots.items():  # the variant for this machine
        assert local_files(snapshot / "torch-cpu") == local_files(published.builds[name] / "build" / "torch-cpu")
    # `kernels lock` fetched every variant's metadata.json at v1: the cache lists v1 with both variants.
    cached = json.loads(run_cli("kernels", "cache", "ls", "--json", env=env).stdout)
    assert {entry["repo_id"]: [(version["version"], version["variants"]) for version in entry["versions"]]
            for entry in cached["repos"]} == {
        f"{TRUSTED}/{name}": [("v1", ["torch-cpu", "torch-tpu"])] for name in KERNEL_NAMES}
    run_cli("kernels", "download", str(project), "--all-variants", env=env)
    for name, snapshot in snapshots.items():
        assert local_files(snapshot) == local_files(published.builds[name] / "build")


@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("sigstore") is not None,
                    reason="kernels[sigstore] is installed: this checks the message of a venv without it")
def test_kernels_verify_signature_without_sigstore_says_what_to_install(published, env):
    result = run_cli("kernels", "verify-signature", "--all-variants", f"{TRUSTED}/attention-tpu", "1",
                     env=env, returncode=1)
    assert (result.stdout, result.stderr.strip()) == ("", "❌ Verifying signatures requires the `sigstore` package, "
                                                          'install it with: pip install "kernels[sigstore]"')


def test_kernels_check_has_moved_to_kernel_builder(env):
    result = run_cli("kernels", "check", f"{TRUSTED}/rmsnorm-tpu", env=env, returncode=1)
    assert result.stderr.strip() == "`kernels check` has moved to `kernel-builder check-abi`"


# -- the hf CLI -------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_hf_cli_publishes_branches_tags_downloads_moves_and_deletes_a_kernel_repo(published, env, api, tmp_path):
    repo, moved = "hf-cli/answer", "hf-cli-moved/answer-renamed"
    build = published.builds["rmsnorm-tpu"]
    run_cli("hf", "repos", "create", repo, "--type", "kernel", env=env)
    run_cli("hf", "upload", repo, str(build), ".", "--repo-type", "kernel", "--revision", "v1", env=env)
    run_cli("hf", "repos", "branch", "create", repo, "v2", "--revision", "refs/heads/v1", "--type", "kernel", env=env)
    run_cli("hf", "repos", "tag", "create", repo, "release-1", "--revision", "refs/heads/v1", "--type", "kernel",
            env=env)
    assert "refs/tags/release-1" in run_cli("hf", "repos", "tag", "list", repo, "--type", "kernel", env=env).stdout

    # Listing the files (hf has no `kernels ls`: a dry run lists what a download would fetch).
    listing = run_cli("hf", "download", repo, "--repo-type", "kernel", "--revision", "refs/heads/v2", "--dry-run",
                      env=env).stdout
    assert all(path in listing for path in local_files(build))
    for revision in ("v1", "refs/heads/v2", "release-1", "refs/tags/release-1"):
        target = tmp_path / revision.replace("/", "_")
        run_cli("hf", "download", repo, "--repo-type", "kernel", "--revision", revision, "--local-dir", str(target),
                env=env)
        assert local_files(target) == local_files(build), revision

    run_cli("hf", "repos", "delete-files", repo, "build/torch-tpu/*", "--type", "kernel", "--revision", "v2", env=env)
    assert not any(path.startswith("build/torch-tpu/")
                   for path in api.list_repo_files(repo, repo_type="kernel", revision="refs/heads/v2"))
    run_cli("hf", "repos", "tag", "delete", repo, "release-1", "--type", "kernel", "-y", env=env)
    run_cli("hf", "repos", "branch", "delete", repo, "v2", "--type", "kernel", env=env)
    refs = api.list_repo_refs(repo, repo_type="kernel")
    assert ([branch.name for branch in refs.branches], refs.tags) == (["main", "v1"], [])

    v1 = api.kernel_info(repo, revision="v1").sha
    run_cli("hf", "repos", "move", repo, moved, "--type", "kernel", env=env)
    assert not api.repo_exists(repo, repo_type="kernel")
    assert api.kernel_info(moved, revision="v1").sha == v1  # commits keep their ids: lock files still resolve
    run_cli("hf", "repos", "delete", moved, "--type", "kernel", "-y", env=env)
    assert not api.repo_exists(moved, repo_type="kernel")
    missing = run_cli("hf", "repos", "delete", moved, "--type", "kernel", "-y", env=env, returncode=1)
    assert "Repository not found" in missing.stderr


@pytest.mark.multiprocess
def test_hf_cli_lists_model_repos_and_files_and_sets_visibility(published, env, anonymous, tmp_path):
    repo = "hf-cli/model"
    run_cli("hf", "repos", "create", repo, env=env)
    run_cli("hf", "upload", repo, str(small_build(tmp_path / "model", 3)), ".", env=env)
    files = run_cli("hf", "models", "ls", repo, "-R", "--format", "json", env=env).stdout
    assert {item["path"]: item["size"] for item in json.loads(files) if "size" in item} == {
        "README.md": 11, "build/torch-cpu/__init__.py": 26, "build/torch-cpu/_value.py": 10}
    assert repo in run_cli("hf", "models", "ls", "--author", "hf-cli", "-q", env=env).stdout.split()
    info = json.loads(run_cli("hf", "models", "info", repo, "--format", "json", env=env).stdout)
    assert sorted(sibling["rfilename"] for sibling in info["siblings"]) == sorted(local_files(tmp_path / "model"))
    assert run_cli("hf", "models", "card", repo, env=env).stdout.strip().endswith("\n# answer 3")

    run_cli("hf", "repos", "settings", repo, "--private", env=env)
    assert not anonymous.repo_exists(repo)
    assert repo not in [model.id for model in anonymous.list_models(author="hf-cli")]
    run_cli("hf", "repos", "settings", repo, "--public", env=env)
    assert anonymous.repo_exists(repo)


@pytest.mark.multiprocess
@pytest.mark.parametrize("command, reason", [
    (["repos", "list"], "the storage listing of repos"),
    (["repos", "duplicate", "hf-cli/refused", "hf-cli/copy"], "duplicating a repo"),
    (["discussions", "list", "hf-cli/refused"], "pull requests and discussions"),
    (["upload", "hf-cli/refused", "{file}", "x.txt", "--create-pr"], "pull requests"),
    (["repos", "create", "hf-cli/data", "--type", "dataset"], "this server holds kernel and model repos only"),
])
def test_hf_cli_refusals_say_what_is_not_supported(published, env, api, tmp_path, command, reason):
    api.create_repo("hf-cli/refused", exist_ok=True)
    (tmp_path / "x.txt").write_text("x")
    result = run_cli("hf", *[part.format(file=tmp_path / "x.txt") for part in command], env=env, returncode=1)
    assert "Bad request" in result.stderr and reason in result.stderr
    assert "not found" not in result.stderr.lower()


# -- HfApi, as a kernel publisher calls it ------------------------------------------------------------


def test_publisher_calls_take_branches_tags_commits_and_full_ref_names(published, api, tmp_path):
    repo = "publisher/answer"
    api.create_repo(repo, repo_type="kernel")
    api.create_repo(repo, repo_type="kernel", exist_ok=True)
    api.create_branch(repo, repo_type="kernel", branch="v1")
    folder = small_build(tmp_path / "build", 1)
    api.upload_folder(repo_id=repo, repo_type="kernel", folder_path=folder, revision="refs/heads/v1",
                      commit_message="build v1")
    head = api.upload_file(path_or_fileobj=b"# card v1\n", path_in_repo="README.md", repo_id=repo,
                           repo_type="kernel", revision="refs/heads/v1").oid
    api.create_tag(repo, repo_type="kernel", tag="release-1", revision="refs/heads/v1")
    api.create_branch(repo, repo_type="kernel", branch="v2", revision="refs/tags/release-1")
    expected = {**local_files(folder), "README.md": b"# card v1\n"}

    for revision in ("v1", "refs/heads/v1", "release-1", "refs/tags/release-1", head, "v2", "refs/heads/v2"):
        assert api.revision_exists(repo, revision, repo_type="kernel"), revision
        assert api.kernel_info(repo, revision=revision).sha == head
        assert api.file_exists(repo, "build/torch-cpu/_value.py", repo_type="kernel", revision=revision)
        assert sorted(api.list_repo_files(repo, repo_type="kernel", revision=revision)) == sorted(expected)
        tree = api.list_repo_tree(repo, path_in_repo="build", recursive=True, repo_type="kernel", revision=revision)
        assert sorted(item.path for item in tree) == ["build/torch-cpu", "build/torch-cpu/__init__.py",
                                                      "build/torch-cpu/_value.py"]
        [info] = api.get_paths_info(repo, ["README.md"], repo_type="kernel", revision=revision)
        assert info.size == len(expected["README.md"])
        assert next(iter(api.list_repo_commits(repo, repo_type="kernel", revision=revision))).commit_id == head
        metadata = get_hf_file_metadata(hf_hub_url(repo, "README.md", repo_type="kernel", revision=revision,
                                                   endpoint=api.endpoint))
        assert metadata.commit_hash == head
        path = api.hf_hub_download(repo, "build/torch-cpu/_value.py", repo_type="kernel", revision=revision,
                                   cache_dir=tmp_path / "cache")
        assert Path(path).read_bytes() == b"VALUE = 1\n"
    # A full ref name names one kind of ref only.
    assert not api.revision_exists(repo, "refs/heads/release-1", repo_type="kernel")
    assert not api.revision_exists(repo, "refs/tags/v1", repo_type="kernel")
    snapshot = api.snapshot_download(repo, repo_type="kernel", revision="refs/tags/release-1",
                                     cache_dir=tmp_path / "cache")
    assert local_files(Path(snapshot)) == expected

    api.create_commit(repo, repo_type="kernel", revision="refs/heads/v2", commit_message="v2",
                      operations=[CommitOperationAdd("build/torch-cpu/_value.py", b"VALUE = 2\n"),
                                  CommitOperationAdd("build/torch-tpu/__init__.py", b"VALUE = 2\n"),
                                  CommitOperationDelete("build/torch-cpu/__init__.py")])
    api.delete_file("README.md", repo, repo_type="kernel", revision="refs/heads/v2")
    api.delete_files(repo, ["build/torch-cpu/*"], repo_type="kernel", revision="refs/heads/v2")
    api.delete_folder("build/torch-tpu", repo, repo_type="kernel", revision="v2")
    assert api.list_repo_files(repo, repo_type="kernel", revision="v2") == []
    with pytest.raises(EntryNotFoundError):
        api.delete_file("README.md", repo, repo_type="kernel", revision="v2")
    assert [commit.title for commit in api.list_repo_commits(repo, repo_type="kernel", revision="v2")][:5] == [
        "Delete folder build/torch-tpu with huggingface_hub", "Delete files build/torch-cpu/* with huggingface_hub",
        "Delete README.md with huggingface_hub", "v2", "Upload README.md with huggingface_hub"]

    api.delete_tag(repo, repo_type="kernel", tag="refs/tags/release-1")
    api.delete_branch(repo, repo_type="kernel", branch="refs/heads/v2")
    refs = api.list_repo_refs(repo, repo_type="kernel")
    assert ([branch.name for branch in refs.branches], refs.tags) == (["main", "v1"], [])
    with pytest.raises(RevisionNotFoundError):
        api.list_repo_files(repo, repo_type="kernel", revision="refs/heads/v2")


def test_delete_and_move_repo(published, api):
    repo, renamed, taken = "movers/kernel", "movers-elsewhere/kernel-renamed", f"{TRUSTED}/rmsnorm-tpu"
    api.create_repo(repo, repo_type="kernel")
    head = api.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id=repo, repo_type="kernel").oid
    with pytest.raises(HfHubHTTPError) as conflict:
        api.move_repo(repo, taken, repo_type="kernel")
    assert conflict.value.response.status_code == 409
    api.move_repo(repo, renamed, repo_type="kernel")
    assert not api.repo_exists(repo, repo_type="kernel")
    assert api.revision_exists(renamed, head, repo_type="kernel")
    with pytest.raises(RepositoryNotFoundError):
        api.move_repo(repo, "movers/other", repo_type="kernel")

    api.delete_repo(renamed, repo_type="kernel")
    assert not api.repo_exists(renamed, repo_type="kernel")
    with pytest.raises(RepositoryNotFoundError):
        api.delete_repo(renamed, repo_type="kernel")
    api.delete_repo(renamed, repo_type="kernel", missing_ok=True)
    api.create_repo(renamed, repo_type="kernel")  # the id is free again, and the new repo starts empty
    assert api.list_repo_files(renamed, repo_type="kernel") == []
    assert len(api.list_repo_commits(renamed, repo_type="kernel")) == 1


def test_a_moved_private_repo_stays_private(published, api, anonymous):
    api.create_repo("movers/private", repo_type="kernel", private=True)
    api.move_repo("movers/private", "movers/private-renamed", repo_type="kernel")
    assert api.kernel_info("movers/private-renamed").private
    assert not anonymous.repo_exists("movers/private-renamed", repo_type="kernel")


def test_visibility_and_listings(published, api, anonymous):
    repo, older = "visibility/model", "visibility/an-older-model"
    api.create_repo(older)
    time.sleep(0.01)  # creation dates have millisecond resolution
    api.create_repo(repo)
    api.update_repo_settings(repo, private=True)
    assert not anonymous.repo_exists(repo)
    assert [model.id for model in api.list_models(author="visibility")] == [older, repo]
    assert [model.id for model in api.list_models(author="visibility", sort="created_at")] == [repo, older]
    assert [model.id for model in api.list_models(search="an-older", limit=1)] == [older]
    assert [model.id for model in anonymous.list_models(author="visibility")] == [older]
    api.update_repo_settings(repo, private=False)
    assert anonymous.repo_exists(repo)
    assert anonymous.auth_check(repo) is None

    kernels = get_session().get(f"{published.url}/api/kernels", params={"author": TRUSTED}).json()
    assert [item["id"] for item in kernels] == sorted(f"{TRUSTED}/{name}" for name in KERNEL_NAMES)


def _raw_unknown_api_calls(api: HfApi, repo: str):
    for method, path in (("POST", f"/api/kernels/{repo}/like"), ("GET", "/api/whoami"), ("GET", "/api/spaces-x")):
        response = get_session().request(method, api.endpoint + path, headers={"Authorization": f"Bearer {TOKEN}"})
        with pytest.raises(HfHubHTTPError) as refused:
            hf_raise_for_status(response)
        assert response.status_code == 400 and "Not supported by this local Hub" in str(refused.value), path
    raise refused.value


def _xet_token_calls(api: HfApi, repo: str):
    for kind in ("read", "write"):
        response = get_session().get(f"{api.endpoint}/api/kernels/{repo}/xet-{kind}-token/main",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        with pytest.raises(HfHubHTTPError) as refused:
            hf_raise_for_status(response)
        assert response.status_code == 400 and "Not supported by this local Hub: Xet storage" in str(refused.value)
    raise refused.value


REFUSED_CALLS = {
    "create_pull_request": lambda api, model, kernel: api.create_pull_request(model, title="change"),
    "get_repo_discussions": lambda api, model, kernel: list(api.get_repo_discussions(model)),
    "create_commit(create_pr=True)": lambda api, model, kernel: api.create_commit(
        kernel, repo_type="kernel", operations=[CommitOperationAdd("x", b"x")], commit_message="x", create_pr=True),
    "super_squash_history": lambda api, model, kernel: api.super_squash_history(model),
    "list_lfs_files": lambda api, model, kernel: list(api.list_lfs_files(kernel, repo_type="kernel")),
    "permanently_delete_lfs_files": lambda api, model, kernel: api.permanently_delete_lfs_files(
        kernel, [LFSFileInfo(fileOid="0" * 64, filename="x", oid="0" * 64, pushedAt="2026-01-01T00:00:00.000Z",
                             ref=None, size=1)], repo_type="kernel"),
    "Xet tokens": lambda api, model, kernel: _xet_token_calls(api, kernel),
    "duplicate_repo": lambda api, model, kernel: api.duplicate_repo(model, "refused/copy"),
    "update_repo_settings(gated)": lambda api, model, kernel: api.update_repo_settings(model, gated="auto"),
    "list_user_repos": lambda api, model, kernel: list(api.list_user_repos(namespace="refused")),
    "create_repo(dataset)": lambda api, model, kernel: api.create_repo("refused/data", repo_type="dataset"),
    "list_models(filter)": lambda api, model, kernel: list(api.list_models(filter="text-generation")),
    "endpoints the server lacks": lambda api, model, kernel: _raw_unknown_api_calls(api, kernel),
}


@pytest.mark.parametrize("call", REFUSED_CALLS)
def test_what_is_not_supported_is_a_400_saying_so_never_a_not_found(published, api, call):
    model, kernel = "refused/model", "refused/kernel"
    api.create_repo(model, exist_ok=True)
    api.create_repo(kernel, repo_type="kernel", exist_ok=True)
    with pytest.raises(HfHubHTTPError) as refused:
        REFUSED_CALLS[call](api, model, kernel)
    assert not isinstance(refused.value, (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError))
    assert refused.value.response.status_code == 400
    assert "Not supported by this local Hub" in str(refused.value)


def test_list_repo_tree_expand_answers_without_last_commit_and_security(published, api):
    expanded = list(api.list_repo_tree(f"{TRUSTED}/rmsnorm-tpu", path_in_repo="build/torch-cpu", expand=True,
                                       repo_type="kernel", revision="v1"))
    plain = list(api.list_repo_tree(f"{TRUSTED}/rmsnorm-tpu", path_in_repo="build/torch-cpu", repo_type="kernel",
                                    revision="v1"))

    def entries(items):
        # Files by their blob id, folders (a kernel's subpackages) by their tree id.
        return [(item.path, item.blob_id if isinstance(item, RepoFile) else item.tree_id) for item in items]

    assert entries(expanded) == entries(plain)
    assert any(not isinstance(item, RepoFile) for item in expanded)
    assert {item.last_commit for item in expanded} == {None}
    assert {item.security for item in expanded if isinstance(item, RepoFile)} == {None}


@pytest.mark.multiprocess
def test_git_clone_is_refused_with_a_400(published, api, tmp_path):
    api.create_repo("git-clone/model", exist_ok=True)
    for url in (f"{published.url}/git-clone/model", f"{published.url}/kernels/{TRUSTED}/rmsnorm-tpu"):
        result = subprocess.run(["git", "clone", "-q", url, str(tmp_path / "clone")], capture_output=True, text=True,
                                timeout=CLI_TIMEOUT, env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
        assert result.returncode != 0 and "The requested URL returned error: 400" in result.stderr, url
