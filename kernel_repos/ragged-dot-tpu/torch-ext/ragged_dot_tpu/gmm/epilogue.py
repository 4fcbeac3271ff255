"""How the grouped matmul's f32 accumulators leave as its output block, once per row tile: the plan's epilogue.

As they are (in the output dtype); packed as int32 words (`MatmulProblem.packed_out`,
`common.packed_rows.pack_rows`); or gated (`MatmulProblem.gate`): gate-then-up
columns, or GPT-OSS's interleaved pairs de-interleaved on the MXU
(`common.gates.deinterleaved_gated`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..common.gates import DEINTERLEAVED_COLUMNS, deinterleaved_gated, gated
from ..common.packed_rows import pack_first_half, pack_second_half
from .plan import MatmulPlan

# Rows the epilogue packs at a time (`MatmulProblem.packed_out`).
PACKED_ROWS = 128


def _store_packed_rows(out_ref, acc_ref, start, rows: int, split: int):
    """Rows [start, start + rows) of the f32 accumulator as packed words (`packed_rows`): column j with column
    split + j, the words past the tile's columns holding column j alone. Two stores, not a padded value: both
    start on whole 128 lanes."""
    acc = acc_ref[pl.ds(start, rows), :]
    paired = acc.shape[1] - split
    first = pack_first_half(acc[:, :split])
    out_ref[pl.ds(start, rows), :paired] = first[:, :paired] | pack_second_half(acc[:, split:])
    if paired < split:
        out_ref[pl.ds(start, rows), paired:] = first[:, paired:]


def _store_interleaved_gated(out_ref, acc_ref, gate, valid_columns, *, exact: bool) -> None:
    """The gated output of an accumulator of interleaved pairs (`[rows, 2 x out columns]` f32).

    Each chunk of 256 columns (128 pairs; the last may be narrower) is
    de-interleaved on the MXU and gated (`common.gates.deinterleaved_gated`) and
    stored as 128 output lanes; `exact` as there: f32 problems at HIGHEST
    precision, bf16 ones in one bf16 pass, which rounds gate and up to bf16
    as the gate in XLA reads the kernel's bf16 output. The MXU work is 256 / K
    of the projection's. Columns from `valid_columns` on (a partial last N
    tile's garbage, possibly NaN, which a matmul would spread to every lane)
    are zeroed first.
    """
    columns = acc_ref.shape[1]
    for start in range(0, columns, DEINTERLEAVED_COLUMNS):
        width = min(DEINTERLEAVED_COLUMNS, columns - start)
        chunk = acc_ref[:, start : start + width]
        if valid_columns is not None:
            column = start + lax.broadcasted_iota(jnp.int32, (1, width), 1)
            chunk = jnp.where(column < valid_columns, chunk, 0.0)
        activated = deinterleaved_gated(chunk, gate.activation, alpha=gate.alpha, limit=gate.limit, exact=exact)
        out_ref[:, start // 2 : (start + width) // 2] = activated.astype(out_ref.dtype)


def _store_packed(out, acc: tuple, plan: MatmulPlan) -> None:
    """A slice of rows at a time: packing the whole tile at once holds several f32 copies of it in VMEM."""
    tile_m = plan.tile_m
    rows = PACKED_ROWS if tile_m % PACKED_ROWS == 0 else tile_m

    def pack(chunk, carry):
        start = pl.multiple_of(chunk * rows, rows)
        _store_packed_rows(out, acc[0], start, rows, plan.out_split)
        return carry

    lax.fori_loop(0, tile_m // rows, pack, 0)


def _store_plain(out, acc: tuple, plan: MatmulPlan) -> None:
    out[...] = acc[0][...].astype(out.dtype)


def _store_interleaved(out, acc: tuple, plan: MatmulPlan) -> None:
    problem = plan.problem
    partial = problem.n % plan.tile_n
    # Columns of this N tile's block that hold pairs; past them a partial last block holds garbage.
    valid = 2 * (problem.n - pl.program_id(0) * plan.tile_n) if partial else None
    _store_interleaved_gated(out, acc[0], problem.gate, valid, exact=problem.dtype == "float32")


def _store_gated(out, acc: tuple, plan: MatmulPlan) -> None:
    gate = plan.problem.gate
    if len(acc) == 2:
        gate_part, up = acc[0][...], acc[1][...]
    else:
        gate_part, up = acc[0][:, : plan.tile_n], acc[0][:, plan.tile_n :]
    # Rows of the tile outside every group hold zeros: gated to zeros.
    out[...] = gated(gate_part, up, gate.activation, alpha=gate.alpha, limit=gate.limit).astype(out.dtype)


def epilogue(plan: MatmulPlan):
    """How the accumulators leave as the output block: packed, as they are, or gated (interleaved pairs or
    gate-then-up columns)."""
    gate = plan.problem.gate
    if gate is None:
        return _store_packed if plan.problem.packed_out else _store_plain
    return _store_interleaved if gate.interleaved else _store_gated
