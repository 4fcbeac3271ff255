"""attention-tpu: flash attention (forward and backward) for prefill, decode and training as Pallas TPU kernels, as
torch ops.

On TPU tensors the ops run the Mosaic-compiled kernels; on CPU tensors they run
the same kernels in Pallas' TPU interpret mode (exact, slow: for development
and CI). `attention_forward` and `attention_mask` plug it into transformers.

Each kernel is a subpackage (`flash`: the forward; `flash_backward`: dq and
dk/dv; each its kernel, its plan and its tiles); `common` is what they share
(the call's options and masking, the tiles' type, the VMEM policy). `__all__`
is what a user calls (the torch op, the transformers entry points and the
reference); `TOOLS` is what benchmarks, the performance model and tests use
besides: the JAX functions, the call's options, and the tile selectors with
what they weigh.
"""

# Submodules are bound by name here, not only imported: `kernels` may load the
# same build (same module id) from a second path, and then Python reuses the
# cached submodules without setting them as attributes of the new package.
from . import common, flash, flash_backward, ops, reference
from .attention import attention_forward, attention_mask
from .common.masking import Attention, kv_steps, prepare, q_steps
from .common.tiles import AttentionConfig
from .common.vmem import WORKING_SET_BOUND_BYTES, WORKING_SET_MARGIN, vmem_budget, vmem_limit
from .flash.kernel import SUPPORTED_HEAD_DIMS, differentiable_flash_attention, flash_attention_forward
from .flash.tiles import (
    DECODE_STEP_BYTES, PREFERRED_TILES, TUNED_TILES, ForwardTiles, TunedKey, check_config, heuristic_config,
    is_decode, select_config, tuned_config, vmem_bytes,
)
from .flash_backward.kernel import flash_attention_backward
from .flash_backward.tiles import (
    PREFERRED_BACKWARD_TILES, STEP_OVERHEAD_MULTIPLE, WINDOW_BLOCK_FACTOR, BackwardConfig, backward_step_seconds,
    backward_tiles, backward_vmem_bytes, check_backward_config, select_backward_config,
)
from .ops import flash_attention

# What a user of the loaded kernel calls (and what `kernels describe-api` lists, from symbols.json): the torch
# op, transformers' attention and mask functions, and the float64 reference the kernels are tested against.
__all__ = ["SUPPORTED_HEAD_DIMS", "attention_forward", "attention_mask", "flash_attention", "ops", "reference"]

# The one face code outside this package (benchmarks, the performance model, integration, tests) uses besides
# `__all__`: tests/test_kernel_face.py holds every use to these names.
TOOLS = [
    # The JAX functions: differentiable, the forward alone (with the log-sum-exp), the backward alone.
    "differentiable_flash_attention", "flash_attention_backward", "flash_attention_forward",
    # One call's options, the problem they make, and the grid lengths its visible pairs give.
    "Attention", "kv_steps", "prepare", "q_steps",
    # The forward's tile selector, and what it weighs.
    "DECODE_STEP_BYTES", "PREFERRED_TILES", "TUNED_TILES", "AttentionConfig", "ForwardTiles", "TunedKey",
    "check_config", "heuristic_config", "is_decode", "select_config", "tuned_config", "vmem_bytes",
    # The backward's tile selector, and what it weighs.
    "PREFERRED_BACKWARD_TILES", "STEP_OVERHEAD_MULTIPLE", "WINDOW_BLOCK_FACTOR", "BackwardConfig",
    "backward_step_seconds", "backward_tiles", "backward_vmem_bytes", "check_backward_config",
    "select_backward_config",
    # The VMEM policy both take: this kernel's margin and bound.
    "WORKING_SET_BOUND_BYTES", "WORKING_SET_MARGIN", "vmem_budget", "vmem_limit",
]
