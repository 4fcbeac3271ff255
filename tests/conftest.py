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
