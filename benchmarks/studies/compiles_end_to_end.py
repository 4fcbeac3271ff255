"""The compiles study's end-to-end counts: every program a kernelized model's `generate` meets under TorchTPU's
strict eager, kernels, our ops around them and transformers' own, with transformers' dynamic cache and with the
fixed-shape recipe kernelize installs on a TPU (prompts padded to token buckets; a static cache at a key bucket, or
the dynamic cache a call asks for grown in key buckets).

Each distinct (op, shapes, dtypes, scalar arguments) is a program TorchTPU's default eager mode compiles once
(`op_signatures.OpSignatures`, over the whole `generate`: the model's forward and generate's bookkeeping). Counted
on a small model of each architecture's kinds of layer (Qwen3-30B-A3B: full attention with per-head q/k norms;
GPT-OSS-20B: sliding and full layers with sinks; Gemma 4 26B-A4B: sliding and global layers, MoE blocks): the
number of distinct programs depends on the shapes a request meets and the kinds of layer, not on the widths, and
layers of one kind share their programs. The kernels' CPU runs are replaced by their fakes (outputs of the right
shape): the counts, not the values, are the result.

Per model and cache: the first request (prompt `FIRST_PROMPT`) and then a seeded trace of `STEADY_REQUESTS` prompt
lengths up to `TRACE_MAX_PROMPT`, each with `NEW_TOKENS` new tokens: the first request's programs, the later
requests' new programs per request (a new token bucket is still new there), and in the model's forward the new
programs per decode step of the last request after its first, split by whose Python called the op (the recipe
pads prompts on CPU tensors: on a TPU host those are no TPU program).
"""

from __future__ import annotations

import random
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.studies.op_signatures import OpSignatures

FIRST_PROMPT = 100
STEADY_REQUESTS = 8
TRACE_MAX_PROMPT = 4096
NEW_TOKENS = 32
SEED = 0
# Each cache as (whether the fixed-shape recipe is on, the cache_implementation generate is asked for).
CACHES = {"dynamic": (False, "dynamic"), "dynamic in key buckets (the recipe's)": (True, "dynamic"),
          "static at a key bucket (the recipe)": (True, None)}


def tiny_models() -> dict:
    """A small transformers model per architecture, built from its config class with its kinds of layer."""
    import transformers

    common = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=8192)
    return {
        "Qwen3-30B-A3B": lambda: transformers.Qwen3MoeConfig(
            **common, num_hidden_layers=1, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            intermediate_size=64),
        "GPT-OSS-20B": lambda: transformers.GptOssConfig(
            **common, num_hidden_layers=2, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"], sliding_window=128),
        "Gemma 4 26B-A4B": lambda: transformers.Gemma4TextConfig(
            **common, num_hidden_layers=2, intermediate_size=64, enable_moe_block=True, num_experts=8,
            top_k_experts=2, moe_intermediate_size=32, global_head_dim=64, sliding_window=1024,
            layer_types=["sliding_attention", "full_attention"]),
    }


class _FakeKernels(TorchDispatchMode):
    """Our kernel ops run as their fakes (zeros of the output's shape): the op still runs as a program of its own
    for `OpSignatures` (entered inside this mode), at no interpret-mode cost."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not func.namespace.startswith("_") or "_tpu_" not in func.namespace:
            return func(*args, **kwargs)
        meta = func(*_to(args, "meta"), **dict(zip(kwargs, _to(tuple(kwargs.values()), "meta"))))
        return _zeros_like(meta)


def _to(values: tuple, device: str) -> tuple:
    return tuple(v.to(device) if isinstance(v, torch.Tensor) else _to(tuple(v), device) if isinstance(v, list)
                 else v for v in values)


def _zeros_like(meta):
    if isinstance(meta, torch.Tensor):
        return torch.zeros(meta.shape, dtype=meta.dtype)
    return type(meta)(_zeros_like(m) for m in meta)


ORIGINS = ("our kernels", "our other ops", "the recipe's prompt padding (host)", "transformers", "other")


def _origin(entry) -> str:
    if entry.origin != "ours":
        return entry.origin
    if entry.where.startswith("tpu_kernels.integration.fixed_shapes"):
        return ORIGINS[2]  # CPU tensors on a TPU host too: no TPU program
    return "our kernels" if "_tpu_" in entry.signature.op.split("::")[0] else "our other ops"


def _origins(new: list, per: int = 1) -> dict[str, float]:
    """New programs by whose op (ORIGINS), divided by `per`."""
    kinds = Counter(_origin(entry) for entry in new)
    return {kind: kinds.get(kind, 0) / max(per, 1) for kind in ORIGINS}


def count(model, recipe: bool, prompts: list[int], new_tokens: int, cache: str | None = None) -> dict:
    """The counts (module docstring) for `model` (kernelized) over `prompts`, the first being the first request,
    each `generate` asked for the `cache` implementation (None: the default, the recipe's static cache if on)."""
    from tpu_kernels.integration import fixed_shapes

    if recipe:
        fixed_shapes.install(model, None)
    recorded, steps, forward = OpSignatures(), [], model.forward

    def recording_forward(*args, **kwargs):
        start = recorded.mark()
        out = forward(*args, **kwargs)
        steps.append(recorded.since(start))
        return out

    model.forward = recording_forward
    per_request = []
    options = {} if cache is None else dict(cache_implementation=cache)
    inputs = [torch.randint(1, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(prompt))
              for prompt in prompts]
    masks = [torch.ones_like(ids) for ids in inputs]  # made outside the count, as a caller's tokenizer makes them
    with _FakeKernels(), recorded, torch.no_grad():
        for ids, mask in zip(inputs, masks):
            start, steps[:] = recorded.mark(), []
            model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, **options)
            per_request.append(recorded.since(start))
    later = [entry for request in per_request[1:] for entry in request]
    decode_steps = [entry for step in steps[2:] for entry in step]  # the last request's, after its first decode step
    return {"first_request": _origins(per_request[0]),
            "later_requests_per_request": _origins(later, len(per_request) - 1),
            "forward_per_decode_step_after_the_first": _origins(decode_steps, len(steps) - 2)}


def study(repos: dict, quick: bool = False) -> dict:
    """Per model and cache, `count` over the first request and the seeded trace; `repos`: kernelize's kinds ->
    build folders."""
    from transformers import AutoModelForCausalLM

    from tpu_kernels import kernelize

    requests = 2 if quick else STEADY_REQUESTS
    prompts = [FIRST_PROMPT, *random.Random(SEED).choices(range(1, TRACE_MAX_PROMPT + 1), k=requests)]
    new_tokens = 4 if quick else NEW_TOKENS
    models = dict(list(tiny_models().items())[:1]) if quick else tiny_models()
    results = {}
    for name, config in models.items():
        for cache, (recipe, implementation) in CACHES.items():
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config()).eval()
            model.generation_config.eos_token_id = None
            kernelize(model, repos=repos, fixed_shapes=False)
            results.setdefault(name, {})[cache] = count(model, recipe, prompts, new_tokens, implementation)
    return {"prompts": prompts, "new_tokens": new_tokens, "models": results}
