"""The MoE layer reads Gemma 4's experts without rewriting them: no per-call relayout in the compiled program.

XLA's default TPU layout stores Gemma-4-26B-A4B's `down_proj[E, H, I]`
I-major (`hardware.default_layout_swaps_minor_dims`); a kernel that read it
row-major made XLA copy all of it on every call (968 MiB at EP1, 60.5 MiB on
an EP8 rank: benchmarks/results/moe_layer.json before the fix). Compiled
ahead of time for v5e and v6e on an EP8 rank (16 local experts), both paths
of `moe.experts_layer`, bf16 and fp8 weights (whose small scale grids may
still be relaid out).
"""

import jax
import jax.numpy as jnp
import pytest

from benchmarks.perf import calibration, xla_program
from benchmarks.studies.model_shapes import EXPERTS_MODELS

S = jax.ShapeDtypeStruct
GEMMA_4 = EXPERTS_MODELS["gemma-4-26b-a4b"]
# Gemma-4-26B-A4B, one of 8 expert-parallel ranks.
EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = GEMMA_4["experts"] // 8, GEMMA_4["hidden"], GEMMA_4["intermediate"], GEMMA_4["top_k"]


@pytest.fixture(scope="module")
def kernel(ragged_dot_kernel):
    return ragged_dot_kernel


@pytest.mark.parametrize("generation, fused, weights_dtype", [
    ("v6e", True, jnp.bfloat16), ("v6e", False, jnp.bfloat16), ("v5e", True, jnp.bfloat16),
    ("v6e", True, jnp.float8_e4m3fn),
])
def test_gemma4_experts_are_read_in_place(kernel, generation, fused, weights_dtype):
    tokens = 8
    gate_up, down = (EXPERTS, 2 * INTERMEDIATE, HIDDEN), (EXPERTS, HIDDEN, INTERMEDIATE)
    avals = [S((tokens, HIDDEN), jnp.bfloat16), S((tokens, TOP_K), jnp.int32), S((tokens, TOP_K), jnp.bfloat16),
             S(gate_up, weights_dtype), S(down, weights_dtype)]
    scheme = "fp8" if weights_dtype == jnp.float8_e4m3fn else None
    if scheme is not None:
        avals += [S(kernel.expected_scales_shape(scheme, shape, 1), jnp.float32) for shape in (gate_up, down)]

    def layer(hidden_states, index, weights, gate_up_proj, down_proj, *scales):
        return kernel.experts_layer(hidden_states, index, weights, gate_up_proj, down_proj, None, None, *scales,
                                    activation="gelu_tanh", weights_transposed=False, fused=fused,
                                    generation=generation)

    program = calibration.compile_text(xla_program.lower_program(layer, avals, generation)).analyse(generation)
    relayouts = [op.detail for op in program.ops if op.detail.startswith("relayout")]
    assert not [detail for detail in relayouts if "_proj" in detail], relayouts
    # fp8's small block-scale grids ([16, 11, 22] and [16, 22, 6] f32) may still be relaid out: ~24 KB a call.
    scale_bytes = sum(aval.size * 4 for aval in avals[5:])
    assert program.relayout_bytes <= 2 * scale_bytes, relayouts


@pytest.mark.slow
def test_gemma4_experts_backward_reads_and_writes_the_weights_in_place(kernel):
    """Training: the gradient of the layer (grouped forward, d_lhs and tgmm backward) neither relays out the
    weights nor writes their gradients in another order than XLA stores them."""
    tokens = 64
    gate_up, down = (EXPERTS, 2 * INTERMEDIATE, HIDDEN), (EXPERTS, HIDDEN, INTERMEDIATE)
    avals = [S((tokens, HIDDEN), jnp.bfloat16), S((tokens, TOP_K), jnp.int32), S((tokens, TOP_K), jnp.bfloat16),
             S(gate_up, jnp.bfloat16), S(down, jnp.bfloat16)]

    def loss(hidden_states, index, weights, gate_up_proj, down_proj):
        out = kernel.experts_layer(hidden_states, index, weights, gate_up_proj, down_proj,
                                   activation="gelu_tanh", weights_transposed=False, generation="v6e")
        return jnp.sum(out.astype(jnp.float32))

    lowered = xla_program.lower_program(jax.grad(loss, argnums=(0, 2, 3, 4)), avals, "v6e")
    program = calibration.compile_text(lowered).analyse("v6e")
    relayouts = [op.detail for op in program.ops if op.detail.startswith("relayout")]
    assert not [detail for detail in relayouts if "_proj" in detail], relayouts
    weights_bytes = 3 * EXPERTS * HIDDEN * INTERMEDIATE * 2
    assert program.relayout_bytes < weights_bytes / 100, relayouts
