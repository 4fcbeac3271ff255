from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def local_agent_registry(tmp_path):
    """For a test that talks to a Hub in this process: huggingface_hub's agent registry from a local copy."""
    from .hub_support import loopback_only

    with loopback_only(tmp_path):
        yield
