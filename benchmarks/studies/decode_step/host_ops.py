"""Eager torch ops per decode step: how many host dispatches each path makes, counted on the CPU.

The device model leaves the eager step's host time out. Its size is the number of torch ops a step
dispatches times each op's host cost. The count does not depend on the device or the sizes, only on the
model's code: this module builds each model's structure at tiny sizes from its transformers config class,
runs `generate` on the CPU with `batched_mm` experts (what `generate` runs on a TPU) and counts the torch
calls one more decode step makes from Python (a `torch.overrides.TorchFunctionMode`: each torch function or
tensor method call, the unit eager torch dispatches from the host), per decoder layer of each attention kind and for the rest of
the step, and which of them run inside what kernelize replaces (RMSNorm modules, the experts module, the
attention function): on the kernelized path those become one kernel call each. Expert-parallel wrappers
(masking, the all-reduce) add a few ops per layer that are not counted.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

ATTENTION_NAME = "decode_step_counted_sdpa"


# What kernelize replaces, each by one kernel call.
REPLACED = ("rmsnorm", "attention", "experts")


class _Counter(TorchFunctionMode):
    """Counts torch calls, and apart those made inside each replaced kind of module (the outermost one)."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.inside = dict.fromkeys(REPLACED, 0)
        self.stack: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if self.stack:
            self.inside[self.stack[0]] += 1
        return func(*args, **(kwargs or {}))


_ACTIVE: list[_Counter] = []


def _enter(kind: str) -> None:
    for counter in _ACTIVE:
        counter.stack.append(kind)


def _leave() -> None:
    for counter in _ACTIVE:
        counter.stack.pop()


@contextlib.contextmanager
def _inside(kind: str):
    _enter(kind)
    try:
        yield
    finally:
        _leave()


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def counted(*args, **kwargs):
        with _inside("attention"):
            return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register(ATTENTION_NAME, counted)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def _mark_replaced_modules(model: torch.nn.Module) -> None:
    """RMSNorm and experts modules count as replaced while they run (kernelize swaps their forward)."""
    for module in model.modules():
        name = type(module).__name__
        kind = "rmsnorm" if name.endswith("RMSNorm") else "experts" if name.endswith("Experts") else None
        if kind:
            module.register_forward_pre_hook(lambda *_, kind=kind: _enter(kind))
            module.register_forward_hook(lambda *_: _leave())


def tiny_model(key: str, layer_types: list[str]):
    """`key`'s model structure at tiny sizes, with the given attention layer kinds."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    layers = len(layer_types)
    if key == "qwen3-30b-a3b":
        config = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                num_experts_per_tok=2, num_hidden_layers=layers, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, vocab_size=128)
        return Qwen3MoeForCausalLM(config)
    config = Gemma4TextConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                              top_k_experts=2, enable_moe_block=True, num_hidden_layers=layers, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                              attention_k_eq_v=True, vocab_size=128, hidden_size_per_layer_input=0, sliding_window=4,
                              layer_types=layer_types, final_logit_softcapping=30.0)
    return Gemma4ForCausalLM(config)


def _generate_ops(key: str, layer_types: list[str], new_tokens: int) -> dict[str, int]:
    torch.manual_seed(0)
    model = tiny_model(key, layer_types).eval()
    model.set_experts_implementation("batched_mm")
    model.set_attn_implementation(ATTENTION_NAME)
    _mark_replaced_modules(model)
    prompt = torch.randint(0, 128, (2, 6))
    counter = _Counter()
    _ACTIVE.append(counter)
    try:
        with torch.no_grad(), counter:
            model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    finally:
        _ACTIVE.remove(counter)
    return {"ops": counter.ops, **counter.inside}


def _minus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a[k] - b[k] for k in a}


def step_ops(key: str, layer_types: list[str]) -> dict[str, int]:
    """The torch calls one more decode step of `generate` makes (`ops`), and of them those inside each REPLACED kind."""
    return _minus(_generate_ops(key, layer_types, 4), _generate_ops(key, layer_types, 3))


def count(key: str, kinds: dict[str, int]) -> dict:
    """Ops per decode step for the real layer counts `kinds` ({transformers layer type: layers}): per layer of
    each kind (one more such layer's ops) and the step's own (embedding, final norm, lm_head, generate's loop);
    each split into the ops inside what kernelize replaces. A Gemma 4 model's last layer must be a
    full-attention one, so every probe ends with one."""
    _register_attention()
    base = step_ops(key, ["full_attention"])
    per_layer = {kind: _minus(step_ops(key, [kind, "full_attention"]), base) for kind in kinds}
    fixed = _minus(base, per_layer["full_attention"])
    per_step = {k: fixed[k] + sum(per_layer[kind][k] * n for kind, n in kinds.items()) for k in fixed}
    return {"per_layer": per_layer, "per_step_fixed": fixed, "per_step": per_step}
