import sys

from .run import main

# argparse names the program after argv[0]: the usage lines should say how it was run.
sys.argv[0] = "python -m benchmarks.studies.decode_step"
sys.exit(main())
