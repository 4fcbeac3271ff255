"""The flash kernels' rule for the order XLA stores q, K and V in (`common.layout.sequence_minor_by_default`)
against the compiler: the layout libtpu's compile-only topologies give the arguments of a jitted function."""

import jax
import jax.numpy as jnp
import pytest

from tpu_kernels.aot import topology_device

# [B, H, kv_len, head_dim] on both sides of the rule: head dims of real models (latent attention's 96, 192, 320 and
# 576 among them: 160 and 288 agreed too when probed) and a smaller one, key lengths at, below and above the head dim
# and 128, not multiples of 8 or of 128, and several batch and head counts.
_HEAD_DIMS = (32, 64, 96, 128, 192, 256, 320, 512, 576)
_KV_LENS = (1, 16, 63, 64, 65, 100, 129, 200, 1000, 4097)
_BATCH_HEADS = ((1, 1), (3, 5), (8, 8))
_KEYS_MINOR = (0, 1, 3, 2)  # major to minor: physically [B, H, head_dim, kv_len]


@pytest.mark.aot
@pytest.mark.slow
# The rule held on all four generations and in both dtypes when it was probed (layout choice is the same compiler
# pass on each); the oldest and the newest generation are checked here, one dtype each.
@pytest.mark.parametrize("generation, dtype", [("v5e", jnp.bfloat16), ("tpu7x", jnp.float32)])
def test_sequence_minor_rule_matches_the_compiler(kernel, generation, dtype):
    sharding = jax.sharding.SingleDeviceSharding(topology_device(generation))
    shapes = [(batch, heads, kv_len, head_dim) for head_dim in _HEAD_DIMS for kv_len in _KV_LENS
              for batch, heads in _BATCH_HEADS]
    # One program takes every shape: XLA picks each parameter's layout on its own.
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape in shapes]
    compiled = jax.jit(lambda *arrays: [a + 1 for a in arrays]).lower(*args).compile()
    found = {shape: fmt.layout.major_to_minor == _KEYS_MINOR for shape, fmt in zip(shapes, compiled.input_formats[0])}
    predicted = {shape: kernel.common.layout.sequence_minor_by_default(shape[2], shape[3]) for shape in shapes}
    assert found == predicted
    assert any(predicted.values()) and not all(predicted.values())
