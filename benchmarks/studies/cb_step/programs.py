"""The XLA parts of each path, written in jnp: one program per eager torch op that copies K, V or q.

Eager torch runs each op as its own XLA program, so each op here is its own program (XLA cannot fuse the gather
into the pad as it would under jit). The cache write (`index_copy_` of the new rows) is the same on every path,
vLLM's included, and is left out; so is the kernel's own reshaping of q and out around its call (the same on
every path that runs our paged kernel).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.studies.decode_step.programs import Program, spec

from .steps import Batch, Model, Sizes, cache_rows

# transformers reads with int64 indices; x64 is off in jax, and the index is a few hundred KB beside the rows.
INDEX = jnp.int32


def index_select(cache, index):
    """torch.index_select(cache, 0, read_index): the rows the read index names, packed (the index is valid: clamped,
    not the bounds select over every row that jnp.take's default "fill" adds)."""
    return jnp.take(cache, index, axis=0, mode="clip")


def masked_scatter(gathered, mask, new):
    """Sliding layers: `gathered.masked_scatter_(mask, new)`, the new keys (values) in order at the sentinel
    slots (out of place here: XLA writes a new buffer)."""
    slot = jnp.clip(jnp.cumsum(mask.astype(jnp.int32)) - 1, 0, new.shape[0] - 1)
    return jnp.where(mask[:, None, None], jnp.take(new, slot, axis=0, mode="clip"), gathered)


def pad_rows(packed, rows: int):
    """flash_api's `_with_rows`: zero rows appended up to `rows` (torch.nn.functional.pad, a copy)."""
    return jnp.pad(packed, ((0, rows - packed.shape[0]), (0, 0), (0, 0)))


def pad_sequences(packed, rows):
    """flash_api's `_pad_sequences`, its first op: packed[rows], [B, L, H, D] (the rows are clamped in range)."""
    return jnp.take(packed, rows, axis=0, mode="clip")


def heads_first(padded):
    """Its second: `.transpose(1, 2)` to [B, H, L, D], a view in torch that the kernel's call makes contiguous."""
    return padded.transpose(0, 2, 1, 3)


def unpad_output(out, sequence, index, inside):
    """flash_api's `torch.where(inside, out[sequence, :, index], 0)`: the padded output back to packed rows."""
    return jnp.where(inside[:, None, None], out[sequence, :, index], 0)


def gather_programs(batch: Batch, model: Model, found: Sizes) -> list[Program]:
    """transformers' gather of this layer's K and V (each program runs once for K and once for V)."""
    h, d = model.kv_heads, model.head_dim
    cache = spec(cache_rows(batch, model), h, d)
    programs = [Program("gather: index_select of K and V from the paged cache", index_select,
                        (cache, spec(found.total_k, dtype=INDEX)), 2)]
    if model.sliding_window is not None:
        programs.append(Program("gather: masked_scatter_ of the new K and V rows", masked_scatter,
                                (spec(found.total_k, h, d), spec(found.total_k, dtype=jnp.bool_),
                                 spec(found.total_q, h, d)), 2))
    return programs


def ragged_pad_programs(model: Model, found: Sizes) -> list[Program]:
    """Our ragged path's pads: K and V to the key-row bucket, q to the query-row bucket."""
    programs = []
    if found.ragged_key_rows > found.total_k:
        programs.append(Program("pad: K and V rows to their key bucket", lambda x: pad_rows(x, found.ragged_key_rows),
                                (spec(found.total_k, model.kv_heads, model.head_dim),), 2))
    if found.ragged_query_rows > found.total_q:
        programs.append(Program("pad: q rows to their token bucket", lambda x: pad_rows(x, found.ragged_query_rows),
                                (spec(found.total_q, model.q_heads, model.head_dim),), 1))
    return programs


def padded_programs(model: Model, found: Sizes) -> list[Program]:
    """The gradient path's copies: K, V and q padded per sequence, and the output gathered back."""
    b, d = found.padded_batch, model.head_dim
    return [
        Program("pad: K and V, every sequence to one length", pad_sequences,
                (spec(found.total_k, model.kv_heads, d), spec(b, found.padded_key_rows, dtype=INDEX)), 2),
        Program("pad: K and V to heads first", heads_first,
                (spec(b, found.padded_key_rows, model.kv_heads, d),), 2),
        Program("pad: q, every sequence to one length", pad_sequences,
                (spec(found.total_q, model.q_heads, d), spec(b, found.padded_query_rows, dtype=INDEX)), 1),
        Program("pad: q to heads first", heads_first, (spec(b, found.padded_query_rows, model.q_heads, d),), 1),
        Program("unpad: the output back to packed rows", unpad_output,
                (spec(b, model.q_heads, found.padded_query_rows, d), spec(found.total_q, dtype=INDEX),
                 spec(found.total_q, dtype=INDEX), spec(found.total_q, dtype=jnp.bool_)), 1),
    ]


def copied_bytes(program: Program) -> int:
    """The bytes a copy program writes per call (its output), for the gather's check against transformers'."""
    out = jax.eval_shape(program.fn, *program.avals)
    return int(out.size) * out.dtype.itemsize
