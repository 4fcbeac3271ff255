"""A local server speaking the Hugging Face Hub HTTP API for kernel and model repos.

`tpu-kernels serve --root DIR` (or `python -m tpu_kernels.distribution.hub --root DIR`) runs it;
`start_hub(root)` runs it in a background thread of the calling process.
"""

from .limits import Limits
from .server import RunningHub, serve_main, start_hub

__all__ = ["Limits", "RunningHub", "serve_main", "start_hub"]
