"""Where XLA's default TPU layout stores K and V keys-minor, as the paged kernel's predicates say: held against the
layouts the compiler gives (benchmarks.perf.argument_layouts reads them from the compiled program)."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks.perf import argument_layouts


@pytest.mark.aot
@pytest.mark.parametrize("generation", ["v5e", "tpu7x"])
def test_the_keys_minor_predicate_agrees_with_the_compiler(kernel, generation):
    """`cache_stored_keys_minor` against the layout XLA gives a cache argument, [pages, page, Hkv, D] in bfloat16 and
    float32: {1,3,2,0} exactly where it answers True; `packed_keys_stored_minor` against packed keys' ({0,2,1})."""
    shapes = [(64, 8, 16), (64, 8, 128), (64, 1, 256), (64, 4, 512), (128, 8, 128), (256, 2, 256), (64, 8, 64)]
    for (head_dim, kv_heads, page_size), dtype in zip(shapes, [jnp.bfloat16, jnp.float32] * len(shapes)):
        cache = jax.ShapeDtypeStruct((64 * 1024 // page_size, page_size, kv_heads, head_dim), dtype)
        layout = argument_layouts.probe(lambda c: c[:1] * 2, [cache], generation).argument(0).minor_to_major
        keys_minor = kernel.common.paged.cache_stored_keys_minor(page_size, head_dim)
        assert (layout == (1, 3, 2, 0)) == keys_minor, (cache, layout)
    for (total_k, kv_heads, head_dim), dtype in zip([(4096, 8, 64), (1000, 1, 64), (4096, 4, 128)],
                                                    [jnp.bfloat16, jnp.float32, jnp.bfloat16]):
        packed = jax.ShapeDtypeStruct((total_k, kv_heads, head_dim), dtype)
        layout = argument_layouts.probe(lambda k: k[:1] * 2, [packed], generation).argument(0).minor_to_major
        assert (layout == (0, 2, 1)) == kernel.common.paged.packed_keys_stored_minor(head_dim), (packed, layout)
