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
from .precompile_batching import check_continuous_batching, warm_continuous_batching


def warm_up_prompts(max_tokens: int, max_keys: int) -> list[int]:
    """Prompt lengths whose prefill and first decode step, together, meet every bucket a batch-1 `generate`
    of prompts up to `max_tokens` tokens and caches up to `max_keys` keys meets.

    A prefill of P tokens compiles each kernel at token_bucket(P) (the rows of the layer norms and the
    experts; the tokens of per-head norms, whose rows are that bucket times the heads) and attention at
    (token_bucket(P), key_bucket(P)): the longest prompt of each combination of buckets stands for all of
    them. A decode step against L keys compiles at key_bucket(L), and the step after a prompt of L - 1
    tokens is one; decode steps share every other shape (one token).
    """
    token_ladder, key_ladder = token_buckets(max_tokens), key_buckets(max_keys)  # both sizes checked: ints >= 1
    if max_keys < max_tokens + 1:
        raise ValueError(f"max_keys ({max_keys}) must hold the longest prompt and a new token ({max_tokens + 1})")
    # A prompt's buckets change past P exactly where P is a bucket of either ladder (each bucket holds the sizes up
    # to itself): the prompts at the buckets below max_tokens, and max_tokens, stand for all.
    prefills = {bucket for bucket in (*token_ladder, *key_buckets(max_tokens)) if bucket < max_tokens} | {max_tokens}
    # A decode step's bucket, reached from the longest prompt that the step's bucket holds with room for it.
    decodes = {min(bucket, max_keys) - 1 for bucket in key_ladder} - {0}
    return sorted(prefills | decodes)


# The longest cache a model may ask for when its config names no max_position_embeddings.
MAX_KEYS_WITHOUT_A_MODEL_LIMIT = 1 << 20


def longest_cache(config) -> int:
    """The most keys `precompile` warms for a model of `config`: its max_position_embeddings."""
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 1 else MAX_KEYS_WITHOUT_A_MODEL_LIMIT


def check_sizes(config, max_tokens: int, max_keys: int) -> None:
    """ValueError (one line) unless 1 <= max_tokens < max_keys <= the model's longest cache."""
    for name, value in (("max_tokens", max_tokens), ("max_keys", max_keys)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number of at least 1, got {value!r}")
    limit = longest_cache(config)
    if max_tokens >= limit:
        raise ValueError(f"max_tokens ({max_tokens}) leaves no room for a new token in the model's "
                         f"max_position_embeddings ({limit})")
    if max_keys > limit:
        raise ValueError(f"max_keys ({max_keys}) is longer than the model's max_position_embeddings ({limit})")
    if max_keys < max_tokens + 1:
        raise ValueError(f"max_keys ({max_keys}) must hold the longest prompt and a new token ({max_tokens + 1})")


def fixed_shape_cache(max_tokens: int, max_keys: int) -> int:
    """The static cache length the fixed-shape recipe serves after `precompile`: a key bucket holding `max_keys`
    and the longest padded prompt with its first new token (transformers keeps the longest a model has used)."""
    return key_bucket(max(max_keys, token_bucket(max_tokens) + 1))


def fixed_shape_prompts(max_tokens: int) -> list[int]:
    """The warm-up prompt lengths of the fixed-shape recipe: per token bucket, a prompt one short of it (left-padded:
    attention gets a padding mask) and, if no longer than `max_tokens`, one that fills it (no padding, no mask)."""
    buckets = token_buckets(max_tokens)
    return sorted({min(bucket - 1, max_tokens) for bucket in buckets} | {b for b in buckets if b <= max_tokens} - {0})


def precompile(model, *, max_tokens: int, max_keys: int, progress: bool = True, compile_config=None,
               continuous_batching=None) -> list[int]:
    """Run `model` (kernelized) once per warm-up prompt length, with a progress bar; returns the prompt lengths run.
    Random token ids (seeded), greedy, two new tokens each (a prefill and a decode step); no gradients.

    Each `generate` takes the decode step's path that serving takes: compiled where transformers compiles it (a
    static cache on a TPU; anywhere with a `compile_config` whose `_compile_all_devices` is set), with the
    `compile_config` the serving calls pass (None: the model's generation config's, else transformers' default), so
    the compiled step's graph is built here, once per cache length.

    With `continuous_batching` (the ContinuousBatchingConfig `generate_batch` will take, naming `max_batch_tokens`
    and `max_requests_per_batch`), it also runs every step shape continuous batching can hand the kernels for
    requests of at most `max_keys` keys (`precompile_batching`).

    With the fixed-shape recipe (`fixed_shapes`, on by default on a TPU) a prompt runs padded to its token bucket
    against one static cache (`fixed_shape_cache`): the warm-up prompts are `fixed_shape_prompts`, and their decode
    steps share one shape, the step transformers compiles on a TPU. Without it, `warm_up_prompts`. ValueError unless
    1 <= max_tokens < max_keys <= the model's max_position_embeddings."""
    import torch
    from tqdm.auto import tqdm

    check_sizes(model.config, max_tokens, max_keys)
    if continuous_batching is not None:
        check_continuous_batching(model, continuous_batching)
    recipe = fixed_shapes.installed(model)
    prompts = fixed_shape_prompts(max_tokens) if recipe else warm_up_prompts(max_tokens, max_keys)
    options = dict(max_cache_len=fixed_shape_cache(max_tokens, max_keys)) if recipe else {}
    if compile_config is not None:
        options["compile_config"] = compile_config
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    with torch.no_grad():
        for prompt in tqdm(prompts, desc="precompiling buckets", unit="prompt", disable=not progress):
            tokens = torch.randint(0, vocab, (1, prompt), generator=generator).to(device)
            model.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=2, min_new_tokens=2,
                           do_sample=False, **options)
        if continuous_batching is not None:
            warm_continuous_batching(model, continuous_batching, max_keys, progress)
    return prompts


NO_TPU = ("no TPU on this machine: precompile runs the model where it will serve, on the TPU host, to fill the "
          "cache that host reads (`tpu-kernels check` compiles kernels for a TPU generation from any machine, but "
          "that fills no cache a TPU host reads). --device cpu runs it here, in interpret mode.")


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


DTYPES = ("bfloat16", "float16", "float32")


def precompile_main(argv: list[str]) -> int:
    """`tpu-kernels precompile MODEL_ID_OR_PATH [--max-tokens N] [--max-keys N] [--device tpu|cpu] [--dtype D]
    [--max-batch-tokens N --max-requests-per-batch N]`."""
    parser = argparse.ArgumentParser(prog="tpu-kernels precompile", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a Hub model id or a local folder (transformers' from_pretrained)")
    parser.add_argument("--max-tokens", type=_at_least_one, default=None,
                        help="longest prompt to serve (default 4096, or less as the model's context allows)")
    parser.add_argument("--max-keys", type=_at_least_one, default=None,
                        help="longest cache (default: max tokens + 128 new tokens, at most the model's context)")
    parser.add_argument("--device", choices=("tpu", "cpu"), default="tpu")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="the weights' dtype (default bfloat16)")
    for bound in ("max-batch-tokens", "max-requests-per-batch"):
        parser.add_argument(f"--{bound}", type=_at_least_one, default=None,
                            help="with the other, also every step continuous batching (generate_batch) can run "
                                 "within these bounds (its ContinuousBatchingConfig's)")
    # One line for a bad argument, as for every other refusal here (argparse would add its usage).
    parser.error = lambda message: parser.exit(2, f"tpu-kernels precompile: {message}\n")
    args = parser.parse_args(argv)
    if (args.max_batch_tokens is None) != (args.max_requests_per_batch is None):
        parser.error("--max-batch-tokens and --max-requests-per-batch go together (continuous batching's bounds)")
    if args.device == "tpu" and not (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")):
        parser.exit(2, f"tpu-kernels precompile: {NO_TPU}\n")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from .kernelize import kernelize

    try:
        config = AutoConfig.from_pretrained(args.model)
    except (OSError, ValueError) as error:
        parser.exit(2, f"tpu-kernels precompile: cannot load {args.model!r}: {(str(error).splitlines() or [type(error).__name__])[0]}\n")
    limit = longest_cache(config)
    max_tokens = args.max_tokens or min(4096, limit - 1)
    max_keys = args.max_keys or min(max_tokens + 128, limit)
    try:
        check_sizes(config, max_tokens, max_keys)
    except ValueError as error:
        parser.exit(2, f"tpu-kernels precompile: {error}\n")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    model = kernelize(model, device=args.device)
    print(model.tpu_kernels_report)
    batching = None
    if args.max_batch_tokens is not None:
        from transformers import ContinuousBatchingConfig

        batching = ContinuousBatchingConfig(max_batch_tokens=args.max_batch_tokens,
                                            max_requests_per_batch=args.max_requests_per_batch)
    try:
        prompts = precompile(model, max_tokens=max_tokens, max_keys=max_keys, continuous_batching=batching)
    except ValueError as error:  # continuous batching on a model kernelize could not put on a flash implementation
        parser.exit(2, f"tpu-kernels precompile: {error}\n")
    print(f"compiled every bucket of prompts up to {max_tokens} tokens and caches up to {max_keys} keys "
          f"({len(prompts)} warm-up prompts" + (", and continuous batching's steps)" if batching else ")"))
    return 0
