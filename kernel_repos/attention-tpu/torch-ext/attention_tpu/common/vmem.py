"""The VMEM policy every tpu-kernels build shares (`_hardware.py`), as both attention kernels take it: with this
kernel's WORKING_SET_MARGIN on its VMEM estimates and its WORKING_SET_BOUND_BYTES on tile size."""

from __future__ import annotations

from .._hardware import MIB, TpuGeneration, vmem_budget_bytes, vmem_limit_bytes

# Working sets the heuristics stay within (the policy's `bound_bytes`). The
# kernels raise the scoped limit to what a config needs, so these bound tile
# size rather than what fits: v6e's is its default scoped limit (32 MiB),
# v5e's half again its default (16 MiB). Chosen with the forward's preferred
# tiles (`flash.tiles.PREFERRED_TILES`), not measured separately. v5p and
# TPU7x have 64 MiB per core: 24 MiB each, within what fits there with
# WORKING_SET_MARGIN.
WORKING_SET_BOUND_BYTES = {"v5e": 24 * MIB, "v5p": 24 * MIB, "v6e": 32 * MIB, "tpu7x": 24 * MIB}
# The VMEM estimate counts the pipeline buffers, the scratch and one slice's
# softmax temporaries; Mosaic's relayouts of the logits come on top. A 1.5x
# margin on the estimate (the policy's `margin`) covers them; every compile
# target also compiles without it (libtpu compile-only, v5e and v6e), so the
# margin is for shapes outside those targets.
WORKING_SET_MARGIN = 1.5


def vmem_budget(target: TpuGeneration) -> int:
    """What a config's working set may take on `target`: the shared policy's budget with WORKING_SET_MARGIN, within
    WORKING_SET_BOUND_BYTES."""
    return vmem_budget_bytes(target.name, margin=WORKING_SET_MARGIN,
                             bound_bytes=WORKING_SET_BOUND_BYTES[target.name])


def vmem_limit(working_set_bytes: int, target: TpuGeneration) -> int:
    """The scoped VMEM limit asked for a working set on `target`: the shared policy's, with WORKING_SET_MARGIN."""
    return vmem_limit_bytes(working_set_bytes, target.name, margin=WORKING_SET_MARGIN)
