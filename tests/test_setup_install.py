"""scripts/setup.sh's install: pip picks the torch wheel (its configuration knows where the CPU build lies),
uv installs that wheel and the project in one call, byte-compiled. pip, uv and the venv are stubs that log
their calls; the script runs in a copy of scripts/ in a temporary folder."""

import json
import os
import shutil
import subprocess
import sys

from .conftest import REPO_ROOT

WHEEL = "file:///wheels/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl"


def _stub(path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)


def _run_setup(tmp_path, pip_report: str):
    """Runs a copy of setup.sh whose `python3.11 -m venv` makes a venv of stubs: its pip answers a dry run
    with `pip_report` and installs uv as a stub. Returns (exit code, stderr, the logged calls)."""
    root, log = tmp_path / "checkout", tmp_path / "calls.log"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "scripts" / "setup.sh", root / "scripts" / "setup.sh")
    _stub(root / "scripts" / "system-packages.sh", f'echo "system-packages" >> {log}')
    (tmp_path / "report.json").write_text(pip_report)
    uv, venv = tmp_path / "uv-stub", tmp_path / "venv-stubs"
    _stub(uv, f'echo "uv $*" >> {log}')
    pip = (f'echo "pip $*" >> {log}\n'
           'while [ $# -gt 0 ]; do case $1 in\n'
           f'  --target) mkdir -p "$2/bin" && cp {uv} "$2/bin/uv";;\n'
           f'  --report) cat {tmp_path / "report.json"};;\n'
           'esac; shift; done')
    _stub(venv / "pip", pip)
    _stub(venv / "python", f'exec {sys.executable} "$@"')
    bin_dir = tmp_path / "bin"
    _stub(bin_dir / "python3.11", f'mkdir -p "$3" && cp -r {venv} "$3/bin"')
    result = subprocess.run(["/bin/bash", str(root / "scripts" / "setup.sh")], capture_output=True, text=True,
                            env={"PATH": f"{bin_dir}:{os.environ['PATH']}"}, timeout=60)
    return result.returncode, result.stderr, log.read_text().splitlines() if log.exists() else []


def test_uv_installs_the_torch_wheel_pip_picks_with_the_project(tmp_path):
    report = json.dumps({"install": [{"download_info": {"url": WHEEL}}]})
    code, err, calls = _run_setup(tmp_path, report)
    assert code == 0, err
    dry_run = [call for call in calls if "--dry-run" in call]
    assert dry_run == ["pip install -q --dry-run --ignore-installed --no-deps --report - torch==2.13.0"]
    (uv_call,) = [call for call in calls if call.startswith("uv ")]
    assert f"torch @ {WHEEL}" in uv_call and '-e .[test]' in uv_call
    assert "--compile-bytecode" in uv_call.split() and "--python .venv/bin/python" in uv_call
    assert calls[-2:] == ["pip check", "system-packages"]


def test_no_wheel_from_pip_stops_the_setup_before_uv(tmp_path):
    # With no exact wheel, uv would resolve torch itself from PyPI: a multi-GB CUDA build.
    code, _, calls = _run_setup(tmp_path, json.dumps({"install": []}))
    assert code != 0
    assert not [call for call in calls if call.startswith("uv ") or call == "system-packages"]
