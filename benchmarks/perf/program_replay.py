"""The replay of a traced JAX function: every pallas_call and XLA ragged dot it runs, with their small operands.

`model_pallas_traffic` (and `replay_program`) traces a JAX function, finds
every `pallas_call` in it (also inside jit, custom_vjp/custom_jvp and scan;
not inside lax.cond or while_loop) and replays each call's grid
(`benchmarks.perf.grid_replay`). The concrete values of the scalar-prefetch
operands and dynamic grid sizes are computed by running the traced
function's own jaxpr on the CPU up to each `pallas_call`, from the arguments
passed concretely; the arguments given as `jax.ShapeDtypeStruct` (weights,
activations) stay abstract and cost nothing. If a scalar-prefetch operand or
a grid size depends on an abstract argument (or on a Pallas kernel's
output), the model raises a ValueError naming it: pass that argument
concretely. Every `lax.ragged_dot_general` is listed too, with its group
sizes where they are known (`benchmarks.perf.xla_ragged_dot` prices it).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import core as jax_core

from . import grid_replay, host_eval, kernel_dmas, kernel_work, scalar_replay, traffic
from .grid_replay import ActiveStepsFn, replay_pallas_call
from .host_eval import UNKNOWN, host_device, is_unknown, run_on_host
from .traffic import PallasCallTraffic, dtype_name

# The modules whose code makes a replay (the objects `replay_program` returns): a cache of replays is keyed
# by their source, so that a change to any of them replays again.
REPLAY_MODULES = (traffic, host_eval, kernel_work, kernel_dmas, scalar_replay, grid_replay, sys.modules[__name__])


@dataclasses.dataclass(frozen=True)
class RaggedDotCall:
    """A `lax.ragged_dot_general` the traced function runs, with its group sizes where they are known.

    XLA compiles it into a windowed loop of its own (`benchmarks.perf.xla_ragged_dot` models it); the loop
    skips the windows a group does not touch, so its cost depends on the group sizes' values.
    """

    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    lhs_dtype: str
    rhs_dtype: str
    out_dtype: str
    dimension_numbers: Any  # lax.RaggedDotDimensionNumbers
    group_sizes: np.ndarray | None


@dataclasses.dataclass(frozen=True)
class ProgramReplay:
    """What the model replays of a traced function: its pallas_calls and its XLA ragged dots, each in execution order."""

    pallas_calls: tuple[PallasCallTraffic, ...]
    ragged_dots: tuple[RaggedDotCall, ...]


def model_pallas_traffic(fn: Callable, *args, active_steps: ActiveStepsFn | None = None) -> list[PallasCallTraffic]:
    """Replays every pallas_call of `fn(*args)` and counts its HBM traffic and MXU work.

    `args` are pytrees of concrete arrays (numpy or jax) and
    `jax.ShapeDtypeStruct`s; pass concretely every argument that a
    scalar-prefetch operand or a dynamic grid size is computed from (e.g.
    group sizes), the rest abstractly. Bind static arguments with
    functools.partial. Returns one `PallasCallTraffic` per pallas_call
    executed, in execution order (a call inside a scan appears once per
    iteration). A pallas_call inside `lax.cond` or `lax.while_loop` is not
    supported.
    """
    return list(replay_program(fn, *args, active_steps=active_steps).pallas_calls)


def replay_program(fn: Callable, *args, active_steps: ActiveStepsFn | None = None) -> ProgramReplay:
    """`model_pallas_traffic`, plus every `lax.ragged_dot_general` of `fn(*args)` with its group sizes' values.

    Pass the group sizes concretely to get their values (else `RaggedDotCall.group_sizes` is None).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    flat_args = jax.tree_util.tree_leaves(args)
    closed = jax.make_jaxpr(fn)(*args)
    is_known = [not isinstance(a, jax.ShapeDtypeStruct) for a in flat_args]
    calls: list[jax_core.JaxprEqn] = []

    # One jitted run of the function's jaxpr computes every known
    # scalar-prefetch operand and dynamic grid size: one XLA compile instead of
    # one per primitive, which dominates the cost otherwise.
    def known_call_operands(known_args, consts):
        known = iter(known_args)
        values = [next(known) if k else UNKNOWN for k in is_known]
        calls.clear()
        operands: list[list[Any]] = []
        _Collector(calls, operands).run(closed.jaxpr, consts, values)
        return operands

    known_args = [a for a, k in zip(flat_args, is_known) if k]
    with jax.default_device(host_device()):
        operand_values = run_on_host(known_call_operands, known_args, list(closed.consts))
    pallas_calls, ragged_dots = [], []
    for eqn, values in zip(calls, operand_values):
        values = [UNKNOWN if v is None else np.asarray(v) for v in values]
        if eqn.primitive.name == "pallas_call":
            pallas_calls.append(replay_pallas_call(eqn, values, active_steps))
        else:
            ragged_dots.append(_ragged_dot_call(eqn, values[0]))
    return ProgramReplay(tuple(pallas_calls), tuple(ragged_dots))


def _ragged_dot_call(eqn: jax_core.JaxprEqn, group_sizes) -> RaggedDotCall:
    lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
    return RaggedDotCall(
        lhs_shape=tuple(int(d) for d in lhs.shape),
        rhs_shape=tuple(int(d) for d in rhs.shape),
        lhs_dtype=dtype_name(lhs.dtype),
        rhs_dtype=dtype_name(rhs.dtype),
        out_dtype=dtype_name(eqn.outvars[0].aval.dtype),
        dimension_numbers=eqn.params["ragged_dot_dimension_numbers"],
        group_sizes=None if is_unknown(group_sizes) else np.asarray(group_sizes, np.int64),
    )


def _num_grid_operands(eqn: jax_core.JaxprEqn) -> tuple[int, int]:
    """(leading captured constants, dynamic grid sizes + scalar-prefetch operands) of a pallas_call."""
    gm = eqn.params["grid_mapping"]
    small = gm.num_dynamic_grid_bounds + gm.num_index_operands
    return len(eqn.invars) - small - gm.num_inputs, small


# Primitives that call their one body on their operands unchanged; the model looks through them.
_CALL_PRIMITIVES = frozenset(
    {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "checkpoint", "remat"}
)


_RAGGED_DOT = "ragged_dot_general"


class _Collector:
    """Traces a jaxpr on the values known so far, collecting each pallas_call (and ragged dot) and its small operands.

    Runs under jax.jit: known values are tracers, the others `UNKNOWN`.
    Everything that depends on an unknown value (or on a pallas_call output,
    which the model does not compute) stays unknown.
    """

    def __init__(self, calls: list[jax_core.JaxprEqn], operands: list[list[Any]]):
        self.calls = calls
        self.operands = operands
        self._has_pallas: dict[int, bool] = {}

    def contains_pallas(self, jaxpr: jax_core.Jaxpr) -> bool:
        key = id(jaxpr)
        if key not in self._has_pallas:
            self._has_pallas[key] = any(
                eqn.primitive.name in ("pallas_call", _RAGGED_DOT)
                or any(self.contains_pallas(sub) for sub in jax_core.jaxprs_in_params(eqn.params))
                for eqn in jaxpr.eqns
            )
        return self._has_pallas[key]

    def run(self, jaxpr: jax_core.Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[jax_core.Var, Any] = {}

        def read(atom):
            return atom.val if isinstance(atom, jax_core.Literal) else env[atom]

        for var, val in zip(jaxpr.constvars, consts):
            env[var] = val
        for var, val in zip(jaxpr.invars, args):
            env[var] = val
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            if eqn.primitive.name == "pallas_call":
                leading, small = _num_grid_operands(eqn)
                self.calls.append(eqn)
                self.operands.append([None if is_unknown(v) else v for v in invals[leading : leading + small]])
                outvals = [UNKNOWN] * len(eqn.outvars)
            elif eqn.primitive.name == _RAGGED_DOT:
                self.calls.append(eqn)
                self.operands.append([None if is_unknown(invals[2]) else invals[2]])
                outvals = [UNKNOWN] * len(eqn.outvars)
            elif any(self.contains_pallas(sub) for sub in jax_core.jaxprs_in_params(eqn.params)):
                outvals = self.descend(eqn, invals)
            elif any(is_unknown(v) for v in invals):
                outvals = [UNKNOWN] * len(eqn.outvars)
            else:
                with eqn.ctx.manager:
                    out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
                outvals = list(out) if eqn.primitive.multiple_results else [out]
            for var, val in zip(eqn.outvars, outvals):
                env[var] = val
        return [read(v) for v in jaxpr.outvars]

    def descend(self, eqn: jax_core.JaxprEqn, invals: list[Any]) -> list[Any]:
        """Runs a higher-order primitive whose body holds a pallas_call."""
        name = eqn.primitive.name
        params = eqn.params
        if name == "scan":
            return self._scan(params, invals)
        subs = [v for v in params.values() if isinstance(v, (jax_core.ClosedJaxpr, jax_core.Jaxpr))]
        if name in _CALL_PRIMITIVES and len(subs) == 1:
            sub = subs[0]
            body, consts = (sub.jaxpr, sub.consts) if isinstance(sub, jax_core.ClosedJaxpr) else (sub, ())
            if len(body.invars) == len(invals) and len(body.outvars) == len(eqn.outvars):
                return self.run(body, consts, invals)
        raise NotImplementedError(f"model_pallas_traffic cannot model a pallas_call inside `{name}`")

    def _scan(self, params, invals):
        body = params["jaxpr"]
        num_consts, num_carry, length = params["num_consts"], params["num_carry"], params["length"]
        consts = invals[:num_consts]
        carry = invals[num_consts : num_consts + num_carry]
        xs = invals[num_consts + num_carry :]
        ys_steps = []
        order = range(length - 1, -1, -1) if params["reverse"] else range(length)
        for i in order:
            x_i = [UNKNOWN if is_unknown(x) else x[i] for x in xs]
            out = self.run(body.jaxpr, body.consts, [*consts, *carry, *x_i])
            carry = out[:num_carry]
            ys_steps.append(out[num_carry:])
        if params["reverse"]:
            ys_steps.reverse()
        ys = []
        for j in range(len(body.jaxpr.outvars) - num_carry):
            column = [step[j] for step in ys_steps]
            ys.append(UNKNOWN if not column or any(is_unknown(c) for c in column) else jax.numpy.stack(column))
        return [*carry, *ys]
