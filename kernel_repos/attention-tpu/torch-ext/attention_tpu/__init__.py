"""attention-tpu: flash attention (forward and backward) for prefill, decode and training, and latent attention for
MLA models' decode, as Pallas TPU kernels, as torch ops.

On TPU tensors the ops run the Mosaic-compiled kernels; on CPU tensors they run
the same kernels in Pallas' TPU interpret mode (exact, slow: for development
and CI). `attention_forward` and `attention_mask` plug it into transformers.

Each kernel is a subpackage (`flash`: the forward; `flash_backward`: dq and
dk/dv; `paged`: ragged paged attention over a paged or contiguous KV cache,
inference only; `latent`: multi-head latent attention in its absorbed form
over transformers' latent cache, inference only) with three seams:
`tiles.select(problem, target)` picks its tiles, `plan.make(problem, target,
config=None)` lays its grid and VMEM limit, and `kernel.call(arrays...,
plan)` runs it. The problem is a frozen value (`Problem`, `PagedProblem`,
`LatentProblem`) and so is the target, the TPU generation's facts
(`_hardware.TpuGeneration`): each JAX function resolves its `generation` (a
name, or None for this device's) once and hands both down to the tiles.
`common` is what the kernels share (the call's options, its `Problem` and
masking, the paged kernel's `PagedProblem`, the latent kernel's
`LatentProblem`, the online softmax, the tiles' type, the VMEM policy, the
layout rule). `__all__` is what a user calls (the torch
ops, the transformers entry points, the flash-attn 2 API and the reference);
`TOOLS` is what this project's lab (benchmarks/) uses besides, and nothing
more: the kernel's own tests reach its internals through the modules bound
below.
"""

# Submodules are bound by name here, not only imported: `kernels` may load the
# same build (same module id) from a second path, and then Python reuses the
# cached submodules without setting them as attributes of the new package.
# Nothing else is bound here but the names of the face.
from . import (common, flash, flash_api, flash_backward, kvcache, latent, latent_ops, mla, ops, paged, paged_ops,
               reference)
from .attention import attention_forward, attention_mask
from .common.head_dims import SUPPORTED_HEAD_DIMS, supports_head_dims
from .common.masking import Problem
from .common.paged import PagedProblem
from .common.tiles import AttentionConfig
from .common.vmem import vmem_budget, vmem_limit
from .flash_api import flash_attn_func, flash_attn_varlen_func
from .kvcache import flash_attn_with_kvcache
from .latent_ops import latent_attention
from .mla import latent_attention_forward, latent_refusal, serve_latent
from .ops import flash_attention
from .paged_ops import ragged_paged_attention, ragged_varlen_attention

# What a user of the loaded kernel calls (and what `kernels describe-api` lists, from symbols.json): the head dims
# it serves (`SUPPORTED_HEAD_DIMS` where q, k and v share one; `supports_head_dims(qk, v)` for any pair), the torch
# op, transformers' attention and mask functions, the flash-attn 2 API (`flash_api`, and `kvcache` on the paged
# kernel: what transformers calls when `attn_implementation` names this repo), the paged kernel's torch ops and the
# float64 reference the kernels are tested against; latent attention (MLA): the absorbed form's op over
# transformers' latent cache and its module, and what kernelize installs for an MLA model (`mla`: the attention
# function that picks the absorbed or the expanded form per call, the module set-up, and why a module cannot be
# set up).
__all__ = ["SUPPORTED_HEAD_DIMS", "supports_head_dims", "attention_forward", "attention_mask", "flash_attention",
           "ops", "reference",
           "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "ragged_paged_attention",
           "ragged_varlen_attention", "latent_attention", "latent_ops", "latent_attention_forward", "serve_latent",
           "latent_refusal"]

# What this project's lab uses besides `__all__`, and nothing more: tests/test_kernel_face.py holds every use
# outside the kernel repo to these names, and each name to a use. A dotted name is reached through the subpackages
# bound above (`flash.tiles.select`), and only that name of its module is.
TOOLS = [
    # The problems the tile selectors take, and the configs they give.
    "Problem", "PagedProblem", "AttentionConfig", "flash_backward.tiles.BackwardConfig",
    # Each kernel's tile selector.
    "flash.tiles.select", "flash_backward.tiles.select", "paged.tiles.select",
    # The JAX functions (each planning its own call): differentiable, the forward alone (with the log-sum-exp), the
    # backward alone, and the paged kernel's over a paged cache and over contiguous keys.
    "flash.kernel.differentiable_flash_attention", "flash.kernel.flash_attention_forward",
    "flash_backward.kernel.flash_attention_backward", "paged.kernel.ragged_paged_attention",
    "paged.kernel.ragged_varlen_attention",
    # What the lab weighs of the tiles: the VMEM the forward's take (of its tiles' type) and the policy's budget and
    # limit, and the backward's tiles.
    "flash.tiles.vmem_bytes", "flash.tiles.ForwardTiles", "vmem_budget", "vmem_limit",
    "flash_backward.tiles.backward_tiles",
    # The latent kernel's (MLA's absorbed form): its problem and tile selector, and its JAX function.
    "latent.tiles.LatentProblem", "latent.tiles.select", "latent.kernel.latent_attention",
]
