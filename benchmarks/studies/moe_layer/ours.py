"""Ours: the built kernel repo's layer entry, at bf16 and with quantized (int8, fp8, int4) expert weights."""

from __future__ import annotations

import contextlib
import functools
import math
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from tpu_kernels.folders import make_private_dirs

from .shapes import DTYPE, Case, Model


# The JAX function behind the built kernel's fused experts op, by its name in the built package's face.
LAYER_ENTRY = "experts_layer"


@contextlib.contextmanager
def build_folder(cache_dir: Path | None):
    """Where the kernel repo is built and loaded from: a fixed folder under the cache, else a temporary one.

    A Mosaic kernel's lowered text embeds the source paths of the code that traced it (its location info),
    so ours is only found in the compile cache when it is built at the same path on every run.
    """
    if cache_dir is None:
        with tempfile.TemporaryDirectory() as folder:
            yield Path(folder)
    else:
        folder = Path(cache_dir) / "build"
        make_private_dirs(folder)
        yield folder


def load_kernel(repo: Path, build_dir: Path):
    import kernels

    from tpu_kernels.distribution.builder import build_kernel_repo

    return kernels.get_local_kernel(build_kernel_repo(repo, build_dir), backend="cpu")


def layer_entry(built):
    return getattr(built, LAYER_ENTRY)


def ours_layer(built, model: Model, generation: str):
    return functools.partial(
        layer_entry(built),
        activation=model.activation,
        weights_transposed=model.weights_transposed,
        interleaved=model.interleaved,
        alpha=model.alpha,
        limit=model.limit,
        generation=generation,
    )


# Quantized expert weights, ours only, decode shapes only: labelled extra variants, never
# headlines. int4 is packed two per byte (uint8), on the generations the kernel serves it on.
QUANTIZED = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.uint8}


def quantized_schemes(built, generation: str) -> list[str]:
    """The QUANTIZED schemes the kernel serves on `generation` (its NOT_SERVED)."""
    return [scheme for scheme in QUANTIZED if (scheme, generation) not in built.NOT_SERVED]


def _stored_shape(built, shape: tuple[int, ...], scheme: str) -> tuple[int, ...]:
    """A weight's array shape in `scheme`: int4 halves its packed axis (the kernel repo's int4_packed_axis)."""
    if scheme != "int4":
        return shape
    axis = built.int4_packed_axis(shape)
    return tuple(d // 2 if i == axis else d for i, d in enumerate(shape))


def quantized_layer(built, model: Model, generation: str):
    """Ours with quantized weights: arguments as `Case.avals`, then the two weights' scales."""
    layer = ours_layer(built, model, generation)

    def run(hidden, top_k_index, top_k_weights, gate_up, down, *rest):
        biases, scales = (rest[:2], rest[2:]) if model.bias else ((None, None), rest)
        return layer(hidden, top_k_index, top_k_weights, gate_up, down, *biases, *scales)

    return run


def quantized_avals(built, case: "Case", scheme: str, concrete_index: bool) -> list:
    """`case.avals` with quantized weights, then their scales in the shapes the kernel expects
    (`expected_scales_shape`)."""
    args = case.avals(concrete_index)
    shapes = case.weight_shapes()
    args[3:5] = [jax.ShapeDtypeStruct(_stored_shape(built, shape, scheme), QUANTIZED[scheme]) for shape in shapes]
    out_axis = 2 if case.model.weights_transposed else 1
    return args + [jax.ShapeDtypeStruct(built.expected_scales_shape(scheme, shape, out_axis), jnp.float32)
                   for shape in shapes]


def quantized_min_bytes(built, case: "Case", scheme: str) -> int:
    """The layer's minimum bytes with quantized weights: each active expert's weights (int4: half a byte each) and
    scales once."""
    model = case.model
    h, i = model.hidden, model.intermediate
    out_axis = 2 if model.weights_transposed else 1
    scales = sum(math.prod(built.expected_scales_shape(scheme, shape, out_axis)[1:]) * 4
                 for shape in case.weight_shapes())
    itemsize = jnp.dtype(DTYPE).itemsize
    weight_bytes = 3 * h * i // 2 if scheme == "int4" else 3 * h * i
    per_expert = weight_bytes + scales + ((2 * i + h) * itemsize if model.bias else 0)
    return 2 * case.rows * h * itemsize + case.active_experts * per_expert + case.picks * (4 + itemsize)
