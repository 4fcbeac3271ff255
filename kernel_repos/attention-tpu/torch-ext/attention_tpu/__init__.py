"""attention-tpu: flash attention (forward and backward) for prefill, decode and training as Pallas TPU kernels, as torch ops.

On TPU tensors the ops run the Mosaic-compiled kernels; on CPU tensors they run
the same kernels in Pallas' TPU interpret mode (exact, slow: for development
and CI). `attention_forward` and `attention_mask` plug it into transformers.
"""

from . import config, masking, ops, pallas_flash, pallas_flash_backward, reference
from .attention import attention_forward, attention_mask
from .ops import flash_attention
from .pallas_flash import SUPPORTED_HEAD_DIMS

__all__ = [
    "SUPPORTED_HEAD_DIMS", "attention_forward", "attention_mask", "config", "flash_attention", "masking", "ops",
    "pallas_flash", "pallas_flash_backward", "reference",
]
