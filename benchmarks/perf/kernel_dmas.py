"""The copies a Pallas kernel makes itself, of operands left in HBM (memory space ANY): bytes at each grid step.

Such an operand has no block for the pipeline to fetch: the kernel copies
what it needs (`pltpu.make_async_copy`). The replay counts those copies
where it can count them exactly, at their waits (`dma_wait`): each wait
accounts for the bytes of its copy's HBM slice at every step it runs:
- at the kernel body's top level: every step;
- in a `cond` whose branch the replay evaluates per step from program ids
  and scalar prefetch (`kernel_work.values_at_each_step`): the steps that
  take its branch;
- in a `fori_loop` (a `while` counting from a lower to an upper bound) whose
  bounds are such values: that many times at each step;
- in a `scan`: its length times.
A copy is counted in the step that waits for it: a copy the kernel starts a
step ahead (its own prefetch) lands in the step that needs it, as the
pipeline's block fetches do (`traffic.PallasCallTraffic.pipelined_seconds`
overlaps it with the step before). A copy started and waited for in the
same step is counted the same way, which is optimistic: it does not overlap
the step before. A wait anywhere else (under a predicate or bound the replay
cannot evaluate) leaves its operand uncounted, and `roofline` refuses to
time the call, as it does for an operand no wait copies from (the kernel
then reads it some way the replay does not know).
"""

from __future__ import annotations

import math

import numpy as np
from jax._src import core as jax_core
from jax._src.pallas.mosaic import primitives as mosaic_primitives

from .kernel_work import fori_trips, values_at_each_step


def waited_bytes(kernel: jax_core.Jaxpr, refs, gm, grid, grid_indices: np.ndarray, prefetch) -> dict:
    """For each of `refs` (top-level kernel refs, e.g. the ANY operands) whose copies the replay can count: HBM
    bytes its copies' waits account for at each grid step, as `(read, written)` arrays of `[steps]`."""
    steps = grid_indices.shape[0]
    refs = set(refs)
    counted = {ref: (np.zeros(steps, np.int64), np.zeros(steps, np.int64)) for ref in refs}
    uncounted: set = set()
    waited: set = set()
    values: dict = {}

    def value(var) -> np.ndarray | None:
        if var is None:
            return None
        if isinstance(var, jax_core.Literal):
            return np.full(steps, int(var.val), np.int64)
        if var not in values:
            values[var] = values_at_each_step(kernel, var, gm, grid, grid_indices, prefetch)
        return values[var]

    def walk(jaxpr: jax_core.Jaxpr, resolve, times: np.ndarray | None):
        """`resolve` maps a variable of `jaxpr` to the top-level variable it is (None: computed in here)."""
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "dma_wait":
                src, dst, *_ = mosaic_primitives._dma_unflatten(eqn.params["tree"], eqn.invars)
                for position, transformed in enumerate((src, dst)):
                    root = resolve(getattr(transformed, "ref", transformed))
                    if root not in refs:
                        continue
                    if times is None:
                        uncounted.add(root)
                    else:
                        counted[root][position][:] += times * _slice_bytes(transformed)
                        waited.add(root)
                continue
            operands = [resolve(var) if isinstance(var, jax_core.Var) else var for var in eqn.invars]
            if name == "cond":
                branch = value(operands[0])
                for number, body in enumerate(eqn.params["branches"]):
                    inner = _scope(body.jaxpr.invars, operands[1:])
                    taken = None if times is None or branch is None else times * (branch == number)
                    walk(body.jaxpr, inner, taken)
            elif name == "while":
                cond_consts, body_consts = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
                body = eqn.params["body_jaxpr"].jaxpr
                consts = operands[cond_consts : cond_consts + body_consts]
                trips = fori_trips(eqn, lambda var: value(resolve(var) if isinstance(var, jax_core.Var) else var))
                walk(body, _scope(body.invars[:body_consts], consts), None if times is None or trips is None
                     else times * trips)
            elif name == "scan":
                body = eqn.params["jaxpr"].jaxpr
                consts = operands[: eqn.params["num_consts"]]
                walk(body, _scope(body.invars[: len(consts)], consts),
                     None if times is None else times * eqn.params["length"])
            elif name in ("pjit", "jit", "closed_call"):
                body = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
                body = getattr(body, "jaxpr", body)
                walk(body, _scope(body.invars, operands), times)
            else:
                for body in jax_core.jaxprs_in_params(eqn.params):
                    walk(body, lambda var: None, None)

    walk(kernel, lambda var: var, np.ones(steps, np.int64))
    uncounted |= refs - waited
    return {ref: bytes_ for ref, bytes_ in counted.items() if ref not in uncounted}


def _scope(inner_vars, outer_values):
    """Resolves an inner jaxpr's variables: its inputs to what the outer scope passed (top-level variables or
    literals), anything computed inside to None."""
    mapping = {var: outer for var, outer in zip(inner_vars, outer_values)}
    return lambda var: mapping.get(var)


def _slice_bytes(transformed) -> int:
    """Bytes of the slice of a ref a copy moves."""
    aval = transformed.ref.aval if hasattr(transformed, "ref") else transformed.aval
    for transform in getattr(transformed, "transforms", ()):
        aval = transform.transform_type(aval)
    return math.prod(int(d) for d in aval.shape) * np.dtype(aval.dtype).itemsize
