"""RMSNorm and fused residual-add + RMSNorm as Pallas TPU kernels, for torch.

On TPU tensors the kernels run compiled by Mosaic; on CPU tensors the same
kernels run in Pallas' TPU interpret mode, which is for development and tests,
not for speed.
"""

from . import config, layers, ops, pallas_rms_norm, reference
from .ops import fused_add_rms_norm, rms_norm

__all__ = ["config", "fused_add_rms_norm", "layers", "ops", "pallas_rms_norm", "reference", "rms_norm"]
