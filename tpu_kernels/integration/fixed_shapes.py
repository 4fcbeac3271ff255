"""The fixed-shape recipe: `generate` at a bounded set of shapes, so that a TPU compiles each program once.

On a TPU each new shape, and each new value of an op's scalar argument, is a program to compile: per op in
TorchTPU's default eager mode, per graph when transformers compiles the decode step (which it does on a TPU with a
static cache). transformers sizes everything by the request: the prefill by the prompt, a static cache by prompt
plus new tokens, a dynamic cache by every token. The recipe bounds those shapes for every `generate` of the model:

* the prompt is left-padded, with its attention mask, to its token bucket (`runtime/buckets.py`), on the host; the
  returned sequences drop that padding again, so a caller sees the tokens of the unpadded call;
* the cache is static unless the call chooses one (a `cache`, a `cache_implementation`), and its length is rounded
  up to a key bucket: transformers keeps the longest a model has used, so one length serves every later request
  up to it (`precompile` sets it from `max_keys`); a call that asks for a dynamic cache gets one whose layers grow
  in key-bucket steps and write each token in place (`bucketed_cache`);
* attention on transformers' flash path (continuous batching's) unpads every call by its data; during `generate`
  the model's layers use the kernel's `attention_forward` instead, whose padded 4-D mask keeps one shape
  (`generate_batch` keeps the flash path).

A new prompt length inside a bucket then adds no program anywhere in the model's forward, and a decode step none
after the first (tests/test_op_signatures.py counts them). kernelize installs it by default on a TPU
(`fixed_shapes=None`), or when `fixed_shapes=True` (how the tests run it on the CPU). It wraps the model
instance's `generate`, since no generation config field does it (a default `cache_implementation` makes
transformers refuse a caller's own cache, and none pads a prompt); the cache's length reaches transformers as the
call's `max_cache_len`.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from types import ModuleType

from ..runtime.buckets import key_bucket, token_bucket
from .attention import latent_flash_implementation

# What the report says when the recipe is on.
SUMMARY = ("generate pads prompts to token buckets (left, with the mask) and uses a static cache at a key bucket "
           "(a dynamic one, if asked for, grows in key buckets){attention}")


def wanted(option: bool | None, device: str) -> bool:
    """kernelize's `fixed_shapes`: None is on for a model on a TPU."""
    return device == "tpu" if option is None else bool(option)


def installed(model) -> bool:
    return "_tpu_kernels_unwrapped" in vars(model)


def install(model, attention_kernel: ModuleType | None) -> str:
    """Wrap `model.generate` with the recipe (module docstring); returns the report's line."""
    fixed_name = _fixed_attention(model, attention_kernel)
    # A second kernelize of the model wraps transformers' own generate again, not the first recipe's.
    original = model.__dict__.setdefault("_tpu_kernels_unwrapped", model.generate)

    @functools.wraps(original)
    def generate(*args, **kwargs):
        return _generate(model, original, fixed_name, args, kwargs)

    model.generate = generate
    return SUMMARY.format(attention=" (attention through attention_forward during generate)" if fixed_name else "")


def _fixed_attention(model, kernel: ModuleType | None) -> str | None:
    """The attention implementation `generate` runs on in place of transformers' flash path, registered; None when
    the model is not on the kernel's flash path (an MLA model on the kernel's latent attention is not: its name holds
    "flash" for continuous batching, and `generate` keeps it, padded to buckets and masked in 4-D)."""
    name = str(model.config._attn_implementation)
    if kernel is None or "flash" not in name or name == latent_flash_implementation(kernel):
        return None
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = f"tpu_kernels_{kernel.__name__.lstrip('_')}"
    AttentionInterface.register(name, kernel.attention_forward)
    AttentionMaskInterface.register(name, kernel.attention_mask)
    return name


@contextmanager
def _attention_as(model, name: str | None):
    """The model on attention implementation `name` for the duration, if it is on the flash path (transformers keeps
    the flash kernels loaded meanwhile, so returning to them loads nothing)."""
    previous = model.config._attn_implementation
    if name is None or "flash" not in str(previous):
        yield
        return
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous, allow_all_kernels=True)


def _generate(model, original, fixed_name: str | None, args: tuple, kwargs: dict):
    if "cache" in kwargs or "past_key_values" in kwargs or model.config.is_encoder_decoder:
        return original(*args, **kwargs)  # a caller's own cache continues at its own positions
    args, kwargs = list(args), dict(kwargs)
    prompt = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    config = kwargs.get("generation_config") or model.generation_config
    if kwargs.get("use_cache", config.use_cache) is not False:
        if "cache_implementation" not in kwargs and config.cache_implementation is None:
            kwargs["cache_implementation"] = "static"
        elif kwargs.get("cache_implementation", config.cache_implementation) == "dynamic":
            _bucketed_dynamic_cache(model, kwargs)
    extra = 0
    if prompt is not None and prompt.dim() == 2 and not prompt.is_floating_point() and prompt.shape[1]:
        extra = token_bucket(prompt.shape[1]) - prompt.shape[1]
    if extra:
        padded, mask = _left_padded(prompt, kwargs.get("attention_mask"), extra, _pad_id(config))
        if args:
            args[0] = padded
        else:
            kwargs["inputs" if "inputs" in kwargs else "input_ids"] = padded
        kwargs["attention_mask"] = mask
        _lengthen_limits(config, kwargs, extra)
    if "static" in str(kwargs.get("cache_implementation", config.cache_implementation)):
        prompt_length = 1 if prompt is None else prompt.shape[-1] + extra
        kwargs["max_cache_len"] = _cache_length(config, kwargs, prompt_length)
    with _attention_as(model, fixed_name):
        out = original(*args, **kwargs)
    return _without_left_padding(out, extra)


def _bucketed_dynamic_cache(model, kwargs: dict) -> None:
    """The call's dynamic cache as a `BucketedDynamicCache`, handed to transformers as the call's own `cache`, which
    takes no `cache_implementation` beside it (None in the call's arguments outranks the generation config's)."""
    if not model._supports_default_dynamic_cache():
        return
    from .bucketed_cache import BucketedDynamicCache

    kwargs["cache_implementation"] = None
    kwargs["cache"] = BucketedDynamicCache(model.config.get_text_config(decoder=True))


def _cache_length(config, kwargs: dict, prompt_length: int) -> int:
    """The static cache's length: the key bucket of what transformers would size it to (the prompt and its new
    tokens but the last, as transformers counts), or of the call's own `max_cache_len` if longer."""
    new_tokens = kwargs.get("max_new_tokens", config.max_new_tokens)
    total = prompt_length + new_tokens if new_tokens is not None else kwargs.get("max_length", config.max_length)
    return key_bucket(max(total - 1, kwargs.get("max_cache_len", config.max_cache_len) or 0, 1))


def _pad_id(config) -> int:
    for token in (config.pad_token_id, config.eos_token_id, 0):
        token = token[0] if isinstance(token, (list, tuple)) else token
        if token is not None:
            return int(token)
    return 0


def _left_padded(prompt, mask, extra: int, pad_id: int):
    """`prompt` and its mask (ones if None) with `extra` masked positions of `pad_id` on the left, made on the host
    (a program per prompt length on a TPU otherwise) and moved back."""
    import torch

    host = prompt.cpu()
    host_mask = torch.ones_like(host) if mask is None else mask.cpu()
    padded = torch.cat([host.new_full((host.shape[0], extra), pad_id), host], dim=1)
    padded_mask = torch.cat([host_mask.new_zeros((host.shape[0], extra)), host_mask], dim=1)
    return padded.to(prompt.device), padded_mask.to(prompt.device if mask is None else mask.device)


def _lengthen_limits(config, kwargs: dict, extra: int) -> None:
    """Limits given as total lengths (max_length, min_length) count the padding too: moved by `extra`, so the
    call generates what it would have without it."""
    if kwargs.get("max_new_tokens", config.max_new_tokens) is None:
        kwargs["max_length"] = kwargs.get("max_length", config.max_length) + extra
    if kwargs.get("min_new_tokens", config.min_new_tokens) is None and kwargs.get("min_length", config.min_length):
        kwargs["min_length"] = kwargs.get("min_length", config.min_length) + extra


def _without_left_padding(out, extra: int):
    """`generate`'s result with the padding's columns dropped from the sequences."""
    if not extra:
        return out
    if hasattr(out, "sequences"):
        out.sequences = out.sequences[:, extra:]
        return out
    return out[:, extra:]
