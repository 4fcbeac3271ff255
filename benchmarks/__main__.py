"""`python -m benchmarks NAME [args...]`, from the checkout's root: the lab's command line (`benchmarks.cli`)."""

import sys

from benchmarks.cli import main

sys.exit(main())
