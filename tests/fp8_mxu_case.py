"""The experts layer with fp8 weights on both paths (the fused kernel, in both gate/up layouts, and the grouped
matmuls), compiled for TPU7x and v6e: which operands the kernels' matmuls take.

Run as `python -m tests.fp8_mxu_case RAGGED_DOT_BUILD DUMP_DIR` with libtpu's
LLO dump switched on (LIBTPU_INIT_ARGS from
`benchmarks.perf.megacore_dump.original_llo_dump_args(DUMP_DIR)`, read once
when libtpu starts: hence a process of its own). Prints, as JSON, {path: {generation: {matmul instruction:
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

from benchmarks.perf.megacore_dump import ORIGINAL_PROGRAM

GENERATIONS = ("tpu7x", "v6e")
# The experts layer's paths: the pallas_call names of their kernels, and the layer's weights layout and gate.
QWEN3 = dict(weights_transposed=False, activation="silu")
GPT_OSS = dict(weights_transposed=True, activation="clamped_swiglu", interleaved=True, alpha=1.702, limit=7.0)
PATHS = {"fused": ("fused_experts.", QWEN3), "grouped": ("ragged_dot.", QWEN3),
         "fused-interleaved": ("fused_experts.", GPT_OSS)}
_MATMUL = re.compile(r"vmatmul[a-z0-9_.]*")


def _layer_avals(layout: dict, tokens=64, hidden=512, intermediate=256, experts=8, top_k=2):
    """A layer with fp8 weights and 128 x 128 block scales, in Qwen3's layout (`[E, 2I, H]`, `[E, H, I]`) or
    GPT-OSS's (`[E, H, 2I]`, `[E, I, H]`, with biases)."""
    blocks = lambda n: -(-n // 128)  # noqa: E731
    gate_up, down = (experts, 2 * intermediate, hidden), (experts, hidden, intermediate)
    if layout["weights_transposed"]:
        gate_up, down = (experts, hidden, 2 * intermediate), (experts, intermediate, hidden)
    fp8, bf16 = jnp.float8_e4m3fn, jnp.bfloat16
    biases = [((experts, 2 * intermediate), bf16), ((experts, hidden), bf16)] if layout.get("interleaved") else []
    return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (
        ((tokens, hidden), bf16), ((tokens, top_k), jnp.int32), ((tokens, top_k), bf16), (gate_up, fp8), (down, fp8),
        *biases, ((experts, *map(blocks, gate_up[1:])), jnp.float32), ((experts, *map(blocks, down[1:])), jnp.float32))]


def matmuls(build: str, dump: Path) -> dict[str, dict[str, dict[str, int]]]:
    import kernels as hf_kernels
    from tpu_kernels.aot import compile_for

    ragged_dot = hf_kernels.get_local_kernel(Path(build), backend="cpu")
    found = {path: {} for path in PATHS}
    for path, (kernel_name, layout) in PATHS.items():
        for generation in GENERATIONS:
            def layer(hidden, index, weights, gate_up, down, *rest, generation=generation,
                      fused=path.startswith("fused"), layout=layout):
                biases = rest[:2] if len(rest) == 4 else (None, None)
                return ragged_dot.experts_layer(hidden, index, weights, gate_up, down, *biases, *rest[-2:],
                                                   fused=fused, generation=generation, **layout)

            before = set(dump.iterdir()) if dump.exists() else set()
            compile_for(layer, _layer_avals(layout), generation)
            programs = [p for p in set(dump.iterdir()) - before
                        if p.name.split("-", 1)[1].startswith(kernel_name) and p.name.endswith(ORIGINAL_PROGRAM)]
            assert programs, f"no {kernel_name} program dumped for {generation}"
            found[path][generation] = dict(sum((collections.Counter(_MATMUL.findall(p.read_text())) for p in programs),
                                               collections.Counter()))
    return found


if __name__ == "__main__":
    print(json.dumps(matmuls(sys.argv[1], Path(sys.argv[2]))))
