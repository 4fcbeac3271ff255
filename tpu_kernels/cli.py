"""`tpu-kernels`: build | check | bench | calibrate | serve | upload | demo."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

DEFAULT_GENERATIONS = "v5e,v6e"
# The project's modelled benchmarks (benchmarks/ of this checkout) of each kernel repo, run by `bench`.
MODELLED_BENCHMARKS = {"ragged-dot-tpu": "moe_layer.py"}
BENCHMARKS_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


def _build(args) -> int:
    from .distribution.builder import build_kernel_repo

    for repo in args.repos:
        print(build_kernel_repo(Path(repo), Path(args.out)))
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

    from .aot import compile_repo, format_table
    from .distribution.builder import build_kernel_repo

    repo = Path(args.repo)
    built = build_kernel_repo(repo, Path(args.out))
    print(f"built {built}")
    tests_status = 0 if args.skip_tests else _run_repo_tests(repo, built)
    generations = [g for g in args.tpu.split(",") if g]
    module = kernels.get_local_kernel(built, backend="cpu")
    results = compile_repo(repo, module, built.name, generations)
    print(format_table(results))
    compiled_all = all(r.compiled for r in results) and bool(results)
    tests_word = "skipped" if args.skip_tests else ("passed" if tests_status == 0 else "FAILED")
    print(f"tests: {tests_word}; "
          f"ahead-of-time compiles: {sum(r.compiled for r in results)}/{len(results)}")
    return 0 if tests_status == 0 and compiled_all else 1


def _bench(args, extra: list[str]) -> int:
    repo = Path(args.repo)
    script = MODELLED_BENCHMARKS.get(repo.resolve().name)
    if script is None:
        known = ", ".join(sorted(MODELLED_BENCHMARKS))
        print(f"{repo}: no modelled benchmark for this kernel repo (known: {known})", file=sys.stderr)
        return 2
    path = BENCHMARKS_DIR / script
    if not path.is_file():
        print(f"{path} is missing: `bench` runs from a checkout of the tpu-kernels project", file=sys.stderr)
        return 2
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    return subprocess.call([sys.executable, str(path), "--repo", str(repo), *extra], env=env)


def _calibrate(args) -> int:
    from tqdm import tqdm

    from .perf import calibration

    try:
        report = calibration.calibrate(
            [Path(path) for path in args.paths],
            chip=args.chip,
            cache_dir=None if args.no_cache else Path(args.cache_dir),
            jobs=args.jobs,
            progress=lambda items, description: tqdm(items, desc=description, unit="entry"),
        )
    except calibration.CalibrationInputError as error:
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


# Subcommands that own their argument parsing.
DELEGATED = {"serve": _serve, "upload": _upload, "demo": _demo}


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
    check.set_defaults(run=_check)

    bench = commands.add_parser(
        "bench", help="run the modelled benchmark of a kernel repo (benchmarks/ of this project); other "
                      "arguments go to the benchmark script"
    )
    bench.add_argument("repo", help="kernel_repos/<name>")
    bench.set_defaults(run=_bench)

    calibrate = commands.add_parser(
        "calibrate", help="model tokamax's measured TPU timings and compare (the performance model's error)"
    )
    calibrate.add_argument("paths", nargs="+", help="tokamax autotuning JSON files or folders of them")
    calibrate.add_argument("--chip", help="v5e, v5p, v6e or tpu7x (default: from the folder name, e.g. tpu_v5_lite)")
    calibrate.add_argument("--out", default="benchmarks/results/calibration.json", help="report file")
    calibrate.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile threads")
    calibrate.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "tpu-kernels" / "calibration"))
    calibrate.add_argument("--no-cache", action="store_true", help="recompile and replay every entry")
    calibrate.set_defaults(run=_calibrate)

    for name, help_ in (("serve", "run a local Hub-compatible server"), ("upload", "publish a build to a Hub"),
                        ("demo", "kernelize a tiny MoE model end to end")):
        commands.add_parser(name, help=help_, add_help=False)

    args, extra = parser.parse_known_args(argv)
    if args.run is _bench:
        return _bench(args, extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
