"""The experts layer with fp8 weights on both paths (the fused kernel, the grouped matmuls), compiled for TPU7x and
v6e: which operands the kernels' matmuls take.

Run as `python -m tests.fp8_mxu_case RAGGED_DOT_BUILD DUMP_DIR` with libtpu's
LLO dump switched on (LIBTPU_INIT_ARGS="--xla_jf_dump_to=DUMP_DIR
--xla_jf_dump_llo_text=true", read once when libtpu starts: hence a process
of its own). Prints, as JSON, {path: {generation: {matmul instruction:
count}}} of the path's kernels' programs as the LLO pipeline first sees them.
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

GENERATIONS = ("tpu7x", "v6e")
# The experts layer's paths, by the pallas_call names of their kernels.
PATHS = {"fused": "fused_experts.", "grouped": "ragged_dot."}
_MATMUL = re.compile(r"vmatmul[a-z0-9_.]*")


def _layer_avals(tokens=64, hidden=512, intermediate=256, experts=8, top_k=2):
    """A Qwen3-layout layer (`[E, 2I, H]`, `[E, H, I]`) with fp8 weights and 128 x 128 block scales."""
    blocks = lambda n: -(-n // 128)  # noqa: E731
    return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (
        ((tokens, hidden), jnp.bfloat16), ((tokens, top_k), jnp.int32), ((tokens, top_k), jnp.bfloat16),
        ((experts, 2 * intermediate, hidden), jnp.float8_e4m3fn), ((experts, hidden, intermediate), jnp.float8_e4m3fn),
        ((experts, blocks(2 * intermediate), blocks(hidden)), jnp.float32),
        ((experts, blocks(hidden), blocks(intermediate)), jnp.float32))]


def matmuls(build: str, dump: Path) -> dict[str, dict[str, dict[str, int]]]:
    import kernels as hf_kernels
    from tpu_kernels.aot import compile_for

    ragged_dot = hf_kernels.get_local_kernel(Path(build), backend="cpu")
    found = {path: {} for path in PATHS}
    for path, kernel_name in PATHS.items():
        for generation in GENERATIONS:
            def layer(hidden, index, weights, gate_up, down, gate_up_scales, down_scales, generation=generation,
                      fused=path == "fused"):
                return ragged_dot.moe.experts_layer(hidden, index, weights, gate_up, down, None, None, gate_up_scales,
                                                   down_scales, fused=fused, activation="silu",
                                                   weights_transposed=False, generation=generation)

            before = set(dump.iterdir()) if dump.exists() else set()
            compile_for(layer, _layer_avals(), generation)
            programs = [p for p in set(dump.iterdir()) - before
                        if p.name.split("-", 1)[1].startswith(kernel_name) and p.name.endswith("-02-original.txt")]
            assert programs, f"no {kernel_name} program dumped for {generation}"
            found[path][generation] = dict(sum((collections.Counter(_MATMUL.findall(p.read_text())) for p in programs),
                                               collections.Counter()))
    return found


if __name__ == "__main__":
    print(json.dumps(matmuls(sys.argv[1], Path(sys.argv[2]))))
