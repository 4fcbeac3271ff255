"""The lab's command line: `python -m benchmarks NAME [args...]`, run from the checkout's root.

NAME is a study or a tool of `benchmarks.studies` (`python -m benchmarks --help` lists them), or a kernel repo's
folder (its modelled study, with --repo). Each runs in this process, as `python -m benchmarks.studies.NAME` would.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from benchmarks import studies
from tpu_kernels.disk_cache import UnsafeCacheError

PROG = "python -m benchmarks"


def usage() -> str:
    width = max(map(len, [*studies.BENCHMARKS, *studies.TOOLS]))
    listed = "\n".join(f"  {name:<{width}}  {line}" for name, line in studies.BENCHMARKS.items())
    tools = "\n".join(f"  {name:<{width}}  {line}" for name, line in studies.TOOLS.items())
    repos = ", ".join(f"{repo} -> {name}" for repo, name in studies.KERNEL_REPO_BENCHMARKS.items())
    return (
        f"usage: {PROG} NAME [args...]         run benchmark or tool NAME (NAME --help: its own options)\n"
        f"       {PROG} KERNEL_REPO [args...]  run a kernel repo's modelled benchmark with --repo KERNEL_REPO\n"
        "\n"
        "Runs in this process, like `python -m benchmarks.studies.NAME [args...]`. Paths are relative to the current\n"
        "directory: results go to benchmarks/results/ (--out), kernel repos come from kernel_repos/ (--repo); run\n"
        "from the checkout's root or pass them.\n"
        f"\nbenchmarks:\n{listed}\n\ntools:\n{tools}\n\nkernel repos: {repos}\n"
    )


def _resolve(target: str, extra: list[str]) -> tuple[str | None, list[str]]:
    """The study or tool `target` names and its arguments (a kernel repo's folder: its modelled study, with
    --repo); None when it names none, said on stderr."""
    if target in studies.BENCHMARKS or target in studies.TOOLS:
        return target, extra
    if Path(target).is_dir() or "/" in target or os.sep in target:
        name = studies.KERNEL_REPO_BENCHMARKS.get(Path(target).resolve().name)
        if name is None:
            known = ", ".join(sorted(studies.KERNEL_REPO_BENCHMARKS))
            print(f"{PROG}: {target}: no modelled benchmark for this kernel repo (known: {known})", file=sys.stderr)
        return name, ["--repo", target, *extra]
    print(f"{PROG}: unknown benchmark {target!r}\n\n{usage()}", end="", file=sys.stderr)
    return None, extra


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, extra = _resolve(argv[0], argv[1:])
    if name is None:
        return 2
    if name in studies.MODELLED:
        # Modelled benchmarks compile for TPUs ahead of time from the CPU (set before jax is imported).
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    module = importlib.import_module(f"{studies.__name__}.{name}")
    argv0 = sys.argv[0] if sys.argv else None
    try:
        # The study's argparse names itself after sys.argv[0]: its usage lines then say how it was run.
        sys.argv[:1] = [f"{PROG} {name}"]
        status = module.main(extra)
    except UnsafeCacheError as error:
        print(f"{PROG} {name}: {error}", file=sys.stderr)
        return 2
    except SystemExit as exit_:
        # argparse's errors and --help, and a study's missing input (studies.MissingInput).
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(f"{PROG} {name}: {exit_.code}", file=sys.stderr)
        return 1
    finally:
        sys.argv[:1] = [] if argv0 is None else [argv0]
    return status or 0
