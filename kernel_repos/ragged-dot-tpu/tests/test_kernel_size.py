"""What Mosaic compiles of the grouped matmuls' row chunks: one chunk's matmul, in a loop over the chunks, however
many a row tile holds (its compile time grows with the matmuls the kernel body holds; interpret-mode results and
the traffic model's counts are the other tests')."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core
import pytest

S = jax.ShapeDtypeStruct


def _kernel_matmuls(fn, *args) -> int:
    """The dot_generals in the body of the one pallas_call `fn(*args)` makes (also inside its loops and branches)."""

    def count(jaxpr) -> int:
        found = 0
        for eqn in jaxpr.eqns:
            found += eqn.primitive.name == "dot_general"
            found += sum(count(inner) for inner in jax_core.jaxprs_in_params(eqn.params))
        return found

    [call] = [eqn for eqn in jax.make_jaxpr(fn)(*args).jaxpr.eqns if eqn.primitive.name == "pallas_call"]
    return count(call.params["jaxpr"])


@pytest.mark.parametrize("chunk_m", [32, 128])
def test_a_grouped_matmul_holds_one_matmul_per_group_slot_whatever_its_chunks(kernel, chunk_m):
    sizes = np.random.default_rng(chunk_m).integers(0, 64, 8).astype(np.int32)
    for groups_per_step in (1, 2):
        config = kernel.gmm.tiles.TileConfig(256, 256, 256, chunk_m, groups_per_step)
        fn = functools.partial(kernel.gmm.kernel.grouped_matmul, config=config, generation="v6e")
        assert _kernel_matmuls(fn, S((256, 256), jnp.bfloat16), S((8, 256, 384), jnp.bfloat16), sizes) == \
            groups_per_step


@pytest.mark.parametrize("group_chunks", [False, True])
def test_a_weights_gradient_holds_one_matmul_whatever_its_chunks(kernel, group_chunks):
    sizes = np.random.default_rng(int(group_chunks)).integers(0, 128, 8).astype(np.int32)
    config = kernel.tgmm.tiles.TgmmConfig(512, 256, 256, 64, group_chunks)
    fn = functools.partial(kernel.tgmm.kernel.transposed_grouped_matmul, config=config, generation="v6e")
    assert _kernel_matmuls(fn, S((1024, 256), jnp.bfloat16), S((1024, 384), jnp.bfloat16), sizes) == 1
