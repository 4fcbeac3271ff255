"""The work inside a Pallas kernel body at each grid step: its matmuls (MXU) and its vector-unit operations.

MXU work is derived from the kernel body: every `dot_general` on the block
shapes, times the loop trip counts around it, at every grid step (so padding
rows inside a block are counted: the MXU computes them). A `cond`
(`pl.when`) whose predicate, and a `fori_loop` whose bounds, depend only on
program ids and scalar-prefetch values are evaluated at every step, so
compute a kernel skips (an empty group, a masked tile, chunks past a group's
rows) costs nothing. Any other `cond` counts its most expensive branch and
any other `while` body counts once; `PallasCallTraffic.dots_exact` is False
then, and the `active_steps` callback can say which steps compute (the
pipeline's DMAs run on every step regardless).

Vector-unit work: every elementwise or reducing op of the kernel body on an
array counts its (8 x 128) register elements (a [bq, 64] f32 block counts
[bq, 128]) at every step it runs, priced at the `rates` the pricing is given
(`chip.ModelRates.vector_elements_per_cycle`, or
`transcendental_elements_per_cycle` for exp, log, div, rsqrt and the like);
an add of a matmul's result into an accumulator is the MXU's, not counted.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax._src import core as jax_core
from jax._src.state import discharge as state_discharge
from jax.extend import core as jex_core

from .host_eval import host_device, is_unknown, run_on_host
from .traffic import dtype_name
from tpu_kernels.runtime.hardware import round_up

def grid_dots(kernel, gm, grid, grid_indices: np.ndarray, prefetch: list[Any]) -> tuple[dict[tuple, np.ndarray], bool]:
    """How many times each matmul shape runs at every grid step, and whether that count is exact.

    A `cond` (e.g. `pl.when`) whose predicate, and a `fori_loop` whose
    bounds, depend only on program ids and scalar-prefetch values are
    evaluated at every step, also nested in each other, so skipped compute
    costs nothing and a loop counts its trips. Other conds count their most
    expensive branch, other `while` bodies count once; the count is then not
    exact.
    """
    steps = grid_indices.shape[0]
    per_step: dict[tuple, np.ndarray] = {}
    top_level: dict = {}

    def top_level_value(var) -> np.ndarray | None:
        if var not in top_level:
            top_level[var] = values_at_each_step(kernel, var, gm, grid, grid_indices, prefetch)
        return top_level[var]

    def walk(jaxpr, value, times: np.ndarray) -> bool:
        exact = True
        products = _matmul_products(jaxpr)
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "cond" and _cond_has_dots(eqn):
                branch = value(eqn.invars[0])
                if branch is not None:
                    branch = np.clip(branch, 0, len(eqn.params["branches"]) - 1)
                    for number, body in enumerate(eqn.params["branches"]):
                        inner = _scope_values(body.jaxpr, body.jaxpr.invars, eqn.invars[1:], value, steps)
                        exact &= walk(body.jaxpr, inner, times * (branch == number))
                    continue
            if name == "while":
                trips = fori_trips(eqn, value)
                if trips is not None:
                    body = eqn.params["body_jaxpr"].jaxpr
                    first_const = eqn.params["cond_nconsts"]
                    consts = eqn.invars[first_const : first_const + eqn.params["body_nconsts"]]
                    inner = _scope_values(body, body.invars[: len(consts)], consts, value, steps)
                    exact &= walk(body, inner, times * trips)
                    continue
            found: dict[tuple, int] = {}
            exact &= _collect_dots_of_eqn(eqn, 1, found, products)
            for key, count in found.items():
                per_step[key] = per_step.get(key, np.zeros(steps, np.int64)) + count * times
        return exact

    def top_value(var) -> np.ndarray | None:
        return np.full(steps, int(var.val), np.int64) if isinstance(var, jax_core.Literal) else top_level_value(var)

    exact = walk(kernel, top_value, np.ones(steps, np.int64))
    return per_step, exact


def fori_trips(eqn, value) -> np.ndarray | None:
    """Trips at every step of a `while` that counts its first carry up to its second (`lax.fori_loop`), if `value`
    knows both bounds."""
    cond = eqn.params["cond_jaxpr"].jaxpr
    cond_consts, body_consts = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    carry = eqn.invars[cond_consts + body_consts :]
    if len(cond.eqns) != 1 or cond.eqns[0].primitive.name != "lt" or len(carry) < 2:
        return None
    counter, bound = cond.invars[cond_consts], cond.invars[cond_consts + 1]
    if list(cond.eqns[0].invars) != [counter, bound] or cond.outvars != cond.eqns[0].outvars:
        return None
    lower, upper = value(carry[0]), value(carry[1])
    if lower is None or upper is None:
        return None
    return np.clip(upper - lower, 0, None)


def _scope_values(jaxpr, inner_vars, outer_vars, outer_value, steps: int):
    """The per-step values of a nested jaxpr's scalars: its inputs `inner_vars` are the enclosing scope's
    `outer_vars` (constant over the nested scope's run, e.g. a loop's consts, not its carry), and a scalar it
    computes from them by an elementwise operation (`pl.when`'s conversion of its predicate, a comparison) is
    computed on the host. Anything else is None."""
    sources = dict(zip(inner_vars, outer_vars))
    producers = {var: eqn for eqn in jaxpr.eqns for var in eqn.outvars}
    known: dict = {}

    def value(var) -> np.ndarray | None:
        if isinstance(var, jax_core.Literal):
            return np.full(steps, var.val)
        if var not in known:
            known[var] = outer_value(sources[var]) if var in sources else _computed(producers.get(var))
        return known[var]

    def _computed(eqn) -> np.ndarray | None:
        if (eqn is None or eqn.primitive.name not in _SCALAR_PRIMITIVES
                or any(var.aval.shape for var in (*eqn.invars, *eqn.outvars))):
            return None
        args = [value(var) for var in eqn.invars]
        if any(arg is None for arg in args):
            return None
        dtypes = [var.aval.dtype for var in eqn.invars]

        def per_step(*columns):
            return eqn.primitive.bind(*(column.astype(dtype) for column, dtype in zip(columns, dtypes)),
                                      **eqn.params)

        with jax.default_device(host_device()):
            result = jax.vmap(per_step)(*(np.asarray(arg) for arg in args))
        return np.asarray(result[0] if eqn.primitive.multiple_results else result).astype(np.int64)

    return value


def _cond_has_dots(eqn) -> bool:
    """Whether a cond holds work the model counts (matmuls or vector work) in some branch."""
    for branch in eqn.params["branches"]:
        found: dict[tuple, int] = {}
        _collect_dots(branch.jaxpr, 1, found)
        if found:
            return True
    return False


# Calls of a jitted function (jnp.clip, jnp.where, ...): pure, so a predicate may take them whole.
_PURE_CALLS = ("pjit", "jit", "closed_call")


def values_at_each_step(kernel, index, gm, grid, grid_indices, prefetch) -> np.ndarray | None:
    """The integer `index` (a literal or a variable of the kernel body's top level) at every grid step, if it
    depends only on program ids and scalar prefetch; else None."""
    steps = grid_indices.shape[0]
    if isinstance(index, jax_core.Literal):
        return np.full(steps, int(index.val), np.int64)
    prefetch_refs = list(kernel.invars[: gm.num_index_operands])
    if any(is_unknown(value) for value in prefetch):
        return None
    if any(
        eqn.primitive.name in ("swap", "addupdate") and eqn.invars[0] in prefetch_refs for eqn in kernel.eqns
    ):
        return None  # the kernel rewrites its scalar prefetch: its values are not the ones passed in
    producers = {id(var): eqn for eqn in kernel.eqns for var in eqn.outvars}
    slice_ids: set[int] = set()
    grid_vars: list[tuple[jax_core.Var, str, int]] = []
    pending = [index]
    while pending:
        var = pending.pop()
        if isinstance(var, jax_core.Literal) or any(var is ref for ref in prefetch_refs):
            continue
        eqn = producers.get(id(var))
        if eqn is None:
            return None  # a kernel input other than scalar prefetch
        if eqn.primitive.name in ("program_id", "num_programs"):
            if all(v is not var for v, _, _ in grid_vars):
                grid_vars.append((var, eqn.primitive.name, eqn.params["axis"]))
            continue
        if list(jax_core.jaxprs_in_params(eqn.params)) and not (eqn.primitive.name in _PURE_CALLS and not eqn.effects):
            return None
        if eqn.effects and not (eqn.primitive.name == "get" and any(eqn.invars[0] is ref for ref in prefetch_refs)):
            return None
        if id(eqn) not in slice_ids:
            slice_ids.add(id(eqn))
            pending.extend(eqn.invars)
    eqns = [eqn for eqn in kernel.eqns if id(eqn) in slice_ids]
    predicate = jax_core.Jaxpr(
        constvars=[],
        invars=[v for v, _, _ in grid_vars] + prefetch_refs,
        outvars=[index],
        eqns=eqns,
        effects=jax_core.join_effects(*(eqn.effects for eqn in eqns)),
        debug_info=jex_core.DebugInfo("benchmarks.perf", "a kernel value at each grid step", None, None),
    )
    pure = jax_core.jaxpr_as_fun(state_discharge.discharge_state(jax_core.ClosedJaxpr(predicate, [])))
    grid_args = [
        grid_indices[:, axis] if kind == "program_id" else np.full(steps, grid[axis], np.int32)
        for _, kind, axis in grid_vars
    ]

    def value_at(step, grid_columns, prefetch_values):
        del step  # vmap needs one mapped argument, also when no program id is read
        return pure(*grid_columns, *prefetch_values)[0]

    batched = jax.vmap(value_at, in_axes=(0, 0, None))
    with jax.default_device(host_device()):
        values = run_on_host(batched, np.arange(steps, dtype=np.int32), grid_args, list(prefetch))
    return np.broadcast_to(np.asarray(values, dtype=np.int64), (steps,))


def _dot_key(eqn) -> tuple:
    lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    batch = math.prod(lhs.shape[d] for d in lhs_batch)
    k = math.prod(lhs.shape[d] for d in lhs_contract)
    m = math.prod(s for d, s in enumerate(lhs.shape) if d not in (*lhs_contract, *lhs_batch))
    n = math.prod(s for d, s in enumerate(rhs.shape) if d not in (*rhs_contract, *rhs_batch))
    precision = eqn.params.get("precision")
    if isinstance(precision, tuple):
        precision = precision[0]
    precision_name = "DEFAULT" if precision is None else getattr(precision, "name", str(precision))
    return (batch, m, k, n, dtype_name(lhs.dtype), dtype_name(rhs.dtype), precision_name)


def _flops_of(collected: dict[tuple, int]) -> int:
    return sum(2 * key[0] * key[1] * key[2] * key[3] * count for key, count in collected.items() if is_dot_key(key))


# Vector-unit work of a kernel body, counted in (sublane x 128-lane) register elements: an array of shape
# [..., r, c] occupies prod(...) * round_up(r, 8) * round_up(c, 128) of them, however many it uses.
VECTOR_KEY = ("vector",)
TRANSCENDENTAL_KEY = ("transcendental",)
# Elementwise and reducing primitives the VPU runs (one op per register element)...
_VECTOR_PRIMITIVES = frozenset({
    "add", "sub", "mul", "neg", "max", "min", "abs", "sign", "floor", "ceil", "round", "select_n", "clamp",
    "convert_element_type", "and", "or", "not", "xor", "eq", "ne", "lt", "le", "gt", "ge", "integer_pow",
    "square", "shift_left", "shift_right_logical", "shift_right_arithmetic", "reduce_max", "reduce_min",
    "reduce_sum", "reduce_and", "reduce_or", "argmax", "argmin", "cumsum", "cummax",
})
# ...and those that go through the transcendental unit (and the VPU for their operands' handling).
_TRANSCENDENTAL_PRIMITIVES = frozenset({
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "erf", "erf_inv", "sin", "cos", "tan",
    "sqrt", "rsqrt", "cbrt", "div", "pow", "atan2",
})


# The elementwise operations `_scope_values` evaluates on scalars.
_SCALAR_PRIMITIVES = _VECTOR_PRIMITIVES - {
    "reduce_max", "reduce_min", "reduce_sum", "reduce_and", "reduce_or", "argmax", "argmin", "cumsum", "cummax"}


def is_dot_key(key: tuple) -> bool:
    return len(key) > 1


def _register_elements(aval) -> int:
    shape = tuple(int(d) for d in getattr(aval, "shape", ()))
    if not shape:
        return 0
    if len(shape) == 1:
        return round_up(shape[0], 128)
    *leading, rows, cols = shape
    return math.prod(leading) * round_up(rows, 8) * round_up(cols, 128)


def _vector_work(eqn) -> tuple[tuple, int] | None:
    """(key, register elements) of the vector work one run of `eqn` does, if it is vector work."""
    name = eqn.primitive.name
    if name not in _VECTOR_PRIMITIVES and name not in _TRANSCENDENTAL_PRIMITIVES:
        return None
    reducing = name.startswith(("reduce_", "arg", "cum"))
    elements = _register_elements(eqn.invars[0].aval if reducing else eqn.outvars[0].aval)
    if not elements:
        return None
    return (TRANSCENDENTAL_KEY if name in _TRANSCENDENTAL_PRIMITIVES else VECTOR_KEY), elements


def _collect_dots(jaxpr: jax_core.Jaxpr, multiplicity: int, collected: dict[tuple, int]) -> bool:
    exact = True
    products = _matmul_products(jaxpr)
    for eqn in jaxpr.eqns:
        exact &= _collect_dots_of_eqn(eqn, multiplicity, collected, products)
    return exact


def _matmul_products(jaxpr: jax_core.Jaxpr) -> set:
    """Variables holding a matmul's result: adding one to an accumulator is the MXU's accumulation, not VPU work."""
    return {var for eqn in jaxpr.eqns if eqn.primitive.name == "dot_general" for var in eqn.outvars}


def _collect_dots_of_eqn(eqn, multiplicity: int, collected: dict[tuple, int], products: set = frozenset()) -> bool:
    """Adds the matmuls (and vector work) one run of `eqn` performs; False if their number is only an upper bound."""
    name = eqn.primitive.name
    if name == "dot_general":
        key = _dot_key(eqn)
        collected[key] = collected.get(key, 0) + multiplicity
        return True
    accumulating = name == "add" and any(var in products for var in eqn.invars if isinstance(var, jax_core.Var))
    work = None if accumulating else _vector_work(eqn)
    if work is not None:
        key, elements = work
        collected[key] = collected.get(key, 0) + elements * multiplicity
        return True
    if name == "cond":
        exact = True
        branch_dots = []
        for branch in eqn.params["branches"]:
            found: dict[tuple, int] = {}
            exact &= _collect_dots(branch.jaxpr, multiplicity, found)
            branch_dots.append(found)
        costs = [(_flops_of(found), sum(c for key, c in found.items() if not is_dot_key(key))) for found in branch_dots]
        for key, count in branch_dots[max(range(len(costs)), key=costs.__getitem__)].items():
            collected[key] = collected.get(key, 0) + count
        return exact and len({flops for flops, _ in costs}) == 1
    if name == "scan":
        return _collect_dots(eqn.params["jaxpr"].jaxpr, multiplicity * eqn.params["length"], collected)
    if name == "while":
        found = {}
        _collect_dots(eqn.params["body_jaxpr"].jaxpr, multiplicity, found)
        for key, count in found.items():
            collected[key] = collected.get(key, 0) + count
        return not any(is_dot_key(key) for key in found)
    exact = True
    for sub in jax_core.jaxprs_in_params(eqn.params):
        exact &= _collect_dots(sub, multiplicity, collected)
    return exact
