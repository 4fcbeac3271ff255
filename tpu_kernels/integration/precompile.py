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

from ..runtime.buckets import key_bucket, key_buckets, token_bucket


def warm_up_prompts(max_tokens: int, max_keys: int) -> list[int]:
    """Prompt lengths whose prefill and first decode step, together, meet every bucket a batch-1 `generate`
    of prompts up to `max_tokens` tokens and caches up to `max_keys` keys meets.

    A prefill of P tokens compiles at (token_bucket(P), key_bucket(P)): the longest prompt of each such pair
    stands for all of them. A decode step against L keys compiles at key_bucket(L), and the step after a
    prompt of L - 1 tokens is one; decode steps share every other shape (one token).
    """
    if max_keys < max_tokens + 1:
        raise ValueError(f"max_keys ({max_keys}) must hold the longest prompt and a new token ({max_tokens + 1})")
    longest = {}
    for prompt in range(1, max_tokens + 1):
        longest[(token_bucket(prompt), key_bucket(prompt))] = prompt
    prefills = set(longest.values())
    # A decode step's bucket, reached from the longest prompt that the step's bucket holds with room for it.
    decodes = {min(bucket, max_keys) - 1 for bucket in key_buckets(max_keys)} - {0}
    return sorted(prefills | decodes)


def precompile(model, *, max_tokens: int, max_keys: int, progress: bool = True) -> list[int]:
    """Run `model` (kernelized) once per prompt length of `warm_up_prompts`, with a progress bar; returns the
    prompt lengths run. Random token ids (seeded), greedy, two new tokens each; no gradients."""
    import torch
    from tqdm.auto import tqdm

    prompts = warm_up_prompts(max_tokens, max_keys)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    with torch.no_grad():
        for prompt in tqdm(prompts, desc="precompiling buckets", unit="prompt", disable=not progress):
            tokens = torch.randint(0, vocab, (1, prompt), generator=generator).to(device)
            model.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=2, min_new_tokens=2,
                           do_sample=False)
    return prompts
