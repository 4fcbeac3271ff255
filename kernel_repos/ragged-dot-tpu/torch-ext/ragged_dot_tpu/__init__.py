"""ragged-dot-tpu: grouped matmul for MoE layers as a Pallas TPU kernel, as torch ops.

On TPU tensors the ops run the Mosaic-compiled kernel; on CPU tensors they run
the same kernel in Pallas' TPU interpret mode (exact, slow: for development
and CI).

Each kernel is a subpackage (`gmm`, `tgmm`, `fused`, `combine`) with three
seams: `tiles.select(problem, target)` picks its blocks, `plan.make(problem,
target, config=None)` derives its buffers and VMEM limit once (`target`: the
generation's facts, `_hardware.TpuGeneration`, resolved once by the JAX
function a call enters), and `kernel.call(arrays..., plan)` runs it; `common` is what they share;
`problem.py`, `plan.py` and `layer.py` describe, plan and run the experts
layer. `__all__` is what a user calls (the torch ops and the reference);
`TOOLS` is what this project's package (kernelize, quantize) and its lab
(benchmarks/) use besides, and nothing more: the kernel's own tests reach
its internals through the modules bound below.
"""

# Submodules are bound by name here, not only imported: `kernels` may load the
# same build (same module id) from a second path, and then Python reuses the
# cached submodules without setting them as attributes of the new package.
# Nothing else is bound here but the names of the face.
from . import backward, combine, common, experts, fused, gmm, layer, ops, plan, problem, reference, tgmm
from .common.quant import (
    NOT_SERVED, check_scheme_served, expected_scales_shape, int4_packable, int4_packed_axis, pack_int4,
)
from .experts import experts_forward, fused_gate
from .layer import experts_layer
from .ops import gated_experts, ragged_dot
from .problem import MatmulProblem, TgmmProblem

# What a user of the loaded kernel calls (and what `kernels describe-api` lists, from symbols.json): the torch
# ops, transformers' experts entry point, and the float64 reference the kernels are tested against.
__all__ = ["experts_forward", "gated_experts", "ops", "ragged_dot", "reference"]

# What this project's package and lab use besides `__all__`, and nothing more: tests/test_kernel_face.py holds
# every use outside the kernel repo to these names, and each name to a use. A dotted name is reached through the
# subpackages bound above (`gmm.tiles.select`), and only that name of its module is.
TOOLS = [
    # What a call computes.
    "MatmulProblem", "TgmmProblem",
    # Quantized weights: which schemes each generation serves, their scales, int4's packing (kernelize, quantize).
    "NOT_SERVED", "check_scheme_served", "expected_scales_shape", "int4_packable", "int4_packed_axis", "pack_int4",
    # The experts layer, and the gate kernelize hands it.
    "experts_layer", "fused_gate",
    # The grouped matmuls' JAX functions and tile selectors, and what the lab weighs of the forward's tiles.
    "gmm.kernel.grouped_matmul", "tgmm.kernel.transposed_grouped_matmul", "gmm.tiles.select", "tgmm.tiles.select",
    "gmm.tiles.select_d_lhs", "gmm.tiles.TileConfig", "gmm.tiles.TUNED_TILES", "gmm.tiles.TunedKey",
    "gmm.tiles.heuristic_config", "gmm.tiles.check_config",
]
