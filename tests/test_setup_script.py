"""scripts/system-packages.sh (run by scripts/setup.sh): Chromium installed when missing and installable,
otherwise a clear message. The system commands it uses are stubs that log their calls."""

import subprocess
from pathlib import Path

import pytest

from .conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "system-packages.sh"
INSTALL = "env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core"


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)


def _run(tmp_path, *, uid: int, chromium: bool, apt: bool, sudo: str | None):
    """Runs the script with only the stubs on PATH; returns (exit code, stderr, the logged calls)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    log.touch()
    record = f'echo "${{0##*/}} $*" >> {log}'
    _stub(bin_dir, "id", f'[ "$1" = -u ] && echo {uid}')
    _stub(bin_dir, "env", f'{record}\nshift; "$@"')  # drops the DEBIAN_FRONTEND=... assignment
    if chromium:
        _stub(bin_dir, "chromium", "exit 0")
    if apt:
        _stub(bin_dir, "apt-get", record)
    if sudo == "passwordless":
        _stub(bin_dir, "sudo", f'{record}\nshift; "$@"')
    elif sudo == "asks":
        _stub(bin_dir, "sudo", f'{record}\nexit 1')
    result = subprocess.run(["/bin/bash", str(SCRIPT)], env={"PATH": str(bin_dir)}, capture_output=True, text=True,
                            timeout=60)
    return result.returncode, result.stderr, log.read_text().splitlines()


def test_present_chromium_installs_nothing(tmp_path):
    code, err, calls = _run(tmp_path, uid=1000, chromium=True, apt=True, sudo=None)
    assert (code, err, calls) == (0, "", [])


@pytest.mark.parametrize("uid,sudo", [(0, None), (1000, "passwordless")])
def test_missing_chromium_is_installed_with_apt(tmp_path, uid, sudo):
    code, err, calls = _run(tmp_path, uid=uid, chromium=False, apt=True, sudo=sudo)
    assert code == 0, err
    installs = [call for call in calls if call.startswith("env")]
    assert installs == ["env DEBIAN_FRONTEND=noninteractive apt-get update -q", INSTALL]
    assert calls[-1] == "apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core"
    if sudo:
        assert [call for call in calls if call.startswith("sudo")] == [
            "sudo -n true", f"sudo -n {installs[0]}", f"sudo -n {installs[1]}"]


@pytest.mark.parametrize("uid,apt,sudo", [(1000, True, None), (1000, True, "asks"), (0, False, None)])
def test_missing_chromium_that_cannot_be_installed_is_named(tmp_path, uid, apt, sudo):
    code, err, calls = _run(tmp_path, uid=uid, chromium=False, apt=apt, sudo=sudo)
    assert code == 0  # the rest of the setup goes on: only the browser tests need Chromium
    assert "Chromium is missing" in err and "tests/test_hub_browser.py" in err
    assert "apt-get install --no-install-recommends chromium fonts-dejavu-core" in err
    assert not [call for call in calls if "apt-get" in call]


def test_setup_runs_the_system_packages_script():
    setup = (REPO_ROOT / "scripts" / "setup.sh").read_text()
    assert "\nscripts/system-packages.sh\n" in setup
    assert "apt-get" not in (REPO_ROOT / ".ci" / "run").read_text()  # CI relies on the setup
