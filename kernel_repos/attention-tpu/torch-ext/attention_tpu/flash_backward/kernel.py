"""Flash-attention backward for TPU in Pallas: dq in one kernel, dk and dv in another.

Both kernels recompute the probabilities of each (query block, KV block) tile
from q, k and the forward's log-sum-exp (p = exp(logit - lse); the sink is
inside lse), with delta = rowsum(d_out * out) precomputed once:

    dP = d_out V^T,   dS = P * (dP - delta),   dq = scale * dS' K,
    dV = P^T d_out,   dk = scale * dS'^T q,    dS' = dS * (1 - tanh^2) under a soft-cap.

* dq kernel, grid (batch, kv_head block, q_block, kv_step): the forward's
  structure. A step handles `kv_heads_per_step` KV heads and their groups of
  query heads against one K/V block each and accumulates dq in float32
  scratch; per query block it walks only the KV blocks holding a visible key
  (scalar-prefetched ranges, clamped index maps: no compute and no fetch
  outside them).
* dk/dv kernel, grid (batch, kv_head block, kv_block, q_step): per KV block it
  walks only the query blocks holding a query that sees one of its keys, and
  every query head of the group, accumulating dk and dv in float32 scratch.
  Its tiles are computed transposed, [block_kv, block_q] (S^T = K q^T), so
  that every matmul is a plain or right-transposed one and lse and delta
  arrive as lane-major rows.
* Several KV heads per step keep a step's MXU work well above the per-step
  overhead when groups are small (Gemma-4: 2 query heads per KV head), which
  lets windowed layers use small tiles: tiles straddling a window's edges
  compute masked pairs in proportion to their size.
* q, k, dq and dk have head dim D, v, d_out and dv Dv (equal but for latent
  attention).
* q, d_out, k and v are each read, and dq, dk and dv written, in the layout
  XLA stores it in by default: row-major [B, H, S, D], or where XLA stores
  it sequence-minor (a head dim that is no multiple of 128 over more than a
  few positions, blocks of whole lane tiles: `common.layout.sequence_minor_reads`)
  as its swapped view [B, H, D, S], a free bitcast. Each kernel then
  transposes such a block it holds across its walk once, at the walk's
  first step, into scratch of rows (dq: q and d_out; dk/dv: k and v),
  multiplies such walked blocks as read ([D, block]: a plain matmul where it
  contracted D, right-transposed where it contracted the walked sequence),
  and transposes such an accumulator at the walk's end. Reading them
  row-major there would make XLA copy each in, and each gradient out, on
  every call.
* Sinks: p_sink = exp(sink - lse) per row, d_sink = -sum over rows of
  p_sink * delta (plain JAX on [B, Hq, Sq] arrays, outside the kernels).
* Masking is the forward's (`common/masking.py`); tiles entirely inside the visible
  region skip it. Where a tile mixes rows (dq: key rows in dS K; dk/dv: query
  rows in P^T d_out and dS^T q) rows (sequence-minor: lanes) past the valid lengths are zeroed first,
  so NaN past an array's end never reaches a gradient, and a query row that
  sees nothing (lse = -inf) gets zero probabilities, not NaN.

Each kernel's tiles come from `tiles.select`, its grid from `plan.make`; `call` runs both kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._hardware import TpuGeneration, resolve_target
from ..common import masking
from ..common.heads import loop_over_heads
from ..common.masking import Attention, Prepared, Problem
from .plan import BackwardPlan, BackwardPlans, make
from .tiles import BackwardConfig

NT = (((1,), (1,)), ((), ()))  # a @ b.T
NN = (((1,), (0,)), ((), ()))  # a @ b


def _dot(a, b, dims, problem: Problem):
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=problem.precision)


def _finite_lse(lse):
    # A row that sees no key has lse = -inf and only invisible entries; any finite value keeps exp() from NaN.
    return jnp.where(lse == -jnp.inf, 0.0, lse)


def _kv_head(s, group: int):
    """The KV head of a step's query head s (s >= 0). lax.div, not //: Mosaic lowers floor division through
    sign(), whose rule asks the attached device for its TPU generation, so an ahead-of-time compile on a
    host without a TPU fails."""
    return jax.lax.div(s, group)


def _grid_step(q_offset_ref, kv_valid_ref, block_lo_ref, num_outer_blocks: int):
    """(outer block, step, slot, walked block, q_offset, kv_valid) of this step of a grid (batch, kv_head block,
    outer block, step): the walked range of the slot (batch, outer block) starts at block_lo_ref[slot]."""
    b, outer, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    slot = b * num_outer_blocks + outer
    walked = block_lo_ref[slot] + step
    return outer, step, slot, walked, q_offset_ref[b], kv_valid_ref[b]


def _tile_mask(problem: Problem, plan: BackwardPlan, q_offset, kv_valid, qi, kv_block):
    """(first key position, first query position, whether element masks are needed) of tile (qi, kv_block)."""
    key_start = kv_block * plan.block_kv
    q_first, q_last = masking.query_block_positions(problem, q_offset, qi, plan.block_q)
    needs_mask = masking.tile_needs_mask(
        problem, key_start=key_start, block_kv=plan.block_kv, kv_valid=kv_valid, q_first=q_first, q_last=q_last
    )
    return key_start, q_first, needs_mask


def _walk_tile(in_range, needs_mask, step, walk_step, plan: BackwardPlan, finalize) -> None:
    """step(apply_mask) on this grid step's tile if it is in the walked range, then, on the walk's last step,
    finalize() (write the float32 accumulators out)."""
    masking.run_tile(in_range, needs_mask, step)
    pl.when(walk_step == plan.num_steps - 1)(finalize)


def _transpose_heads(rows_ref, minor_ref) -> None:
    """Each head's block [D, block] of a sequence-minor ref into its rows [block, D] of a scratch: once per block
    held across the walk, so that every step multiplies it as a plain or right-transposed matmul."""

    def transpose(s):
        rows_ref[s] = minor_ref[s].T

    loop_over_heads(rows_ref.shape[0], transpose)


def _store_scaled(out_ref, acc_ref, scale, sequence_minor: bool) -> None:
    """The float32 accumulator [heads, block, D] times `scale` into the output block: as is, or each head transposed
    to [D, block] (sequence-minor)."""
    if not sequence_minor:
        out_ref[...] = (acc_ref[...] * scale).astype(out_ref.dtype)
        return

    def store(s):
        out_ref[s] = (acc_ref[s] * scale).T.astype(out_ref.dtype)

    loop_over_heads(acc_ref.shape[0], store)


def _walked_dims(sequence_minor: bool):
    """(contract D, contract the walked sequence) of a row tile [block, D] against a tile of a walked array: [block,
    D] row-major (a @ b.T, a @ b), [D, block] sequence-minor (a @ b, a @ b.T)."""
    return (NN, NT) if sequence_minor else (NT, NN)


def _sequence_valid(sequence_minor: bool, head_dim: int, block: int, first, valid):
    """Which entries of a walked tile ([block, D], or [D, block] sequence-minor) lie before position `valid`."""
    axis = 1 if sequence_minor else 0
    shape = (head_dim, block) if sequence_minor else (block, head_dim)
    return first + jax.lax.broadcasted_iota(jnp.int32, shape, axis) < valid


def _zeroed_past(tile, valid):
    return tile if valid is None else jnp.where(valid, tile, jnp.zeros_like(tile))


def _split_refs(rest, problem: Problem, count: int, held):
    """A backward kernel's refs after its inputs: (the mask ref or None, its `count` output and accumulator refs,
    the rows of the two blocks it holds across its walk). `held` is each of those blocks' (ref, read
    sequence-minor): such a block's rows are a scratch it is transposed into, the next one after the
    accumulators; the other's are the ref itself."""
    rest = list(rest)
    mask_ref = rest.pop(0) if problem.mask_kind is not None else None
    outputs, scratch = rest[:count], iter(rest[count:])
    return mask_ref, outputs, tuple(next(scratch) if minor else ref for ref, minor in held)


def _dq_kernel(
    q_offset_ref, kv_valid_ref, block_lo_ref, block_hi_ref,
    q_ref, k_ref, v_ref, d_out_ref, lse_ref, delta_ref, *rest,
    problem: Problem, plan: BackwardPlan,
):
    minor = plan.sequence_minor
    mask_ref, (dq_ref, acc_ref), (q_rows_ref, d_out_rows_ref) = _split_refs(
        rest, problem, 2, ((q_ref, minor.q), (d_out_ref, minor.out)))
    qi, kv_step, slot, kv_block, q_offset, kv_valid = _grid_step(
        q_offset_ref, kv_valid_ref, block_lo_ref, plan.num_q_blocks)
    block_q, block_kv = plan.block_q, plan.block_kv
    (k_contract_d, k_contract_keys), (v_contract_d, _) = _walked_dims(minor.k), _walked_dims(minor.v)

    @pl.when(kv_step == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        for rows_ref, ref, transposed in ((q_rows_ref, q_ref, minor.q), (d_out_rows_ref, d_out_ref, minor.out)):
            if transposed:
                _transpose_heads(rows_ref, ref)

    key_start, q_first, needs_mask = _tile_mask(problem, plan, q_offset, kv_valid, qi, kv_block)

    def step(apply_mask: bool):
        visible = bias = k_valid = v_valid = None
        if apply_mask:
            key_pos = key_start + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_kv), 1)
            query_pos = q_first + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_kv), 0)
            visible = masking.positional_visibility(problem, query_pos, key_pos, kv_valid)
            if mask_ref is not None:
                allowed, bias = masking.explicit_mask(problem, mask_ref[...])
                visible = visible & allowed
            k_valid = _sequence_valid(minor.k, problem.head_dim, block_kv, key_start, kv_valid)
            v_valid = _sequence_valid(minor.v, problem.v_head_dim, block_kv, key_start, kv_valid)

        def head(s):
            kv_head = _kv_head(s, problem.group)
            # dS K mixes keys: keys past the valid length (anything, NaN included) must be zero.
            k, v = _zeroed_past(k_ref[kv_head], k_valid), _zeroed_past(v_ref[kv_head], v_valid)
            capped = masking.capped_logits(problem, _dot(q_rows_ref[s], k, k_contract_d, problem))
            logits = capped if bias is None else capped + bias
            lse = _finite_lse(lse_ref[s].reshape(block_q, 1))
            p = jnp.exp(logits - lse)
            if visible is not None:
                p = jnp.where(visible, p, 0.0)
            dp = _dot(d_out_rows_ref[s], v, v_contract_d, problem)
            ds = p * (dp - delta_ref[s].reshape(block_q, 1))
            if problem.softcap is not None:
                ds = ds * masking.softcap_slope(problem, capped)
            acc_ref[s] += _dot(ds.astype(k.dtype), k, k_contract_keys, problem)

        loop_over_heads(acc_ref.shape[0], head)

    def finalize():
        _store_scaled(dq_ref, acc_ref, problem.scale, minor.q)

    _walk_tile(kv_block <= block_hi_ref[slot], needs_mask, step, kv_step, plan, finalize)


def _dkv_kernel(
    q_offset_ref, kv_valid_ref, block_lo_ref, block_hi_ref,
    q_ref, k_ref, v_ref, d_out_ref, lse_ref, delta_ref, *rest,
    problem: Problem, plan: BackwardPlan,
):
    minor = plan.sequence_minor
    mask_ref, (dk_ref, dv_ref, dk_acc_ref, dv_acc_ref), (k_rows_ref, v_rows_ref) = _split_refs(
        rest, problem, 4, ((k_ref, minor.k), (v_ref, minor.v)))
    kj, q_step, slot, qi, q_offset, kv_valid = _grid_step(q_offset_ref, kv_valid_ref, block_lo_ref, plan.num_kv_blocks)
    block_q, block_kv = plan.block_q, plan.block_kv
    (q_contract_d, q_contract_queries), (out_contract_d, out_contract_queries) = (_walked_dims(minor.q),
                                                                                  _walked_dims(minor.out))

    @pl.when(q_step == 0)
    def _init():
        dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)
        dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)
        for rows_ref, ref, transposed in ((k_rows_ref, k_ref, minor.k), (v_rows_ref, v_ref, minor.v)):
            if transposed:
                _transpose_heads(rows_ref, ref)

    key_start, _, needs_mask = _tile_mask(problem, plan, q_offset, kv_valid, qi, kj)
    if needs_mask is not True:
        # Also a ragged last query block: its rows past the query length mix into dk and dv.
        needs_mask = needs_mask | ((qi + 1) * block_q > problem.q_len)

    def step(apply_mask: bool):
        visible = bias = q_valid = d_out_valid = None
        if apply_mask:
            # Tiles are [block_kv, block_q]: keys along sublanes, queries along lanes.
            key_pos = key_start + jax.lax.broadcasted_iota(jnp.int32, (block_kv, block_q), 0)
            query_index = qi * block_q + jax.lax.broadcasted_iota(jnp.int32, (block_kv, block_q), 1)
            visible = masking.positional_visibility(problem, q_offset + query_index, key_pos, kv_valid)
            visible = visible & (query_index < problem.q_len)
            if mask_ref is not None:
                allowed, bias = masking.explicit_mask(problem, mask_ref[...].T)
                visible = visible & allowed
            q_valid = _sequence_valid(minor.q, problem.head_dim, block_q, qi * block_q, problem.q_len)
            d_out_valid = _sequence_valid(minor.out, problem.v_head_dim, block_q, qi * block_q, problem.q_len)

        def head(s):
            kv_head = _kv_head(s, problem.group)
            k, v = k_rows_ref[kv_head], v_rows_ref[kv_head]
            # P^T d_out and dS^T q mix queries: queries past the query length must be zero.
            q, d_out = _zeroed_past(q_ref[s], q_valid), _zeroed_past(d_out_ref[s], d_out_valid)
            capped = masking.capped_logits(problem, _dot(k, q, q_contract_d, problem))
            logits = capped if bias is None else capped + bias
            p = jnp.exp(logits - _finite_lse(lse_ref[s]))
            if visible is not None:
                p = jnp.where(visible, p, 0.0)
            dv_acc_ref[kv_head] += _dot(p.astype(d_out.dtype), d_out, out_contract_queries, problem)
            ds = p * (_dot(v, d_out, out_contract_d, problem) - delta_ref[s])
            if problem.softcap is not None:
                ds = ds * masking.softcap_slope(problem, capped)
            if visible is not None:
                # Keys past the valid length may hold NaN (so do their dP rows and slopes): 0 * NaN is NaN.
                ds = jnp.where(visible, ds, 0.0)
            dk_acc_ref[kv_head] += _dot(ds.astype(q.dtype), q, q_contract_queries, problem)

        loop_over_heads(q_ref.shape[0], head)

    def finalize():
        _store_scaled(dk_ref, dk_acc_ref, problem.scale, minor.k)
        _store_scaled(dv_ref, dv_acc_ref, 1.0, minor.v)

    _walk_tile(qi <= block_hi_ref[slot], needs_mask, step, q_step, plan, finalize)


def _cost(problem: Problem, width: int, bytes_accessed: int) -> pl.CostEstimate:
    """`width`: the summed widths (head dims) of a kernel's matmuls, each over every visible pair."""
    pairs = problem.batch * problem.q_heads * masking.static_visible_pairs(problem)
    return pl.CostEstimate(
        flops=int(2 * pairs * width),
        transcendentals=int(pairs * (2 if problem.softcap is not None else 1)),
        bytes_accessed=int(bytes_accessed),
    )


def _compiler_params(plan: BackwardPlan):
    return pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=plan.vmem_limit_bytes,
    )


def _sequence_spec(heads: int, block: int, head_dim: int, block_index, sequence_minor: bool) -> pl.BlockSpec:
    """The BlockSpec of a [B, H, S, D] array (q, d_out, dq; or k, v, dk, dv) in blocks of `heads` heads: [block, D],
    or [D, block] of the swapped view where the plan reads it sequence-minor. block_index(b, outer, step, lo_ref,
    hi_ref) is the sequence block of a grid step."""

    def index_map(b, h, outer, step, q_offset_ref, kv_valid_ref, lo_ref, hi_ref):
        index = block_index(b, outer, step, lo_ref, hi_ref)
        return (b, h, 0, index) if sequence_minor else (b, h, index, 0)

    shape = (head_dim, block) if sequence_minor else (block, head_dim)
    return pl.BlockSpec((None, heads, *shape), index_map)


def _outputs(q, k, v, problem: Problem, plan: BackwardPlan, specs: dict, *, for_dq: bool):
    """(out_shape, out_specs, scratch_shapes) of the dq call (for_dq) or the dk/dv call, on q, k, v as the kernel
    reads them: float32 accumulators of each gradient, then the rows of each block held across the walk that is
    read sequence-minor (dq: q and d_out; dk/dv: k and v)."""
    heads, group, minor = plan.kv_heads_per_step, problem.group, plan.sequence_minor
    if for_dq:
        rows = heads * group, plan.block_q
        held = [(problem.head_dim, minor.q), (problem.v_head_dim, minor.out)]
        accumulators = [problem.head_dim]
        out_shape, out_specs = jax.ShapeDtypeStruct(q.shape, q.dtype), specs["q"]
    else:
        rows = heads, plan.block_kv
        held = [(problem.head_dim, minor.k), (problem.v_head_dim, minor.v)]
        accumulators = [problem.head_dim, problem.v_head_dim]
        out_shape = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
        out_specs = (specs["k"], specs["v"])
    scratch = [pltpu.VMEM((*rows, width), jnp.float32) for width in accumulators]
    scratch += [pltpu.VMEM((*rows, width), q.dtype) for width, transposed in held if transposed]
    return out_shape, out_specs, scratch


def _kernel_call(q, k, v, d_out, lse, delta, prepared: Prepared, problem: Problem, plan: BackwardPlan, *,
                 for_dq: bool):
    """The dq call (for_dq) or the dk/dv call.

    Both read (q, k, v, d_out, lse, delta[, mask]) in the same blocks, with the query offsets, valid key lengths
    and the per-block ranges of the walked axis prefetched. They differ in the grid's third axis (the "outer"
    block: a query block for dq, a KV block for dk/dv) and in the axis the last grid axis walks (KV blocks for
    dq, query blocks for dk/dv).
    """
    batch = q.shape[0]
    block_q, block_kv, nq, nkv = plan.block_q, plan.block_kv, plan.num_q_blocks, plan.num_kv_blocks
    block_ranges = masking.kv_block_ranges if for_dq else masking.q_block_ranges
    block_lo, block_hi = block_ranges(problem, prepared, block_q, block_kv)

    # The walked block comes from the prefetched ranges; the outer block is the grid index itself.
    def q_block(b, outer, step, lo_ref, hi_ref):
        return outer if for_dq else masking.block_of_step(lo_ref, hi_ref, b * nkv + outer, step)

    def kv_block(b, outer, step, lo_ref, hi_ref):
        return masking.block_of_step(lo_ref, hi_ref, b * nq + outer, step) if for_dq else outer

    def row_index_map(b, h, outer, step, q_offset_ref, kv_valid_ref, lo_ref, hi_ref):
        return (b, h, 0, q_block(b, outer, step, lo_ref, hi_ref))

    heads, minor = plan.kv_heads_per_step, plan.sequence_minor
    query_heads = heads * problem.group
    specs = dict(q=_sequence_spec(query_heads, block_q, problem.head_dim, q_block, minor.q),
                 k=_sequence_spec(heads, block_kv, problem.head_dim, kv_block, minor.k),
                 v=_sequence_spec(heads, block_kv, problem.v_head_dim, kv_block, minor.v),
                 d_out=_sequence_spec(query_heads, block_q, problem.v_head_dim, q_block, minor.out))
    row_spec = pl.BlockSpec((None, query_heads, 1, block_q), row_index_map)
    # The swapped views [B, H, D, S] of the arrays read sequence-minor: bitcasts of XLA's layout; their gradients
    # are written so.
    q, k, v, d_out = (jnp.swapaxes(x, 2, 3) if transposed else x
                      for x, transposed in ((q, minor.q), (k, minor.k), (v, minor.v), (d_out, minor.out)))
    in_specs = [specs["q"], specs["k"], specs["v"], specs["d_out"], row_spec, row_spec]
    operands = [q, k, v, d_out, lse, delta]
    if prepared.mask is not None:
        broadcast_batch = problem.mask_batch == 1

        def mask_index_map(b, h, outer, step, q_offset_ref, kv_valid_ref, lo_ref, hi_ref):
            blocks = (q_block(b, outer, step, lo_ref, hi_ref), kv_block(b, outer, step, lo_ref, hi_ref))
            return (0 if broadcast_batch else b, 0, *blocks)

        in_specs.append(pl.BlockSpec((None, None, block_q, block_kv), mask_index_map))
        operands.append(prepared.mask)
    itemsize = jnp.dtype(q.dtype).itemsize
    passes = masking.static_kv_passes(problem, block_q, block_kv)  # symmetric: q/d_out passes per KV block
    head_dim, v_head_dim = problem.head_dim, problem.v_head_dim
    if for_dq:  # reads q, d_out and K/V per pass, writes dq
        bytes_accessed = ((2 * q.size + d_out.size) * itemsize + (k.size + v.size) * itemsize * passes
                          + 2 * lse.size * 4)
        kernel, name, width, outer_blocks = _dq_kernel, "attention_tpu_flash_dq", 2 * head_dim + v_head_dim, nq
    else:  # reads k, v and q, d_out per pass, writes dk, dv
        bytes_accessed = ((q.size + d_out.size) * itemsize * passes + 2 * (k.size + v.size) * itemsize
                          + 2 * lse.size * 4 * passes)
        kernel, name, width, outer_blocks = _dkv_kernel, "attention_tpu_flash_dkv", 2 * (head_dim + v_head_dim), nkv
    out_shape, out_specs, scratch_shapes = _outputs(q, k, v, problem, plan, specs, for_dq=for_dq)
    results = pl.pallas_call(
        functools.partial(kernel, problem=problem, plan=plan),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(batch, problem.kv_heads // heads, outer_blocks, plan.num_steps),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch_shapes,
        ),
        compiler_params=_compiler_params(plan),
        cost_estimate=_cost(problem, width, bytes_accessed),
        name=name,
    )(prepared.q_offset, prepared.kv_valid, block_lo, block_hi, *operands)
    if for_dq:
        return jnp.swapaxes(results, 2, 3) if minor.q else results
    return tuple(jnp.swapaxes(x, 2, 3) if transposed else x for x, transposed in zip(results, (minor.k, minor.v)))


def flash_attention_backward(
    d_out: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    *,
    config: BackwardConfig | None = None,
    generation: str | TpuGeneration | None = None,
    **options,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """(dq, dk, dv, d_sinks or None) of `flash.kernel.differentiable_flash_attention` given d_out = dL/d out;
    `options` those of `masking.Attention`; `generation` a name or its facts (default this device's), resolved once
    here."""
    return attention_backward(d_out, q, k, v, out, lse, Attention(**options), resolve_target(generation), config)


def attention_backward(
    d_out: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array, attention: Attention,
    target: TpuGeneration, config: BackwardConfig | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """`flash_attention_backward` of an `Attention` value on `target` (a generation's facts, resolved once).

    `out` and `lse` are what `flash.kernel.attention_forward` returned for the
    same inputs. Keys past kv_lengths get zero gradients; so do the rows of
    queries that see nothing. Without a batch, a query head, a query or a key
    every gradient is zero and no kernel runs.
    """
    sinks = attention.sinks
    if 0 in (q.shape[0], q.shape[1], q.shape[2], k.shape[2]):
        d_sinks = None if sinks is None else jnp.zeros(sinks.shape, sinks.dtype)
        return jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape, v.dtype), d_sinks
    problem, prepared = masking.prepare(q, k, attention, v_head_dim=v.shape[3])
    return call(d_out, q, k, v, out, lse, prepared, make(problem, target, config), sinks)


def call(d_out: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array,
         prepared: Prepared, plan: BackwardPlans,
         sinks: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """The dq and dk/dv kernels as `plan` says (inputs of the plan's non-empty problem, assumed valid, `prepared`
    as `prepare` made it): (dq, dk, dv, d_sinks in the dtype of the call's `sinks`, or None without)."""
    problem = plan.problem
    batch, q_heads, q_len, _ = q.shape
    delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1)  # [B, Hq, Sq]
    # [B, Hq, Sq] -> [B, Hq, 1, Sq]: a row of query positions per query head.
    rows = (batch, q_heads, 1, q_len)
    lse_rows, delta_rows = lse.reshape(rows), delta.reshape(rows)
    d_out = d_out.astype(q.dtype)
    dq = _kernel_call(q, k, v, d_out, lse_rows, delta_rows, prepared, problem, plan.dq, for_dq=True)
    dk, dv = _kernel_call(q, k, v, d_out, lse_rows, delta_rows, prepared, problem, plan.dkv, for_dq=False)
    d_sinks = None
    if sinks is not None:
        # d out / d sink = -p_sink * out, so dL/d sink = -sum over rows of p_sink * delta.
        p_sink = jnp.exp(prepared.sinks[None, :, None] - lse)
        d_sinks = -jnp.sum(p_sink * delta, axis=(0, 2)).astype(sinks.dtype)
    return dq, dk, dv, d_sinks
