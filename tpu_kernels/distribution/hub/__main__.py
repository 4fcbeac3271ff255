import sys

from .server import serve_main

sys.exit(serve_main())
