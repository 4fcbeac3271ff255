"""rmsnorm-tpu: RMSNorm and fused residual-add + RMSNorm (forward and backward) as Pallas TPU kernels, as torch ops.

On TPU tensors the ops run the Mosaic-compiled kernels; on CPU tensors they run
the same kernels in Pallas' TPU interpret mode, which is for development and
tests, not for speed. `layers` plugs them into transformers' RMSNorm modules.

The kernels are one subpackage (`norm`: the four ops' kernels) with three
seams: `tiles.select(problem, target)` picks a call's row block,
`plan.make(problem, target, config=None)` lays its grid (`target`: the TPU
generation's facts, `_hardware.TpuGeneration`, that the JAX functions resolve
once from their `generation`), and
`kernel.call(rows, weight, plan)` runs it. `__all__` is what a user calls (the
torch ops, the layers and the reference); `TOOLS` is what this project's lab
(benchmarks/) uses besides, and nothing more: the kernel's own tests reach
its internals through the modules bound below.
"""

# Submodules are bound by name here, not only imported: `kernels` may load the
# same build (same module id) from a second path, and then Python reuses the
# cached submodules without setting them as attributes of the new package.
# Nothing else is bound here but the names of the face.
from . import layers, norm, ops, problem, reference
from .ops import fused_add_rms_norm, rms_norm
from .problem import NormProblem

# What a user of the loaded kernel calls (and what `kernels describe-api` lists, from symbols.json): the torch ops,
# the `kernels` layers, and the reference the kernels are tested against.
__all__ = ["fused_add_rms_norm", "layers", "ops", "reference", "rms_norm"]

# What this project's lab uses besides `__all__`, and nothing more: tests/test_kernel_face.py holds every use
# outside the kernel repo to these names, and each name to a use. A dotted name is reached through the subpackage
# bound above (`norm.tiles.select`), and only that name of its module is.
TOOLS = [
    # What a call computes, and the row block the selector picks for it.
    "NormProblem", "norm.tiles.select",
    # The JAX functions, one per kernel (each planning its own call): each forward alone, each backward alone.
    "norm.kernel.fused_add_rms_norm_backward", "norm.kernel.fused_add_rms_norm_forward",
    "norm.kernel.rms_norm_backward", "norm.kernel.rms_norm_forward",
]
