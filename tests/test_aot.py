"""Ahead-of-time compiles of every kernel repo's declared shapes for every supported TPU generation (libtpu
compile-only)."""

from pathlib import Path

import jax
import jax.numpy as jnp
from tpu_kernels.distribution.loader import get_local_kernel
import pytest
from jax.experimental import pallas as pl

from tpu_kernels.aot import compile_for, compile_kernel, lower_for
from tpu_kernels.aot_record import RECORD_FILE, AotRecord
from tpu_kernels.runtime.hardware import SUPPORTED_GENERATIONS

pytestmark = pytest.mark.aot

KERNEL_REPOS = sorted(p.parent for p in (Path(__file__).resolve().parents[1] / "kernel_repos").glob("*/build.toml"))


@pytest.mark.parametrize("repo", KERNEL_REPOS, ids=lambda p: p.name)
@pytest.mark.parametrize("generation", SUPPORTED_GENERATIONS)
def test_declared_shapes_compile(repo, generation, kernel_builds):
    """Each target compiles, or the repo's committed record (aot_record) covers it at today's sources and
    compiler versions; one covered target per generation is compiled anyway and must agree with the record."""
    module = get_local_kernel(kernel_builds[repo.name], backend="cpu")
    results = compile_kernel(module, repo.name, [generation], record=AotRecord.read(repo / RECORD_FILE))
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


def _fake_kernel(root: Path, digest: str, oversized: bool = True):
    """A built-variant-like package whose compile targets are: a small kernel inside an XLA program, the same kernel
    in another program, a program that calls no kernel and (`oversized`) an oversized block, whose failing compile
    costs about 4 s of CPU."""
    import importlib
    import sys
    import textwrap

    package = root / f"fake_kernel_{digest}"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "metadata.json").write_text(f'{{"digest": {{"algorithm": "sha256", "files": {{"x": "{digest}"}}}}}}')
    (package / "compile_targets.py").write_text(textwrap.dedent('''
        import jax
        import jax.numpy as jnp
        from jax.experimental import pallas as pl

        def copy(x, rows):
            block = pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0))
            return pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
                                  out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // rows,),
                                  in_specs=[block], out_specs=block)(x)

        def compile_targets(generation):
            small = (jax.ShapeDtypeStruct((8, 128), jnp.float32),)
            targets = [("small", lambda x: copy(x * 2, 8), small), ("small again", lambda x: copy(x, 8) + 1, small),
                       ("no kernel", lambda x: x * 2, small)]
            if OVERSIZED:
                big = (jax.ShapeDtypeStruct((16384, 8192), jnp.float32),)
                targets.append(("too big", lambda x: copy(x, 8192), big))
            return targets
    ''') + f"\nOVERSIZED = {oversized}\n")
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module(package.name)
    finally:
        sys.path.remove(str(root))


def test_a_compile_that_succeeded_is_remembered_and_a_failure_never(tmp_path):
    cache = tmp_path / "cache"
    # The failure: a target that calls no kernel (a failing compile is reported alike: the next test).
    kernel = _fake_kernel(tmp_path, "a" * 8, oversized=False)
    first = {r.label: r for r in compile_kernel(kernel, "fake", ["v5e"], cache_dir=cache)}
    assert first["small"].compiled and not first["small"].cached
    assert not first["no kernel"].compiled
    second = {r.label: r for r in compile_kernel(kernel, "fake", ["v5e"], cache_dir=cache)}
    assert second["small"].compiled and second["small"].cached and second["small"].flops == first["small"].flops
    assert not second["no kernel"].compiled and not second["no kernel"].cached
    # Another variant (its content digest), or another generation, compiles again; without a cache folder a
    # remembered target compiles again too.
    changed = _fake_kernel(tmp_path, "b" * 8, oversized=False)
    assert not compile_kernel(changed, "fake", ["v5e"], cache_dir=cache)[0].cached
    assert not compile_kernel(changed, "fake", ["v6e"], cache_dir=cache)[0].cached
    assert compile_kernel(changed, "fake", ["v5e"], cache_dir=cache)[0].cached
    assert not compile_kernel(changed, "fake", ["v5e"], cache_dir=None)[0].cached


def test_each_kernel_compiles_alone_once_and_a_target_without_one_fails(tmp_path, monkeypatch):
    from tpu_kernels import aot

    compiled = []
    compile_program = aot._compile_program
    monkeypatch.setattr(aot, "_compile_program", lambda lowered: compiled.append(lowered) or compile_program(lowered))
    results = {r.label: r for r in compile_kernel(_fake_kernel(tmp_path, "c" * 8), "fake", ["v5e"], cache_dir=None)}
    # "small" and "small again" call one kernel (the XLA around it differs): one compile, and both targets compiled.
    assert len(compiled) == 2 and "custom_call" in compiled[0].as_text() and "multiply" not in compiled[0].as_text()
    assert results["small"].compiled and results["small again"].compiled
    assert not results["no kernel"].compiled and "no Pallas kernel" in results["no kernel"].error
    assert not results["too big"].compiled and results["too big"].error


def test_the_kernels_of_a_program_are_found_under_jit_control_flow_and_derivatives():
    from tpu_kernels.aot import pallas_kernels

    def scale(x, factor):
        return pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * factor),
                              out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    @jax.custom_vjp
    def doubled(x):
        return scale(x, 2.0)

    doubled.defvjp(lambda x: (scale(x, 2.0), None), lambda _, g: (scale(g, 3.0),))

    def program(x, flag):
        y = jax.jit(lambda x: scale(x, 4.0))(x)
        y = jax.lax.cond(flag, lambda y: scale(y, 5.0), lambda y: y, y)
        return jax.value_and_grad(lambda x: doubled(x).sum())(y)

    x = jax.ShapeDtypeStruct((16, 128), jnp.float32)
    found = pallas_kernels(program, [x, jax.ShapeDtypeStruct((), jnp.bool_)])
    assert len(found) == 4
    # Each is the call alone, on its own operands: a program of one custom call.
    for call, operands in found:
        assert [(a.shape, a.dtype) for a in operands] == [(x.shape, x.dtype)]
        text = lower_for(call, operands, "v5e").as_text()
        assert text.count("tpu_custom_call") == 1 and "multiply" not in text
