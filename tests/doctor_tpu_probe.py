"""Run by tests/test_doctor.py in a process of its own: `tpu-kernels doctor`'s TPU branch where torch_tpu registered
its `tpu` device without a chip (`torch_tpu._loader._init_device`, as tests/torch_tpu_modes_probe.py does).

Prints one JSON object: the TorchTPU eager mode each mode's runner sets, the backend its compiled runner names,
the fields of torch_tpu's cache statistics, and `doctor("tpu")`'s report for the kernel builds named on the command
line (experts, rmsnorm, attention). Ends with `os._exit`: torch_tpu's runtime is left half started.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    import torch
    from torch_tpu import _loader

    _loader._init_device("tpu")
    from torch_tpu._internal import execution_mode

    from tpu_kernels.integration import doctor

    modes_set = {}
    for mode in ("strict_eager", "deferred_and_fused"):
        runner = doctor._mode_runner(mode, "tpu", lambda: torch.tensor([execution_mode.eager_mode.name == name
                                                                        for name in ("DEFER_NEVER", "DEFER_AND_FUSE")]))
        seen = runner().tolist()
        modes_set[mode] = ("DEFER_NEVER", "DEFER_AND_FUSE")[seen.index(True)] if any(seen) else None
    asked = {}
    compile_ = torch.compile
    torch.compile = lambda fn, **options: asked.update(options) or compile_(fn, **options)
    doctor._mode_runner("compiled", "tpu", lambda x: x)
    torch.compile = compile_
    torch._dynamo.lookup_backend(asked["backend"])  # raises unless torch_tpu registered it
    counter = doctor._Counter("tpu")
    repos = dict(zip(("experts", "rmsnorm", "attention"), sys.argv[1:4]))
    print(json.dumps({"modes_set": modes_set, "compile_options": asked, "stats": sorted(counter.mark()),
                      "report": doctor.doctor("tpu", repos)}))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
