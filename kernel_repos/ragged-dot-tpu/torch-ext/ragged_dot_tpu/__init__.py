"""ragged-dot-tpu: grouped matmul for MoE layers as a Pallas TPU kernel, as torch ops.

On TPU tensors the ops run the Mosaic-compiled kernel; on CPU tensors they run
the same kernel in Pallas' TPU interpret mode (exact, slow: for development
and CI).
"""

# Submodules are bound by name here, not only imported: `kernels` may load the
# same build (same module id) from a second path, and then Python reuses the
# cached submodules without setting them as attributes of the new package.
from . import (
    backward, config, experts, fused_tiles, gates, gmm_tiles, int4, moe, ops, pallas_fused, pallas_gmm, pallas_tgmm,
    plan, problem, quant, reference, routing, tgmm_tiles, vmem, weights_layout,
)
from .experts import experts_forward
from .ops import gated_experts, ragged_dot

__all__ = [
    "backward", "config", "experts", "experts_forward", "fused_tiles", "gated_experts", "gates", "gmm_tiles", "int4",
    "moe", "ops", "pallas_fused", "pallas_gmm", "pallas_tgmm", "plan", "problem", "quant", "ragged_dot", "reference",
    "routing", "tgmm_tiles", "vmem", "weights_layout",
]
