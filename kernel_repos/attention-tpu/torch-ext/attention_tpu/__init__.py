"""attention-tpu: flash attention for prefill and decode as a Pallas TPU kernel, as torch ops.

On TPU tensors the ops run the Mosaic-compiled kernel; on CPU tensors they run
the same kernel in Pallas' TPU interpret mode (exact, slow: for development
and CI). `attention_forward` and `attention_mask` plug it into transformers.
"""

from . import config, ops, pallas_tpu, reference
from .attention import attention_forward, attention_mask
from .ops import flash_attention
from .pallas_tpu import SUPPORTED_HEAD_DIMS

__all__ = [
    "SUPPORTED_HEAD_DIMS", "attention_forward", "attention_mask", "config", "flash_attention", "ops", "pallas_tpu",
    "reference",
]
