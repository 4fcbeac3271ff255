"""Shared by the local-Hub client, page and browser tests: a Hub holding the three built kernel
repos, and the real CLIs run against it in subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from huggingface_hub import constants

from tpu_kernels.builder import build_kernel_repo
from tpu_kernels.hub import RunningHub, start_hub
from tpu_kernels.publish import upload_kernel

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKEN = "test-token-" + os.urandom(4).hex()
TRUSTED = "tpu-kernels"
KERNEL_NAMES = ("ragged-dot-tpu", "rmsnorm-tpu", "attention-tpu")
CLI_TIMEOUT = 180
BIN = Path(sys.executable).parent


@dataclass
class PublishedHub:
    hub: RunningHub
    builds: dict[str, Path]  # kernel name -> its build folder
    commits: dict[str, str]  # repo id -> the commit its v1 holds

    @property
    def url(self) -> str:
        return self.hub.url


@contextmanager
def loopback_only(folder: Path) -> Iterator[None]:
    """The first time huggingface_hub builds request headers in a process, it fetches an agent registry
    from HF_ENDPOINT (huggingface.co in this process) unless a copy is cached: give it one."""
    registry = folder / "agent-harnesses.json"
    registry.write_text(json.dumps({"standardEnvVars": [], "harnesses": {}}))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(constants, "AGENT_HARNESSES_PATH", str(registry))
        yield


@contextmanager
def published_hub(root: Path) -> Iterator[PublishedHub]:
    """A Hub under `root` where tpu-kernels (a trusted publisher) has published v1 of the three kernels."""
    with loopback_only(root), start_hub(root / "hub", token=TOKEN, trusted_orgs=[TRUSTED]) as hub:
        builds, commits = {}, {}
        for name in KERNEL_NAMES:
            builds[name] = build_kernel_repo(REPO_ROOT / "kernel_repos" / name, root / "build")
            commits[f"{TRUSTED}/{name}"] = upload_kernel(builds[name], f"{TRUSTED}/{name}", endpoint=hub.url,
                                                         token=TOKEN).build_oid
        yield PublishedHub(hub, builds, commits)


def cli_env(hub_url: str, home: Path, token: str | None = TOKEN) -> dict[str, str]:
    """The environment of a user of this Hub: HF_ENDPOINT, their own caches, and the token."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("HF_", "KERNELS_", "LOCAL_KERNELS"))}
    env.update(
        HF_ENDPOINT=hub_url,
        HF_HOME=str(home / "hf-home"),
        KERNELS_CACHE=str(home / "kernels-cache"),
        HF_HUB_DISABLE_UPDATE_CHECK="1",
        # Our kernels need no TPU runtime here: skipping torch_tpu's autoload halves each start-up.
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",
        NO_COLOR="1",
        COLUMNS="250",
    )
    if token is not None:
        env["HF_TOKEN"] = token
    return env


def run_cli(program: str, *args: str, env: dict[str, str], returncode: int = 0) -> subprocess.CompletedProcess:
    """Run `kernels ...` or `hf ...`; check its exit code, and that it printed no traceback."""
    result = subprocess.run([str(BIN / program), *args], env=env, capture_output=True, text=True,
                            timeout=CLI_TIMEOUT, stdin=subprocess.DEVNULL)
    output = result.stdout + result.stderr
    assert result.returncode == returncode, f"{program} {' '.join(args)} -> {result.returncode}\n{output[-4000:]}"
    assert "Traceback" not in output, output[-4000:]
    return result
