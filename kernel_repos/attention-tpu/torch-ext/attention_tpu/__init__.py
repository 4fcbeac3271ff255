"""attention-tpu: flash attention for prefill and decode as a Pallas TPU kernel, as torch ops.

On TPU tensors the ops run the Mosaic-compiled kernel; on CPU tensors they run
the same kernel in Pallas' TPU interpret mode (exact, slow: for development
and CI). `attention_forward` and `attention_mask` plug it into transformers.
"""

from . import kernel, reference
from .attention import attention_forward, attention_mask
from .ops import flash_attention

__all__ = ["attention_forward", "attention_mask", "flash_attention", "kernel", "reference"]
