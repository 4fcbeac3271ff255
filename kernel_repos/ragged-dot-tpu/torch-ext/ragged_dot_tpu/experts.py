"""transformers ExpertsInterface entry point built on ragged_dot.

`experts_forward(self, hidden_states, top_k_index, top_k_weights)` is what
transformers calls on a module made by `use_experts_implementation`. Gated
experts whose gate we know (transformers' default gate with SiLU / GELU, and
GPT-OSS's clamped SwiGLU; concatenated or interleaved, with or without
biases, plain or transposed weights) run as one op, `ops.gated_experts`
(the fused decode kernel, or two grouped matmuls for larger calls: see
`layer.py`); every other layout (custom gates, no gate, post-expert norms)
composes torch ops around the ragged_dot op, so any valid model gets the
right answer.

Both paths see the token count padded to its bucket (`_buckets.token_bucket`):
the padded rows are zeros picking only the expert-parallel sentinel (weight 0,
never computed), and the result is sliced back to the real tokens. A model then
compiles the layer's kernels once per bucket, not once per prompt length.
"""

from __future__ import annotations

import torch

from . import ops
from ._buckets import token_bucket

# Activation modules of torch and transformers mapped to the fused path's names.
_FUSED_ACTIVATIONS = {
    "SiLU": "silu",
    "SiLUActivation": "silu",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "NewGELUActivation": "gelu_tanh",
    "GELUActivation": "gelu",
}


def _fused_activation(experts: torch.nn.Module) -> str | None:
    act = getattr(experts, "act_fn", None)
    if isinstance(act, torch.nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    return _FUSED_ACTIVATIONS.get(type(act).__name__)


def _uses_default_gate(experts: torch.nn.Module) -> bool:
    gate = getattr(type(experts), "_apply_gate", None)
    return getattr(gate, "__module__", None) == "transformers.integrations.moe" and gate.__name__ == "_default_apply_gate"


def _uses_gpt_oss_gate(experts: torch.nn.Module) -> bool:
    gate = getattr(type(experts), "_apply_gate", None)
    return getattr(gate, "__qualname__", None) == "GptOssExperts._apply_gate" and hasattr(experts, "limit")


def fused_gate(experts: torch.nn.Module) -> dict | None:
    """Arguments of the fused op's gate if it computes this module exactly, else None."""
    if not getattr(experts, "has_gate", True) or getattr(experts, "has_post_expert_norm", False):
        return None
    if experts.gate_up_proj.dtype != experts.down_proj.dtype:
        return None
    interleaved = not getattr(experts, "is_concatenated", True)
    if _uses_gpt_oss_gate(experts):
        return dict(activation="clamped_swiglu", interleaved=interleaved, alpha=float(experts.alpha),
                    limit=float(experts.limit))
    activation = _fused_activation(experts) if _uses_default_gate(experts) and not interleaved else None
    return None if activation is None else dict(activation=activation, interleaved=False)


def composed_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Any experts layout: torch ops for gating, biases and routing around two ragged_dot calls.

    The routing is checked once here; the ragged_dot calls count their group
    sizes from it and check only shapes (`ops.routed_ragged_dot`).
    """
    ops.check_routing(hidden_states, top_k_index, top_k_weights)
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[1]
    num_experts = self.num_experts
    transpose_rhs = not self.is_transposed

    # int64: torch scatters with int32 or int64 indices only.
    expert_ids = top_k_index.reshape(-1).to(torch.int64)
    sorted_ids, order = torch.sort(expert_ids, stable=True)
    # Sentinels land in the extra last bin; a scatter keeps the shape static for torch.compile.
    picks = torch.ones_like(expert_ids, dtype=torch.int32)
    group_sizes = torch.zeros(num_experts + 1, dtype=torch.int32, device=expert_ids.device)
    group_sizes = group_sizes.scatter_add(0, expert_ids, picks)[:num_experts]
    is_sentinel = (sorted_ids >= num_experts).unsqueeze(-1)
    bias_rows = sorted_ids.clamp(max=num_experts - 1)

    up_weight = self.gate_up_proj if self.has_gate else self.up_proj
    rows = hidden_states[order // top_k].to(up_weight.dtype)
    # Sentinel rows past the groups were never written: zero them before the gate, whose backward
    # would otherwise multiply their zero gradient by whatever they held (NaN included).
    proj = ops.routed_ragged_dot(rows, up_weight, group_sizes, transpose_rhs).masked_fill(is_sentinel, 0.0)
    if self.has_bias:
        up_bias = self.gate_up_proj_bias if self.has_gate else self.up_proj_bias
        proj = proj + up_bias[bias_rows]
    proj = self._apply_gate(proj) if self.has_gate else self.act_fn(proj)
    out = ops.routed_ragged_dot(proj.to(self.down_proj.dtype), self.down_proj, group_sizes, transpose_rhs)
    if self.has_bias:
        out = out + self.down_proj_bias[bias_rows]
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    # Sentinel rows sit past the groups: the down kernel never wrote them. Drop them.
    out = out.masked_fill(is_sentinel, 0.0)

    weighted = out.float() * top_k_weights.reshape(-1)[order].float().unsqueeze(-1)
    unsorted = torch.empty_like(weighted)
    unsorted[order] = weighted
    return unsorted.view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


def _padded_to_bucket(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three inputs with zero tokens appended up to the token bucket, each picking only the sentinel expert."""
    tokens = hidden_states.shape[0]
    extra = token_bucket(int(tokens)) - tokens if tokens else 0  # no tokens: no kernel runs, nothing to pad
    if extra == 0:
        return hidden_states, top_k_index, top_k_weights
    rows = (0, 0, 0, extra)
    return (torch.nn.functional.pad(hidden_states, rows), torch.nn.functional.pad(top_k_index, rows, value=num_experts),
            torch.nn.functional.pad(top_k_weights, rows))


def experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers ExpertsInterface signature: `[T,H], [T,K], [T,K] -> [T,H]`.

    Picks with id == num_experts are expert-parallel sentinels: never computed,
    contributing zero. Inputs are checked once per call, by the op that runs
    the layer (`ops.gated_experts`, or `ops.check_routing` on the composed path);
    the routing's shapes also before T is padded to its bucket (module docstring).
    """
    ops.check_routing(hidden_states, top_k_index, top_k_weights)  # before padding: errors name the caller's T
    tokens = hidden_states.shape[0]
    padded = _padded_to_bucket(hidden_states, top_k_index, top_k_weights, self.num_experts)
    return _bucketed_experts_forward(self, *padded)[:tokens]


def _bucketed_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    gate = fused_gate(self)
    if gate is None:
        return composed_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    biases = (self.gate_up_proj_bias, self.down_proj_bias) if getattr(self, "has_bias", False) else (None, None)
    # Quantized weights (int8 / fp8, with transformers' `*_scale_inv` names for their scales) compute in the
    # activations' dtype; float weights in their own.
    quantized = self.gate_up_proj.dtype in ops.QUANTIZED_DTYPES
    return ops.gated_experts(
        hidden_states if quantized else hidden_states.to(self.gate_up_proj.dtype),
        top_k_index,
        top_k_weights,
        self.gate_up_proj,
        self.down_proj,
        *biases,
        weights_transposed=self.is_transposed,
        gate_up_scales=getattr(self, "gate_up_proj_scale_inv", None) if quantized else None,
        down_scales=getattr(self, "down_proj_scale_inv", None) if quantized else None,
        **gate,
    ).to(hidden_states.dtype)


# What kernelize reads to decide where this entry point may serve.
experts_forward.has_backward = True
experts_forward.can_torch_compile = True
