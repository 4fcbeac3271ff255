"""`tpu-kernels bench` runs the project's modelled benchmark of a kernel repo."""

import sys
from pathlib import Path

from tpu_kernels import cli

ROOT = Path(__file__).resolve().parents[1]


def test_bench_runs_the_modelled_benchmark_of_the_repo_with_the_extra_arguments(monkeypatch):
    seen = {}

    def call(command, env):
        seen["command"], seen["env"] = command, env
        return 0

    monkeypatch.setattr(cli.subprocess, "call", call)
    repo = ROOT / "kernel_repos" / "ragged-dot-tpu"
    assert cli.main(["bench", str(repo), "--tokens", "1", "--settings", "deepseek-v3 EP32 dispatch"]) == 0
    assert seen["command"] == [
        sys.executable, str(ROOT / "benchmarks" / "moe_layer.py"), "--repo", str(repo),
        "--tokens", "1", "--settings", "deepseek-v3 EP32 dispatch",
    ]
    assert seen["env"]["JAX_PLATFORMS"]


def test_bench_refuses_a_repo_without_a_modelled_benchmark(capsys):
    assert cli.main(["bench", str(ROOT / "kernel_repos" / "rmsnorm-tpu")]) == 2
    assert "no modelled benchmark" in capsys.readouterr().err


def test_other_commands_still_refuse_unknown_arguments(capsys):
    try:
        cli.main(["build", "kernel_repos/rmsnorm-tpu", "--bogus"])
    except SystemExit as exit_:
        assert exit_.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
