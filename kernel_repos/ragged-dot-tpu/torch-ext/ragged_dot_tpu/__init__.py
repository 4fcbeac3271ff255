"""ragged-dot-tpu: grouped matmul for MoE layers as a Pallas TPU kernel, as torch ops.

On TPU tensors the ops run the Mosaic-compiled kernel; on CPU tensors they run
the same kernel in Pallas' TPU interpret mode (exact, slow: for development
and CI).

Each kernel is a subpackage (`gmm`, `tgmm`, `fused`, `combine`: its kernel,
its plan and its tiles); `common` is what they share; `problem.py`,
`plan.py` and `layer.py` describe, plan and run the experts layer. `__all__`
is what a user calls (the torch ops and the reference); `TOOLS` is what
benchmarks, the performance model and tests use besides: the problem values,
the plan makers, the tile selectors, each kernel's call, quantized weights and
their packing.
"""

# Submodules are bound by name here, not only imported: `kernels` may load the
# same build (same module id) from a second path, and then Python reuses the
# cached submodules without setting them as attributes of the new package.
from . import combine, common, fused, gmm, ops, reference, tgmm
from .backward import differentiable_ragged_dot
from .combine.kernel import combine_picks
from .combine.plan import plan_combine
from .common.packed_rows import pack_rows, unpack_rows
from .common.quant import (
    INT4, NOT_SERVED, check_scheme_served, expected_scales_shape, int4_packable, int4_packed_axis, pack_int4,
    scheme_of, unpack_int4,
)
from .common.routing import expected_active_groups, expert_plan
from .common.vmem import buffers_bytes
from .common.weights_layout import weights_orientation
from .experts import composed_experts_forward, experts_forward, fused_gate
from .fused.kernel import fused_experts, fused_experts_call
from .fused.plan import plan_fused
from .fused.tiles import (
    MULTI_EXPERT_MIN_TOKENS, FusedConfig, busier_core_seconds, check_fused_config, experts_per_step_saving,
    fused_config, fused_feeds_fp8_mxu, fused_vmem_bytes, i_tiles,
)
from .gmm.kernel import grouped_matmul, grouped_matmul_call
from .gmm.plan import gated_plan, gathered_plan, packed_plan, plan_ragged_dot
from .gmm.schedule import make_work_items
from .gmm.tiles import (
    HEURISTIC_RHS_BLOCK_BYTES, TUNED_TILES, TileConfig, TunedKey, check_config, heuristic_config,
    matmul_buffers, n_tile, ridge_rows, row_chunks, row_tile_rows, select_config,
    select_d_lhs_config, vmem_bytes, vmem_limit,
)
from .layer import experts_layer
from .ops import gated_experts, ragged_dot
from .plan import FUSED_MAX_TOKENS, fused_path_config, plan_experts
from .problem import (
    CombineProblem, ExpertsProblem, ExpertWeights, Gate, MatmulProblem, TgmmProblem, describe_experts,
)
from .tgmm.kernel import make_tgmm_items, transposed_grouped_matmul, transposed_grouped_matmul_call
from .tgmm.plan import plan_tgmm
from .tgmm.tiles import TgmmConfig, select_tgmm_config

# What a user of the loaded kernel calls (and what `kernels describe-api` lists, from symbols.json): the torch
# ops, transformers' experts entry point, and the float64 reference the kernels are tested against.
__all__ = ["experts_forward", "gated_experts", "ops", "ragged_dot", "reference"]

# The one face code outside this package (benchmarks, the performance model, integration, tests) uses besides
# `__all__`: tests/test_kernel_face.py holds every use to these names.
TOOLS = [
    # The composed experts forward, and the gate of the fused op.
    "composed_experts_forward", "fused_gate",
    # What a call computes.
    "CombineProblem", "ExpertWeights", "ExpertsProblem", "Gate", "MatmulProblem", "TgmmProblem", "describe_experts",
    # The plan makers, and the rule that picks the experts layer's kernel.
    "FUSED_MAX_TOKENS", "fused_path_config", "gated_plan", "gathered_plan", "packed_plan", "plan_combine",
    "plan_experts", "plan_fused", "plan_ragged_dot", "plan_tgmm",
    # The tile selectors, and what they weigh.
    "HEURISTIC_RHS_BLOCK_BYTES", "MULTI_EXPERT_MIN_TOKENS", "TUNED_TILES", "FusedConfig", "TgmmConfig", "TileConfig",
    "TunedKey", "buffers_bytes", "busier_core_seconds", "check_config", "check_fused_config", "expected_active_groups",
    "experts_per_step_saving", "fused_config", "fused_feeds_fp8_mxu", "fused_vmem_bytes", "heuristic_config",
    "i_tiles", "matmul_buffers", "n_tile", "ridge_rows", "row_chunks", "row_tile_rows", "select_config",
    "select_d_lhs_config", "select_tgmm_config", "vmem_bytes", "vmem_limit", "weights_orientation",
    # Each kernel's call (planning its own, and running a plan), and the schedules they run.
    "combine_picks", "differentiable_ragged_dot", "experts_layer", "expert_plan", "fused_experts",
    "fused_experts_call", "grouped_matmul", "grouped_matmul_call", "make_tgmm_items", "make_work_items",
    "transposed_grouped_matmul", "transposed_grouped_matmul_call",
    # Quantized weights, and packing.
    "INT4", "NOT_SERVED", "check_scheme_served", "expected_scales_shape", "int4_packable", "int4_packed_axis",
    "pack_int4", "pack_rows", "scheme_of", "unpack_int4", "unpack_rows",
]
