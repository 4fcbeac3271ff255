"""ragged-dot-tpu: grouped matmul for MoE layers as a Pallas TPU kernel, as torch ops.

On TPU tensors the ops run the Mosaic-compiled kernel; on CPU tensors they run
the same kernel in Pallas' TPU interpret mode (exact, slow: for development
and CI).

Each kernel is a subpackage (`gmm`, `tgmm`, `fused`, `combine`) with three
seams: `tiles.select(problem, generation)` picks its blocks, `plan.make(problem,
generation, config=None)` derives its buffers and VMEM limit once, and
`kernel.call(arrays..., plan)` runs it; `common` is what they share;
`problem.py`, `plan.py` and `layer.py` describe, plan and run the experts
layer. `__all__` is what a user calls (the torch ops and the reference);
`TOOLS` is what benchmarks, the performance model and tests use besides: the
problem values, the quantized weights and their packing, the experts layer,
and each kernel's seams (dotted: `gmm.plan.make`) with the few decisions
beside them that tools weigh.
"""

# Submodules are bound by name here, not only imported: `kernels` may load the
# same build (same module id) from a second path, and then Python reuses the
# cached submodules without setting them as attributes of the new package.
from . import combine, common, fused, gmm, ops, reference, tgmm
from .backward import differentiable_ragged_dot
from .common.packed_rows import pack_rows, unpack_rows
from .common.quant import (
    INT4, NOT_SERVED, check_scheme_served, expected_scales_shape, int4_packable, int4_packed_axis, pack_int4,
    scheme_of, unpack_int4,
)
from .common.routing import expected_active_groups, expert_plan
from .common.vmem import buffers_bytes
from .common.weights_layout import weights_orientation
from .experts import composed_experts_forward, experts_forward, fused_gate
from .layer import experts_layer
from .ops import gated_experts, ragged_dot
from .plan import FUSED_MAX_TOKENS, fused_path_config, plan_experts
from .problem import (
    CombineProblem, ExpertsProblem, ExpertWeights, Gate, MatmulProblem, TgmmProblem, describe_experts,
)

# What a user of the loaded kernel calls (and what `kernels describe-api` lists, from symbols.json): the torch
# ops, transformers' experts entry point, and the float64 reference the kernels are tested against.
__all__ = ["experts_forward", "gated_experts", "ops", "ragged_dot", "reference"]

# The one face code outside this package (benchmarks, the performance model, integration, tests) uses besides
# `__all__`: tests/test_kernel_face.py holds every use to these names. A dotted name is reached through the
# subpackages bound above (`gmm.plan.make`), and only that name of its module is.
TOOLS = [
    # What a call computes.
    "CombineProblem", "ExpertWeights", "ExpertsProblem", "Gate", "MatmulProblem", "TgmmProblem", "describe_experts",
    # Quantized weights, and packing.
    "INT4", "NOT_SERVED", "check_scheme_served", "expected_scales_shape", "int4_packable", "int4_packed_axis",
    "pack_int4", "pack_rows", "scheme_of", "unpack_int4", "unpack_rows",
    # The experts layer: its plan, the rule that picks its kernel, its calls; the routing, weights order and VMEM
    # its kernels share.
    "FUSED_MAX_TOKENS", "composed_experts_forward", "differentiable_ragged_dot", "expected_active_groups",
    "expert_plan", "experts_layer", "buffers_bytes", "fused_gate", "fused_path_config", "plan_experts",
    "weights_orientation",
    # Each kernel's seams.
    "gmm.tiles.select", "gmm.plan.make", "gmm.kernel.call",
    "tgmm.tiles.select", "tgmm.plan.make", "tgmm.kernel.call",
    "fused.tiles.select", "fused.plan.make", "fused.kernel.call",
    "combine.tiles.select", "combine.plan.make", "combine.kernel.call",
    # Beside them: the configs a caller hands `make`, and each kernel's call that plans its own.
    "gmm.tiles.TileConfig", "tgmm.tiles.TgmmConfig", "fused.tiles.FusedConfig",
    "gmm.kernel.grouped_matmul", "tgmm.kernel.transposed_grouped_matmul", "fused.kernel.fused_experts",
    # The grouped matmul's other decisions: the backward's d_lhs tiles, the experts layer's variants of a plan,
    # the tuned table and the heuristic it overrides, and what a config's blocks take (rows, N tile, VMEM).
    "gmm.tiles.select_d_lhs", "gmm.plan.gated_plan", "gmm.plan.gathered_plan", "gmm.plan.packed_plan",
    "gmm.tiles.TUNED_TILES", "gmm.tiles.TunedKey", "gmm.tiles.heuristic_config", "gmm.tiles.HEURISTIC_RHS_BLOCK_BYTES",
    "gmm.tiles.check_config", "gmm.tiles.ridge_rows", "gmm.tiles.n_tile", "gmm.tiles.row_tile_rows",
    "gmm.tiles.row_chunks", "gmm.tiles.matmul_buffers", "gmm.tiles.vmem_bytes", "gmm.tiles.vmem_limit",
    # The fused kernel's: when it runs several experts per step, how it splits them over cores, its I tiles and
    # their slabs, fp8 on the MXU, its VMEM.
    "fused.tiles.MULTI_EXPERT_MIN_TOKENS", "fused.tiles.experts_per_step_saving", "fused.tiles.busier_core_seconds",
    "fused.tiles.check_fused_config", "fused.tiles.i_tiles", "fused.tiles.MAX_SLAB_I", "fused.tiles.slab_i",
    "fused.tiles.fused_feeds_fp8_mxu", "fused.tiles.fused_vmem_bytes",
    # The work schedules the grouped matmuls run.
    "gmm.schedule.make_work_items", "tgmm.kernel.make_tgmm_items",
]
