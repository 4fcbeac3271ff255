"""The grouped matmul's plan: a `MatmulProblem` goes in, the `MatmulPlan` its kernel runs comes out.

`make` resolves the tiles (`tiles.py`) for the problem's shape;
`gated_plan`, `gathered_plan` and `packed_plan` turn a plan into the
experts layer's variants of the kernel (the gate in the epilogue, rows
copied from their tokens, the output as packed words), or say it cannot.
"""

from __future__ import annotations

from typing import NamedTuple

from .._hardware import LANES, TpuGeneration, max_vmem_limit_bytes, round_up
from ..common.quant import check_served
from ..common.vmem import Buffer, check_vmem_fits
from ..problem import Gate, MatmulProblem
from ..common.routing import expected_active_groups
from .tiles import (
    TileConfig, check_config, matmul_buffers, matmul_feeds_fp8_mxu, row_chunks, row_tile_rows, select, vmem_bytes,
    vmem_limit,
)


class MatmulPlan(NamedTuple):
    """One grouped matmul as `gmm.kernel.call` runs it: blocks resolved for the problem's shape."""

    problem: MatmulProblem
    tile_m: int  # rows of a row tile (`row_tile_rows`)
    tile_k: int
    tile_n: int
    chunk_m: int | None  # rows per MXU pass; None: the whole row tile
    groups_per_step: int
    buffers: tuple[Buffer, ...]  # what the pipeline holds in VMEM (`matmul_buffers`)
    vmem_limit_bytes: int
    active_groups: float  # expected, for the cost estimate (`expected_active_groups`)
    fp8_matmul: bool  # fp8 weights multiplied on the fp8 MXU with fp8 activations (`gmm.tiles.matmul_feeds_fp8_mxu`)
    # Gathered bf16 rows (`gathered_plan`): the K column where the second half of each copied word starts.
    gather_split: int = 0
    # Packed output (`packed_plan`): words per N tile, each holding one of the tile's columns before this and
    # one from it.
    out_split: int = 0


def make(problem: MatmulProblem, target: TpuGeneration,
                    config: TileConfig | None = None) -> MatmulPlan:
    """The plan of one grouped matmul on `target`: `config`'s tiles (checked),
    else `select`'s."""
    check_served(problem.rhs_dtype, target)
    if config is None:
        config = select(problem, target)
    check_config(config, problem, target)
    fp8_matmul = matmul_feeds_fp8_mxu(config, problem, target)
    return MatmulPlan(
        problem=problem, tile_m=row_tile_rows(config, problem), tile_k=min(config.tile_k, problem.k),
        tile_n=min(config.tile_n, problem.n), chunk_m=config.chunk_m if row_chunks(config, problem) > 1 else None,
        groups_per_step=config.groups_per_step, buffers=matmul_buffers(config, problem, fp8_matmul=fp8_matmul),
        vmem_limit_bytes=vmem_limit(config, problem, target),
        active_groups=expected_active_groups(problem.m, problem.groups), fp8_matmul=fp8_matmul,
    )


def gated_plan(gate_up: MatmulPlan, gate: Gate, target: TpuGeneration) -> MatmulPlan | None:
    """The experts' first projection with the gate in its epilogue (`MatmulProblem.gate`) on `target`:
    `gate_up`'s tiles, its N tile counted in output columns (half as many), so the
    weights blocks and accumulators take the VMEM gate_up's did (its `buffers` and VMEM limit, which the
    halved output block only undercuts). With gate_up in one N tile the kernel reads all 2I columns as one
    block; with several, each tile's gate and up halves apart.

    GPT-OSS's interleaved columns (gate and up alternate) come as one block of the N tile's pairs
    (`interleaved_gated_plan`). None where the gate stays in XLA: with several N tiles, one-byte weights
    (their scales come per weights block); concatenated, also where the half tile does not divide the
    intermediate size, is not a whole number of 128 lanes (the output block's, which Mosaic needs), or the
    two halves would pad the MXU beyond the whole tile (Gemma 4's I = 704 on v5e's 128-wide MXU: 2 x 768
    columns for 1408). Biases are added to each part before the gate.
    """
    problem = gate_up.problem
    intermediate = problem.n // 2
    if gate.interleaved:
        return interleaved_gated_plan(gate_up, gate, target)
    if gate_up.tile_n % 2:
        return None
    half = gate_up.tile_n // 2
    gated = gate_up._replace(problem=problem._replace(n=intermediate, gate=gate), tile_n=half)
    if half == intermediate:
        return gated
    if problem.rhs_scheme is not None:
        return None
    mxu = target.mxu_size
    if intermediate % half or 2 * round_up(half, mxu) > round_up(gate_up.tile_n, mxu):
        return None
    # The output block's lanes (and the weights block's lanes or, read transposed, sublanes).
    return gated if half % LANES == 0 else None


def interleaved_gated_plan(gate_up: MatmulPlan, gate: Gate, target: TpuGeneration) -> MatmulPlan | None:
    """`gated_plan` for interleaved gate and up columns: each N tile reads its pairs as one block, which the
    kernel's epilogue de-interleaves (`gmm/kernel.py`). One N tile takes any I. With several, the output block's
    columns (the half tile) must be whole 128 lanes: of gate_up's half tile rounded down and up to the lanes,
    the one that computes the fewest columns (a partial last tile computes its whole width) and fits VMEM,
    planned anew (`make`). None for one-byte weights in several N tiles (their scales come per
    weights block) and where neither half fits."""
    problem = gate_up.problem
    intermediate = problem.n // 2
    if gate_up.tile_n >= problem.n:
        return gate_up._replace(problem=problem._replace(n=intermediate, gate=gate), tile_n=intermediate)
    if problem.rhs_scheme is not None:
        return None
    halves = sorted({max(gate_up.tile_n // 2 // LANES, 1) * LANES, round_up(gate_up.tile_n // 2, LANES)},
                    key=lambda half: (-(-intermediate // half) * half, -half))
    for half in halves:
        half = min(half, intermediate)
        config = TileConfig(gate_up.tile_m, gate_up.tile_k, 2 * half, gate_up.chunk_m, gate_up.groups_per_step)
        try:
            planned = make(problem, target, config)
        except ValueError:
            continue
        return planned._replace(problem=problem._replace(n=intermediate, gate=gate), tile_n=half)
    return None


def gathered_plan(plan: MatmulPlan, target: TpuGeneration) -> MatmulPlan | None:
    """`plan` with its rows copied in the kernel from their tokens (`MatmulProblem.gathered`) on `target`:
    the same tiles, the copies landing in two buffers of lhs's window, as the
    pipeline's would, or in one for a single row tile.

    A bf16 row is copied as 32-bit words, each holding one element of the row's first K columns and one of the
    rest (`common.packed_rows.pack_rows`), and the kernel multiplies each part by its rows of the weights block.
    Where the second part starts (`gather_split`) is half of K if that falls on the weights block's tiling (16
    sublanes, or 128 lanes read transposed) and the two parts take no more MXU passes than K whole, else the
    first multiple of the MXU width past half (GPT-OSS's K = 2880 on v5e's 128-wide MXU: 1536 + 1344 columns
    in 12 + 11 passes, not 2 x 1440 in 2 x 12), whose words are wider than half a row (the VMEM limit grows
    by the difference).

    None where lhs stays an array of sorted rows: one-byte weights and fp8 on the MXU (their K blocks), rows
    in several K tiles (a row is copied whole), and bf16 rows with no split of either kind.
    """
    problem = plan.problem
    if problem.rhs_dtype != problem.dtype or problem.dtype not in ("bfloat16", "float32"):
        return None
    if plan.tile_k < problem.k:
        return None
    gathered = plan._replace(problem=problem._replace(gathered=True))
    if problem.dtype == "float32":
        return gathered
    split = _gather_split(problem.k, problem.transpose_rhs, target.mxu_size)
    if split is None:
        return None
    window_rows = plan.tile_m + (plan.chunk_m or 0)
    copies = 1 if plan.tile_m >= problem.m else 2
    wider_words = copies * window_rows * 4 * (split - problem.k // 2)
    return gathered._replace(gather_split=split, vmem_limit_bytes=min(plan.vmem_limit_bytes + wider_words,
                                                                      max_vmem_limit_bytes(target.name)))


def _gather_split(k: int, transpose_rhs: bool, mxu: int) -> int | None:
    """`gathered_plan`'s split of a bf16 row of K columns: half, the MXU-aligned one, or None."""
    def passes(columns):
        return -(-columns // mxu)

    half = k // 2 if k % 2 == 0 and (k // 2) % (LANES if transpose_rhs else 16) == 0 else None
    aligned = round_up(-(-k // 2), mxu)
    aligned = aligned if aligned < k else None
    if half is not None and (aligned is None or 2 * passes(half) <= passes(k)):
        return half
    return aligned


def packed_plan(plan: MatmulPlan, target: TpuGeneration) -> MatmulPlan | None:
    """`plan` with its output as packed words (`MatmulProblem.packed_out`) on `target`, for the combine kernel to
    copy by row: each N tile's columns in words of one column before
    `out_split` (half the tile, rounded up to whole 128 lanes: the words' block and the combine kernel's
    parts of each tile) and one from it; the rows' words are `out_split` per N tile, a partial last tile's
    included. The VMEM limit grows by what the words' blocks take past the bf16 ones.

    One N tile off the lanes (GPT-OSS's 2880) is planned anew as one tile of whole lanes: a partial tile, whose
    columns past N the weights' copy never reads and the combine kernel never sums (the same MXU passes).

    None unless the output is bf16 without a gate and the N tile is whole 128 lanes, at least 256.
    """
    problem = plan.problem
    if problem.dtype != "bfloat16" or problem.gate is not None:
        return None
    if plan.tile_n == problem.n and problem.n % LANES:
        widened = TileConfig(plan.tile_m, plan.tile_k, round_up(problem.n, LANES), plan.chunk_m, plan.groups_per_step)
        # Its blocks and VMEM as for N of the widened tile's columns.
        widened_problem = problem._replace(n=widened.tile_n)
        try:
            check_vmem_fits(widened, vmem_bytes(widened, widened_problem, fp8_matmul=plan.fp8_matmul), target)
        except ValueError:
            return None
        plan = plan._replace(tile_n=widened.tile_n,
                             buffers=matmul_buffers(widened, widened_problem, fp8_matmul=plan.fp8_matmul),
                             vmem_limit_bytes=vmem_limit(widened, widened_problem, target))
    if plan.tile_n % LANES or plan.tile_n < 2 * LANES:
        return None
    split = round_up(plan.tile_n // 2, LANES)
    wider_words = 2 * plan.tile_m * (4 * split - 2 * plan.tile_n)
    return plan._replace(problem=problem._replace(packed_out=True), out_split=split,
                         vmem_limit_bytes=min(plan.vmem_limit_bytes + wider_words,
                                              max_vmem_limit_bytes(target.name)))

