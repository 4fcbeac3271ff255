"""Run by tests/test_torch_tpu_modes.py in a process of its own: our op and `jax_op`'s in torch_tpu's modes, off TPU.

torch_tpu registers its `tpu` device without a chip (`torch_tpu._loader._init_device`) and makes TPU placeholder
tensors (`tpu_torch_compile.placeholder`). Its eager ops, `JaxCallable` and the launcher record their calls in
deferred-and-fused eager and in the compile backend's tracing mode without one; building the MLIR of what they
recorded, and strict eager's per-op compile, need a PjRt client, that is a chip. This script records what the
launcher is handed, and how the `tpu` backend traces a function holding our op up to that point, and prints
one JSON object. It mutates the process (the device rename, torch.compile's default backend) and leaves
deferred work behind: it ends with `os._exit`.
"""

from __future__ import annotations

import json
import os
import sys

import jax
from jax.experimental import pallas as pl

# libtpu asks the cloud metadata server (30 tries per key) unless told the host's shape; another process's libtpu
# holds its lockfile.
CHIPLESS_ENVIRONMENT = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5litepod-1",
                        "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def _add_kernel(x_ref, y_ref, out_ref):
    out_ref[...] = x_ref[...] + y_ref[...]


def add(x: jax.Array, y: jax.Array | None, scale: float) -> jax.Array:
    total = x if y is None else pl.pallas_call(_add_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x, y)
    return total * scale


class _Traced(Exception):
    """Raised in place of the backend's MLIR build: the FX graph's interpretation is done."""


def main() -> None:
    import torch
    from torch_tpu import _loader

    _loader._init_device("tpu")
    from torch_tpu._internal import execution_mode, export
    from torch_tpu._internal.compile import tpu_torch_compile
    from torch_tpu._internal.pallas import pallas as torch_tpu_pallas

    from tpu_kernels.runtime import binding

    ours = binding.jax_torch_op("tk_modes::add")(add)
    theirs = torch_tpu_pallas.jax_op("tk_modes_jax_op::add", add)
    launches = []
    launch = torch_tpu_pallas.tpu_torch_pallas.call_custom_kernel

    def recording(name, fingerprint, inputs, output_shapes, donate_argnums, device_assignment):
        launches.append({"mode": execution_mode.eager_mode.name, "fingerprint": fingerprint,
                         "inputs": [[list(t.shape), str(t.dtype), str(t.device)] for t in inputs],
                         "outputs": [[list(t.shape), str(t.dtype), str(t.device)] for t in output_shapes],
                         "donate": list(donate_argnums), "devices": list(device_assignment)})
        return launch(name, fingerprint, inputs=inputs, output_shapes=output_shapes, donate_argnums=donate_argnums,
                      device_assignment=device_assignment)

    torch_tpu_pallas.tpu_torch_pallas.call_custom_kernel = recording
    tpu_kernel = ours.registered.tpu_kernel
    through_jax_callable = []
    first_call = tpu_kernel._first_call
    tpu_kernel._first_call = lambda *a: through_jax_callable.append(1) or first_call(*a)
    x, y = (tpu_torch_compile.placeholder([8, 128], torch.float32) for _ in range(2))
    result = {"modes": {}}
    for mode in (execution_mode.EagerMode.DEFER_AND_FUSE, execution_mode.EagerMode._INTERNAL_COMPILE_FX_GRAPH):
        calls = {}
        with execution_mode.set_eager_mode(mode):
            for label, op in (("jax_op", theirs), ("ours", ours.op)):
                start = len(launches)
                outputs = [op(x, y, 2.0), op(x, None, 2.0), op(x, y, 2.0)]
                calls[label] = {"launches": launches[start:],
                                "outputs": [[list(o.shape), str(o.dtype), str(o.device)] for o in outputs]}
        result["modes"][mode.name] = calls
    result["ours_through_jax_callable"] = len(through_jax_callable)
    result["direct"] = tpu_kernel.direct
    result["compiled"] = _trace_with_the_tpu_backend(ours, x, y, export, execution_mode, launches)
    print(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


def _trace_with_the_tpu_backend(ours, x, y, export, execution_mode, launches) -> dict:
    """`torch.compile(backend="tpu", fullgraph=True, dynamic=False)` of a function holding our op, up to the MLIR
    build: `fx_to_mlir` interprets the graph on the placeholders in the backend's tracing mode, as torch_tpu's
    `export.fx_to_mlir` does before it asks PjRt for the device's RNG state and compiles."""
    import torch

    seen = {}

    def interpret_only(module, args, **options):
        with execution_mode.set_eager_mode(execution_mode.EagerMode._INTERNAL_COMPILE_FX_GRAPH):
            start = len(launches)
            outputs = export.export.EagerLikeFxInterpreter(module).run(
                *(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
            seen["launches"] = launches[start:]
        seen["targets"] = sorted({str(node.target) for node in module.graph.nodes if node.op == "call_function"})
        seen["outputs"] = [[list(o.shape), str(o.device)] for o in outputs if isinstance(o, torch.Tensor)]
        raise _Traced

    export.fx_to_mlir = interpret_only
    try:
        torch.compile(lambda a, b: ours(a, b, 0.5) * 2 + ours(a, None, 3.0), backend="tpu", fullgraph=True,
                      dynamic=False)(x, y)
    except Exception as error:  # dynamo wraps what a backend raises
        chain = [error]
        while chain[-1].__cause__ or chain[-1].__context__:
            chain.append(chain[-1].__cause__ or chain[-1].__context__)
        seen["stopped_at_mlir_build"] = any(isinstance(e, _Traced) for e in chain)
        if not seen["stopped_at_mlir_build"]:
            seen["error"] = f"{type(error).__name__}: {error}"[:2000]
    return seen


if __name__ == "__main__":
    main()
