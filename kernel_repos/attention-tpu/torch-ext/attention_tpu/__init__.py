"""attention-tpu: flash attention (forward and backward) for prefill, decode and training as Pallas TPU kernels, as
torch ops.

On TPU tensors the ops run the Mosaic-compiled kernels; on CPU tensors they run
the same kernels in Pallas' TPU interpret mode (exact, slow: for development
and CI). `attention_forward` and `attention_mask` plug it into transformers.

Each kernel is a subpackage (`flash`: the forward; `flash_backward`: dq and
dk/dv; `paged`: ragged paged attention over a paged or contiguous KV cache,
inference only) with three seams: `tiles.select(problem, target)` picks its tiles,
`plan.make(problem, target, config=None)` lays its grid and VMEM limit,
and `kernel.call(arrays..., plan)` runs it. The problem is a frozen value
(`Problem`, `PagedProblem`) and so is the target, the TPU generation's facts
(`_hardware.TpuGeneration`): each JAX function resolves its `generation` (a
name, or None for this device's) once and hands both down to the tiles.
`common` is what the kernels share (the call's options, its `Problem` and
masking, the paged kernel's `PagedProblem`, the online softmax, the tiles'
type, the VMEM policy, the layout rule). `__all__` is what a user calls (the torch
ops, the transformers entry points, the flash-attn 2 API and the reference); `TOOLS` is what benchmarks, the performance model and
tests use besides: the call's options and problem, the seams (dotted:
`flash.plan.make`), the JAX functions, and what the tile selectors weigh.
"""

# Submodules are bound by name here, not only imported: `kernels` may load the
# same build (same module id) from a second path, and then Python reuses the
# cached submodules without setting them as attributes of the new package.
from . import common, flash, flash_api, flash_backward, kvcache, ops, paged, paged_ops, reference
from .attention import attention_forward, attention_mask
from .common.layout import sequence_minor_by_default
from .common.masking import Attention, Problem, kv_steps, prepare, q_steps
from .common.paged import PagedProblem, cache_stored_keys_minor, packed_keys_stored_minor, paged_problem
from .common.tiles import AttentionConfig
from .common.vmem import WORKING_SET_BOUND_BYTES, WORKING_SET_MARGIN, vmem_budget, vmem_limit
from .flash.kernel import SUPPORTED_HEAD_DIMS
from .flash_api import flash_attn_func, flash_attn_varlen_func
from .kvcache import flash_attn_with_kvcache
from .ops import flash_attention
from .paged_ops import ragged_paged_attention, ragged_varlen_attention

# What a user of the loaded kernel calls (and what `kernels describe-api` lists, from symbols.json): the torch
# op, transformers' attention and mask functions, the flash-attn 2 API (`flash_api`, and `kvcache` on the paged
# kernel: what transformers calls when `attn_implementation` names this repo), the paged kernel's torch ops and the
# float64 reference the kernels are tested against.
__all__ = ["SUPPORTED_HEAD_DIMS", "attention_forward", "attention_mask", "flash_attention", "ops", "reference",
           "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "ragged_paged_attention",
           "ragged_varlen_attention"]

# The one face code outside this package (benchmarks, the performance model, integration, tests) uses besides
# `__all__`: tests/test_kernel_face.py holds every use to these names. A dotted name is reached through the
# subpackages bound above (`flash.plan.make`), and only that name of its module is.
TOOLS = [
    # One call's options, the problem they make, and the grid lengths its visible pairs give.
    "Attention", "Problem", "kv_steps", "prepare", "q_steps",
    # Each kernel's seams.
    "flash.tiles.select", "flash.plan.make", "flash.kernel.call",
    "flash_backward.tiles.select", "flash_backward.plan.make", "flash_backward.kernel.call",
    # The JAX functions (each planning its own call): differentiable, the forward alone (with the log-sum-exp), the
    # backward alone.
    "flash.kernel.differentiable_flash_attention", "flash.kernel.flash_attention_forward",
    "flash_backward.kernel.flash_attention_backward",
    # The configs a caller hands `make`.
    "AttentionConfig", "flash_backward.tiles.BackwardConfig",
    # What the forward's tile selector weighs.
    "flash.tiles.DECODE_STEP_BYTES", "flash.tiles.PREFERRED_TILES", "flash.tiles.PREFERRED_TILES_BY_HEAD_DIM",
    "flash.tiles.TUNED_TILES",
    "flash.tiles.ForwardTiles", "flash.tiles.TunedKey", "flash.tiles.check_config", "flash.tiles.heuristic_config",
    "flash.tiles.is_decode", "flash.tiles.tuned_config", "flash.tiles.vmem_bytes",
    # The order the forward and backward read q, K and V in and write their results in: XLA's default layout's.
    "sequence_minor_by_default",
    # What the backward's weighs.
    "flash_backward.tiles.PREFERRED_BACKWARD_TILES", "flash_backward.tiles.PREFERRED_BACKWARD_TILES_BY_HEAD_DIM",
    "flash_backward.tiles.STEP_OVERHEAD_MULTIPLE",
    "flash_backward.tiles.WINDOW_BLOCK_FACTOR", "flash_backward.tiles.backward_step_seconds",
    "flash_backward.tiles.backward_tiles", "flash_backward.tiles.backward_vmem_bytes",
    "flash_backward.tiles.check_backward_config", "flash_backward.tiles.reads_sequence_minor",
    # The VMEM policy both take: this kernel's margin and bound.
    "WORKING_SET_BOUND_BYTES", "WORKING_SET_MARGIN", "vmem_budget", "vmem_limit",
    # Ragged paged attention: its problem, seams, JAX function, config and what its tile selector weighs.
    "PagedProblem", "paged_problem", "cache_stored_keys_minor", "packed_keys_stored_minor", "paged.tiles.select",
    "paged.plan.make", "paged.kernel.call",
    "paged.kernel.ragged_paged_attention", "paged.kernel.ragged_varlen_attention", "paged.kernel.SUPPORTED_HEAD_DIMS",
    "paged.tiles.PagedConfig", "paged.tiles.PREFERRED_TILES", "paged.tiles.vmem_bytes",
]
