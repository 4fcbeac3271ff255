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
torch ops, the layers and the reference); `TOOLS` is what benchmarks, the
performance model and tests use besides: the problem value, the seams, the
JAX functions, and what the row-block selector weighs.
"""

# Submodules are bound by name here, not only imported: `kernels` may load the
# same build (same module id) from a second path, and then Python reuses the
# cached submodules without setting them as attributes of the new package.
from . import layers, norm, ops, reference
from .ops import fused_add_rms_norm, rms_norm
from .problem import NormProblem

# What a user of the loaded kernel calls (and what `kernels describe-api` lists, from symbols.json): the torch ops,
# the `kernels` layers, and the reference the kernels are tested against.
__all__ = ["fused_add_rms_norm", "layers", "ops", "reference", "rms_norm"]

# The one face code outside this package (benchmarks, the performance model, integration, tests) uses besides
# `__all__`: tests/test_kernel_face.py holds every use to these names. A dotted name is reached through the
# subpackage bound above (`norm.plan.make`), and only that name of its module is.
TOOLS = [
    # What a call computes.
    "NormProblem",
    # The kernels' seams.
    "norm.tiles.select", "norm.plan.make", "norm.kernel.call",
    # The JAX functions, one per kernel (each planning its own call): each forward alone, each backward alone.
    "norm.kernel.fused_add_rms_norm_backward", "norm.kernel.fused_add_rms_norm_forward",
    "norm.kernel.rms_norm_backward", "norm.kernel.rms_norm_forward",
    # What the row-block selector weighs: the tuned table, the heuristic, the VMEM a block takes, and the config a
    # caller hands `make`.
    "norm.tiles.TUNED_TILES", "norm.tiles.TunedKey", "norm.tiles.RowBlockTiles", "norm.tiles.RowBlockConfig",
    "norm.tiles.check_block_rows", "norm.tiles.heuristic_config", "norm.tiles.tuned_config", "norm.tiles.vmem_bytes",
    # The VMEM policy it takes: this kernel's margin and bound.
    "norm.tiles.WORKING_SET_BOUND_BYTES", "norm.tiles.WORKING_SET_MARGIN", "norm.tiles.vmem_budget",
    "norm.tiles.vmem_limit",
]
