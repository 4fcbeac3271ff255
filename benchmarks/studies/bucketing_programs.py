"""The XLA programs our bucketing itself adds: the pads before a kernel call and the slices after it.

The kernels' torch entry points pad a call's real token count and key length to their buckets with `F.pad`, and
cut the result back with a slice, both at the REAL shape. Under torch_tpu eager each such op at a new real shape is
an XLA program compiled on the host, so the buckets bound the kernels' compiles but not these. Per forward of
`tokens` tokens against `keys` keys, batch 1, as `generate` runs it with transformers' default (dynamic) cache,
whose key length grows by one at each decode step:

- RMSNorm (`rmsnorm_tpu.ops._on_rows`): x's rows padded to their bucket, the result sliced back: the layer norms'
  [tokens, hidden] and, with per-head norms, [tokens x heads, head_dim] for the query and the key heads;
- the experts layer (`ragged_dot_tpu.experts.experts_forward`): hidden states, routing ids (padded with the
  sentinel id, `experts`) and routing weights padded to the token bucket, the result sliced back;
- attention through transformers' flash path (`attention_tpu.flash_api.flash_attn_func`, the route kernelize
  takes for `generate` from a Hub): q [1, tokens, q heads, head_dim] padded to the token bucket (one query stays
  one), k and v [1, keys, kv heads, head_dim] padded to the key bucket, the result sliced back to the tokens. A
  decode step's keys are one longer than the last step's, so each step pads them at a new shape (a sliding layer's
  stop growing at its window: `compiles.Attention.keys_seen`).

Reshapes and transposes are views. A pad or a slice that changes nothing is listed where the entry point runs it
all the same (a copy, one per bucket): RMSNorm's pad and slice at rows that fill their bucket, the experts'
slice of its result; the experts' and attention's pads are skipped then, and so is attention's slice (torch skips
the parts of a multi-dimensional index that cut nothing).
A program is ("pad", dtype, fill value, source shape, padded shape) or ("slice", dtype, source shape, cut shape);
programs alike in all of these are one program, whichever op runs them (the experts' hidden-state pad is the
layer norm's). `tests/test_bench_compiles.py` runs the entry points and checks this list against the ops they run.

Compile seconds are those of jax-lowered equivalents (`jnp.pad`, a slice) compiled ahead of time for the chip:
torch_tpu's own lowering of these eager ops is not available off a TPU, so they estimate that cost. Each is priced
as a program of its own: where torch_tpu's eager mode defers and fuses ops (`EagerMode.DEFER_AND_FUSE`), a pad joins
the program of the ops around it, whose shapes (with the default cache, the model's own cache concatenation) change
at the same calls, so the figure is an upper bound of what the pads add.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpu_kernels.runtime.buckets import key_bucket, token_bucket

OPS = ("pad", "slice")
INDEX_DTYPE = "int64"  # torch.topk's ids, which transformers' routers hand the experts layer


def is_program(shape: tuple) -> bool:
    return shape[0] in OPS


def _pad(dtype: str, source: tuple, padded: tuple, value: int = 0) -> set[tuple]:
    return {("pad", dtype, value, source, padded)}


def _cut(dtype: str, source: tuple, cut: tuple) -> set[tuple]:
    return {("slice", dtype, source, cut)}


def _pad_if_short(dtype: str, source: tuple, padded: tuple, value: int = 0) -> set[tuple]:
    """A pad the entry point skips when there is nothing to pad (`padding.padded`, `experts._padded_to_bucket`)."""
    return set() if source == padded else _pad(dtype, source, padded, value)


def _norm(dtype: str, rows: int, bucket_rows: int, width: int) -> set[tuple]:
    """`rmsnorm_tpu.ops._on_rows`: it pads and cuts even rows that fill their bucket (each then copies as is)."""
    return _pad(dtype, (rows, width), (bucket_rows, width)) | _cut(dtype, (bucket_rows, width), (rows, width))


def programs(model, tokens: int, keys: int) -> set[tuple]:
    """The bucketing programs one forward of `tokens` against `keys` keys runs (module docstring), in bf16."""
    dtype, bucket = "bfloat16", token_bucket(tokens)
    found = _norm(dtype, tokens, bucket, model.hidden)
    found |= _pad_if_short(dtype, (tokens, model.hidden), (bucket, model.hidden))
    found |= _pad_if_short(INDEX_DTYPE, (tokens, model.top_k), (bucket, model.top_k), value=model.experts)
    found |= _pad_if_short(model.router_weights, (tokens, model.top_k), (bucket, model.top_k))
    found |= _cut(dtype, (bucket, model.hidden), (tokens, model.hidden))
    queries = tokens if tokens == 1 else bucket
    for kind in model.attention:
        if model.qk_norms:
            for heads in (model.q_heads, kind.kv_heads):
                found |= _norm(dtype, tokens * heads, bucket * heads, kind.head_dim)
        q_shape, kv_shape = (model.q_heads, kind.head_dim), (kind.kv_heads, kind.head_dim)
        found |= _pad_if_short(dtype, (1, tokens, *q_shape), (1, queries, *q_shape))
        seen = kind.keys_seen(tokens, keys)
        found |= _pad_if_short(dtype, (1, seen, *kv_shape), (1, key_bucket(seen), *kv_shape))
        # `out[:batch, :q_len]`: torch skips the slices of a multi-dimensional index that cut nothing.
        if queries != tokens:
            found |= _cut(dtype, (1, queries, *q_shape), (1, tokens, *q_shape))
    return found


def of_requests(model, requests: list[list[tuple[int, int]]]) -> list[set[tuple]]:
    """Per request (its calls as (tokens, key length)), the bucketing programs its calls run."""
    return [set().union(*(programs(model, tokens, keys) for tokens, keys in calls)) for calls in requests]


def group_of(program: tuple) -> str:
    """Programs whose compile times are alike: one op and dtype (and fill), one shape but for the padded or cut
    dimension (`*`); those that change nothing (a copy) by their number of dimensions."""
    source, result = program[-2], program[-1]
    fill = f" fill {program[2]}" if program[0] == "pad" and program[2] else ""
    if source == result:
        return f"{program[0]} {program[1]}{fill} unchanged {len(source)}-d"
    varying = next(dim for dim, (before, after) in enumerate(zip(source, result)) if before != after)
    dims = ", ".join("*" if dim == varying else str(size) for dim, size in enumerate(source))
    return f"{program[0]} {program[1]}{fill} [{dims}]"


def sizes(program: tuple) -> list[int]:
    return [*program[-2], *program[-1]]


def target(program: tuple):
    """(fn, avals) of a jax program equivalent to one bucketing program."""
    source, result = program[-2], program[-1]
    aval = jax.ShapeDtypeStruct(source, jnp.dtype(program[1]))
    if program[0] == "pad":
        widths = [(0, after - before) for before, after in zip(source, result)]
        return (lambda x: jnp.pad(x, widths, constant_values=program[2])), [aval]
    return (lambda x: jax.lax.slice(x, (0,) * len(result), result)), [aval]
