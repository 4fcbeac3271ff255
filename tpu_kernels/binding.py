"""Turn a typed JAX function (Pallas inside) into a torch custom op.

The builder copies this file verbatim into every built kernel as `_binding.py`,
because a built kernel must load where only `kernels` is installed: it may
import the standard library, numpy, torch and jax, nothing else.

One op, two execution paths, chosen by torch's dispatcher per device:

* TPU tensors: the op is registered through `torch.tpu.pallas.jax_op`, which
  compiles the JAX function with Mosaic and runs it on the TPU.
* CPU tensors: the same JAX function runs jitted under Pallas' TPU interpret
  mode, with tensors handed over through DLPack (no copy for contiguous
  inputs). This path exists for development, CI and correctness: it simulates
  the TPU kernel on the CPU and is orders of magnitude slower than the real
  thing.
"""

from __future__ import annotations

import glob
import inspect
import os
import types
import typing
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import torch
from jax.experimental.pallas import tpu as pltpu

RACE_DETECTION_ENV = "TPU_KERNELS_DETECT_RACES"


def _use_cpu_platform_off_tpu() -> None:
    """With libtpu installed, JAX would try (noisily, slowly) to open a TPU that is not there."""
    if "JAX_PLATFORMS" in os.environ or glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return
    jax.config.update("jax_platforms", "cpu")


_use_cpu_platform_off_tpu()

_TORCH_TO_JAX_DTYPE = {
    torch.float32: jnp.float32,
    torch.bfloat16: jnp.bfloat16,
    torch.float16: jnp.float16,
    torch.int32: jnp.int32,
    torch.int8: jnp.int8,
    torch.uint8: jnp.uint8,
    torch.bool: jnp.bool_,
}
_JAX_TO_TORCH_DTYPE = {jnp.dtype(v): k for k, v in _TORCH_TO_JAX_DTYPE.items()}
_STATIC_TYPES = (bool, int, float, str)


def _jax_op_registrar() -> Callable | None:
    """`torch.tpu.pallas.jax_op` when torch_tpu is installed, else None.

    torch_tpu registers fine on a CPU-only machine; only execution needs a TPU.
    """
    try:
        from torch_tpu._internal.pallas import jax_op
    except ImportError:
        return None
    return jax_op


def _is_array(annotation) -> bool:
    return annotation is jax.Array


def _returns_tuple(annotation) -> bool:
    return typing.get_origin(annotation) is tuple


def _torch_annotation(annotation):
    """The torch.library type for one parameter of the JAX function."""
    if _is_array(annotation):
        return torch.Tensor
    if annotation in _STATIC_TYPES:
        return annotation
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = args[0] if args[1] is type(None) else args[1]
        if inner in _STATIC_TYPES:
            return inner | None
    raise TypeError(
        f"unsupported parameter annotation {annotation!r}: use jax.Array for tensors "
        f"and bool/int/float/str (optionally | None) for static arguments"
    )


def _torch_return_annotation(annotation):
    if _is_array(annotation):
        return torch.Tensor
    if _returns_tuple(annotation) and all(_is_array(a) for a in typing.get_args(annotation)):
        return tuple[tuple(torch.Tensor for _ in typing.get_args(annotation))]
    raise TypeError(f"unsupported return annotation {annotation!r}: use jax.Array or tuple[jax.Array, ...]")


def _to_jax(tensor: torch.Tensor) -> jax.Array:
    if tensor.dtype not in _TORCH_TO_JAX_DTYPE:
        raise TypeError(f"dtype {tensor.dtype} cannot be passed to a TPU kernel")
    tensor = tensor.detach()
    if tensor.numel() == 0:
        return jnp.zeros(tuple(tensor.shape), _TORCH_TO_JAX_DTYPE[tensor.dtype])
    return jax.dlpack.from_dlpack(tensor.contiguous())


def _to_torch(array: jax.Array) -> torch.Tensor:
    if array.size == 0:
        return torch.empty(array.shape, dtype=_JAX_TO_TORCH_DTYPE[array.dtype])
    return torch.from_dlpack(array)


def interpret_params() -> pltpu.InterpretParams:
    """Interpret-mode settings of the CPU path.

    Uninitialised memory is always NaN-filled so a kernel reading garbage shows
    it; race detection is opt-in (slower) through TPU_KERNELS_DETECT_RACES=1.
    """
    return pltpu.InterpretParams(
        detect_races=os.environ.get(RACE_DETECTION_ENV, "0") == "1",
        uninitialized_memory="nan",
    )


def _raise_on_race(qualname: str) -> None:
    # The interpreter keeps the race state of the last kernel it ran in a module
    # global; jax exposes no public accessor for it.
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    races = interpret_pallas_call.races
    if races is not None and races.races_found:
        raise RuntimeError(f"{qualname}: the TPU interpreter detected a data race in the kernel")


class _JaxFunction:
    """A JAX function split into tensor and static parameters, jitted once."""

    def __init__(self, qualname: str, fn: Callable):
        self.qualname = qualname
        self.fn = fn
        self.signature = inspect.signature(fn, eval_str=True)
        self.parameters = list(self.signature.parameters.values())
        for parameter in self.parameters:
            if parameter.annotation is inspect.Parameter.empty:
                raise TypeError(f"{qualname}: parameter {parameter.name!r} needs a type annotation")
        self.static_names = tuple(p.name for p in self.parameters if not _is_array(p.annotation))
        self.returns_tuple = _returns_tuple(self.signature.return_annotation)
        # Fails early, in our words, on annotations no torch schema can express.
        self.torch_signature()
        # Re-wrapping jax.jit on every call costs hundreds of microseconds; one
        # jitted function caches a compilation per static-argument combination.
        self.jitted = jax.jit(fn, static_argnames=self.static_names)

    def torch_signature(self) -> inspect.Signature:
        parameters = [p.replace(annotation=_torch_annotation(p.annotation)) for p in self.parameters]
        return inspect.Signature(parameters, return_annotation=_torch_return_annotation(self.signature.return_annotation))

    def split(self, args: Sequence, kwargs: dict) -> tuple[dict, dict]:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        tensors = {n: v for n, v in bound.arguments.items() if n not in self.static_names}
        statics = {n: v for n, v in bound.arguments.items() if n in self.static_names}
        return tensors, statics

    def run_interpreted(self, *args, **kwargs):
        tensors, statics = self.split(args, kwargs)
        params = interpret_params()
        with pltpu.force_tpu_interpret_mode(params):
            out = self.jitted(**{n: _to_jax(t) for n, t in tensors.items()}, **statics)
            out = jax.block_until_ready(out)
        if params.detect_races:
            _raise_on_race(self.qualname)
        if self.returns_tuple:
            return tuple(_to_torch(o) for o in out)
        return _to_torch(out)

    def fake(self, *args, **kwargs):
        tensors, statics = self.split(args, kwargs)
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        avals = {n: jax.ShapeDtypeStruct(tuple(t.shape), _TORCH_TO_JAX_DTYPE[t.dtype]) for n, t in tensors.items()}
        out = jax.eval_shape(lambda **arrays: self.fn(**arrays, **statics), **avals)

        def empty(aval):
            return torch.empty(aval.shape, dtype=_JAX_TO_TORCH_DTYPE[aval.dtype], device=device)

        if self.returns_tuple:
            return tuple(empty(o) for o in out)
        return empty(out)


def jax_torch_op(qualname: str) -> Callable[[Callable], torch.library.CustomOpDef]:
    """Decorator: register the typed JAX function `fn` as the torch op `qualname`.

    Parameters annotated `jax.Array` become tensors; bool/int/float/str
    parameters are static (part of the compilation cache key). The return is
    `jax.Array` or `tuple[jax.Array, ...]`. Validate inputs in torch terms
    before calling the op: shapes that reach the kernel are assumed valid.
    """

    def register(fn: Callable) -> torch.library.CustomOpDef:
        jax_function = _JaxFunction(qualname, fn)
        jax_op = _jax_op_registrar()
        if jax_op is not None:
            op = jax_op(qualname, fn)
        else:
            def placeholder(*args, **kwargs):
                raise RuntimeError(f"{qualname} runs on TPU only through torch_tpu, which is not installed")

            placeholder.__signature__ = jax_function.torch_signature()
            op = torch.library.custom_op(qualname, placeholder, mutates_args=())
        op.register_kernel("cpu")(jax_function.run_interpreted)
        # jax_op's own fake lowers for the TPU platform; shapes from eval_shape
        # are the same on every device and need no backend.
        op.register_fake(jax_function.fake)
        return op

    return register
