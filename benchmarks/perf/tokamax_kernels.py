"""tokamax's Pallas TPU kernels as the performance model replays them (tokamax is a benchmark rival, never a runtime need).

tokamax hides each kernel's grid in an `emit_pipeline` inside a grid-less
`pallas_call` whose operands stay in HBM (`custom_buffered_pallas_call`), so
`perf.model_pallas_traffic` would see no grid and no copies. Under
`grid_as_pallas_call()` the same kernel body, grid, BlockSpecs, scalar
prefetch and scratch run as a plain `pallas_call`, which the replay counts
like any other kernel. Compiles must run tokamax's own code path: use the
context only around a replay.

The plain call's grid dimensions are all "arbitrary": tokamax's outer
`pallas_call` has no grid and no dimension semantics, and its `emit_pipeline`
gets no `core_axis`, so on a megacore device (v5p) nothing splits the grid
over the two TensorCores and it runs on one (jax's Pallas TPU pipelining
guide: without dimension semantics only one TensorCore is used; with
`emit_pipeline`, `core_axis` partitions the grid). tokamax's v5p timings of
this kernel agree: of its 89 modelled ragged-dot timings (openxla/tokamax
783ea95, tpu_v5), those whose grid the "parallel" semantics would have split
were priced at a median 0.56 of measured, and at 1.10 on one core, beside
1.01 for those with nothing to split.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

# The patch swaps a module attribute of tokamax: replays under it and lowerings of tokamax code must not interleave.
TOKAMAX_LOCK = threading.Lock()


@contextlib.contextmanager
def grid_as_pallas_call() -> Iterator[None]:
    """tokamax's `custom_buffered_pallas_call` replaced by a plain `pallas_call` of the same grid (module docstring).

    Input buffer counts other than 2 become `pl.Buffered(count)`, as tokamax binds them.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from tokamax._src import mosaic_tpu

    def plain_pallas_call(kernel, out_shape, grid_spec, compiler_params, input_buffer_count=None, **kw):
        counts = input_buffer_count or [2] * len(grid_spec.in_specs)
        if any(count != 2 for count in counts):
            grid_spec = pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=grid_spec.num_scalar_prefetch,
                grid=grid_spec.grid,
                in_specs=[
                    spec if count == 2 else dataclasses.replace(spec, pipeline_mode=pl.Buffered(count))
                    for spec, count in zip(grid_spec.in_specs, counts)
                ],
                out_specs=grid_spec.out_specs,
                scratch_shapes=grid_spec.scratch_shapes,
            )
        kw.pop("metadata", None)
        kw.pop("interpret", None)
        # No megacore split (module docstring): tokamax's own call gives Mosaic no parallel grid dimension.
        params = dataclasses.replace(compiler_params, dimension_semantics=("arbitrary",) * len(grid_spec.grid))
        return pl.pallas_call(kernel, out_shape, grid_spec=grid_spec, compiler_params=params, **kw)

    with TOKAMAX_LOCK:
        original = mosaic_tpu.custom_buffered_pallas_call
        mosaic_tpu.custom_buffered_pallas_call = plain_pallas_call
        try:
            yield
        finally:
            mosaic_tpu.custom_buffered_pallas_call = original
