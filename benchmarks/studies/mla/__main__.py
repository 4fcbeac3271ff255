"""`python -m benchmarks.studies.mla [...]`: the benchmark's command line (`run.main`)."""

import sys

from .run import main

# argparse names the program after argv[0], here this file's path: the usage lines should say how it was run.
sys.argv[0] = "python -m benchmarks.studies.mla"
sys.exit(main())
