"""`tpu-kernels`: build | check | serve | upload | demo | precompile | doctor."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

DEFAULT_GENERATIONS = "v5e,v5p,v6e,tpu7x"


def _build_errors() -> tuple[type[Exception], ...]:
    """What `build_kernel_repo` raises about the kernel repo itself: said in one line, never a traceback."""
    from .distribution.build_toml import BuildTomlError
    from .distribution.links import LinkOutError, SpecialFileError
    from .distribution.symbols import SymbolsError

    return BuildTomlError, LinkOutError, SpecialFileError, SymbolsError, FileNotFoundError


def _build(args) -> int:
    from .distribution.builder import build_kernel_repo

    for repo in args.repos:
        try:
            print(build_kernel_repo(Path(repo), Path(args.out)))
        except _build_errors() as error:
            print(f"tpu-kernels build: {error}", file=sys.stderr)
            return 1
    return 0


def _run_repo_tests(repo: Path, built: Path) -> int:
    tests = repo / "tests"
    if not tests.is_dir():
        print(f"{repo}: no tests/ folder", file=sys.stderr)
        return 1
    env = dict(os.environ, TPU_KERNELS_BUILT=str(built), JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    return subprocess.call(
        [sys.executable, "-m", "pytest", str(tests), "-q", "-o", "tpu_kernels_detect_races=true"], env=env
    )


def _check(args) -> int:
    import kernels

    from .aot import compile_kernel, format_table
    from .distribution.builder import build_kernel_repo
    from .disk_cache import UnsafeCacheError, cache_root

    repo = Path(args.repo)
    try:
        built = build_kernel_repo(repo, Path(args.out))
    except _build_errors() as error:
        print(f"tpu-kernels check: {error}", file=sys.stderr)
        return 1
    print(f"built {built}")
    tests_status = 0 if args.skip_tests else _run_repo_tests(repo, built)
    generations = [g for g in args.tpu.split(",") if g]
    module = kernels.get_local_kernel(built, backend="cpu")
    cache_dir = None if args.no_cache else args.cache_dir or cache_root("aot")
    try:
        results = compile_kernel(module, built.name, generations, cache_dir=cache_dir)
    except UnsafeCacheError as error:
        print(f"tpu-kernels check: {error}", file=sys.stderr)
        return 2
    print(format_table(results))
    compiled_all = all(r.compiled for r in results) and bool(results)
    if args.record:
        _write_record(repo, module, results)
    tests_word = "skipped" if args.skip_tests else ("passed" if tests_status == 0 else "FAILED")
    print(f"tests: {tests_word}; "
          f"ahead-of-time compiles: {sum(r.compiled for r in results)}/{len(results)}")
    return 0 if tests_status == 0 and compiled_all else 1


def _write_record(repo: Path, module, results) -> None:
    """The compiles that passed, into the repo's committed record (aot_record), beside its build.toml."""
    from .aot import compile_fingerprint
    from .aot_record import EMPTY, RECORD_FILE, AotRecord

    path = repo / RECORD_FILE
    fingerprint = compile_fingerprint(module)
    (AotRecord.read(path) or EMPTY).updated(fingerprint, results).write(path)
    print(f"recorded {sum(r.compiled for r in results)} compiles in {path}")


def _serve(argv: list[str]) -> int:
    from .distribution.hub import serve_main

    return serve_main(argv)


def _upload(argv: list[str]) -> int:
    from .distribution.publish import upload_main

    return upload_main(argv)


def _demo(argv: list[str]) -> int:
    from .integration.demo import demo_main

    return demo_main(argv)


def _precompile(argv: list[str]) -> int:
    from .integration.precompile import precompile_main

    return precompile_main(argv)


def _doctor(argv: list[str]) -> int:
    from .integration.doctor import doctor_main

    return doctor_main(argv)


# Subcommands that own their argument parsing.
DELEGATED = {"serve": _serve, "upload": _upload, "demo": _demo, "precompile": _precompile,
             "doctor": _doctor}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in DELEGATED:
        return DELEGATED[argv[0]](argv[1:])

    parser = argparse.ArgumentParser(prog="tpu-kernels", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    build = commands.add_parser("build", help="build kernel repos into Hub kernel repos")
    build.add_argument("repos", nargs="+", help="kernel_repos/<name> folders")
    build.add_argument("--out", default="build", help="output folder (default: build/)")
    build.set_defaults(run=_build)

    check = commands.add_parser(
        "check", help="build, run the repo's tests on the torch-cpu variant, compile ahead of time for TPUs"
    )
    check.add_argument("repo", help="kernel_repos/<name>")
    check.add_argument("--tpu", default=DEFAULT_GENERATIONS, help=f"TPU generations (default: {DEFAULT_GENERATIONS})")
    check.add_argument("--out", default="build", help="output folder (default: build/)")
    check.add_argument("--skip-tests", action="store_true", help="only build and compile")
    check.add_argument("--cache-dir", type=Path, default=None,
                       help="where compiles that succeeded are remembered "
                            "(default: $XDG_CACHE_HOME/tpu-kernels/aot, else ~/.cache/tpu-kernels/aot)")
    check.add_argument("--no-cache", action="store_true", help="compile every target, remembering nothing")
    check.add_argument("--record", action="store_true",
                       help="write the compiles that passed into REPO/aot_record.json (commit it: the project's tests "
                            "then compile only what it does not cover)")
    check.set_defaults(run=_check)

    for name, help_ in (("serve", "run a local Hub-compatible server"), ("upload", "publish a build to a Hub"),
                        ("demo", "kernelize a tiny MoE model end to end"),
                        ("precompile", "compile every bucket of a model on the TPU host that serves it"),
                        ("doctor", "run each kernel in each TorchTPU mode, check it and count its compiles (JSON)")):
        commands.add_parser(name, help=help_, add_help=False)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
