"""A kernel body run step by step on its scalars: the copies it waits for and the work it does, phase by phase.

`kernel_dmas` and `kernel_work` count what they can read off the kernel's
structure: a `pl.when` or a loop bound that depends on program ids and
scalar prefetch. A kernel that walks data-dependent loops (a ragged paged
attention: per grid step a loop over its sequences, in it a loop over each
sequence's K/V blocks, whose bounds come from the previous loop's values)
defeats that. This replay runs such a kernel's scalar program instead, at
every grid step, with the concrete scalar-prefetch values:

- integer and boolean scalars (program ids, scalar-prefetch and SMEM scratch
  reads and writes, loop counters and carries, the arithmetic on them) are
  computed; every array value in VMEM or vector registers stays unknown;
- a `cond` takes the branch its (known) index names, a `while` runs as many
  trips as its (known) predicate allows, a `scan` its length;
- each `dma_start` puts its copy's bytes on its semaphore; each `dma_wait`
  takes its descriptor's bytes off that semaphore, oldest copy first, and
  the copies it completes that read or write an operand left in HBM count
  there (a kernel may wait once, on a descriptor of its own, for several);
- an operand left in HBM is moved by copies only: an equation that takes one
  otherwise makes the replay give up; one no copy touches moves no bytes;
- every `dot_general` and every vector-unit operation that runs counts as in
  `kernel_work` (its matmul shape; its register elements).

The count is exact for the path the scalars take; if a branch or a loop
predicate depends on an unknown value (an array in VMEM) the replay gives up
and says why. A step is cut into phases at its waits: a phase is the copies a
wait (or a run of waits with no work between them) accounts for, and the work
done until the next wait. A kernel that starts block b+1's copy before it
waits for block b (double buffering of its own) overlaps phase b's work with
phase b+1's copies, which is how `traffic.PallasCallTraffic.pipelined_seconds`
prices phases.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.core
import jax.extend.core as jax_core
import numpy as np
from jax.experimental import pallas as pl
# No public API exposes a DMA's flattened operands or the state indexer type: the replay reads them from jax's
# internals (the rest of this package does likewise for the kernels it replays).
from jax._src.pallas.mosaic import primitives as mosaic_primitives
from jax._src.state import indexing

from .kernel_dmas import _slice_bytes
from .kernel_work import _dot_key, _matmul_products, _vector_work

# A known array value is kept only up to this many elements (scalars and small SMEM slices); larger ones are vector
# work whose values the replay has no use for.
_KNOWN_ELEMENTS = 256
# A while loop running longer than this is not a kernel's scalar loop: the replay stops rather than spin.
_MAX_TRIPS = 1 << 20


class Unresolved(Exception):
    """The kernel's control flow depends on a value the replay does not know."""


class _Unknown:
    def __repr__(self):
        return "<unknown>"


_UNKNOWN = _Unknown()


@dataclasses.dataclass
class _Ref:
    """A ref of the kernel: an SMEM array the replay tracks (`values`), or an opaque one (`hbm`: the operand it is, if left in HBM)."""

    values: np.ndarray | None = None
    hbm: Any = None  # the kernel's top-level ref var of an HBM operand


@dataclasses.dataclass
class Phase:
    """One phase of a grid step: HBM bytes its waits account for, per HBM ref, and the work done after them."""

    step: int
    read: dict = dataclasses.field(default_factory=dict)  # top-level ref var -> bytes
    written: dict = dataclasses.field(default_factory=dict)
    work: dict = dataclasses.field(default_factory=dict)  # kernel_work keys -> count (dots) or register elements
    copies: int = 0  # copies of an HBM operand started in this phase

    @property
    def has_work(self) -> bool:
        return any(self.work.values())


@dataclasses.dataclass(frozen=True)
class StepPhases:
    """The phases of every grid step, flattened in execution order."""

    step: np.ndarray  # [phases] grid step of each phase
    read: dict  # top-level ref var -> [phases] bytes
    written: dict
    work: dict  # kernel_work key -> [phases]
    copies: np.ndarray  # [phases] copies of an HBM operand started (what a per-copy issue cost is charged on)

    def per_step(self, values: np.ndarray, steps: int) -> np.ndarray:
        return np.bincount(self.step, weights=values, minlength=steps).astype(np.int64)


def replay_steps(kernel: jax_core.Jaxpr, gm, grid, grid_indices: np.ndarray, prefetch, hbm_refs,
                 scratch_spaces) -> StepPhases:
    """The phases of every grid step of `kernel` (raises `Unresolved` with the reason if its control flow depends on
    an unknown value). `scratch_spaces`: the memory space name of each scratch operand."""
    hbm_refs = list(hbm_refs)
    phases: list[Phase] = []
    num_prefetch = gm.num_index_operands
    operand_vars = kernel.invars[num_prefetch : num_prefetch + len(gm.block_mappings)]
    scratch_vars = kernel.invars[num_prefetch + len(gm.block_mappings) :]
    # SMEM (scalar prefetch, scratch) and the DMA semaphores keep their state from one grid step to the next.
    env: dict = {}
    for var, values in zip(kernel.invars[:num_prefetch], prefetch):
        env[var] = _Ref(values=np.array(values).reshape(var.aval.shape))
    for var in operand_vars:
        env[var] = _Ref(hbm=var if var in hbm_refs else None)
    for var, space in zip(scratch_vars, scratch_spaces):
        env[var] = _new_ref(var.aval, space)
    in_flight: dict = {}
    for step in range(grid_indices.shape[0]):
        runner = _StepRunner(step, grid, grid_indices[step], in_flight)
        runner.run(kernel, env)
        phases.extend(runner.phases)
    return _flatten(phases, hbm_refs)


def _flatten(phases: list[Phase], hbm_refs) -> StepPhases:
    keys = {key for phase in phases for key in phase.work}
    return StepPhases(
        step=np.array([p.step for p in phases], np.int64),
        copies=np.array([p.copies for p in phases], np.int64),
        read={ref: np.array([p.read.get(ref, 0) for p in phases], np.int64) for ref in hbm_refs},
        written={ref: np.array([p.written.get(ref, 0) for p in phases], np.int64) for ref in hbm_refs},
        work={key: np.array([p.work.get(key, 0) for p in phases], np.int64) for key in keys},
    )


def _new_ref(aval, space: str) -> _Ref:
    inner = getattr(aval, "inner_aval", aval)
    if "smem" in space and hasattr(inner, "shape"):
        return _Ref(values=np.zeros(inner.shape, inner.dtype))
    return _Ref()


class _StepRunner:
    def __init__(self, step: int, grid, indices: np.ndarray, in_flight: dict):
        self.step, self.grid, self.indices = step, grid, indices
        # Per DMA semaphore: the copies started on it and not yet waited for, [top-level HBM ref or None, direction
        # (0 read, 1 write), bytes], oldest first.
        self.in_flight = in_flight
        self.phases = [Phase(step)]

    def run(self, jaxpr: jax_core.Jaxpr, env: dict, consts=(), args=None) -> list:
        env = dict(env) if args is None else {}
        for var, value in zip(jaxpr.constvars, consts):
            env[var] = _known(value)
        if args is not None:
            for var, value in zip(jaxpr.invars, args):
                env[var] = value
        for kind, item in _plan(jaxpr):
            if kind == "work":
                work = self.phases[-1].work
                for key, amount in item.items():
                    work[key] = work.get(key, 0) + amount
                continue
            ins = [_read(env, var) for var in item.invars]
            if kind == "hbm_use":
                raise Unresolved(f"{item.primitive.name} takes an operand left in HBM, not through a copy")
            if kind == "scalar":
                outs = _evaluate(item, ins)
            else:
                outs = getattr(self, "_" + item.primitive.name)(item, ins)
            for var, value in zip(item.outvars, outs):
                env[var] = value
        return [_read(env, var) for var in jaxpr.outvars]

    # Control flow.
    def _cond(self, eqn, ins):
        index = ins[0]
        if index is _UNKNOWN:
            raise Unresolved("a pl.when / lax.cond predicate depends on a value in VMEM")
        branches = eqn.params["branches"]
        body = branches[int(np.clip(int(index), 0, len(branches) - 1))]
        return self.run(body.jaxpr, {}, body.consts, ins[1:])

    def _while(self, eqn, ins):
        cond_n, body_n = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        cond, body = eqn.params["cond_jaxpr"], eqn.params["body_jaxpr"]
        cond_consts, body_consts, carry = ins[:cond_n], ins[cond_n : cond_n + body_n], ins[cond_n + body_n :]
        for _ in range(_MAX_TRIPS):
            (going,) = self.run(cond.jaxpr, {}, cond.consts, [*cond_consts, *carry])
            if going is _UNKNOWN:
                raise Unresolved("a while loop's predicate depends on a value in VMEM")
            if not bool(going):
                return carry
            carry = self.run(body.jaxpr, {}, body.consts, [*body_consts, *carry])
        raise Unresolved(f"a while loop ran over {_MAX_TRIPS} trips")

    def _scan(self, eqn, ins):
        params = eqn.params
        consts_n, carry_n, length = params["num_consts"], params["num_carry"], params["length"]
        consts, carry, xs = ins[:consts_n], ins[consts_n : consts_n + carry_n], ins[consts_n + carry_n :]
        body = params["jaxpr"]
        for trip in range(length):
            i = length - 1 - trip if params["reverse"] else trip
            x = [_UNKNOWN if v is _UNKNOWN or isinstance(v, _Ref) else _known(np.asarray(v)[i]) for v in xs]
            outs = self.run(body.jaxpr, {}, body.consts, [*consts, *carry, *x])
            carry = outs[:carry_n]
        return [*carry, *([_UNKNOWN] * (len(eqn.outvars) - carry_n))]

    def _pjit(self, eqn, ins):
        body = eqn.params["jaxpr"]
        return self.run(body.jaxpr, {}, body.consts, ins)

    _jit = _pjit

    def _closed_call(self, eqn, ins):
        body = eqn.params["call_jaxpr"]
        return self.run(body.jaxpr, {}, body.consts, ins)

    def _custom_jvp_call(self, eqn, ins):
        return self._closed_call(eqn, ins)

    def _run_scoped(self, eqn, ins):
        body = eqn.params["jaxpr"]
        scoped = [_new_ref(var.aval, str(getattr(getattr(var.aval, "inner_aval", var.aval), "memory_space", "")
                                         or getattr(var.aval, "memory_space", "")).lower())
                  for var in body.invars[len(ins):]]
        return self.run(body, {}, (), [*ins, *scoped])

    # Kernel state.
    def _program_id(self, eqn, ins):
        return [np.int32(self.indices[eqn.params["axis"]])]

    def _num_programs(self, eqn, ins):
        return [np.int32(self.grid[eqn.params["axis"]])]

    def _get(self, eqn, ins):
        ref = ins[0]
        if not isinstance(ref, _Ref) or ref.values is None:
            return [_UNKNOWN]
        index = _index(eqn, ins[1:])
        return [_UNKNOWN if index is None else _known(ref.values[index])]

    def _swap(self, eqn, ins):
        ref, value = ins[0], ins[1]
        if not isinstance(ref, _Ref) or ref.values is None:
            return [_UNKNOWN]
        index = _index(eqn, ins[2:])
        if index is None:
            raise Unresolved("a write to SMEM at an index the replay does not know")
        old = _known(ref.values[index].copy())
        if value is _UNKNOWN:
            raise Unresolved("SMEM is written a value computed in VMEM")
        ref.values[index] = value
        return [old]

    def _addupdate(self, eqn, ins):
        ref, value = ins[0], ins[1]
        if isinstance(ref, _Ref) and ref.values is not None:
            index = _index(eqn, ins[2:])
            if index is None or value is _UNKNOWN:
                raise Unresolved("an SMEM update the replay cannot compute")
            ref.values[index] += value
        return []

    def _dma_start(self, eqn, ins):
        dma = _dma_plan(eqn)
        hbm, direction = None, 0
        for position, root in enumerate((dma.src_root, dma.dst_root)):
            ref = ins[root]
            if isinstance(ref, _Ref) and ref.hbm is not None:
                hbm, direction = ref.hbm, position
        if hbm is not None:
            self.phases[-1].copies += 1
        self.in_flight.setdefault(dma.semaphore(ins), []).append([hbm, direction, dma.bytes(eqn, ins)])
        return []

    def _dma_wait(self, eqn, ins):
        """A wait takes its descriptor's bytes off its semaphore: the copies started on it, oldest first, land in
        this phase (a kernel may wait once, on a descriptor of its own, for several copies it started)."""
        dma = _dma_plan(eqn)
        remaining = dma.bytes(eqn, ins)
        pending = self.in_flight.get(dma.semaphore(ins), [])
        phase = self.phases[-1]
        if phase.has_work:
            phase = Phase(self.step)
            self.phases.append(phase)
        while remaining > 0 and pending:
            copy = pending[0]
            taken = min(remaining, copy[2])
            if copy[0] is not None:
                counts = phase.read if copy[1] == 0 else phase.written
                counts[copy[0]] = counts.get(copy[0], 0) + taken
            copy[2] -= taken
            remaining -= taken
            if copy[2] == 0:
                pending.pop(0)
        return []


@dataclasses.dataclass(frozen=True)
class _Dma:
    """What the replay needs of a dma_start or dma_wait, worked out once per equation: where its source, destination
    and semaphore refs sit among its operands, its semaphore's index, and its bytes when its slice is static."""

    src: Any
    src_root: int
    dst_root: int
    semaphore_root: int
    semaphore_index: tuple  # per index: ("literal", value) or ("operand", position)
    static_bytes: int | None

    def semaphore(self, ins) -> tuple:
        """The semaphore's identity: its ref and its (known) index."""
        index = []
        for kind, value in self.semaphore_index:
            if kind == "literal":
                index.append(value)
                continue
            known = ins[value]
            if known is _UNKNOWN:
                raise Unresolved("a DMA semaphore picked by a value the replay does not know")
            index.append(int(known))
        return id(ins[self.semaphore_root]), tuple(index)

    def bytes(self, eqn, ins) -> int:
        if self.static_bytes is not None:
            return self.static_bytes
        return _copy_bytes(self.src, mosaic_primitives._dma_unflatten(eqn.params["tree"], ins)[0])


_DMAS: dict[int, tuple[Any, _Dma]] = {}


def _dma_plan(eqn) -> _Dma:
    cached = _DMAS.get(id(eqn))
    if cached is not None and cached[0] is eqn:
        return cached[1]
    src, dst, semaphore, *_ = mosaic_primitives._dma_unflatten(eqn.params["tree"], eqn.invars)
    positions = {id(var): number for number, var in enumerate(eqn.invars)}

    def root(transformed) -> int:
        return positions[id(getattr(transformed, "ref", transformed))]

    index = []
    for transform in getattr(semaphore, "transforms", ()):
        for dim in getattr(transform, "indices", ()):
            if isinstance(dim, pl.Slice):
                raise Unresolved("a DMA semaphore taken by a slice")
            if isinstance(dim, jax_core.Literal):
                index.append(("literal", int(dim.val)))
            elif isinstance(dim, jax_core.Var):
                index.append(("operand", positions[id(dim)]))
            else:
                index.append(("literal", int(dim)))
    try:
        static_bytes = _slice_bytes(src)
    except TypeError:  # a slice of traced size
        static_bytes = None
    dma = _Dma(src, root(src), root(dst), root(semaphore), tuple(index), static_bytes)
    _DMAS[id(eqn)] = (eqn, dma)
    return dma


def _copy_bytes(transformed, values) -> int:
    """Bytes of a copy's slice; a slice of dynamic size (`pl.ds(start, size)` with a traced size) at its known size."""
    try:
        return _slice_bytes(transformed)
    except TypeError:
        pass
    aval = transformed.ref.aval
    shape = list(aval.shape)
    for static, transform in zip(transformed.transforms, getattr(values, "transforms", ())):
        if not isinstance(transform, indexing.NDIndexer):
            shape = list(static.transform_type(jax.core.ShapedArray(tuple(shape), aval.dtype)).shape)
            continue
        sizes = []
        for dim, extent in zip(transform.indices, shape):
            if isinstance(dim, pl.Slice):
                if dim.size is _UNKNOWN:
                    raise Unresolved("a copy whose size depends on a value in VMEM")
                sizes.append(int(dim.size))
            elif np.ndim(dim) > 0:
                sizes.append(int(np.size(dim)))
        shape = sizes + shape[len(transform.indices):]
    return int(np.prod(shape)) * np.dtype(aval.dtype).itemsize


# Per jaxpr (by id, kept with the jaxpr so that a reused id is not mistaken for it): its plan, a list of
#   ("work", {key: amount})  the matmuls and vector work of a run of plain equations,
#   ("eqn", eqn)              control flow or kernel state, run by the `_StepRunner` method of its name,
#   ("scalar", eqn)           a pure equation with small outputs, computed when its inputs are known.
_PLANS: dict[int, tuple[jax_core.Jaxpr, list]] = {}


def _plan(jaxpr: jax_core.Jaxpr) -> list:
    cached = _PLANS.get(id(jaxpr))
    if cached is not None and cached[0] is jaxpr:
        return cached[1]
    products = _matmul_products(jaxpr)
    plan: list = []
    work: dict = {}
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name not in _PASSES_REFS and any(_in_hbm(var) for var in eqn.invars):
            # Only copies move an HBM operand; anything else that takes one does what the replay cannot count.
            plan.append(("hbm_use", eqn))
            continue
        if hasattr(_StepRunner, "_" + name):
            if work:
                plan.append(("work", work))
                work = {}
            plan.append(("eqn", eqn))
            continue
        if eqn.effects and any(True for _ in jax_core.jaxprs_in_params(eqn.params)):
            raise Unresolved(f"{name}: a nested kernel region the replay does not run")
        found = None
        if name == "dot_general":
            found = (_dot_key(eqn), 1)
        elif not (name == "add" and any(isinstance(v, jax_core.Var) and v in products for v in eqn.invars)):
            found = _vector_work(eqn)
        if found is not None:
            work[found[0]] = work.get(found[0], 0) + found[1]
        small = all(hasattr(v.aval, "dtype") and _size(v.aval) <= _KNOWN_ELEMENTS for v in eqn.outvars)
        if small and not eqn.effects:
            if work:
                plan.append(("work", work))
                work = {}
            plan.append(("scalar", eqn))
    if work:
        plan.append(("work", work))
    plan = _live(plan, jaxpr.outvars)
    _PLANS[id(jaxpr)] = (jaxpr, plan)
    return plan


# Equations that hand refs on (control flow, calls) or copy them: the replay follows those.
_PASSES_REFS = frozenset({"cond", "while", "scan", "pjit", "jit", "closed_call", "custom_jvp_call", "run_scoped",
                          "dma_start", "dma_wait"})


def _in_hbm(var) -> bool:
    space = str(getattr(getattr(var, "aval", None), "memory_space", "") or "").lower()
    return space in ("any", "hbm") or space.endswith((".any", ".hbm"))


def _live(plan: list, outvars) -> list:
    """`plan` without the scalar equations nothing the replay runs depends on (values feeding vector work only)."""
    needed = {var for var in outvars if isinstance(var, jax_core.Var)}
    kept = []
    for kind, item in reversed(plan):
        if kind == "scalar" and not any(var in needed for var in item.outvars):
            continue
        if kind != "work":
            needed.update(var for var in item.invars if isinstance(var, jax_core.Var))
        kept.append((kind, item))
    return kept[::-1]


def _size(aval) -> int:
    size = 1
    for dim in getattr(aval, "shape", ()):
        size *= int(dim)
    return size


def _read(env: dict, atom):
    if isinstance(atom, jax_core.Literal):
        return _known(np.asarray(atom.val))
    return env.get(atom, _UNKNOWN)


def _known(value):
    array = np.asarray(value)
    return array if array.size <= _KNOWN_ELEMENTS else _UNKNOWN


def _index(eqn, index_values):
    """The numpy index of a get/swap's indexers, if every index is known."""
    transforms = eqn.params["tree"].unflatten(index_values)
    index = ()
    for transform in transforms:
        if not isinstance(transform, indexing.NDIndexer):
            return None
        if index:
            return None  # a second indexer: not a pattern of scalar code
        parts = []
        for dim in transform.indices:
            if isinstance(dim, pl.Slice):
                start, size, stride = dim.start, dim.size, dim.stride
                if start is _UNKNOWN or size is _UNKNOWN:
                    return None
                start = int(start)
                parts.append(slice(start, start + int(size) * int(stride), int(stride)))
            elif dim is _UNKNOWN:
                return None
            else:
                parts.append(np.asarray(dim).astype(np.int64))
        index = tuple(parts)
    return index if index else Ellipsis


_NUMPY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum, "min": np.minimum,
    "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "eq": np.equal,
    "ne": np.not_equal, "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor, "not": np.invert,
    "neg": np.negative, "abs": np.abs, "sign": np.sign, "shift_left": np.left_shift,
    "shift_right_arithmetic": np.right_shift,
}


def _evaluate(eqn, ins: list) -> list:
    """The outputs of a pure equation whose inputs are known and small; unknown otherwise."""
    unknown = [_UNKNOWN] * len(eqn.outvars)
    if any(v is _UNKNOWN or isinstance(v, _Ref) for v in ins):
        return unknown
    name = eqn.primitive.name
    out_dtype = eqn.outvars[0].aval.dtype if eqn.outvars else None
    try:
        if name in _NUMPY:
            result = _NUMPY[name](*ins)
        elif name == "div" and np.issubdtype(out_dtype, np.integer):
            a, b = (np.asarray(v, np.int64) for v in ins)
            result = np.sign(a) * np.sign(b) * (np.abs(a) // np.maximum(np.abs(b), 1))
        elif name == "rem" and np.issubdtype(out_dtype, np.integer):
            a, b = (np.asarray(v, np.int64) for v in ins)
            result = np.sign(a) * (np.abs(a) % np.maximum(np.abs(b), 1))
        elif name == "select_n":
            result = np.choose(np.asarray(ins[0]).astype(np.int64), ins[1:])
        elif name == "clamp":
            result = np.clip(ins[1], ins[0], ins[2])
        elif name == "convert_element_type":
            result = ins[0]
        elif name == "shift_right_logical":
            result = np.right_shift(np.asarray(ins[0]).astype(np.uint64), ins[1])
        else:
            result = eqn.primitive.bind(*ins, **eqn.params)
    except Exception:  # noqa: BLE001 - a scalar the replay cannot compute stays unknown
        return unknown
    results = result if eqn.primitive.multiple_results else [result]
    return [_known(np.asarray(r).astype(v.aval.dtype)) if hasattr(v.aval, "dtype") else _UNKNOWN
            for r, v in zip(results, eqn.outvars)]
