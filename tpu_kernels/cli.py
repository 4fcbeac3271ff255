"""`tpu-kernels`: build | check | bench | calibrate | serve | upload | demo | precompile."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from pathlib import Path

DEFAULT_GENERATIONS = "v5e,v5p,v6e,tpu7x"
# The performance lab (the model, the studies, calibrate) lives in the project's checkout, not in the wheel.
LAB_MISSING = ("the performance lab is not installed with the package: run this from a checkout of the tpu-kernels "
               "project (git clone it, run scripts/setup.sh, then this command from its root)")


class LabMissing(Exception):
    """`bench` or `calibrate` run where no checkout's benchmarks/ folder can be found."""


def _is_checkout(root: Path) -> bool:
    pyproject = root / "pyproject.toml"
    return ((root / "benchmarks" / "__init__.py").is_file() and pyproject.is_file()
            and 'name = "tpu-kernels"' in pyproject.read_text(errors="replace"))


def _import_lab(module: str):
    """`module` of the lab (`benchmarks.…`) from the checkout this package was installed from (editable), else from
    the current directory when it is such a checkout; LabMissing when neither is."""
    for root in (Path(__file__).resolve().parents[1], Path.cwd()):
        if _is_checkout(root):
            if str(root) not in sys.path:
                sys.path.insert(0, str(root))
            break
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name == "benchmarks" or (error.name or "").startswith("benchmarks."):
            raise LabMissing(LAB_MISSING) from None
        raise


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


def _bench_usage(bench) -> str:
    width = max(map(len, [*bench.BENCHMARKS, *bench.TOOLS]))
    listed = "\n".join(f"  {name:<{width}}  {line}" for name, line in bench.BENCHMARKS.items())
    tools = "\n".join(f"  {name:<{width}}  {line}" for name, line in bench.TOOLS.items())
    repos = ", ".join(f"{repo} -> {name}" for repo, name in bench.KERNEL_REPO_BENCHMARKS.items())
    return (
        "usage: tpu-kernels bench NAME [args...]        run benchmark NAME (NAME --help: its own options)\n"
        "       tpu-kernels bench KERNEL_REPO [args...]  run a kernel repo's modelled benchmark with --repo KERNEL_REPO\n"
        "\n"
        "Runs in this process, like `python -m benchmarks.studies.NAME [args...]` from the checkout's root. Paths are\n"
        "relative to the current directory: results go to benchmarks/results/ (--out), kernel repos come from\n"
        "kernel_repos/ (--repo); run from the checkout's root or pass them.\n"
        f"\nbenchmarks:\n{listed}\n\ntools:\n{tools}\n\nkernel repos: {repos}\n"
    )


def _bench(argv: list[str]) -> int:
    try:
        bench = _import_lab("benchmarks.studies")
    except LabMissing as error:
        print(f"tpu-kernels bench: {error}", file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        print(_bench_usage(bench), end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    target, extra = argv[0], argv[1:]
    if target in bench.BENCHMARKS or target in bench.TOOLS:
        name = target
    elif Path(target).is_dir() or "/" in target or os.sep in target:
        # A kernel repo: its modelled benchmark, with --repo.
        name = bench.KERNEL_REPO_BENCHMARKS.get(Path(target).resolve().name)
        if name is None:
            known = ", ".join(sorted(bench.KERNEL_REPO_BENCHMARKS))
            print(f"tpu-kernels bench: {target}: no modelled benchmark for this kernel repo (known: {known})",
                  file=sys.stderr)
            return 2
        extra = ["--repo", target, *extra]
    else:
        print(f"tpu-kernels bench: unknown benchmark {target!r}\n\n{_bench_usage(bench)}", end="", file=sys.stderr)
        return 2
    if name in bench.MODELLED:
        # Modelled benchmarks compile for TPUs ahead of time from the CPU (set before jax is imported).
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from .disk_cache import UnsafeCacheError

    module = importlib.import_module(f"{bench.__name__}.{name}")
    argv0 = sys.argv[0] if sys.argv else None
    try:
        # The benchmark's argparse names itself after sys.argv[0]: its usage lines then say how it was run.
        sys.argv[:1] = [f"tpu-kernels bench {name}"]
        status = module.main(extra)
    except UnsafeCacheError as error:
        print(f"tpu-kernels bench {name}: {error}", file=sys.stderr)
        return 2
    except SystemExit as exit_:
        # argparse's errors and --help, and a benchmark's missing input (bench.MissingInput).
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(f"tpu-kernels bench {name}: {exit_.code}", file=sys.stderr)
        return 1
    finally:
        sys.argv[:1] = [] if argv0 is None else [argv0]
    return status or 0


def _calibrate(args) -> int:
    from tqdm import tqdm

    from .disk_cache import UnsafeCacheError, cache_root

    if sum(map(bool, (args.paths, args.from_benchmark, args.resummarize))) != 1:
        print("tpu-kernels calibrate: give one of tokamax's timing files, --from-benchmark RESULTS_JSON or "
              "--resummarize REPORT", file=sys.stderr)
        return 2
    try:
        calibration = _import_lab("benchmarks.perf.calibration")
        from_benchmark = _import_lab("benchmarks.studies.from_benchmark") if args.from_benchmark else None
    except LabMissing as error:
        print(f"tpu-kernels calibrate: {error}", file=sys.stderr)
        return 2
    if args.resummarize:
        for path in args.resummarize:
            calibration.write_report(calibration.resummarize(Path(path)), Path(path))
            print(f"rewrote the summary of {path} from its entries")
        return 0
    cache_dir = None if args.no_cache else Path(args.cache_dir) if args.cache_dir else cache_root("calibration")
    if from_benchmark is not None:
        try:
            from_benchmark.run([Path(path) for path in args.from_benchmark], args.chip, Path(args.out or from_benchmark.DEFAULT_OUT),
                               cache_dir=cache_dir)
        except (calibration.CalibrationInputError, UnsafeCacheError) as error:
            print(f"tpu-kernels calibrate: {error}", file=sys.stderr)
            return 2
        return 0
    args.out = args.out or "benchmarks/results/calibration.json"
    try:
        report = calibration.calibrate(
            [Path(path) for path in args.paths],
            chip=args.chip,
            cache_dir=cache_dir,
            jobs=args.jobs,
            progress=lambda items, description: tqdm(items, desc=description, unit="entry"),
        )
    except (calibration.CalibrationInputError, UnsafeCacheError) as error:
        print(f"tpu-kernels calibrate: {error}", file=sys.stderr)
        return 2
    calibration.write_report(report, Path(args.out))
    print(calibration.summary_table(report))
    print(f"{len(report['entries'])} entries modelled, {len(report['skipped'])} skipped; wrote {args.out}")
    return 0


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
DELEGATED = {"serve": _serve, "upload": _upload, "demo": _demo, "bench": _bench, "precompile": _precompile,
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

    calibrate = commands.add_parser(
        "calibrate", help="model tokamax's measured TPU timings and compare (the performance model's error)"
    )
    calibrate.add_argument("paths", nargs="*", help="tokamax autotuning JSON files or folders of them")
    calibrate.add_argument("--from-benchmark", metavar="RESULTS_JSON", nargs="+",
                           help="instead: the --output JSON files of `kernels benchmark ORG/REPO` run on a TPU "
                                "(needs --chip)")
    calibrate.add_argument("--resummarize", nargs="+", metavar="REPORT",
                           help="rewrite these reports' summaries from their entries, compiling nothing")
    calibrate.add_argument("--chip", help="v5e, v5p, v6e or tpu7x (default: from the folder name, e.g. tpu_v5_lite)")
    calibrate.add_argument("--out", default=None, help="report file (default: benchmarks/results/calibration.json, "
                                                       "with --from-benchmark calibration_from_benchmark.json)")
    calibrate.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile threads")
    calibrate.add_argument("--cache-dir", default=None,
                           help="compiles and replays kept between runs "
                                "(default: $XDG_CACHE_HOME/tpu-kernels/calibration, else ~/.cache/tpu-kernels/calibration)")
    calibrate.add_argument("--no-cache", action="store_true", help="recompile and replay every entry")
    calibrate.set_defaults(run=_calibrate)

    for name, help_ in (("bench", "run a benchmark: bench NAME [args] (moe_layer, multichip, attention, ...; "
                                  "`bench --help` lists them) or bench kernel_repos/<name> [args]"),
                        ("serve", "run a local Hub-compatible server"), ("upload", "publish a build to a Hub"),
                        ("demo", "kernelize a tiny MoE model end to end"),
                        ("precompile", "compile every bucket of a model on the TPU host that serves it"),
                        ("doctor", "run each kernel in each TorchTPU mode, check it and count its compiles (JSON)")):
        commands.add_parser(name, help=help_, add_help=False)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
