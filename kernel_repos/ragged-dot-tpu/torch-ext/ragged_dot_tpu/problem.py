"""What a call computes, as values: the static description a plan is made from, and the experts layer's arrays.

- `ExpertWeights`: the six arrays of a gated experts layer (projections,
  optional biases, optional scales of one-byte weights), passed as one value.
- `Gate`: the gated activation between the two projections.
- `ExpertsProblem`: the static description of one experts call (shapes,
  dtypes, gate, weight orientation, quantization, biases); hashable, so it
  can be a static argument of jit and custom_vjp.
- `MatmulProblem` / `TgmmProblem`: one grouped matmul, one weights' gradient.
- `CombineProblem`: the per-token sum of an experts call's picks (the combine kernel).

`plan.plan_experts(problem, target)` turns a problem into the plan the
kernels run; the kernels take arrays and a plan.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .common.quant import INT4, int4_unpacked_shape, scheme_of, swapped_minor_dims
from .common.weights_layout import WeightsOrientation, weights_orientation


def weight_shape(weight: jax.Array, known_dim: int, known_axis: int) -> tuple[int, ...]:
    """The `[G, D1, D2]` shape of a weight as the layer uses it: packed int4 unpacked (`common/quant.py`), given
    that its dim `known_axis` is `known_dim` (valid inputs: `ops.py` checks them)."""
    if scheme_of(weight.dtype) != INT4:
        return tuple(weight.shape)
    return int4_unpacked_shape(tuple(weight.shape), known_dim, known_axis)


class Gate(NamedTuple):
    """The gated activation: `activation` (one of `common.gates.GATES`) of the gate half times the up half.

    The gate is the first half of the gate_up projection, or its even
    columns when `interleaved`; `alpha` and `limit` parametrise GPT-OSS's
    clamped SwiGLU.
    """

    activation: str
    interleaved: bool = False
    alpha: float = 1.0
    limit: float = float("inf")


class ExpertWeights(NamedTuple):
    """The arrays of a gated experts layer, in transformers' layouts.

    `gate_up_proj[E, 2I, H]` and `down_proj[E, H, I]` (or `[E, H, 2I]` /
    `[E, I, H]` when transposed); optional `gate_up_bias[E, 2I]` and
    `down_bias[E, H]`; int8 or float8_e4m3fn projections come with their
    float32 scales (`common/quant.py`).
    """

    gate_up_proj: jax.Array
    down_proj: jax.Array
    gate_up_bias: jax.Array | None = None
    down_bias: jax.Array | None = None
    gate_up_scales: jax.Array | None = None
    down_scales: jax.Array | None = None

    @property
    def quantized(self) -> bool:
        return self.gate_up_scales is not None or self.down_scales is not None

    def as_read(self, orientation, *, weights_transposed: bool) -> ExpertWeights:
        """The views of both projections (and their scales) that the kernels read: each in the order XLA stores
        it (`orientation`, a `common.weights_layout.WeightsOrientation`); a swapped view is a bitcast."""
        gate_up, gate_up_scales, down, down_scales = (self.gate_up_proj, self.gate_up_scales, self.down_proj,
                                                      self.down_scales)
        if orientation.gate_up_transposed != weights_transposed:
            gate_up, gate_up_scales = swapped_minor_dims(gate_up, gate_up_scales)
        if orientation.down_transposed != weights_transposed:
            down, down_scales = swapped_minor_dims(down, down_scales)
        return self._replace(gate_up_proj=gate_up, down_proj=down, gate_up_scales=gate_up_scales,
                             down_scales=down_scales)


class ExpertsProblem(NamedTuple):
    """One experts call: `hidden_states[T, H]` routed to `top_k` of `num_experts` experts of intermediate size I."""

    tokens: int
    top_k: int
    hidden: int
    intermediate: int
    num_experts: int
    dtype: str  # the activations'
    weights_dtype: str  # bfloat16 / float32, or int8 / float8_e4m3fn / uint8 (packed int4) (quantized)
    routing_dtype: str  # top_k_weights'
    weights_transposed: bool
    has_bias: bool
    gate: Gate

    @classmethod
    def of(cls, hidden_states, top_k_index, top_k_weights, weights: ExpertWeights, gate: Gate, *,
           weights_transposed: bool) -> ExpertsProblem:
        down = weight_shape(weights.down_proj, hidden_states.shape[1], 2 if weights_transposed else 1)
        return cls(
            tokens=hidden_states.shape[0], top_k=top_k_index.shape[1], hidden=hidden_states.shape[1],
            intermediate=down[1] if weights_transposed else down[2], num_experts=weights.gate_up_proj.shape[0],
            dtype=jnp.dtype(hidden_states.dtype).name, weights_dtype=jnp.dtype(weights.gate_up_proj.dtype).name,
            routing_dtype=jnp.dtype(top_k_weights.dtype).name, weights_transposed=bool(weights_transposed),
            has_bias=weights.gate_up_bias is not None, gate=Gate(*gate),
        )

    @property
    def picks(self) -> int:
        return self.tokens * self.top_k

    @property
    def orientation(self) -> WeightsOrientation:
        """How the kernels read each projection's weights (`common.weights_layout.weights_orientation`)."""
        return weights_orientation(self.hidden, self.intermediate, weights_transposed=self.weights_transposed)

    @property
    def empty(self) -> bool:
        """Nothing to compute: no tokens, picks, hidden size or experts."""
        return 0 in (self.tokens, self.top_k, self.hidden, self.num_experts)


class MatmulProblem(NamedTuple):
    """`lhs[m, k] x rhs[groups, k, n]` (rhs `[groups, n, k]` with `transpose_rhs`) per row group.

    With `gate`, rhs holds 2n columns (the gate projection's, then the up
    projection's) and the result is the gated intermediate `[m, n]`
    (`gmm/kernel.py`'s module docstring). With `bias`, a `[groups, n]` bias
    row is added to each of its group's rows (in f32, before the cast).
    With `gathered`, lhs is not the m sorted rows but the token rows they
    are picks of: the kernel copies each row it multiplies from its token
    (`gmm/kernel.py`'s module docstring), so no `[m, k]` copy of the rows exists.
    With `packed_out` (bfloat16 only) the result leaves as int32 words, two
    bf16 columns each, about half as many as columns (`gmm.plan.packed_plan`), a
    form the combine kernel copies one row at a time.
    """

    m: int
    k: int
    n: int
    groups: int
    dtype: str  # lhs's and the output's
    rhs_dtype: str  # lhs's, or int8 / float8_e4m3fn / uint8 (packed int4; k and n unpacked)
    transpose_rhs: bool
    zero_rows_past_groups: bool = True
    gate: Gate | None = None
    bias: bool = False
    gathered: bool = False
    packed_out: bool = False

    @property
    def rhs_scheme(self) -> str | None:
        """The weights' quantization scheme (`common.quant.scheme_of`), None for weights of lhs's dtype."""
        return scheme_of(self.rhs_dtype)

    def in_rhs_order(self, k_extent: int, n_extent: int) -> tuple[int, int]:
        """A block's (K, N) extents in the order one group's weights hold them: (N, K) with `transpose_rhs`."""
        return (n_extent, k_extent) if self.transpose_rhs else (k_extent, n_extent)


class TgmmProblem(NamedTuple):
    """Per group `lhs_g^T @ rhs_g`: `lhs[m, k], rhs[m, n] -> [groups, k, n]` in `out_dtype`."""

    m: int
    k: int
    n: int
    groups: int
    dtype: str
    out_dtype: str


class CombineProblem(NamedTuple):
    """Each of `tokens` tokens' sum of its `top_k` picks' rows of `hidden` columns, weighted, in `dtype`.

    The rows arrive as the second projection writes them (`gmm.plan.packed_plan`): each N tile of `tile_n`
    columns in `split` int32 words, column j of the tile with column split + j.
    """

    tokens: int
    top_k: int
    hidden: int
    dtype: str  # the layer's output's
    tile_n: int
    split: int

    @property
    def words(self) -> int:
        """Words of one row: `split` per N tile."""
        return -(-self.hidden // self.tile_n) * self.split


def describe_experts(hidden_states, top_k_index, top_k_weights, *weights, activation: str, weights_transposed: bool,
                     interleaved: bool = False, alpha: float = 1.0,
                     limit: float = float("inf")) -> tuple[ExpertsProblem, ExpertWeights]:
    """An experts call's problem and arrays from the arguments of `layer.experts_layer`.

    `weights` are those of `ExpertWeights`, in its order (`gate_up_proj,
    down_proj`, then optionally the biases and the scales of one-byte
    weights), in transformers' layouts; the gate is `Gate(activation,
    interleaved, alpha, limit)`.
    """
    weights = ExpertWeights(*weights)
    gate = Gate(activation, bool(interleaved), float(alpha), float(limit))
    return ExpertsProblem.of(hidden_states, top_k_index, top_k_weights, weights, gate,
                             weights_transposed=weights_transposed), weights
