"""`python -m benchmarks` (the lab's command line, `benchmarks.cli`) runs the project's benchmarks
(benchmarks.studies) by name or by kernel repo; the product's `tpu-kernels` has no lab command."""

from pathlib import Path

import pytest

from benchmarks import cli
from benchmarks import studies as bench
from benchmarks.studies import moe_layer, rmsnorm
from tpu_kernels import cli as product_cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def seen(monkeypatch):
    """Replaces moe_layer's and rmsnorm's main: records what they were called with."""
    calls = []

    def recorder(name):
        def main(argv=None):
            import sys

            calls.append((name, argv))
            # argparse's usage line names the benchmark as it was run.
            assert sys.argv[0] == f"python -m benchmarks {name}"
            return 0
        return main

    monkeypatch.setattr(moe_layer, "main", recorder("moe_layer"))
    monkeypatch.setattr(rmsnorm, "main", recorder("rmsnorm"))
    return calls


def test_bench_runs_the_modelled_benchmark_of_a_kernel_repo_with_the_extra_arguments(seen):
    repo = ROOT / "kernel_repos" / "ragged-dot-tpu"
    assert cli.main([str(repo), "--tokens", "1", "--settings", "deepseek-v3 EP32 dispatch"]) == 0
    assert seen == [("moe_layer", ["--repo", str(repo), "--tokens", "1", "--settings", "deepseek-v3 EP32 dispatch"])]


def test_bench_runs_a_benchmark_by_name(seen, monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert cli.main(["rmsnorm", "--quick"]) == 0
    assert seen == [("rmsnorm", ["--quick"])]
    import os
    import sys

    assert sys.argv[0] != "python -m benchmarks rmsnorm"  # restored

    assert os.environ["JAX_PLATFORMS"] == "cpu"  # a modelled benchmark compiles for TPUs from the CPU


@pytest.mark.multiprocess
def test_the_lab_runs_as_a_module_from_the_checkouts_root():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: python -m benchmarks NAME") and "calibrate" in done.stdout


def test_every_listed_benchmark_is_a_module_with_a_main():
    import importlib

    assert set(bench.KERNEL_REPO_BENCHMARKS.values()) <= set(bench.BENCHMARKS) and bench.MODELLED <= set(bench.BENCHMARKS)
    for name in ("moe_layer", "multichip", "attention", "rmsnorm", "moe_backward", "report", "calibrate"):
        assert callable(importlib.import_module(f"benchmarks.studies.{name}").main)


def test_bench_help_and_an_unknown_name_list_the_benchmarks(capsys):
    assert cli.main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in bench.BENCHMARKS)
    assert cli.main(["no_such_benchmark"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'no_such_benchmark'" in err and "moe_layer" in err and "multichip" in err


def test_bench_refuses_a_repo_without_a_modelled_benchmark(tmp_path, capsys):
    repo = tmp_path / "unknown-tpu"
    repo.mkdir()
    assert cli.main([str(repo)]) == 2
    assert "no modelled benchmark" in capsys.readouterr().err


def test_a_benchmark_without_its_kernel_repo_says_where_it_looked(tmp_path, monkeypatch, capsys):
    """Paths are relative to the current directory: away from a checkout the kernel repo is missing, clearly."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["rmsnorm", "--quick", "--out", str(tmp_path / "r.json")]) == 1
    err = capsys.readouterr().err
    assert "no kernel repo at kernel_repos/rmsnorm-tpu" in err and "--repo" in err
    assert not (tmp_path / "r.json").exists()


def test_results_default_to_benchmarks_results_under_the_current_directory():
    assert moe_layer.DEFAULT_OUT == Path("benchmarks/results/moe_layer.json")
    assert not moe_layer.DEFAULT_OUT.is_absolute() and not moe_layer.DEFAULT_REPO.is_absolute()


def test_other_commands_still_refuse_unknown_arguments(capsys):
    try:
        product_cli.main(["build", "kernel_repos/rmsnorm-tpu", "--bogus"])
    except SystemExit as exit_:
        assert exit_.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["bench", "calibrate"])
def test_the_product_cli_has_no_lab_command(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        product_cli.main([command, "--help"])
    assert exit_.value.code == 2 and f"invalid choice: '{command}'" in capsys.readouterr().err
