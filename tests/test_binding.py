"""The JAX -> torch op binding: both registration paths, optional tensors, hand-off, fakes, races."""

import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpu_kernels.runtime import binding
from tpu_kernels.runtime.binding import jax_torch_op

from .conftest import REPO_ROOT


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


def _add(x_ref, y_ref, out_ref):
    out_ref[...] = x_ref[...] + y_ref[...]


def biased_add(x: jax.Array, y: jax.Array, bias: jax.Array | None, scale: float) -> jax.Array:
    """(x + y) * scale, plus bias[N] when given: one op instead of a with/without pair."""
    total = pl.pallas_call(_add, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x, y) * scale
    return total if bias is None else total + bias


def expected_biased_add(x, y, bias, scale):
    return (x + y) * scale + (0 if bias is None else bias)


def test_torch_tpu_kernel_registers_our_signature_on_cpu():
    """torch_tpu is installed here: TPU tensors reach its JaxCallable behind our launcher."""
    assert binding._torch_tpu_installed()
    op = jax_torch_op("tk_test_jaxop::scale_add")(scale_add)
    assert isinstance(op.registered.tpu_kernel, binding._TpuKernel)
    # Registering makes no JaxCallable (nor imports torch_tpu's Pallas module): the first TPU call does.
    assert "jax_callable" not in vars(op.registered.tpu_kernel)
    assert str(torch.ops.tk_test_jaxop.scale_add.default._schema) == (
        "tk_test_jaxop::scale_add(Tensor x, Tensor y, float scale) -> (Tensor, Tensor)"
    )
    x, y = torch.randn(16, 128), torch.randn(16, 128)
    out, diff = op(x, y, 3.0)
    torch.testing.assert_close(out, x * 3 + y)
    torch.testing.assert_close(diff, x - y)


def test_optional_tensor_through_jax_op_on_cpu():
    op = jax_torch_op("tk_test_optional::biased_add")(biased_add)
    assert isinstance(op.registered.tpu_kernel, binding._TpuKernel)
    assert str(torch.ops.tk_test_optional.biased_add.default._schema) == (
        "tk_test_optional::biased_add(Tensor x, Tensor y, Tensor? bias, float scale) -> Tensor"
    )
    x, y, bias = torch.randn(8, 128), torch.randn(8, 128), torch.randn(128)
    torch.testing.assert_close(op(x, y, None, 2.0), expected_biased_add(x, y, None, 2.0))
    torch.testing.assert_close(op(x, y, bias, 2.0), expected_biased_add(x, y, bias, 2.0))


class _StubTpuRuntime:
    """torch_tpu's C++ kernel registry and launcher, which need a TPU: records what jax_op hands them."""

    def __init__(self):
        self.registered, self.launched = [], []

    def lookup_custom_kernel(self, name, fingerprint):
        return fingerprint in self.registered

    def register_custom_kernel(self, name, fingerprint, serialized_mlir_module):
        self.registered.append(fingerprint)

    def call_custom_kernel(self, name, fingerprint, inputs, output_shapes, donate_argnums, device_assignment):
        self.launched.append((fingerprint, [tuple(t.shape) for t in inputs]))
        return list(output_shapes)


@pytest.fixture
def tpu_runtime(monkeypatch):
    """torch_tpu's launcher replaced by `_StubTpuRuntime`, its placeholders made on the CPU."""
    from torch_tpu._internal.pallas import pallas as torch_tpu_pallas

    runtime = _StubTpuRuntime()
    monkeypatch.setattr(torch_tpu_pallas, "tpu_torch_pallas", runtime)
    placeholder = torch_tpu_pallas.torch_placeholder
    monkeypatch.setattr(torch_tpu_pallas, "torch_placeholder", lambda *a, **k: placeholder(*a, **{**k, "device": "cpu"}))
    return runtime


def test_jax_op_lowers_for_tpu_with_the_optional_tensor_present_and_absent(tpu_runtime):
    """The TPU path up to the runtime: one Mosaic kernel per case, the absent tensor not passed."""
    runtime = tpu_runtime
    op = jax_torch_op("tk_test_optional_tpu::biased_add")(biased_add)
    tpu_kernel = op.registered.tpu_kernel  # what TPU tensors reach
    x, y, bias = torch.randn(8, 128), torch.randn(8, 128), torch.randn(128)
    assert tpu_kernel(x, y, None, 2.0).shape == (8, 128)
    assert tpu_kernel(x, y, bias, 2.0).shape == (8, 128)
    assert len(set(runtime.registered)) == 2
    assert [shapes for _, shapes in runtime.launched] == [[(8, 128), (8, 128)], [(8, 128), (8, 128), (128,)]]


def test_tpu_kernel_launches_a_registered_kernel_without_jax_callable(tpu_runtime, monkeypatch):
    """A signature's first call goes through torch_tpu's JaxCallable, which registers its kernel; later calls hand
    the same kernel the same tensors directly. Keyword and defaulted arguments are keyed as given positionally."""
    runtime = tpu_runtime

    def scaled(x: jax.Array, shift: jax.Array | None = None, *, scale: float = 2.0) -> jax.Array:
        return x * scale if shift is None else x * scale + shift

    tpu_kernel = jax_torch_op("tk_test_launch::scaled")(scaled).registered.tpu_kernel
    through_jax_callable = []
    normalize = tpu_kernel.jax_callable._normalize_invocation_args
    monkeypatch.setattr(tpu_kernel.jax_callable, "_normalize_invocation_args",
                        lambda *a: through_jax_callable.append(a) or normalize(*a))
    x, shift, wide = torch.randn(8, 128), torch.randn(8, 128), torch.randn(8, 256)
    calls = [((x,), {}), ((x, shift), {}), ((x,), {}), ((x, shift), {"scale": 2.0}), ((x, None), {"scale": 2.0}),
             ((x, shift), {"scale": 3.0}), ((wide,), {}), ((x, shift), {})]
    outputs = [tpu_kernel(*args, **kwargs) for args, kwargs in calls]
    assert [tuple(out.shape) for out in outputs] == [(8, 256) if args[0] is wide else (8, 128) for args, _ in calls]
    assert len(runtime.registered) == 4  # x alone, with shift, with shift at scale 3, wide
    first = dict(zip(["alone", "shift"], runtime.launched[:2]))
    assert runtime.launched == [first["alone"], first["shift"], first["alone"], first["shift"], first["alone"],
                                (runtime.registered[2], [(8, 128), (8, 128)]), (runtime.registered[3], [(8, 256)]),
                                first["shift"]]
    assert len(through_jax_callable) == 2 * 4  # JaxCallable's call and its key, once per kernel
    runtime.registered.clear()  # a runtime that lost its kernels: JaxCallable registers them again
    tpu_kernel(x)
    assert len(runtime.registered) == 1 and len(through_jax_callable) == 2 * 5


def test_tpu_kernel_leaves_other_tensors_and_other_torch_tpus_to_jax_callable(tpu_runtime, monkeypatch):
    """A tensor subclass (torch_tpu's wrappers are one) goes through JaxCallable every time; so does every call
    under a torch_tpu without what the launcher reads of 0.2.0 (here: its kernel key), and under a release whose
    JaxCallable nobody has compared with the direct launch."""

    class Wrapped(torch.Tensor):
        pass

    tpu_kernel = jax_torch_op("tk_test_launch_other::biased_add")(biased_add).registered.tpu_kernel
    calls = []
    normalize = tpu_kernel.jax_callable._normalize_invocation_args
    monkeypatch.setattr(tpu_kernel.jax_callable, "_normalize_invocation_args", lambda *a: calls.append(a) or normalize(*a))
    x, y = torch.randn(8, 128), torch.randn(8, 128)
    for _ in range(2):
        assert tpu_kernel(x.as_subclass(Wrapped), y, None, 1.0).shape == (8, 128)
    assert len(calls) == 2 and not tpu_kernel.launches
    monkeypatch.setattr(binding, "_torch_tpu_pallas", lambda: types.SimpleNamespace(tpu_torch_pallas=tpu_runtime))
    for _ in range(2):
        assert tpu_kernel(x, y, None, 1.0).shape == (8, 128)
    assert len(calls) == 4 and not tpu_kernel.direct and len(tpu_runtime.launched) == 4
    monkeypatch.setattr(binding, "DIRECT_LAUNCH_TORCH_TPU", ("0.1.0",))
    assert not jax_torch_op("tk_test_launch_release::biased_add")(biased_add).registered.tpu_kernel.direct


def test_plain_op_without_torch_tpu(monkeypatch):
    monkeypatch.setattr(binding, "_torch_tpu_installed", lambda: False)
    op = jax_torch_op("tk_test_plain::scale_add")(scale_add)
    assert op.registered.tpu_kernel is None
    x, y = torch.randn(16, 128).bfloat16(), torch.randn(16, 128).bfloat16()
    out, _ = op(x, y, 2.0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, x * 2 + y)

    optional = jax_torch_op("tk_test_plain::biased_add")(biased_add)
    assert "Tensor? bias" in str(torch.ops.tk_test_plain.biased_add.default._schema)
    x, y, bias = x.float(), y.float(), torch.randn(128)
    torch.testing.assert_close(optional(x, y, None, 0.5), expected_biased_add(x, y, None, 0.5))
    torch.testing.assert_close(optional(x, y, bias, 0.5), expected_biased_add(x, y, bias, 0.5))


def test_torch_compile_fullgraph_uses_the_fake():
    op = jax_torch_op("tk_test_compile::scale_add")(scale_add)
    x, y = torch.randn(24, 128), torch.randn(24, 128)
    compiled = torch.compile(lambda a, b: op(a, b, 0.5)[0].relu(), fullgraph=True)
    torch.testing.assert_close(compiled(x, y), (x * 0.5 + y).relu())


def test_torch_compile_fullgraph_traces_an_optional_tensor_present_and_absent():
    op = jax_torch_op("tk_test_compile_optional::biased_add")(biased_add)
    x, y, bias = torch.randn(8, 128), torch.randn(8, 128), torch.randn(128)
    compiled = torch.compile(lambda a, b, c: op(a, b, c, 2.0).relu(), fullgraph=True)
    torch.testing.assert_close(compiled(x, y, None), expected_biased_add(x, y, None, 2.0).relu())
    torch.testing.assert_close(compiled(x, y, bias), expected_biased_add(x, y, bias, 2.0).relu())


def test_keyword_only_and_defaulted_parameters():
    def scaled(x: jax.Array, shift: jax.Array | None = None, *, scale: float = 2.0) -> jax.Array:
        return x * scale if shift is None else x * scale + shift

    op = jax_torch_op("tk_test_keywords::scaled")(scaled)
    x, shift = torch.randn(8, 128), torch.randn(8, 128)
    torch.testing.assert_close(op(x), x * 2)
    torch.testing.assert_close(op(x, shift, scale=3.0), x * 3 + shift)
    torch.testing.assert_close(op(x, shift=shift), x * 2 + shift)


def test_cpu_tensors_reach_jax_without_copy():
    for dtype in (torch.float32, torch.bfloat16):
        tensor = torch.randn(32, 128).to(dtype)
        array = jax.device_put(binding._to_host_array(tensor))
        assert array.dtype == binding._TORCH_TO_JAX_DTYPE[dtype]
        assert array.unsafe_buffer_pointer() == tensor.data_ptr()
        assert binding._to_torch(array).data_ptr() == tensor.data_ptr()


def test_inputs_that_are_not_plain_contiguous_tensors():
    op = jax_torch_op("tk_test_layouts::add")(_plain_add)
    base = torch.randn(128, 16)
    transposed, broadcast = base.t(), torch.randn(1, 128).expand(16, 128)
    torch.testing.assert_close(op(transposed, broadcast), transposed + broadcast)
    weight = torch.nn.Parameter(torch.randn(16, 128))
    torch.testing.assert_close(op(weight, broadcast), weight.detach() + broadcast)
    empty = torch.randn(0, 128)
    assert op(empty, empty).shape == (0, 128)
    with pytest.raises(TypeError, match="cannot be passed to a TPU kernel"):
        op(base.double(), base.double())


def _plain_add(x: jax.Array, y: jax.Array) -> jax.Array:
    return x + y


@pytest.mark.multiprocess
@pytest.mark.slow
def test_cpu_platform_is_chosen_at_the_first_cpu_call_and_only_off_tpu():
    """Import leaves jax alone; with libtpu installed and no TPU, the first CPU call points jax at the CPU; with a
    TPU, the platforms the caller chose stay. One fresh process: the TPU host's case after the first call (the
    function's cache cleared) reads only the devices and the caller's choice, which it is given anew."""
    script = (
        "import glob, os, jax, torch\n"
        "glob.glob = lambda pattern: []\n"
        "import tpu_kernels.runtime.binding as binding\n"
        "print(jax.config.jax_platforms)\n"
        "@binding.jax_torch_op('platform_probe::add')\n"
        "def add(x: jax.Array, y: jax.Array) -> jax.Array:\n"
        "    return x + y\n"
        "assert add(torch.ones(3), torch.ones(3)).tolist() == [2.0, 2.0, 2.0]\n"
        "print(jax.config.jax_platforms)\n"
        "glob.glob = lambda pattern: ['/dev/accel0'] if pattern.startswith('/dev/accel') else []\n"
        "jax.config.update('jax_platforms', 'tpu,cpu')\n"
        "binding._use_cpu_platform_off_tpu.cache_clear()\n"
        "binding._use_cpu_platform_off_tpu()\n"
        "print(jax.config.jax_platforms)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["None", "cpu", "tpu,cpu"]


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


def clean(x: jax.Array) -> jax.Array:
    return pl.pallas_call(_add, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x, x)


def racy_then_clean(x: jax.Array) -> jax.Array:
    return clean(racy(x))


def test_our_test_runs_detect_races():
    """pyproject.toml's pytest settings turn race detection on (see also test_testing.py)."""
    assert os.environ.get(binding.RACE_DETECTION_ENV) == "1"
    assert binding.interpret_params().detect_races


def test_race_detection_raises(monkeypatch):
    op = jax_torch_op("tk_test_race::racy")(racy)
    monkeypatch.setenv(binding.RACE_DETECTION_ENV, "1")
    with pytest.raises(RuntimeError, match="data race"):
        op(torch.randn(8, 128))


def test_race_in_an_earlier_kernel_of_an_op_is_reported(monkeypatch):
    """The interpreter keeps only the last kernel's race state; the binding looks at each kernel's."""
    op = jax_torch_op("tk_test_race_first::racy_then_clean")(racy_then_clean)
    monkeypatch.setenv(binding.RACE_DETECTION_ENV, "1")
    with pytest.raises(RuntimeError, match="data race"):
        op(torch.randn(8, 128))


def test_a_race_is_not_blamed_on_the_next_op(monkeypatch):
    racy_op = jax_torch_op("tk_test_race_stale::racy")(racy)
    clean_op = jax_torch_op("tk_test_race_stale::clean")(clean)
    monkeypatch.setenv(binding.RACE_DETECTION_ENV, "1")
    with pytest.raises(RuntimeError, match="data race"):
        racy_op(torch.randn(8, 128))
    x = torch.randn(8, 128)
    torch.testing.assert_close(clean_op(x), x + x)


def test_uninitialised_memory_reads_as_nan(monkeypatch):
    def _reads_scratch_only(x_ref, out_ref, scratch):
        out_ref[...] = scratch[...] + x_ref[...]

    def reads_garbage(x: jax.Array) -> jax.Array:
        return pl.pallas_call(
            _reads_scratch_only,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            scratch_shapes=[pltpu.VMEM(x.shape, x.dtype)],
        )(x)

    op = jax_torch_op("tk_test_nan::reads_garbage")(reads_garbage)
    for races in ("0", "1"):
        monkeypatch.setenv(binding.RACE_DETECTION_ENV, races)
        assert np.isnan(op(torch.randn(8, 128)).numpy()).all()


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


def test_variadic_parameters_are_refused():
    def bad(*xs: jax.Array) -> jax.Array:
        return xs[0]

    with pytest.raises(TypeError, match="no torch schema"):
        jax_torch_op("tk_test_bad3::bad")(bad)


def _scale_kernel(x_ref, w_ref, out_ref):
    out_ref[...] = jnp.tanh(x_ref[...] * w_ref[...])


def _scaled_tanh_kernel(x, w):
    return pl.pallas_call(_scale_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x, w)


@jax.custom_vjp
def _scaled_tanh(x, w):
    return _scaled_tanh_kernel(x, w)


def _scaled_tanh_forward(x, w):
    out = _scaled_tanh_kernel(x, w)
    return out, (x, w, out)


def _scaled_tanh_backward(residuals, d_out):
    x, w, out = residuals
    d_pre = d_out * (1 - out * out)
    return d_pre * w, jnp.sum(d_pre * x, axis=0, keepdims=True)


_scaled_tanh.defvjp(_scaled_tanh_forward, _scaled_tanh_backward)


def scaled_tanh(x: jax.Array, w: jax.Array, rows: jax.Array | None, shift: float) -> jax.Array:
    """tanh(x * w) + shift (a Pallas kernel with a custom_vjp), times `rows` (integer, not differentiated)."""
    out = _scaled_tanh(x, w) + shift
    return out if rows is None else out * rows[:, None].astype(out.dtype)


def _expected_scaled_tanh(x, w, rows, shift):
    out = torch.tanh(x * w) + shift
    return out if rows is None else out * rows[:, None].to(out.dtype)


@pytest.mark.parametrize("registrar", ["torch_tpu", "without_torch_tpu"])
def test_gradients_come_from_the_jax_vjp(monkeypatch, registrar):
    if registrar == "without_torch_tpu":
        monkeypatch.setattr(binding, "_torch_tpu_installed", lambda: False)
    op = jax_torch_op(f"tk_test_grad_{registrar}::scaled_tanh")(scaled_tanh)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 128, generator=generator, requires_grad=True)
    w = torch.randn(1, 128, generator=generator, requires_grad=True)
    rows = torch.arange(8, dtype=torch.int32)
    for row_scale in (None, rows):
        out = op(x, w, row_scale, 0.5)
        x_ref, w_ref = x.detach().requires_grad_(), w.detach().requires_grad_()
        expected = _expected_scaled_tanh(x_ref, w_ref, row_scale, 0.5)
        torch.testing.assert_close(out, expected)
        d_out = torch.randn(8, 128, generator=generator)
        # XLA's and torch's float32 tanh differ in the last bits; d_w sums 8 rows scaled by up to 7.
        torch.testing.assert_close(torch.autograd.grad(out, (x, w), d_out),
                                   torch.autograd.grad(expected, (x_ref, w_ref), d_out), rtol=1e-5, atol=1e-5)
    # Only w requires grad: x gets none, and the pullback still runs.
    w_only = op(x.detach(), w, None, 0.0)
    (d_w,) = torch.autograd.grad(w_only.sum(), (w,))
    assert d_w.shape == (1, 128)


def plain_scaled_tanh(x: jax.Array, w: jax.Array) -> jax.Array:
    return _scaled_tanh(x, w)


def test_residuals_that_are_inputs_or_outputs_are_not_returned_again():
    op = jax_torch_op("tk_test_grad_residuals::scaled_tanh")(plain_scaled_tanh)
    x, w = torch.randn(8, 128, requires_grad=True), torch.randn(1, 128, requires_grad=True)
    # x, w and the output are the custom_vjp's residuals: the forward op returns the output alone.
    assert len(op.gradient_ops.forward(x, w, "x,w")) == 1
    # With the shift, the residual output is the kernel's before the shift: returned beside the output.
    shifted = jax_torch_op("tk_test_grad_residuals::shifted_scaled_tanh")(scaled_tanh)
    assert len(shifted.gradient_ops.forward(x, w, None, 0.5, "x,w")) == 2


def test_no_gradient_ops_without_autograd():
    op = jax_torch_op("tk_test_grad_inference::scaled_tanh")(scaled_tanh)
    x, w = torch.randn(8, 128, requires_grad=True), torch.randn(1, 128, requires_grad=True)
    with torch.no_grad():
        out = op(x, w, None, 0.0)
    assert not out.requires_grad


def test_gradients_under_torch_compile_fullgraph():
    op = jax_torch_op("tk_test_grad_compile::scaled_tanh")(scaled_tanh)
    x, w = torch.randn(8, 128, requires_grad=True), torch.randn(1, 128, requires_grad=True)
    compiled = torch.compile(lambda a, b: op(a, b, None, 0.25).square().sum(), fullgraph=True)
    d_x, d_w = torch.autograd.grad(compiled(x, w), (x, w))
    x_ref, w_ref = x.detach().requires_grad_(), w.detach().requires_grad_()
    expected = torch.autograd.grad(_expected_scaled_tanh(x_ref, w_ref, None, 0.25).square().sum(), (x_ref, w_ref))
    torch.testing.assert_close((d_x, d_w), expected)


def test_gradient_ops_lower_for_tpu(tpu_runtime):
    """The gradient ops go through jax_op too: each lowers to Mosaic kernels and reaches the TPU runtime."""
    runtime = tpu_runtime
    op = jax_torch_op("tk_test_grad_tpu::scaled_tanh")(scaled_tanh)
    x, w = torch.randn(8, 128), torch.randn(1, 128)
    forward_kernel, backward_kernel = (registered.tpu_kernel for registered in op.gradient_ops.registrations)
    forward = forward_kernel(x, w, None, 0.5, "x,w")
    # The output and the kernel's output before the shift (x, w and the output itself are not returned again).
    assert [tuple(t.shape) for t in forward] == [(8, 128), (8, 128)]
    grads = backward_kernel(x, w, None, 0.5, forward[:1], forward[1:], [torch.randn(8, 128)], "x,w")
    assert [tuple(t.shape) for t in grads] == [(8, 128), (1, 128)]
    assert len(set(runtime.registered)) == 2


def test_the_cpu_path_compiles_with_the_options_the_compiler_knows_and_leaves_out_the_rest(monkeypatch):
    """A jaxlib that drops one of CPU_COMPILE_OPTIONS must not break every CPU call: the option is left out."""
    known = binding.cpu_compile_options()
    assert known == binding.CPU_COMPILE_OPTIONS  # this environment's jaxlib knows them all
    monkeypatch.setattr(binding, "CPU_COMPILE_OPTIONS", {**binding.CPU_COMPILE_OPTIONS, "xla_no_such_option": 1})
    binding.cpu_compile_options.cache_clear()
    try:
        assert binding.cpu_compile_options() == known
    finally:
        binding.cpu_compile_options.cache_clear()
