"""The problem value of latent attention (`latent/`): multi-head latent attention (MLA) in its absorbed form, over the
compressed cache that transformers keeps for its MLA models (DeepSeek-V2/V3, Kimi, GLM-4.7-Flash, Mistral 4, ...).

Per batch b and query head h, with L = kv_lora_rank and R = qk_rope_head_dim (R may be 0):

* q_latent [B, H, Sq, L]: the query's no-rope part folded through W_UK into the latent space; q_rope [B, H, Sq, R].
* latent [B, 1, S, L] (transformers' `kv_nope`) and rope [B, 1, S, R] (`k_rot`): one KV head shared by every
  query head.
* logits[h, i, j] = scale * (q_latent[h, i] . latent[j] + q_rope[h, i] . rope[j]); the output
  [B, H, Sq, L] = softmax_j(logits) @ latent: the values are the latent itself (the caller applies W_UV).

Which (query, key) pairs are visible, the logits' scale and soft-cap, and the sinks (one logit per query head in every
row's softmax, attending to nothing: HY-v4's) are `masking.Attention`'s: the attention's `Problem` has H query heads,
one KV head and head_dim L; its scale defaults to (L + R) ** -0.5 (an MLA model passes its own, (nope + rope) ** -0.5
times its mscale).
"""

from __future__ import annotations

import dataclasses

import jax

from . import masking
from .masking import Attention, Prepared, Problem


@dataclasses.dataclass(frozen=True)
class LatentProblem:
    """The static description of one latent attention call (shapes and options; no tile sizes)."""

    attention: Problem  # H query heads, one KV head, head_dim L, the scale resolved
    rope_dim: int  # R; 0: no rope keys (q_rope and rope absent)

    @property
    def heads(self) -> int:
        return self.attention.q_heads

    @property
    def latent_dim(self) -> int:
        return self.attention.head_dim

    @property
    def key_dim(self) -> int:
        """The width of a key: the latent's and the rope's."""
        return self.latent_dim + self.rope_dim

    @classmethod
    def of_shape(cls, *, heads: int, q_len: int, kv_len: int, latent_dim: int, rope_dim: int, dtype, mask_dtype=None,
                 causal: bool = True, batch: int = 1, has_sinks: bool = False) -> LatentProblem:
        """The problem of a call of this shape as `latent_problem` makes it (default scale, the queries last in the
        cache), with a mask of `mask_dtype` (a float one adds, any other selects) if given, and sinks if
        `has_sinks`."""
        attention = Problem.of_shape(q_heads=heads, kv_heads=1, q_len=q_len, kv_len=kv_len, head_dim=latent_dim,
                                     dtype=dtype, mask_dtype=mask_dtype, causal=causal, batch=batch)
        return cls(dataclasses.replace(attention, scale=default_scale(latent_dim, rope_dim), has_sinks=has_sinks),
                   rope_dim)


def default_scale(latent_dim: int, rope_dim: int) -> float:
    return float((latent_dim + rope_dim) ** -0.5)


def latent_problem(q_latent: jax.Array, q_rope: jax.Array | None, latent: jax.Array,
                   attention: Attention) -> tuple[LatentProblem, Prepared]:
    """The LatentProblem and the prepared arrays (`masking.prepare`) of one call (inputs assumed valid)."""
    rope_dim = 0 if q_rope is None else q_rope.shape[-1]
    if attention.scale is None:
        attention = dataclasses.replace(attention, scale=default_scale(q_latent.shape[-1], rope_dim))
    problem, prepared = masking.prepare(q_latent, latent, attention)
    return LatentProblem(problem, rope_dim), prepared

