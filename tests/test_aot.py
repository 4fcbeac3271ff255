"""Ahead-of-time compiles of every kernel repo's declared shapes for every supported TPU generation (libtpu
compile-only)."""

from pathlib import Path

import jax
import jax.numpy as jnp
from tpu_kernels.distribution.loader import get_local_kernel
import pytest
from jax.experimental import pallas as pl

from tpu_kernels.aot import compile_for, compile_kernel
from tpu_kernels.runtime.hardware import SUPPORTED_GENERATIONS

pytestmark = pytest.mark.aot

KERNEL_REPOS = sorted(p.parent for p in (Path(__file__).resolve().parents[1] / "kernel_repos").glob("*/build.toml"))


@pytest.mark.parametrize("repo", KERNEL_REPOS, ids=lambda p: p.name)
@pytest.mark.parametrize("generation", SUPPORTED_GENERATIONS)
def test_declared_shapes_compile(repo, generation, kernel_builds):
    module = get_local_kernel(kernel_builds[repo.name], backend="cpu")
    results = compile_kernel(module, repo.name, [generation])
    assert results, f"{repo.name} declares no compile targets"
    failed = [f"{r.generation} {r.label}: {r.error}" for r in results if not r.compiled]
    assert not failed, "\n".join(failed)


def test_an_oversized_block_fails_to_compile():
    """The check has teeth: a block far past VMEM is refused by Mosaic, as on a real TPU."""

    def copy(x):
        block = pl.BlockSpec((8192, 8192), lambda i: (i, 0))
        return pl.pallas_call(
            lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(2,),
            in_specs=[block],
            out_specs=block,
        )(x)

    with pytest.raises(Exception, match="(?i)vmem|resource"):
        compile_for(copy, [jax.ShapeDtypeStruct((16384, 8192), jnp.float32)], "v6e")
