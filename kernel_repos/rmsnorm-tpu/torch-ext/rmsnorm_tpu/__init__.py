"""rmsnorm-tpu: RMSNorm and fused residual-add + RMSNorm (forward and backward) as Pallas TPU kernels, as torch ops.

On TPU tensors the ops run the Mosaic-compiled kernels; on CPU tensors they run
the same kernels in Pallas' TPU interpret mode, which is for development and
tests, not for speed. `layers` plugs them into transformers' RMSNorm modules.

The kernels are one subpackage (`norm`: the four ops' kernels, their plan and
their row blocks). `__all__` is what a user calls (the torch ops, the layers
and the reference); `TOOLS` is what benchmarks, the performance model and
tests use besides: the JAX functions, and the row-block selector with what it
weighs.
"""

# Submodules are bound by name here, not only imported: `kernels` may load the
# same build (same module id) from a second path, and then Python reuses the
# cached submodules without setting them as attributes of the new package.
from . import layers, norm, ops, reference
from .norm.kernel import fused_add_rms_norm_backward, fused_add_rms_norm_forward, rms_norm_backward, rms_norm_forward
from .norm.tiles import (
    TUNED_TILES, WORKING_SET_BOUND_BYTES, WORKING_SET_MARGIN, RowBlockConfig, RowBlockTiles, TunedKey,
    check_block_rows, heuristic_config, select_config, tuned_config, vmem_budget, vmem_bytes, vmem_limit,
)
from .ops import fused_add_rms_norm, rms_norm

# What a user of the loaded kernel calls (and what `kernels describe-api` lists, from symbols.json): the torch ops,
# the `kernels` layers, and the reference the kernels are tested against.
__all__ = ["fused_add_rms_norm", "layers", "ops", "reference", "rms_norm"]

# The one face code outside this package (benchmarks, the performance model, integration, tests) uses besides
# `__all__`: tests/test_kernel_face.py holds every use to these names.
TOOLS = [
    # The JAX functions, one per kernel: each forward alone, each backward alone.
    "fused_add_rms_norm_backward", "fused_add_rms_norm_forward", "rms_norm_backward", "rms_norm_forward",
    # The row-block selector, and what it weighs.
    "TUNED_TILES", "RowBlockConfig", "RowBlockTiles", "TunedKey", "check_block_rows", "heuristic_config",
    "select_config", "tuned_config", "vmem_bytes",
    # The VMEM policy it takes: this kernel's margin and bound.
    "WORKING_SET_BOUND_BYTES", "WORKING_SET_MARGIN", "vmem_budget", "vmem_limit",
]
