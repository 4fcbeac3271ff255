"""The experts layer's plan: a call's problem (`problem.py`) goes in, the plan its kernels run comes out.

A plan is made once per call and handed to the kernels, which take arrays
and a plan and never come back for a decision. `plan_experts` decides the
experts layer whole: the kernel (fused or grouped, by the rule
`fused_path_config`), the weights' orientation (each projection read in the
order XLA already stores it: `common/weights_layout.py`), and the tiles,
buffers and VMEM limit of every kernel of its forward and backward
(`plan_ragged_dot_backward`: a grouped matmul's d_lhs and d_rhs).

Each kernel plans its own calls (`gmm/plan.py`, `tgmm/plan.py`,
`fused/plan.py`, `combine/plan.py`) from its tiles (its `tiles.py`: a tuned
table or a VMEM-aware heuristic), kept apart from the kernel code so that
tuning changes data, not kernels. `common/vmem.py` holds the VMEM budget and
the bounds on what a grid step multiplies; `_hardware.py` the TPU facts (VMEM,
bandwidth, MXU peak, tiling).
"""

from __future__ import annotations

from typing import NamedTuple

from ._hardware import TpuGeneration
from .combine import plan as combine_plan
from .combine.plan import CombinePlan
from .common.quant import check_served, scheme_of
from .common.weights_layout import WeightsOrientation
from .fused import plan as fused_plan, tiles as fused_tiles
from .fused.plan import FusedPlan
from .fused.tiles import FusedConfig
from .gmm import plan as gmm_plan, tiles as gmm_tiles
from .gmm.plan import MatmulPlan, gated_plan, gathered_plan, packed_plan
from .problem import CombineProblem, ExpertsProblem, MatmulProblem, TgmmProblem
from .tgmm import plan as tgmm_plan
from .tgmm.plan import TgmmPlan

# The fused experts kernel serves calls of at most this many tokens (decode
# batches). It gathers an expert's rows and scatters its results with one-hot
# matmuls against all T tokens: 2 x T x H multiply-adds per row on top of the
# expert's 3 x I x H, so at T = 512 and the I of today's MoE models (704 to
# 2880) at most 49 % more MXU work, which decode (rows per expert far below
# `gmm.tiles.ridge_rows`, weight streaming the bound) hides; the work grows with T, and
# prefill-sized calls take the two grouped matmuls. 512, not 256: under EP
# token dispatch a rank's call holds the picks sent to it, one per row, and at
# a decode batch of 256 the busiest rank gets more than 256 of them (Qwen3-30B-A3B
# on 8 ranks: 301 in `python -m benchmarks moe_layer`), which the grouped path served
# at 1.28x its roofline on v6e, the fused kernel at 1.06x.
FUSED_MAX_TOKENS = 512


def fused_path_config(problem: ExpertsProblem, target: TpuGeneration) -> FusedConfig | None:
    """The rule: the fused kernel's blocks for a decode-sized call (T <= FUSED_MAX_TOKENS) whose blocks fit the VMEM
    of `target`; None, the two grouped matmuls, otherwise (see FUSED_MAX_TOKENS for
    why)."""
    if problem.tokens > FUSED_MAX_TOKENS:
        return None
    return fused_tiles.select(problem, target)


class MatmulBackwardPlan(NamedTuple):
    """The gradients of one grouped matmul: d_lhs (a grouped matmul against the same weights read the other way)
    and d_rhs (tgmm; `swapped`: of `(d_out, lhs)`, for weights read transposed)."""

    d_lhs: MatmulPlan
    d_rhs: TgmmPlan
    swapped: bool


def plan_ragged_dot_backward(forward: MatmulProblem, target: TpuGeneration) -> MatmulBackwardPlan:
    """The backward of `forward`: d_lhs tiles of `gmm.tiles.select_d_lhs`, d_rhs of `tgmm.tiles.select`."""
    m, k, n, groups, dtype = forward.m, forward.k, forward.n, forward.groups, forward.dtype
    d_lhs = MatmulProblem(m, n, k, groups, dtype, dtype, transpose_rhs=not forward.transpose_rhs)
    d_lhs_config = gmm_tiles.select_d_lhs(d_lhs, target)
    d_rhs = TgmmProblem(m, n, k, groups, dtype, dtype) if forward.transpose_rhs else TgmmProblem(m, k, n, groups,
                                                                                                  dtype, dtype)
    return MatmulBackwardPlan(gmm_plan.make(d_lhs, target, d_lhs_config), tgmm_plan.make(d_rhs, target),
                              swapped=forward.transpose_rhs)


class ExpertsPlan(NamedTuple):
    """Everything the experts layer's kernels need, decided once per call.

    `fused` is the fused kernel's plan when it serves the forward, else None;
    `gate_up` and `down` plan the grouped path's two matmuls, which the
    forward under differentiation always takes (the backward needs
    gate_up's output and the sorted rows); `forward_gate_up` is the first
    projection the grouped forward without a gradient runs: gate_up with the
    gate in its epilogue (`gated_plan`) and its rows copied from their
    tokens in the kernel (`gathered_plan`), each where it can;
    `forward_down` and `combine` the second projection and the per-token
    sum it runs: the projection's rows as packed words and the combine
    kernel (`packed_plan`, `combine/`) where it can (else `down` and
    None: the sum runs in XLA); `gate_up_backward` and
    `down_backward` plan the backward (None for one-byte weights, which have
    none).
    """

    problem: ExpertsProblem
    orientation: WeightsOrientation
    fused: FusedPlan | None
    gate_up: MatmulPlan
    forward_gate_up: MatmulPlan
    down: MatmulPlan
    forward_down: MatmulPlan
    combine: CombinePlan | None
    gate_up_backward: MatmulBackwardPlan | None
    down_backward: MatmulBackwardPlan | None


def plan_experts(problem: ExpertsProblem, target: TpuGeneration, *, fused: bool | None = None) -> ExpertsPlan:
    """The plan of one experts call on `target`.

    `fused` forces a path; None takes the rule (`fused_path_config`).
    """
    check_served(problem.weights_dtype, target)
    orientation = problem.orientation
    if fused is None:
        config = fused_path_config(problem, target)
        fused_call = None if config is None else fused_plan.make(problem, target, config)
    else:
        fused_call = fused_plan.make(problem, target) if fused else None
    picks, hidden, intermediate = problem.picks, problem.hidden, problem.intermediate

    def matmul(k: int, n: int, read_transposed: bool) -> MatmulProblem:
        return MatmulProblem(picks, k, n, problem.num_experts, problem.dtype, problem.weights_dtype,
                             transpose_rhs=not read_transposed, zero_rows_past_groups=False, bias=problem.has_bias)

    gate_up = matmul(hidden, 2 * intermediate, orientation.gate_up_transposed)
    down = matmul(intermediate, hidden, orientation.down_transposed)
    trains = scheme_of(problem.weights_dtype) is None
    gate_up_plan = gmm_plan.make(gate_up, target)
    forward_gate_up = gated_plan(gate_up_plan, problem.gate, target) or gate_up_plan
    down_plan = gmm_plan.make(down, target)
    packed_down = packed_plan(down_plan, target)
    return ExpertsPlan(
        problem=problem, orientation=orientation, fused=fused_call,
        gate_up=gate_up_plan, forward_gate_up=gathered_plan(forward_gate_up, target) or forward_gate_up,
        down=down_plan, forward_down=packed_down or down_plan,
        combine=packed_down and combine_plan.make(CombineProblem(problem.tokens, problem.top_k, hidden, problem.dtype,
                                                            packed_down.tile_n, packed_down.out_split), target),
        gate_up_backward=plan_ragged_dot_backward(gate_up, target) if trains else None,
        down_backward=plan_ragged_dot_backward(down, target) if trains else None,
    )

