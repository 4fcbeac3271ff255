import itertools
import logging
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def hub(tmp_path):
    """A Hub in this process with the loader tests' token, trusting their publisher (loader_support.TRUSTED)."""
    from tpu_kernels.distribution.hub import start_hub

    from .loader_support import TOKEN, TRUSTED

    with start_hub(tmp_path / "hub", token=TOKEN, trusted_orgs=[TRUSTED]) as running:
        yield running


@pytest.fixture
def client(monkeypatch, tmp_path, hub) -> Path:
    """huggingface_hub and kernels in this process, as if HF_ENDPOINT and KERNELS_CACHE had been set."""
    from .loader_support import point_clients_at

    cache = tmp_path / "kernels-cache"
    point_clients_at(monkeypatch, hub.url, cache)
    return cache


@pytest.fixture
def local_agent_registry(tmp_path):
    """For a test that talks to a Hub in this process: huggingface_hub's agent registry from a local copy."""
    from .hub_support import loopback_only

    with loopback_only(tmp_path):
        yield


@pytest.fixture
def api(hub):
    """huggingface_hub's client of the test module's `hub`, with its token."""
    from huggingface_hub import HfApi

    return HfApi(endpoint=hub.url, token=hub.token)


_repo_names = itertools.count()


@pytest.fixture
def repo(api) -> str:
    """A new kernel repo on the test module's `hub` whose main holds README.md and c/d.txt; its id."""
    from .hub_support import add

    repo_id = f"org/kernel-{next(_repo_names)}"
    api.create_repo(repo_id, repo_type="kernel")
    api.create_commit(repo_id, repo_type="kernel", commit_message="seed",
                      operations=[add("README.md", b"# card\n"), add("c/d.txt", b"d")])
    return repo_id


@pytest.fixture
def errors_logged(caplog):
    """The server's log records at ERROR and above (a traceback is one)."""
    caplog.set_level(logging.WARNING)
    return lambda: [record for record in caplog.records if record.levelno >= logging.ERROR]


@pytest.fixture
def renders(monkeypatch):
    """One item per card markdown-it parses."""
    from tpu_kernels.distribution.hub import card

    counted = []
    parse = card._MARKDOWN.parse

    def counting(*args, **kwargs):
        counted.append(1)
        return parse(*args, **kwargs)

    monkeypatch.setattr(card._MARKDOWN, "parse", counting)
    return counted


@pytest.fixture(scope="session")
def kernel_builds(tmp_path_factory) -> dict[str, Path]:
    """Every kernel repo built once per test session: {repo folder name: build folder}."""
    from tpu_kernels.distribution.builder import build_kernel_repo

    out = tmp_path_factory.mktemp("kernel_builds")
    repos = sorted(build_toml.parent for build_toml in (REPO_ROOT / "kernel_repos").glob("*/build.toml"))
    return {repo.name: build_kernel_repo(repo, out) for repo in repos}


@pytest.fixture(scope="session")
def ragged_dot_kernel(kernel_builds):
    """The torch-cpu variant of ragged-dot-tpu, as get_local_kernel loads it."""
    from tpu_kernels.distribution.loader import get_local_kernel

    return get_local_kernel(kernel_builds["ragged-dot-tpu"], backend="cpu")


@pytest.fixture
def private_temp(tmp_path, monkeypatch):
    """A temporary folder of this test's own for the loader's private copies, and a fresh root in it."""
    import tempfile

    from tpu_kernels.distribution.loader import private_copies

    folder = tmp_path / "tmp"
    folder.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.setattr(private_copies, "_private_root", None)
    monkeypatch.setattr(private_copies, "_PRIVATE_COPIES", {})
    return folder
