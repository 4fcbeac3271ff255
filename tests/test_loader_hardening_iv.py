"""The loader's part of the fourth hardening round (issue 64): kernelize's flash route loads only the module the
loader verified (N2-L1), the private-copy root is locked as it is made (N2-L3), deep nesting and special files
are refused with one line (N2-L2), and one version grammar serves the pages and the loader (N2-H1)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import uuid

import pytest
import torch
import transformers
from huggingface_hub import HfApi, get_session
from transformers.modeling_flash_attention_utils import lazy_import_flash_attention

from tpu_kernels import kernelize
from tpu_kernels.distribution.digest import KernelIntegrityError, digest_field
from tpu_kernels.distribution.loader import get_kernel, get_local_kernel, load_kernel, private_copies

from .conftest import REPO_ROOT
from .loader_support import REPO, TOKEN, TRUSTED, cached_variant, make_build, publish

pytestmark = pytest.mark.usefixtures("local_agent_registry")

FLASHY = f"{TRUSTED}/flashy"

# An attention kernel as kernelize's flash route needs it; its flash functions answer with VALUE.
_FLASH_KERNEL = """from ._value import VALUE

SUPPORTED_HEAD_DIMS = (16,)


def answer():
    return VALUE


def attention_forward(module, query, key, value, attention_mask, **kwargs):
    return query.transpose(1, 2) * VALUE, None


def attention_mask(*args, **kwargs):
    return None


def flash_attn_func(q, k, v, **kwargs):
    return q * VALUE


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
    return q * VALUE
"""


def _write_variant(variant, init: str, kernel_id: str) -> None:
    """`init` as the variant's __init__.py, and metadata.json naming `kernel_id` with a digest that matches."""
    (variant / "__init__.py").write_text(init)
    metadata_path = variant / "metadata.json"
    metadata = json.loads(metadata_path.read_text())
    metadata_path.unlink()
    metadata.update(id=kernel_id, digest=digest_field(variant))
    metadata_path.write_text(json.dumps(metadata))


def _flash_build(tmp_path, answer: int):
    build = make_build(tmp_path, answer=answer, name="flashy")
    for variant in (build / "build").iterdir():
        _write_variant(variant, f"{_FLASH_KERNEL}\n# answers {answer}\n", f"_flashy_{variant.name[6:]}_{uuid.uuid4().hex[:10]}")
    return build


def _tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def _kernelize_attention(version: int):
    model = kernelize(_tiny_llama(), repos={"experts": None, "rmsnorm": None, "attention": f"{FLASHY}@{version}"})
    assert "generate and generate_batch" in model.tpu_kernels_report.replaced("attention")[0].note
    return model, model.config._attn_implementation


def _flash_varlen(name: str):
    return lazy_import_flash_attention(name)[0][1]


@pytest.mark.slow
def test_the_flash_route_never_runs_cache_blobs_rewritten_after_the_check(hub, client, tmp_path):
    """F2's attacker rewrites the cached __init__.py and metadata.json (a new kernel id, a digest that matches)
    after the verified load; transformers loads the kernel again when another flash kernel was loaded in between."""
    publish(hub, _flash_build(tmp_path, answer=1), repo_id=FLASHY, version=1)
    publish(hub, _flash_build(tmp_path, answer=2), repo_id=FLASHY, version=2)
    verified = get_kernel(FLASHY, version=1)
    _, name = _kernelize_attention(1)
    commit = HfApi().repo_info(FLASHY, repo_type="kernel", revision="v1").sha
    variant = cached_variant(client, commit, repo_id=FLASHY)
    marker = tmp_path / "rewritten code ran"
    tampered = tmp_path / "tampered"
    tampered.mkdir()
    for file in ("_value.py", "metadata.json"):
        (tampered / file).write_bytes((variant / file).read_bytes())
    _write_variant(tampered, f"open({str(marker)!r}, 'w').close()\n" + _FLASH_KERNEL, "_flashy_cpu_attacker")
    for file in ("__init__.py", "metadata.json"):
        (variant / file).resolve().write_bytes((tampered / file).read_bytes())

    _kernelize_attention(2)  # transformers' flash path now holds v2
    assert _flash_varlen(name) is verified.flash_attn_varlen_func
    assert not marker.exists()


@pytest.mark.slow
def test_unstable_kernels_all_latest_does_not_move_the_flash_route(hub, client, tmp_path, monkeypatch):
    publish(hub, _flash_build(tmp_path, answer=1), repo_id=FLASHY, version=1)
    publish(hub, _flash_build(tmp_path, answer=2), repo_id=FLASHY, version=2)
    monkeypatch.setenv("UNSTABLE_KERNELS_ALL_LATEST", "1")
    _, name = _kernelize_attention(1)
    query = torch.rand(3, 2, 16) + 0.5
    assert torch.equal(_flash_varlen(name)(query, query, query, None, None, 3, 3), query)
    assert _flash_varlen(name) is get_kernel(FLASHY, version=1).flash_attn_varlen_func


def test_a_concurrent_load_cannot_delete_a_root_not_yet_locked(tmp_path, private_temp, monkeypatch):
    """Another process's clean-up runs at the worst moment: after this process made its root, before it holds the
    lock. The root it removes must not be this one."""
    build = make_build(tmp_path, answer=5)
    flock = fcntl.flock
    interleaved = []

    def flock_after_a_concurrent_clean_up(fd, operation):
        if not interleaved:
            interleaved.append(True)
            private_copies._remove_abandoned_roots(private_temp, keep=None)
        return flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock_after_a_concurrent_clean_up)
    assert get_local_kernel(build, backend="cpu").answer() == 5
    assert interleaved
    (root,) = private_temp.glob("tpu-kernels-verified-*")
    monkeypatch.setattr(fcntl, "flock", flock)
    with open(root / ".owner.lock") as lock, pytest.raises(BlockingIOError):
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)


_DEEP_JSON = "[" * 5000 + "]" * 5000


def test_a_deeply_nested_metadata_json_is_refused_and_dropped(hub, client, tmp_path):
    """A Hub (or publisher) serving a metadata.json too deep for Python's parser: KernelIntegrityError, and the
    variant leaves the cache, as any refused variant does."""
    build = make_build(tmp_path, answer=3)
    for variant in (build / "build").iterdir():
        path = variant / "metadata.json"
        path.write_text(path.read_text()[:-1] + f', "nested": {_DEEP_JSON}}}')
    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo(REPO, repo_type="kernel")
    api.create_branch(REPO, repo_type="kernel", branch="v1")
    commit = api.upload_folder(repo_id=REPO, repo_type="kernel", folder_path=build, revision="v1").oid
    with pytest.raises(KernelIntegrityError, match="nests too deeply"):
        get_kernel(REPO, version=1)
    assert not cached_variant(client, commit).exists()


def test_a_deeply_nested_lock_file_is_refused_in_one_line(tmp_path):
    lockfile = tmp_path / "kernels.lock"
    lockfile.write_text(_DEEP_JSON)
    with pytest.raises(ValueError, match="nests too deeply"):
        load_kernel(REPO, lockfile=lockfile)


@pytest.fixture
def kernel_source(tmp_path):
    source = tmp_path / "rmsnorm-tpu"
    shutil.copytree(REPO_ROOT / "kernel_repos" / "rmsnorm-tpu", source,
                    ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    return source


def _deepen_build_toml(source):
    (source / "build.toml").write_text(f"nested = {_DEEP_JSON}\n" + (source / "build.toml").read_text())
    return source / "build.toml"


def _deepen_package(source):
    init = source / "torch-ext" / "rmsnorm_tpu" / "__init__.py"
    init.write_text(init.read_text() + "\nDEEP = 1" + " + 1" * 200_000 + "\n")
    return init


def _pipe_in_benchmarks(source):
    (source / "benchmarks").mkdir(exist_ok=True)
    os.mkfifo(source / "benchmarks" / "pipe")
    return source / "benchmarks" / "pipe"


@pytest.mark.parametrize("plant", [_deepen_build_toml, _deepen_package, _pipe_in_benchmarks])
def test_build_refuses_deep_nesting_and_special_files_in_one_line(tmp_path, kernel_source, plant, capsys):
    from tpu_kernels import cli

    planted = plant(kernel_source)
    assert cli.main(["build", str(kernel_source), "--out", str(tmp_path / "build")]) == 1
    error = capsys.readouterr().err
    assert str(planted) in error and "Traceback" not in error and len(error.strip().splitlines()) == 1


def test_upload_refuses_a_named_pipe_and_publishes_nothing(hub, tmp_path, kernel_source):
    from tpu_kernels.distribution.builder import build_kernel_repo
    from tpu_kernels.distribution.links import SpecialFileError
    from tpu_kernels.distribution.publish import upload_kernel

    built = build_kernel_repo(kernel_source, tmp_path / "build")
    pipe = _pipe_in_benchmarks(built)
    with pytest.raises(SpecialFileError, match="named pipe") as refused:  # `tpu-kernels upload` prints it, exits 1
        upload_kernel(built, "org/piped", endpoint=hub.url, token=TOKEN)
    assert refused.value.path == pipe
    assert not (hub.storage.root / "repos" / "kernel" / "org" / "piped").exists()


def test_a_v01_branch_is_no_version_on_the_pages_nor_to_the_loader(hub, client, tmp_path):
    """`v01` beside `v1`: the loader's version 1 is `v1`, so the pages list only `v1` as version 1, and the `v01`
    page's snippet loads `v01` by name, the commit it shows."""
    from .hub_support import visible_text

    publish(hub, make_build(tmp_path, answer=1), version=1)
    publish(hub, make_build(tmp_path, answer=2), version=2)
    api = HfApi(endpoint=hub.url, token=TOKEN)
    second = api.repo_info(REPO, repo_type="kernel", revision="v2").sha
    api.create_branch(REPO, repo_type="kernel", branch="v01", revision=second)
    api.delete_branch(REPO, repo_type="kernel", branch="v2")
    assert get_kernel(REPO, version=1).answer() == 1
    session = get_session()
    front = visible_text(session.get(f"{hub.url}/").text)
    assert f"{REPO} kernel v1 updated" in front and "v01" not in front
    text = visible_text(session.get(f"{hub.url}/kernels/{REPO}/tree/v01").text)
    assert f'get_kernel("{REPO}", revision="v01")' in text and f"at {second[:10]}" in text
    versions = text[text.index("Versions"):text.index("Tags")]
    assert "v01" not in versions and "v1" in versions
