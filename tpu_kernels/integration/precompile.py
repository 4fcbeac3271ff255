"""precompile(model): compile every bucket of a kernelized model once, before the first request needs it.

The kernels pad token counts and key lengths to buckets (`runtime/buckets.py`), so a model compiles a
bounded set of shapes; `precompile` visits all of them at batch 1 by running the model: one `generate` of
two tokens per prompt length in `warm_up_prompts` (its prefill, then one decode step). On a TPU host this
is the compile a user would otherwise wait for at the first prompt of each new bucket, and with
`keep_compiled_programs` (which kernelize calls) torch_tpu keeps the results on disk: a later process on
the host reads them instead of compiling.

It runs the model on its own device, on purpose. From a machine without a TPU, kernels can be compiled
for a named generation (`tpu-kernels check`), but that fills no cache a TPU host reads: a TPU host
compiles our ops in torch_tpu's runtime, not through jax, and jax 0.10.2 cannot load back what it
compiled for a compile-only topology (`tpu_kernels.compile_cache`).
"""

from __future__ import annotations

import argparse
import glob

from ..runtime.buckets import key_bucket, key_buckets, token_bucket, token_buckets
from . import fixed_shapes


def warm_up_prompts(max_tokens: int, max_keys: int) -> list[int]:
    """Prompt lengths whose prefill and first decode step, together, meet every bucket a batch-1 `generate`
    of prompts up to `max_tokens` tokens and caches up to `max_keys` keys meets.

    A prefill of P tokens compiles each kernel at token_bucket(P) (the rows of the layer norms and the
    experts; the tokens of per-head norms, whose rows are that bucket times the heads) and attention at
    (token_bucket(P), key_bucket(P)): the longest prompt of each combination of buckets stands for all of
    them. A decode step against L keys compiles at key_bucket(L), and the step after a prompt of L - 1
    tokens is one; decode steps share every other shape (one token).
    """
    if max_keys < max_tokens + 1:
        raise ValueError(f"max_keys ({max_keys}) must hold the longest prompt and a new token ({max_tokens + 1})")

    def buckets(prompt: int) -> tuple[int, int]:
        return key_bucket(prompt), token_bucket(prompt)

    prefills = {p for p in range(1, max_tokens + 1) if p == max_tokens or buckets(p) != buckets(p + 1)}
    # A decode step's bucket, reached from the longest prompt that the step's bucket holds with room for it.
    decodes = {min(bucket, max_keys) - 1 for bucket in key_buckets(max_keys)} - {0}
    return sorted(prefills | decodes)


def fixed_shape_cache(max_tokens: int, max_keys: int) -> int:
    """The static cache length the fixed-shape recipe serves after `precompile`: a key bucket holding `max_keys`
    and the longest padded prompt with its first new token (transformers keeps the longest a model has used)."""
    return key_bucket(max(max_keys, token_bucket(max_tokens) + 1))


def fixed_shape_prompts(max_tokens: int) -> list[int]:
    """The warm-up prompt lengths of the fixed-shape recipe: per token bucket, a prompt one short of it (left-padded:
    attention gets a padding mask) and, if no longer than `max_tokens`, one that fills it (no padding, no mask)."""
    buckets = token_buckets(max_tokens)
    return sorted({min(bucket - 1, max_tokens) for bucket in buckets} | {b for b in buckets if b <= max_tokens} - {0})


def precompile(model, *, max_tokens: int, max_keys: int, progress: bool = True) -> list[int]:
    """Run `model` (kernelized) once per warm-up prompt length, with a progress bar; returns the prompt lengths run.
    Random token ids (seeded), greedy, two new tokens each (a prefill and a decode step); no gradients.

    With the fixed-shape recipe (`fixed_shapes`, on by default on a TPU) a prompt runs padded to its token bucket
    against one static cache (`fixed_shape_cache`): the warm-up prompts are `fixed_shape_prompts`, and their decode
    steps share one shape, the step transformers compiles on a TPU. Without it, `warm_up_prompts`."""
    import torch
    from tqdm.auto import tqdm

    recipe = fixed_shapes.installed(model)
    prompts = fixed_shape_prompts(max_tokens) if recipe else warm_up_prompts(max_tokens, max_keys)
    options = dict(max_cache_len=fixed_shape_cache(max_tokens, max_keys)) if recipe else {}
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    with torch.no_grad():
        for prompt in tqdm(prompts, desc="precompiling buckets", unit="prompt", disable=not progress):
            tokens = torch.randint(0, vocab, (1, prompt), generator=generator).to(device)
            model.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=2, min_new_tokens=2,
                           do_sample=False, **options)
    return prompts


NO_TPU = ("no TPU on this machine: precompile runs the model where it will serve, on the TPU host, to fill the "
          "cache that host reads (`tpu-kernels check` compiles kernels for a TPU generation from any machine, but "
          "that fills no cache a TPU host reads). --device cpu runs it here, in interpret mode.")


def precompile_main(argv: list[str]) -> int:
    """`tpu-kernels precompile MODEL_ID_OR_PATH [--max-tokens N] [--max-keys N] [--device tpu|cpu] [--dtype D]`."""
    parser = argparse.ArgumentParser(prog="tpu-kernels precompile", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a Hub model id or a local folder (transformers' from_pretrained)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="longest prompt to serve (default 4096)")
    parser.add_argument("--max-keys", type=int, default=None,
                        help="longest cache (default: max tokens + 128 new tokens)")
    parser.add_argument("--device", choices=("tpu", "cpu"), default="tpu")
    parser.add_argument("--dtype", default="bfloat16", help="the weights' dtype (default bfloat16)")
    args = parser.parse_args(argv)
    if args.device == "tpu" and not (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")):
        parser.exit(2, f"tpu-kernels precompile: {NO_TPU}\n")
    max_keys = args.max_keys or args.max_tokens + 128
    import torch
    from transformers import AutoModelForCausalLM

    from .kernelize import kernelize

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    model = kernelize(model, device=args.device)
    print(model.tpu_kernels_report)
    prompts = precompile(model, max_tokens=args.max_tokens, max_keys=max_keys)
    print(f"compiled every bucket of prompts up to {args.max_tokens} tokens and caches up to {max_keys} keys "
          f"({len(prompts)} warm-up prompts)")
    return 0
