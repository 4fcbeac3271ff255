"""ragged-dot-tpu: grouped matmul for MoE layers as a Pallas TPU kernel, as torch ops.

On TPU tensors the ops run the Mosaic-compiled kernel; on CPU tensors they run
the same kernel in Pallas' TPU interpret mode (exact, slow: for development
and CI).
"""

from . import config, kernel, moe, reference
from .experts import experts_forward
from .ops import gated_experts, ragged_dot

__all__ = ["config", "experts_forward", "gated_experts", "kernel", "moe", "ragged_dot", "reference"]
