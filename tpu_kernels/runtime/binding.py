"""Turn a typed JAX function (Pallas inside) into a torch custom op.

The builder copies this file verbatim into every built kernel as `_binding.py`, because a built kernel must load
where only `kernels` is installed: it may import the standard library, numpy, torch and jax, nothing else.

One op, two execution paths, chosen by torch's dispatcher per device:

* TPU tensors: torch_tpu's `JaxCallable` (what `torch.tpu.pallas.jax_op` registers) exports the JAX function for
  Mosaic and registers the kernel with torch_tpu's runtime at the first call of each signature; later calls launch
  that kernel directly (`_TpuKernel`), without its per-call Python.
* CPU tensors: the same JAX function runs jitted under Pallas' TPU interpret mode. Tensors cross as numpy views that
  jax's CPU client adopts without a copy; results come back through DLPack. This path exists for development, CI and
  correctness: it simulates the TPU kernel on the CPU and is orders of magnitude slower than the real thing.

A parameter annotated `jax.Array | None` is an optional tensor (`Tensor?` in the op schema) on both paths: the JAX
function receives None when the caller passes None, and each case is traced and compiled on its own.

The op is a `torch.library.Library` op without an autograd kernel, so that a call runs no Python between the
dispatcher and its kernel. Differentiate through the `JaxTorchOp`: a direct `torch.ops` call warns at backward, as
torch does for any op without an autograd kernel.

Gradients come from the JAX function itself (`jax.vjp`, so a `jax.custom_vjp` inside it decides how they are
computed): when autograd needs a gradient of a floating tensor argument, the call runs a second op that returns the
outputs and the pullback's residuals as tensors, and torch autograd hands those to a third op that runs the
pullback. Residuals that are the call's own inputs or outputs are not returned again: autograd keeps the tensors it
already has.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.metadata
import importlib.util
import inspect
import os
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.experimental.pallas import tpu as pltpu

RACE_DETECTION_ENV = "TPU_KERNELS_DETECT_RACES"
# How the interpreter's report of a race begins (printed once per race, as `pltpu.InterpretParams` documents).
RACE_REPORT = "RACE DETECTED"


@functools.cache
def _use_cpu_platform_off_tpu() -> None:
    """With libtpu installed, JAX would try (noisily, slowly) to open a TPU that is not there.

    Called by the CPU path before it first touches JAX, not at import: importing a kernel leaves
    the process's JAX configuration alone, and a caller that already chose platforms keeps them.
    """
    if "JAX_PLATFORMS" in os.environ or glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return
    jax.config.update("jax_platforms", "cpu")

_TORCH_TO_JAX_DTYPE = {
    torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16, torch.int32: jnp.int32,
    torch.int8: jnp.int8, torch.uint8: jnp.uint8, torch.float8_e4m3fn: jnp.float8_e4m3fn, torch.bool: jnp.bool_,
}
_JAX_TO_TORCH_DTYPE = {jnp.dtype(v): k for k, v in _TORCH_TO_JAX_DTYPE.items()}
# torch cannot view a bfloat16 (or float8) tensor as numpy: its bits cross as int16 (uint8) and
# become jax's (ml_dtypes) bfloat16 (float8_e4m3fn) again on the numpy side, still without a copy.
_NUMPY_BITS_DTYPE = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}
_STATIC_TYPES = (bool, int, float, str)


def _torch_tpu_installed() -> bool:
    """Whether torch_tpu is installed, found without importing it: importing its Pallas module costs a process
    about 3 s of CPU, which only a TPU call needs (`_torch_tpu_pallas`)."""
    return importlib.util.find_spec("torch_tpu") is not None


@functools.cache
def _torch_tpu_pallas() -> types.ModuleType:
    """torch_tpu's Pallas module (`JaxCallable`, its launcher); it registers without a TPU."""
    from torch_tpu._internal.pallas import pallas
    return pallas


def _optional_of(annotation):
    """`X` for an annotation `X | None` (or `Optional[X]`), else None."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        return args[0] if args[1] is type(None) else args[1]
    return None


# A list of tensors: the residuals and cotangents of the ops that carry gradients.
_ARRAY_LIST = list[jax.Array]


def _is_tensor(annotation) -> bool:
    return annotation is jax.Array or _optional_of(annotation) is jax.Array or annotation == _ARRAY_LIST


def _returns_tuple(annotation) -> bool:
    return typing.get_origin(annotation) is tuple


def _torch_annotation(annotation):
    """The torch.library type for one parameter of the JAX function."""
    if annotation is jax.Array:
        return torch.Tensor
    if annotation == _ARRAY_LIST:
        return list[torch.Tensor]
    if annotation in _STATIC_TYPES:
        return annotation
    inner = _optional_of(annotation)
    if inner is jax.Array:
        return torch.Tensor | None
    if inner in _STATIC_TYPES:
        return inner | None
    raise TypeError(
        f"unsupported parameter annotation {annotation!r}: use jax.Array (or jax.Array | None) for "
        f"tensors and bool/int/float/str (optionally | None) for static arguments"
    )


def _torch_return_annotation(annotation):
    if annotation is jax.Array:
        return torch.Tensor
    if annotation == _ARRAY_LIST:
        return list[torch.Tensor]
    if _returns_tuple(annotation) and all(a is jax.Array for a in typing.get_args(annotation)):
        return tuple[tuple(torch.Tensor for _ in typing.get_args(annotation))]
    raise TypeError(f"unsupported return annotation {annotation!r}: use jax.Array or tuple[jax.Array, ...]")


def _holds_tensors(value) -> bool:
    """A tensor, or a non-empty list of them."""
    return isinstance(value, torch.Tensor) or (
        isinstance(value, list) and bool(value) and all(isinstance(v, torch.Tensor) for v in value))


def _map_tensors(value, convert):
    """`convert` applied to a tensor, or to each tensor of a list of them; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return convert(value)
    if _holds_tensors(value):
        return [convert(v) for v in value]
    return value


def _to_host_array(tensor: torch.Tensor):
    """A numpy view of a CPU tensor, in the dtype JAX will see: jax.jit takes numpy arguments on its C++ fast path,
    and the CPU client aliases aligned ones instead of copying (about 1 µs a tensor against 20 µs for
    `jax.dlpack.from_dlpack`). Why that is safe for the call: docs/binding.md, "What the CPU path hands JAX"."""
    if tensor.dtype not in _TORCH_TO_JAX_DTYPE:
        raise TypeError(f"dtype {tensor.dtype} cannot be passed to a TPU kernel")
    _use_cpu_platform_off_tpu()
    if tensor.requires_grad:
        tensor = tensor.detach()
    bits = _NUMPY_BITS_DTYPE.get(tensor.dtype)
    if bits is None:
        return tensor.numpy()
    return tensor.view(bits).numpy().view(_TORCH_TO_JAX_DTYPE[tensor.dtype])


def _to_torch(array: jax.Array) -> torch.Tensor:
    if array.size == 0:
        return torch.empty(array.shape, dtype=_JAX_TO_TORCH_DTYPE[array.dtype])
    return torch.from_dlpack(array)


class _RaceWatch:
    """Standard output while an op runs in interpret mode, passed on unchanged, noting a race report.

    With `detect_races`, the interpreter prints a report starting "RACE DETECTED" for every race it finds, in every
    kernel of the op (the behaviour `pltpu.InterpretParams` documents); its race state has no public accessor.
    """

    def __init__(self, stream):
        self.stream = stream
        self.found = False

    def write(self, text: str) -> int:
        self.found = self.found or RACE_REPORT in text
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


# The CPU path compiles interpret-mode programs (the kernel's grid as loops of host callbacks), each run a few
# times: XLA's CPU fusion emitters and LLVM optimisation cost more compile time than they save in running.
CPU_COMPILE_OPTIONS = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0,
                       "xla_llvm_disable_expensive_passes": True, "xla_cpu_parallel_codegen_split_count": 1}
# XLA:CPU holds three memory mappings per object file of each program jax keeps (thousands), 50 to 200 for an
# interpret-mode program (one codegen split, above, halves the files): a process that compiles a few hundred reaches
# Linux's vm.max_map_count (65530) and dies in XLA's next compile (issue 75, jax-ml/jax#27201). Hence an op's CPU
# path drops its programs when it holds this many.
CPU_PROGRAMS_KEPT = 32


@functools.cache
def cpu_compile_options() -> dict:
    """CPU_COMPILE_OPTIONS less those the compiler of JAX's default backend does not know: a jaxlib release may
    drop one, and a host with a TPU compiles this path for it. They make compiling faster, never change what a
    program computes, so an unknown one is left out rather than failing every call."""
    _use_cpu_platform_off_tpu()
    known = {}
    for name, value in CPU_COMPILE_OPTIONS.items():
        try:
            jax.jit(lambda: 0, compiler_options={name: value}).lower().compile()
        except jax.errors.JaxRuntimeError:
            continue
        known[name] = value
    return known

# Uninitialised memory is always NaN-filled so a kernel reading garbage shows it.
_INTERPRET = pltpu.InterpretParams(uninitialized_memory="nan")
_INTERPRET_DETECTING_RACES = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")


def interpret_params() -> pltpu.InterpretParams:
    """Interpret-mode settings of the CPU path; race detection is opt-in (slower) through TPU_KERNELS_DETECT_RACES=1."""
    return _INTERPRET_DETECTING_RACES if os.environ.get(RACE_DETECTION_ENV) == "1" else _INTERPRET


class _JaxFunction:
    """A JAX function as the CPU kernel and the fake of a torch op, jitted once."""

    def __init__(self, qualname: str, fn: Callable):
        self.qualname = qualname
        self.fn = fn
        self.signature = inspect.signature(fn, eval_str=True)
        parameters = list(self.signature.parameters.values())
        for parameter in parameters:
            if parameter.annotation is inspect.Parameter.empty:
                raise TypeError(f"{qualname}: parameter {parameter.name!r} needs a type annotation")
            if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                raise TypeError(f"{qualname}: parameter {parameter.name!r}: *args and **kwargs have no torch schema")
        self.torch_signature = inspect.Signature(
            [p.replace(annotation=_torch_annotation(p.annotation)) for p in parameters],
            return_annotation=_torch_return_annotation(self.signature.return_annotation),
        )
        self.positional_count = sum(p.kind is not inspect.Parameter.KEYWORD_ONLY for p in parameters)
        self.returns_tuple = _returns_tuple(self.signature.return_annotation)
        # One jitted function (`jitted`) caches a compilation per static-argument combination and optional tensor.
        self.static_names = tuple(p.name for p in parameters if not _is_tensor(p.annotation))

    @functools.cached_property
    def jitted(self):
        """`fn` jitted for the CPU path; made at the first call, not at registration: its compile options are
        probed on the backend then (`cpu_compile_options`)."""
        return jax.jit(self.fn, static_argnames=self.static_names, compiler_options=cpu_compile_options())

    def _complete(self, args: Sequence, kwargs: dict) -> tuple[Sequence, dict]:
        """Positional and keyword-only arguments with defaults filled in."""
        if not kwargs and len(args) == self.positional_count:
            return args, kwargs
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.args, bound.kwargs

    def run_on_cpu(self, *args, **kwargs):
        args, kwargs = self._complete(args, kwargs)
        host_args = [_map_tensors(a, _to_host_array) for a in args]
        host_kwargs = {k: _map_tensors(v, _to_host_array) for k, v in kwargs.items()}
        params = interpret_params()
        race_watch = _RaceWatch(sys.stdout)
        with pltpu.force_tpu_interpret_mode(params), (
                contextlib.redirect_stdout(race_watch) if params.detect_races else contextlib.nullcontext()):
            out = self.jitted(*host_args, **host_kwargs)
            outputs = out if isinstance(out, (tuple, list)) else (out,)
            for array in outputs:
                array.block_until_ready()
        if self.jitted._cache_size() >= CPU_PROGRAMS_KEPT:
            self.jitted.clear_cache()
        if race_watch.found:
            raise RuntimeError(f"{self.qualname}: the TPU interpreter detected a data race in the kernel")
        if isinstance(out, list):
            return [_to_torch(o) for o in outputs]
        if self.returns_tuple:
            return tuple(_to_torch(o) for o in outputs)
        return _to_torch(out)

    def fake(self, *args, **kwargs):
        _use_cpu_platform_off_tpu()
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        tensors = {n: v for n, v in bound.arguments.items() if _holds_tensors(v)}
        others = {n: v for n, v in bound.arguments.items() if n not in tensors}
        first = next((v if isinstance(v, torch.Tensor) else v[0] for v in tensors.values()), None)
        device = torch.device("cpu") if first is None else first.device
        avals = {n: _map_tensors(v, _shape_dtype) for n, v in tensors.items()}
        out = jax.eval_shape(lambda **arrays: self.fn(**arrays, **others), **avals)

        def empty(shape_dtype):
            return torch.empty(shape_dtype.shape, dtype=_JAX_TO_TORCH_DTYPE[shape_dtype.dtype], device=device)

        if isinstance(out, list):
            return [empty(o) for o in out]
        if self.returns_tuple:
            return tuple(empty(o) for o in out)
        return empty(out)


def _shape_dtype(tensor: torch.Tensor) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(tensor.shape), _TORCH_TO_JAX_DTYPE[tensor.dtype])


class _Residual(NamedTuple):
    """Where one leaf of a pullback comes from: an input of the call (by name), an output (by index), or the
    residuals the forward op returns (by index)."""

    source: str  # "input", "output" or "residual"
    key: str | int


class _Pullback(NamedTuple):
    treedef: jax.tree_util.PyTreeDef
    residuals: tuple[_Residual, ...]


def _linearize(fn: Callable, arguments: dict, differentiated: Sequence[str]):
    """`(outputs, pullback leaves, _Pullback)` of `fn(**arguments)` with respect to the named arguments."""

    def of_differentiated(*values):
        return fn(**(arguments | dict(zip(differentiated, values))))

    out, pullback = jax.vjp(of_differentiated, *(arguments[name] for name in differentiated))
    outputs = tuple(out) if isinstance(out, tuple) else (out,)
    leaves, treedef = jax.tree_util.tree_flatten(pullback)
    residuals, returned = [], 0
    for leaf in leaves:
        source = next((_Residual("input", name) for name, value in arguments.items() if leaf is value), None)
        source = source or next((_Residual("output", i) for i, output in enumerate(outputs) if leaf is output), None)
        if source is None:
            source, returned = _Residual("residual", returned), returned + 1
        residuals.append(source)
    returned_leaves = [jnp.asarray(leaf) for leaf, r in zip(leaves, residuals) if r.source == "residual"]
    return outputs, returned_leaves, _Pullback(treedef, tuple(residuals))


def _pullback_structure(fn: Callable, arguments: dict, differentiated: Sequence[str]) -> _Pullback:
    """The `_Pullback` of `_linearize` for these arguments, traced abstractly (nothing is computed)."""
    structure = []

    def trace(arrays):
        _, leaves, pullback = _linearize(fn, arguments | arrays, differentiated)
        structure.append(pullback)
        return leaves

    arrays = {name: jax.ShapeDtypeStruct(value.shape, value.dtype) for name, value in arguments.items()
              if isinstance(value, jax.Array)}
    jax.eval_shape(trace, arrays)
    return structure[0]


def _cotangent(cotangent: jax.Array, output: jax.Array):
    """The cotangent JAX expects for `output`: in its dtype, or float0 zeros for an integer output."""
    if jnp.issubdtype(output.dtype, jnp.inexact):
        return cotangent.astype(output.dtype)
    return np.zeros(output.shape, jax.dtypes.float0)


class _GradientOps:
    """The two ops that give a JAX function's torch op its gradients.

    `forward` takes the function's arguments and the names of those to differentiate (`differentiated`,
    comma-separated) and returns the outputs followed by the pullback's residuals; `backward` takes the same
    arguments, the outputs, the residuals and one cotangent per output, and returns the gradients of the
    differentiated arguments in that order.
    """

    EXTRA_PARAMETERS = ("outputs", "residuals", "cotangents", "differentiated")

    def __init__(self, qualname: str, jax_function: "_JaxFunction"):
        self.fn = jax_function.fn
        parameters = [p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
                      for p in jax_function.signature.parameters.values()]
        clashes = set(self.EXTRA_PARAMETERS) & {p.name for p in parameters}
        if clashes:
            raise TypeError(f"{qualname}: parameter names {sorted(clashes)} are taken by the gradient ops")
        # The extra parameters follow the function's own, so those lose their defaults (a default cannot come
        # before a parameter without one); the caller passes every argument.
        parameters = [p.replace(default=inspect.Parameter.empty) for p in parameters]
        self.names = tuple(p.name for p in parameters)

        def parameter(name, annotation):
            return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation)

        def forward(*args, **kwargs):
            arguments = forward.__signature__.bind(*args, **kwargs).arguments
            differentiated = arguments.pop("differentiated").split(",")
            outputs, residuals, _ = _linearize(self.fn, arguments, differentiated)
            return [*outputs, *residuals]

        def backward(*args, **kwargs):
            arguments = backward.__signature__.bind(*args, **kwargs).arguments
            outputs, residuals, cotangents = (arguments.pop(name) for name in self.EXTRA_PARAMETERS[:3])
            names = arguments.pop("differentiated").split(",")
            pullback = _pullback_structure(self.fn, dict(arguments), names)
            leaves = [arguments[r.key] if r.source == "input" else outputs[r.key] if r.source == "output"
                      else residuals[r.key] for r in pullback.residuals]
            cotangent = tuple(_cotangent(c, o) for c, o in zip(cotangents, outputs))
            grads = jax.tree_util.tree_unflatten(pullback.treedef, leaves)(
                cotangent if jax_function.returns_tuple else cotangent[0])
            return list(grads)

        forward.__signature__ = inspect.Signature(
            [*parameters, parameter("differentiated", str)], return_annotation=_ARRAY_LIST)
        backward.__signature__ = inspect.Signature(
            [*parameters, *(parameter(name, _ARRAY_LIST) for name in self.EXTRA_PARAMETERS[:3]),
             parameter("differentiated", str)], return_annotation=_ARRAY_LIST)
        self.output_count = len(typing.get_args(jax_function.signature.return_annotation)) or 1
        self.registrations = (_register(f"{qualname}_vjp_forward", forward),
                              _register(f"{qualname}_vjp_backward", backward))
        self.forward, self.backward = (registered.op for registered in self.registrations)
        torch.library.register_autograd(f"{qualname}_vjp_forward", self._backward_formula,
                                        setup_context=self._save_for_backward, lib=self.registrations[0].library)

    def _save_for_backward(self, ctx, inputs, output):
        *values, differentiated = inputs
        outputs, residuals = output[: self.output_count], output[self.output_count :]
        ctx.tensor_positions = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
        ctx.save_for_backward(*(values[i] for i in ctx.tensor_positions), *outputs, *residuals)
        ctx.mark_non_differentiable(*residuals)
        ctx.values = values
        ctx.differentiated = differentiated

    def _backward_formula(self, ctx, cotangents):
        saved = list(ctx.saved_tensors)
        values = list(ctx.values)
        for position in ctx.tensor_positions:
            values[position] = saved.pop(0)
        outputs, residuals = saved[: self.output_count], saved[self.output_count :]
        cotangents = [c.contiguous() for c in cotangents[: self.output_count]]
        grads = iter(self.backward(*values, outputs, residuals, cotangents, ctx.differentiated))
        differentiated = set(ctx.differentiated.split(","))
        return (*(next(grads) if name in differentiated else None for name in self.names), None)


class JaxTorchOp:
    """A JAX function as a torch op (`op`), differentiable through `jax.vjp` of the same function.

    Calling it runs `op`, unless autograd needs the gradient of a floating tensor argument: then the call runs the
    gradient ops (`_GradientOps`), whose backward hands the residuals to the JAX pullback.
    """

    def __init__(self, qualname: str, registered: "_Registered"):
        self.registered, self.op, jax_function = registered, registered.op, registered.jax_function
        self.returns_tuple = jax_function.returns_tuple
        # Registered with the op: torch.compile cannot trace a registration.
        self.gradient_ops = _GradientOps(qualname, jax_function)
        parameters = list(jax_function.signature.parameters.values())
        self._names = tuple(p.name for p in parameters)
        self._defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.op(*args, **kwargs)
        values = [*args, *(kwargs[n] if n in kwargs else self._defaults[n] for n in self._names[len(args):])]
        differentiated = [name for name, value in zip(self._names, values)
                          if isinstance(value, torch.Tensor) and value.requires_grad]
        if not differentiated:
            return self.op(*args, **kwargs)
        result = self.gradient_ops.forward(*values, ",".join(differentiated))
        outputs = result[: self.gradient_ops.output_count]
        return tuple(outputs) if self.returns_tuple else outputs[0]


class _Launch(NamedTuple):
    """What torch_tpu's runtime takes to launch a registered kernel again (JaxCallable made the rest)."""

    fingerprint: str
    output_shapes: list
    out_tree: jax.tree_util.PyTreeDef


# Tensors the launcher takes as they are; any other (torch_tpu's `_elem` wrappers) goes through JaxCallable.
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
# The torch_tpu releases whose JaxCallable hands the launcher, in every eager mode and in the compile backend's
# tracing, just what the direct launch hands it (docs/binding.md); under any other, every call is JaxCallable's.
DIRECT_LAUNCH_TORCH_TPU = ("0.2.0",)


class _TpuKernel:
    """The op's kernel for TPU tensors (module docstring).

    torch_tpu's `JaxCallable` (as `jax_op` makes it) binds, normalises and keys the arguments on every call, most of
    a call's host cost (benchmarks/results/binding.json). It runs each signature's first call (shapes, dtypes,
    static values, optional tensors present or not): it registers the Mosaic kernel with the runtime, whose
    fingerprint and output placeholders this kernel keeps. Later calls hand their tensors to the runtime's launcher
    as JaxCallable would, after the same registry check. JaxCallable runs again where that check fails, for tensors
    it wraps, and always under a torch_tpu not in DIRECT_LAUNCH_TORCH_TPU.
    """

    def __init__(self, jax_function: _JaxFunction, qualname: str):
        self.jax_function, self.qualname, self.signature = jax_function, qualname, jax_function.signature
        self.tensor_parameters = tuple(_is_tensor(p.annotation) for p in self.signature.parameters.values())
        self.launches: dict[tuple, _Launch] = {}
        self.direct = importlib.metadata.version("torch_tpu") in DIRECT_LAUNCH_TORCH_TPU

    @functools.cached_property
    def jax_callable(self):
        """torch_tpu's `JaxCallable` of the function, made at the first TPU call."""
        static = [(i, p) for i, p in enumerate(self.signature.parameters.values()) if not _is_tensor(p.annotation)]
        return _torch_tpu_pallas().custom_jax_kernel(
            self.jax_function.fn, self.qualname, warn_deprecated=False,
            static_argnums=tuple(i for i, p in static if p.kind is not inspect.Parameter.KEYWORD_ONLY),
            static_argnames=tuple(p.name for _, p in static if p.kind is inspect.Parameter.KEYWORD_ONLY))

    def __call__(self, *args, **kwargs):
        # The dispatcher passes trailing defaulted arguments only when they were given.
        values = args if not kwargs and len(args) == len(self.tensor_parameters) else self._bound(args, kwargs)
        key, tensors = [], []
        for value, is_tensor in zip(values, self.tensor_parameters):
            if not is_tensor or value is None:
                key.append(value)
            elif type(value) in _PLAIN_TENSORS:
                key.append((value.shape, value.dtype))
                tensors.append(value)
            elif isinstance(value, list) and all(type(v) in _PLAIN_TENSORS for v in value):
                key.append(tuple((v.shape, v.dtype) for v in value))
                tensors.extend(value)
            else:
                return self.jax_callable(*args, **kwargs)
        key = tuple(key)
        launch = self.launches.get(key)
        runtime = _torch_tpu_pallas().tpu_torch_pallas
        if launch is None or not runtime.lookup_custom_kernel(self.jax_callable.name, launch.fingerprint):
            return self._first_call(key, args, kwargs)
        return launch.out_tree.unflatten(runtime.call_custom_kernel(
            self.jax_callable.name, launch.fingerprint, inputs=tensors, output_shapes=launch.output_shapes,
            donate_argnums=[], device_assignment=[]))

    def _bound(self, args: tuple, kwargs: dict):
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments.values()

    def _first_call(self, key: tuple, args: tuple, kwargs: dict):
        """JaxCallable's call, whose registered kernel is then kept under `key`."""
        jax_callable = self.jax_callable
        outputs = jax_callable(*args, **kwargs)
        if self.direct:
            try:
                kernel_key = _torch_tpu_pallas()._get_kernel_invocation_key(
                    jax_callable.trace_key, *jax_callable._normalize_invocation_args(args, kwargs),
                    jax_callable.static_argnums)
                self.launches[key] = _Launch(jax_callable.kernel_key_to_mlir_fingerprint[kernel_key],
                                             *jax_callable.output_shapes[kernel_key])
            except (AttributeError, KeyError):
                self.direct = False
        return outputs


class _Registered(NamedTuple):
    op: Callable  # torch.ops.<namespace>.<name>.default
    jax_function: _JaxFunction
    tpu_kernel: Callable | None  # None without torch_tpu
    library: torch.library.Library  # the op's registrations last as long as it does


def _register(qualname: str, fn: Callable) -> _Registered:
    """`fn` as the torch op `qualname` on both paths (module docstring), with its kernels and fake."""
    jax_function = _JaxFunction(qualname, fn)
    namespace, name = qualname.split("::")

    def without_torch_tpu(*args, **kwargs):
        raise RuntimeError(f"{qualname} runs on TPU only through torch_tpu, which is not installed")

    without_torch_tpu.__signature__ = jax_function.torch_signature
    library = torch.library.Library(namespace, "FRAGMENT")
    library.define(name + torch.library.infer_schema(without_torch_tpu, mutates_args=()))
    tpu_kernel = _TpuKernel(jax_function, qualname) if _torch_tpu_installed() else None
    library.impl(name, tpu_kernel or without_torch_tpu, "CompositeExplicitAutograd")
    library.impl(name, jax_function.run_on_cpu, "CPU")
    # eval_shape's shapes hold on every device (JaxCallable's fake lowers for TPU).
    torch.library.register_fake(qualname, jax_function.fake, lib=library)
    return _Registered(getattr(getattr(torch.ops, namespace), name).default, jax_function, tpu_kernel, library)


def jax_torch_op(qualname: str) -> Callable[[Callable], JaxTorchOp]:
    """Decorator: register the typed JAX function `fn` as the torch op `qualname`, with its gradients.

    Parameters annotated `jax.Array` become tensors, `jax.Array | None` optional tensors; bool/int/float/str
    parameters (optionally `| None`) are static (part of the compilation cache key). The return is `jax.Array` or
    `tuple[jax.Array, ...]`. Gradients are those of `jax.vjp(fn)` (module docstring). Validate inputs in torch terms
    before calling the op: shapes that reach the kernel are assumed valid.
    """

    def register(fn: Callable) -> JaxTorchOp:
        return JaxTorchOp(qualname, _register(qualname, fn))

    return register
