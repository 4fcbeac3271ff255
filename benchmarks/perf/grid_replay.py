"""The grid of one pallas_call replayed the way the Mosaic TPU pipeline runs it: HBM traffic per grid step.

- Grid order: row-major over the grid, the last axis fastest, one step after
  the other on one TensorCore (a v5e, v6e or TPU7x device has one; "parallel"
  dimension semantics change nothing there). A v5p device is two TensorCores
  in megacore: the first "parallel" grid dimension with more than one index
  is split into two contiguous halves, one per core, and a call takes as long
  as its busier core (with no such dimension the grid runs on one core). The
  copy rules below are the ones jax documents for its pipeline emitter
  (docs/pallas/pipelining.md, "if the data slices between two consecutive
  iterations are the same, the pipeline will not issue a copy_in/copy_out";
  docs/pallas/tpu/sparse.md on revisiting).
- An input block is copied HBM -> VMEM (or SMEM) at the first step and at
  every step whose block index differs from the previous step's. Revisiting a
  block that was fetched earlier but not at the previous step fetches it again.
- An output block is copied VMEM -> HBM when the next step's block index
  differs, and at the last step. An output block visited again after the
  pipeline left it is counted in `OperandTraffic.revisits`: under the default
  revisit mode its contents are then undefined (a kernel bug worth seeing);
  with `pl.Buffered(1, revisit=pl.RevisitMode.ANY)` Mosaic reads it back, and
  that read-back is counted as HBM traffic.
- Bytes of a block are those of its window clipped to the array (a partial
  edge block moves only its in-bounds part). HBM tiling granularity is
  ignored: a (1, 2048) bf16 row counts 4 KiB although the (8|16, 128)-tiled
  HBM layout makes the DMA touch more.
- Index maps are evaluated for all grid steps at once (vmapped) with the
  concrete values of the scalar-prefetch operands and dynamic grid sizes
  (`benchmarks.perf.program_replay` computes them).
- Operands in memory space ANY/HBM are not windowed: the kernel copies them
  itself. The replay counts those copies from the kernel body where it can
  (`kernel_dmas`: each wait's bytes at the steps it runs, as bytes fetched
  for, or written after, that step), else by running the kernel's scalar
  program at every step (`scalar_replay`, which also cuts each step into
  phases at its waits). Where neither can, it lists the operand
  (`unmodelled_dmas`, and the call's `notes`); `roofline` refuses to time
  such a call rather than call its copies free. Scalar-prefetch operands are
  copied to SMEM once before the grid starts and count as HBM reads. Scratch
  buffers move no HBM bytes.

The MXU and vector work of each step comes from the kernel body
(`benchmarks.perf.kernel_work`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax._src import core as jax_core
from jax._src.pallas import core as pallas_core
from jax._src.state import discharge as state_discharge

from .host_eval import host_device, is_unknown, run_on_host
from .kernel_dmas import waited_bytes
from .kernel_work import TRANSCENDENTAL_KEY, VECTOR_KEY, grid_dots, is_dot_key
from .scalar_replay import StepPhases, Unresolved, replay_steps
from .traffic import DotShape, OperandTraffic, PallasCallTraffic, dtype_name
from tpu_kernels.runtime.hardware import LANES, SUBLANES, padded_vmem_bytes, round_up, sublane_multiple

_UNPIPELINED_MEMORY_SPACES = ("any", "hbm", "host")
_SEMAPHORE_MEMORY_SPACES = ("semaphore_mem",)


# A callback telling which grid steps run their compute:
#   active_steps(call_name, grid_indices[steps, ndim], scalar_prefetch_values) -> bool[steps] | None
ActiveStepsFn = Callable[[str, np.ndarray, tuple[np.ndarray, ...]], Any]


def _call_name(eqn: jax_core.JaxprEqn) -> str:
    name = eqn.params.get("name")
    if name:
        return str(name)
    debug_info = getattr(eqn.params["jaxpr"], "debug_info", None)
    return getattr(debug_info, "func_name", None) or "pallas_call"


def _memory_space_name(block_mapping: pallas_core.BlockMapping) -> str:
    space = block_mapping.block_aval.memory_space
    name = "default" if space is None else str(space).lower()
    return "vmem" if name == "default" else name


def _grid(gm: pallas_core.GridMapping, dynamic_values: list[Any], call_name: str) -> tuple[int, ...]:
    """The call's grid, each dynamic size read from its concrete value."""
    grid = []
    dynamic_sizes = iter(dynamic_values)
    for axis, size in enumerate(gm.grid):
        if pallas_core.is_dynamic_dim(size):
            value = next(dynamic_sizes)
            if is_unknown(value):
                raise ValueError(
                    f"pallas_call {call_name}: grid axis {axis} has a dynamic size computed from an argument "
                    "given as ShapeDtypeStruct (or from a kernel output); pass that argument concretely"
                )
            grid.append(int(value.reshape(-1)[0]))
        else:
            grid.append(int(size))
    return tuple(grid)


def _active_steps(active_steps_fn: ActiveStepsFn | None, call_name: str, grid_indices: np.ndarray, prefetch: list[Any],
                  steps: int) -> np.ndarray:
    """bool[steps]: the grid steps that run their compute; all of them unless `active_steps_fn` says otherwise."""
    active = np.ones(steps, dtype=bool)
    if active_steps_fn is not None:
        mask = active_steps_fn(call_name, grid_indices, tuple(prefetch))
        if mask is not None:
            active = np.asarray(mask, dtype=bool)
            if active.shape != (steps,):
                raise ValueError(f"active_steps must return a bool array of shape ({steps},), got {active.shape}")
    return active


def replay_pallas_call(eqn, small_operands: list[Any], active_steps_fn) -> PallasCallTraffic:
    """Replays one pallas_call given its dynamic grid sizes and scalar-prefetch operands."""
    params = eqn.params
    gm: pallas_core.GridMapping = params["grid_mapping"]
    name = _call_name(eqn)
    dynamic_values = small_operands[: gm.num_dynamic_grid_bounds]
    prefetch = small_operands[gm.num_dynamic_grid_bounds :]

    grid = _grid(gm, dynamic_values, name)
    steps = math.prod(grid)
    # Row-major, last axis fastest: Mosaic's iteration order. A grid-less call runs once.
    grid_indices = np.indices(grid, dtype=np.int32).reshape(len(grid), steps).T

    operands = [_prefetch_traffic(position, aval) for position, aval in enumerate(gm.index_map_avals[len(grid) :])]
    notes: list[str] = []
    kept = []
    for number, block_mapping in enumerate(gm.block_mappings):
        space = _memory_space_name(block_mapping)
        if space not in _SEMAPHORE_MEMORY_SPACES:
            kept.append((block_mapping, "input" if number < gm.num_inputs else "output", space))
    windowed = [bm for bm, _, space in kept if space not in _UNPIPELINED_MEMORY_SPACES]
    indices = dict(zip(map(id, windowed), _block_indices(windowed, grid_indices, prefetch, name)))
    kernel = params["jaxpr"]
    operand_refs = {id(bm): kernel.invars[gm.num_index_operands + number] for number, bm in enumerate(gm.block_mappings)}
    unpipelined = [operand_refs[id(bm)] for bm, _, space in kept if space in _UNPIPELINED_MEMORY_SPACES]
    copied = waited_bytes(kernel, unpipelined, gm, grid, grid_indices, prefetch) if unpipelined else {}
    phases = None
    if set(unpipelined) - set(copied) and not any(is_unknown(value) for value in prefetch):
        phases = _scalar_replay(kernel, gm, grid, grid_indices, prefetch, unpipelined, notes)
    if phases is not None:
        # The replay ran every equation that touches these operands: what no copy moved, nothing moved.
        copied = {ref: (phases.per_step(phases.read[ref], steps), phases.per_step(phases.written[ref], steps))
                  for ref in unpipelined}
    for block_mapping, role, space in kept:
        if space in _UNPIPELINED_MEMORY_SPACES and operand_refs[id(block_mapping)] in copied:
            read, written = copied[operand_refs[id(block_mapping)]]
            notes.append(f"{block_mapping.origin} is in memory space {space}: counted from the kernel's own copies")
            operands.append(_copied_traffic(block_mapping, role, space, read, written))
        elif space in _UNPIPELINED_MEMORY_SPACES:
            notes.append(f"{block_mapping.origin} is in memory space {space}: the kernel's own DMAs of it are not counted")
            operands.append(_unpipelined_traffic(block_mapping, role, space))
        else:
            operands.append(_operand_traffic(block_mapping, role, space, indices[id(block_mapping)]))

    compiler_params = params.get("compiler_params")
    dimension_semantics = getattr(compiler_params, "dimension_semantics", None)
    if dimension_semantics is not None:
        dimension_semantics = tuple(str(s).lower().split(".")[-1] for s in dimension_semantics)

    active = _active_steps(active_steps_fn, name, grid_indices, prefetch, steps)
    megacore_core = _megacore_split(grid, grid_indices, dimension_semantics)
    if phases is None:
        step_dots, dots_exact = grid_dots(params["jaxpr"], gm, grid, grid_indices, prefetch)
    else:
        step_dots = {key: phases.per_step(counts, steps) for key, counts in phases.work.items()}
        dots_exact = True
    work_per_step = {key: counts * active for key, counts in step_dots.items() if np.any(counts * active)}
    dots_per_step = {key: counts for key, counts in work_per_step.items() if is_dot_key(key)}
    dots = tuple(DotShape(*key, count=int(counts.sum())) for key, counts in dots_per_step.items())
    no_work = np.zeros(steps, np.int64)

    return PallasCallTraffic(
        name=name,
        grid=grid,
        dimension_semantics=dimension_semantics,
        steps=steps,
        active_steps=int(active.sum()),
        operands=tuple(operands),
        dots=dots,
        dots_exact=dots_exact,
        scratch_vmem_bytes=sum(_scratch_vmem_bytes(aval) for aval in gm.scratch_avals),
        vmem_limit_bytes=getattr(compiler_params, "vmem_limit_bytes", None),
        cost_estimate=params.get("cost_estimate"),
        notes=tuple(notes),
        dots_per_step=dots_per_step,
        vector_per_step=work_per_step.get(VECTOR_KEY, no_work),
        transcendental_per_step=work_per_step.get(TRANSCENDENTAL_KEY, no_work),
        megacore_core=megacore_core,
        phases=phases,
    )


def _scalar_replay(kernel, gm, grid, grid_indices, prefetch, unpipelined, notes: list) -> StepPhases | None:
    """The kernel's own copies and work, phase by phase, from running its scalar program (`scalar_replay`); None,
    with the reason in `notes`, where its control flow depends on a value in VMEM."""
    spaces = [str(getattr(aval, "memory_space", "") or "").lower() for aval in gm.scratch_avals]
    try:
        phases = replay_steps(kernel, gm, grid, grid_indices, [np.asarray(v) for v in prefetch], unpipelined, spaces)
    except Unresolved as why:
        notes.append(f"the kernel's scalar program could not be replayed: {why}")
        return None
    notes.append("the kernel's own copies and work counted by running its scalar program at every step")
    return phases


def _megacore_split(grid, grid_indices: np.ndarray, dimension_semantics) -> np.ndarray | None:
    """Each step's core (0 or 1) when a parallel grid dimension of more than one index lets a megacore split it.

    Assumption (jax's Pallas TPU docs describe megacore sharding along "parallel" dimensions but not the
    split itself): the first such dimension is cut into two contiguous halves, the first half on core 0.
    """
    for axis, semantics in enumerate(dimension_semantics or ()):
        if semantics in ("parallel", "core_parallel") and grid[axis] > 1:
            return (grid_indices[:, axis] >= (grid[axis] + 1) // 2).astype(np.int8)
    return None


def _prefetch_traffic(position: int, aval) -> OperandTraffic:
    """A scalar-prefetch operand: copied whole into SMEM once, before the first step."""
    shape = tuple(int(d) for d in aval.shape)
    return OperandTraffic(
        origin=f"scalar_prefetch[{position}]",
        role="scalar_prefetch",
        memory_space="smem",
        array_shape=shape,
        dtype=dtype_name(aval.dtype),
        block_shape=shape,
        buffer_count=1,
        transfers=1,
        distinct_blocks=1,
        hbm_bytes=math.prod(shape) * np.dtype(aval.dtype).itemsize,
        buffer_bytes=padded_vmem_bytes(shape, aval.dtype),
        revisits=0,
        pipelined=True,
    )


def _unpipelined_traffic(block_mapping, role: str, space: str) -> OperandTraffic:
    return OperandTraffic(
        origin=block_mapping.origin,
        role=role,
        memory_space=space,
        array_shape=tuple(int(d) for d in block_mapping.array_aval.shape),
        dtype=dtype_name(block_mapping.array_aval.dtype),
        block_shape=tuple(pallas_core.get_block_size(d) for d in block_mapping.block_shape),
        buffer_count=0,
        transfers=0,
        distinct_blocks=0,
        hbm_bytes=0,
        buffer_bytes=0,
        revisits=0,
        pipelined=False,
    )


def _copied_traffic(block_mapping, role: str, space: str, read: np.ndarray, written: np.ndarray) -> OperandTraffic:
    """An operand the kernel copies itself, with the bytes its waits account for at each step (`kernel_dmas`);
    its VMEM is the kernel's scratch, counted there."""
    return dataclasses.replace(
        _unpipelined_traffic(block_mapping, role, space),
        transfers=int(np.count_nonzero(read + written)),
        hbm_bytes=int(read.sum() + written.sum()),
        pipelined=True,
        fetched_per_step=read,
        written_per_step=written,
    )


def scratch_vmem_bytes(shape: tuple[int, ...], dtype) -> int:
    """Bytes Mosaic allocates for a VMEM scratch buffer of `shape`: rows (the second-minor dimension) at least a
    native tile's are padded to whole native tiles (`padded_vmem_bytes`); fewer rows get a tile of their own
    height, the smallest power of two that holds them (at most SUBLANES, at least the rows one 32-bit word packs).
    The compiler reports `bf16[2,16384,5,2,128]` (RPA v3's K/V buffer) as tiled T(2,128)(2,1), 80 MiB, where
    padding its 2 rows to bf16's 16 would count 640 MiB."""
    itemsize = np.dtype(dtype).itemsize
    if len(shape) < 2 or shape[-2] >= sublane_multiple(dtype):
        return padded_vmem_bytes(shape, dtype)
    *leading, rows, cols = shape
    packing = max(1, 4 // itemsize)
    tile_rows = max(packing, 1 << (min(rows, SUBLANES) - 1).bit_length())
    return math.prod(leading) * round_up(rows, tile_rows) * round_up(cols, LANES) * itemsize


def _scratch_vmem_bytes(aval) -> int:
    inner = getattr(aval, "inner_aval", aval)
    space = str(getattr(aval, "memory_space", "vmem")).lower()
    if space not in ("vmem", "default") or jax.dtypes.issubdtype(inner.dtype, jax.dtypes.extended):
        return 0
    return scratch_vmem_bytes(tuple(inner.shape), inner.dtype)


def _block_indices(block_mappings, grid_indices: np.ndarray, prefetch: list[Any], call_name: str) -> list[np.ndarray]:
    """The block index tuple of each block mapping at every grid step, each (steps, rank).

    All index maps are vmapped over the steps and evaluated in one jitted call.
    A scalar-prefetch operand whose value is unknown may only be passed to
    index maps that do not read it.
    """
    steps, num_grid = grid_indices.shape
    if not block_mappings:
        return []
    if steps == 0:
        return [np.zeros((0, len(bm.block_shape)), np.int64) for bm in block_mappings]
    prefetch_args = []
    for position, value in enumerate(prefetch):
        if is_unknown(value):
            for block_mapping in block_mappings:
                index_map = block_mapping.index_map_jaxpr.jaxpr
                if index_map.invars[num_grid + position] in _used_vars(index_map):
                    raise ValueError(
                        f"pallas_call {call_name}: the index map of {block_mapping.origin} reads scalar-prefetch "
                        f"operand {position}, which is computed from an argument given as ShapeDtypeStruct "
                        "(or from a kernel output); pass that argument concretely"
                    )
            ref_aval = block_mappings[0].index_map_jaxpr.in_avals[num_grid + position]
            value = np.zeros(ref_aval.inner_aval.shape, ref_aval.inner_aval.dtype)
        prefetch_args.append(value)

    index_maps = [
        (jax_core.jaxpr_as_fun(state_discharge.discharge_state(bm.index_map_jaxpr)), len(bm.block_shape))
        for bm in block_mappings
    ]

    def all_block_indices(step_index, grid_columns, prefetch_values):
        del step_index  # vmap needs one mapped argument, also for a grid-less call
        return [tuple(index_map(*grid_columns, *prefetch_values)[:rank]) for index_map, rank in index_maps]

    columns = [grid_indices[:, axis] for axis in range(num_grid)]
    batched = jax.vmap(all_block_indices, in_axes=(0, 0, None))
    with jax.default_device(host_device()):
        results = run_on_host(batched, np.arange(steps, dtype=np.int32), columns, prefetch_args)
    return [np.stack([np.asarray(c, dtype=np.int64) for c in result], axis=1).reshape(steps, -1) for result in results]


def _used_vars(jaxpr: jax_core.Jaxpr) -> set:
    used = set()
    for eqn in jaxpr.eqns:
        used.update(v for v in eqn.invars if isinstance(v, jax_core.Var))
    used.update(v for v in jaxpr.outvars if isinstance(v, jax_core.Var))
    return used


def _step_bytes(block_mapping, block_indices: np.ndarray) -> np.ndarray:
    """int64[steps]: the bytes of each step's block, its window clipped to the array."""
    array_shape = tuple(int(d) for d in block_mapping.array_aval.shape)
    steps = block_indices.shape[0]
    itemsize = np.dtype(block_mapping.array_aval.dtype).itemsize
    starts, sizes = [], []
    for axis, block_dim in enumerate(block_mapping.block_shape):
        column = block_indices[:, axis]
        match block_dim:
            case pallas_core.Blocked(block_size=size):
                starts.append(column * size)
                sizes.append(size)
            case pallas_core.Squeezed():
                starts.append(column)
                sizes.append(1)
            case pallas_core.Element(block_size=size, padding=(pad_low, _)):
                starts.append(column - pad_low)
                sizes.append(size)
            case _:
                raise NotImplementedError(
                    f"{block_mapping.origin}: block dimension {block_dim} is not supported by the traffic model"
                )
    clipped = np.ones(steps, dtype=np.int64)
    for start, size, dim in zip(starts, sizes, array_shape):
        clipped *= np.clip(np.minimum(start + size, dim) - np.maximum(start, 0), 0, None)
    return clipped * itemsize


def _operand_traffic(block_mapping, role, space, block_indices) -> OperandTraffic:
    array_shape = tuple(int(d) for d in block_mapping.array_aval.shape)
    dtype = block_mapping.array_aval.dtype
    steps = block_indices.shape[0]
    step_bytes = _step_bytes(block_mapping, block_indices)

    changed_from_previous = np.ones(steps, dtype=bool)
    if steps > 1:
        changed_from_previous[1:] = np.any(block_indices[1:] != block_indices[:-1], axis=1)
    run_starts = np.flatnonzero(changed_from_previous)
    run_blocks = block_indices[run_starts]
    distinct, first_run = np.unique(run_blocks, axis=0, return_index=True)
    revisits = len(run_starts) - len(distinct)

    buffer_count = 2
    pipeline_mode = block_mapping.pipeline_mode
    if pipeline_mode is not None:
        buffer_count = pipeline_mode.buffer_count
    elif space == "vmem" and block_mapping.has_trivial_window():
        buffer_count = 1  # Mosaic single-buffers blocks that never move.

    fetched = np.zeros(steps, np.int64)
    written = np.zeros(steps, np.int64)
    if role == "input":
        transfer_steps = run_starts
        fetched[transfer_steps] = step_bytes[transfer_steps]
        revisits = 0
    else:
        transfer_steps = np.append(run_starts[1:] - 1, steps - 1) if steps else run_starts
        written[transfer_steps] = step_bytes[transfer_steps]
        revisit_any = pipeline_mode is not None and pipeline_mode.revisit == pallas_core.RevisitMode.ANY
        if revisit_any and revisits:
            is_first_visit = np.zeros(len(run_starts), dtype=bool)
            is_first_visit[first_run] = True
            read_back = run_starts[~is_first_visit]
            fetched[read_back] = step_bytes[read_back]
    hbm_bytes = int(fetched.sum() + written.sum())

    ref_shape = tuple(
        pallas_core.get_block_size(d)
        for d in block_mapping.block_shape
        if not isinstance(d, pallas_core.Squeezed)
    )
    return OperandTraffic(
        origin=block_mapping.origin,
        role=role,
        memory_space=space,
        array_shape=array_shape,
        dtype=dtype_name(dtype),
        block_shape=tuple(pallas_core.get_block_size(d) for d in block_mapping.block_shape),
        buffer_count=buffer_count,
        transfers=int(len(transfer_steps)),
        distinct_blocks=int(len(distinct)),
        hbm_bytes=hbm_bytes,
        buffer_bytes=buffer_count * padded_vmem_bytes(ref_shape, dtype),
        revisits=int(revisits),
        pipelined=True,
        fetched_per_step=fetched,
        written_per_step=written,
    )
