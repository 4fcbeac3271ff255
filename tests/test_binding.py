"""The JAX -> torch op binding: both registration paths, DLPack hand-off, fakes, races."""

import jax
import jax.numpy as jnp
import pytest
import torch
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpu_kernels import binding
from tpu_kernels.binding import jax_torch_op


def _scale_add(x_ref, y_ref, out_ref, diff_ref, *, scale):
    out_ref[...] = x_ref[...] * scale + y_ref[...]
    diff_ref[...] = x_ref[...] - y_ref[...]


def scale_add(x: jax.Array, y: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
    block = pl.BlockSpec((8, 128), lambda i: (i, 0))
    return pl.pallas_call(
        lambda *refs: _scale_add(*refs, scale=scale),
        out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype),) * 2,
        grid=(x.shape[0] // 8,),
        in_specs=[block, block],
        out_specs=(block, block),
    )(x, y)


def test_jax_op_registers_our_signature_on_cpu():
    """torch_tpu is installed here: registration goes through torch.tpu.pallas.jax_op."""
    assert binding._jax_op_registrar() is not None
    op = jax_torch_op("tk_test_jaxop::scale_add")(scale_add)
    assert type(op).__module__.startswith("torch_tpu")
    assert str(torch.ops.tk_test_jaxop.scale_add.default._schema) == (
        "tk_test_jaxop::scale_add(Tensor x, Tensor y, float scale) -> (Tensor, Tensor)"
    )
    x, y = torch.randn(16, 128), torch.randn(16, 128)
    out, diff = op(x, y, 3.0)
    torch.testing.assert_close(out, x * 3 + y)
    torch.testing.assert_close(diff, x - y)


def test_plain_custom_op_without_torch_tpu(monkeypatch):
    monkeypatch.setattr(binding, "_jax_op_registrar", lambda: None)
    op = jax_torch_op("tk_test_plain::scale_add")(scale_add)
    assert isinstance(op, torch.library.CustomOpDef)
    x, y = torch.randn(16, 128).bfloat16(), torch.randn(16, 128).bfloat16()
    out, _ = op(x, y, 2.0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, x * 2 + y)


def test_torch_compile_fullgraph_uses_the_fake():
    op = jax_torch_op("tk_test_compile::scale_add")(scale_add)
    x, y = torch.randn(24, 128), torch.randn(24, 128)
    compiled = torch.compile(lambda a, b: op(a, b, 0.5)[0].relu(), fullgraph=True)
    torch.testing.assert_close(compiled(x, y), (x * 0.5 + y).relu())


def test_dlpack_hands_cpu_tensors_to_jax_without_copy():
    for dtype in (torch.float32, torch.bfloat16):
        tensor = torch.randn(32, 128).to(dtype)
        array = binding._to_jax(tensor)
        assert array.unsafe_buffer_pointer() == tensor.data_ptr()
        assert binding._to_torch(array).data_ptr() == tensor.data_ptr()


def test_jax_runs_on_the_cpu_platform():
    assert jax.devices()[0].platform == "cpu"


def _racy_kernel(x_hbm, out_ref, scratch, semaphore):
    copy = pltpu.make_async_copy(x_hbm, scratch, semaphore)
    copy.start()
    # Reads the DMA destination before waiting for the copy: a data race.
    out_ref[...] = scratch[...] + 1
    copy.wait()


def racy(x: jax.Array) -> jax.Array:
    return pl.pallas_call(
        _racy_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA],
    )(x)


def test_race_detection_raises(monkeypatch):
    op = jax_torch_op("tk_test_race::racy")(racy)
    monkeypatch.setenv(binding.RACE_DETECTION_ENV, "1")
    with pytest.raises(RuntimeError, match="data race"):
        op(torch.randn(8, 128))


def test_unsupported_annotation_is_refused():
    def bad(x: jax.Array, sizes: list) -> jax.Array:
        return x

    with pytest.raises(TypeError, match="unsupported parameter annotation"):
        jax_torch_op("tk_test_bad::bad")(bad)


def test_missing_annotation_is_refused():
    def bad(x) -> jax.Array:
        return jnp.asarray(x)

    with pytest.raises(TypeError, match="needs a type annotation"):
        jax_torch_op("tk_test_bad2::bad")(bad)
