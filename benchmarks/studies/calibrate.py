"""`python -m benchmarks calibrate`: the performance model against measured TPU timings.

Three inputs, one at a time:

- tokamax's autotuning JSON files (or folders of them): each timed call rebuilt, compiled for its chip and priced
  (`benchmarks.perf.calibration`), written to benchmarks/results/calibration.json;
- `--from-benchmark RESULTS_JSON ...`: the `--output` files of `kernels benchmark ORG/REPO` run on a TPU
  (`from_benchmark`, needs --chip);
- `--resummarize REPORT ...`: these reports' summaries rewritten from their entries, compiling nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tqdm import tqdm

from benchmarks.perf import calibration
from benchmarks.studies import from_benchmark
from tpu_kernels.disk_cache import UnsafeCacheError, cache_root

DEFAULT_OUT = Path("benchmarks/results/calibration.json")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", help="tokamax autotuning JSON files or folders of them")
    parser.add_argument("--from-benchmark", metavar="RESULTS_JSON", nargs="+",
                        help="instead: the --output JSON files of `kernels benchmark ORG/REPO` run on a TPU "
                             "(needs --chip)")
    parser.add_argument("--resummarize", nargs="+", metavar="REPORT",
                        help="rewrite these reports' summaries from their entries, compiling nothing")
    parser.add_argument("--chip", help="v5e, v5p, v6e or tpu7x (default: from the folder name, e.g. tpu_v5_lite)")
    parser.add_argument("--out", default=None, help=f"report file (default: {DEFAULT_OUT.as_posix()}, "
                                                    f"with --from-benchmark {from_benchmark.DEFAULT_OUT.name})")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile threads")
    parser.add_argument("--cache-dir", default=None,
                        help="compiles and replays kept between runs "
                             "(default: $XDG_CACHE_HOME/tpu-kernels/calibration, else ~/.cache/tpu-kernels/calibration)")
    parser.add_argument("--no-cache", action="store_true", help="recompile and replay every entry")
    return parser


def main(argv: list[str] | None = None) -> int:
    command_line = parser()
    args = command_line.parse_args(argv)
    prog = command_line.prog
    if sum(map(bool, (args.paths, args.from_benchmark, args.resummarize))) != 1:
        print(f"{prog}: give one of tokamax's timing files, --from-benchmark RESULTS_JSON or --resummarize REPORT",
              file=sys.stderr)
        return 2
    if args.resummarize:
        for path in args.resummarize:
            calibration.write_report(calibration.resummarize(Path(path)), Path(path))
            print(f"rewrote the summary of {path} from its entries")
        return 0
    cache_dir = None if args.no_cache else Path(args.cache_dir) if args.cache_dir else cache_root("calibration")
    try:
        if args.from_benchmark:
            from_benchmark.run([Path(path) for path in args.from_benchmark], args.chip,
                               Path(args.out or from_benchmark.DEFAULT_OUT), cache_dir=cache_dir)
            return 0
        report = calibration.calibrate(
            [Path(path) for path in args.paths],
            chip=args.chip,
            cache_dir=cache_dir,
            jobs=args.jobs,
            progress=lambda items, description: tqdm(items, desc=description, unit="entry"),
        )
    except (calibration.CalibrationInputError, UnsafeCacheError) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    out = Path(args.out or DEFAULT_OUT)
    calibration.write_report(report, out)
    print(calibration.summary_table(report))
    print(f"{len(report['entries'])} entries modelled, {len(report['skipped'])} skipped; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
