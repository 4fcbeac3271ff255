"""Shapes `tpu-kernels check` compiles ahead of time for each TPU generation.

The tiling is chosen per generation, so every target binds `generation`: a
v5e compile checks the v5e tiles against the VMEM limit they ask for there.
"""

import functools

import jax
import jax.numpy as jnp

from .norm.kernel import fused_add_rms_norm_backward, fused_add_rms_norm_forward, rms_norm_backward, rms_norm_forward

HIDDEN_SIZES = (2048, 2816, 4096, 7168)
ROW_COUNTS = (1, 64, 8192)
EPS = 1e-6


def _targets_of(kernel_fn, arity: int, name: str, rows: int, hidden: int, dtype, generation: str, **options):
    label = f"{name} rows={rows} H={hidden} {jnp.dtype(dtype).name}"
    if options:
        label += " " + " ".join(f"{k}={v}" for k, v in options.items())
    fn = functools.partial(kernel_fn, eps=EPS, generation=generation, **options)
    avals = (jax.ShapeDtypeStruct((rows, hidden), dtype),) * arity + (jax.ShapeDtypeStruct((hidden,), dtype),)
    return label, fn, avals


def compile_targets(generation: str):
    forward = (("rms_norm", rms_norm_forward, 1), ("fused_add_rms_norm", fused_add_rms_norm_forward, 2))
    backward = (
        ("rms_norm_backward", rms_norm_backward, 2),
        ("fused_add_rms_norm_backward", fused_add_rms_norm_backward, 3),
    )
    targets = []
    for name, fn, arity in forward:
        for hidden in HIDDEN_SIZES:
            for rows in ROW_COUNTS:
                targets.append(_targets_of(fn, arity, name, rows, hidden, jnp.bfloat16, generation))
        for hidden in (4096, 7168):
            # float32 doubles the bytes per row: the largest blocks' VMEM fit.
            targets.append(_targets_of(fn, arity, name, 8192, hidden, jnp.float32, generation, offset=1.0))
        for hidden in (96, 200):
            # Hidden sizes that are not a multiple of the 128 lanes, with a ragged last row block.
            targets.append(_targets_of(fn, arity, name, 1000, hidden, jnp.bfloat16, generation))
    for name, fn, arity in backward:
        for dtype in (jnp.bfloat16, jnp.float32):
            targets.append(_targets_of(fn, arity, name, 8192, 7168, dtype, generation))
        targets.append(_targets_of(fn, arity, name, 1000, 200, jnp.bfloat16, generation))
    # Per-head q/k norms (Qwen3's 32 query heads of 128): a token bucket times the heads, for a decode step
    # (16 x 32 rows) and a 4096-token prefill (4096 x 32).
    for rows in (16 * 32, 4096 * 32):
        targets.append(_targets_of(rms_norm_forward, 1, "rms_norm", rows, 128, jnp.bfloat16, generation))
    # Rows so wide that even 8 of them pass the kernel's bound on its blocks (norm.tiles.WORKING_SET_BOUND_BYTES).
    targets.append(_targets_of(rms_norm_forward, 1, "rms_norm", 64, 65536, jnp.float32, generation))
    return targets
