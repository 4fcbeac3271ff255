"""The XLA programs of one MLA attention call, written in jnp: one program per eager torch op that moves the cache or
its expansion (eager torch runs each op as its own program, so XLA cannot fuse one into the next).

transformers 5.25 (`DeepseekV3Attention.forward`, `expand_kv`) at every call, decode included:

- `kv_b_proj(kv_nope)`: the whole latent cache [B, 1, S, L] through kv_b_proj into [B, S, H x (nope + v)];
- the keys assembled: a new [B, H, S, nope + R] filled by `copy_` of the k_nope half and of k_rot broadcast over the
  heads (the two copies, one program here: each writes its part of the keys once);
- sdpa over the keys and the value half of the expansion (a strided view) as XLA compiles plain softmax attention,
  the logits materialised, the causal mask made from positions (transformers' mask tensor is not read: a floor).

Ours, absorbed: q_latent = q_nope @ W_UK [B, H, Sq, L] and out = out_latent @ W_UV^T [B, H, Sq, v] (W_UK, W_UV: the
key and value halves of kv_b_proj's weight, per head), with the latent kernel between them. Expanded: transformers'
two expansion programs once, the value half made contiguous for the kernel, then the flash kernel.

Left out, the same on every path: the projections into q, the latent and k_rot, RoPE, the cache update (the latent
appended: `decode_step` prices it), the query's concatenation and the output's transpose and o_proj.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.studies.decode_step.programs import Program, spec

from .shapes import Call, MlaModel


def kv_b_proj(kv_nope, weight):
    """[B, 1, S, L] @ W [H (nope + v), L]^T -> [B, 1, S, H (nope + v)]."""
    return kv_nope @ weight.T


def assembled_keys(expanded, k_rot, nope: int, heads: int):
    """[B, H, S, nope + R]: each head's k_nope (the first nope of its nope + v) beside k_rot."""
    batch, _, length, _ = expanded.shape
    k_nope = expanded.reshape(batch, length, heads, -1)[..., :nope].transpose(0, 2, 1, 3)
    return jnp.concatenate([k_nope, jnp.broadcast_to(k_rot, (batch, heads, length, k_rot.shape[-1]))], axis=-1)


def contiguous_values(expanded, nope: int, heads: int):
    """[B, H, S, v]: the value half of the expansion, the view transformers hands on, made contiguous."""
    batch, _, length, _ = expanded.shape
    return expanded.reshape(batch, length, heads, -1)[..., nope:].transpose(0, 2, 1, 3)


def causal_visible(q_len: int, kv_len: int):
    query_pos = (kv_len - q_len) + jnp.arange(q_len)[:, None]
    return jnp.arange(kv_len)[None, :] <= query_pos


def sdpa(query, keys, expanded, nope: int, heads: int):
    """Softmax attention of query [B, H, Sq, nope + R] over keys [B, H, S, nope + R] and the value view of
    `expanded`; logits in f32, causal."""
    values = contiguous_values(expanded, nope, heads)
    logits = jnp.einsum("bhqd,bhkd->bhqk", query, keys, preferred_element_type=jnp.float32) * query.shape[-1] ** -0.5
    if query.shape[2] > 1:
        logits = jnp.where(causal_visible(query.shape[2], keys.shape[2]), logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1).astype(values.dtype)
    return jnp.einsum("bhqk,bhkd->bhqd", weights, values)


def query_to_latent(query, weight, nope: int, latent: int):
    """q_latent = q_nope @ W_UK: [B, H, Sq, nope] x [H, nope, L] -> [B, H, Sq, L]."""
    heads = query.shape[1]
    w_uk = weight.reshape(heads, -1, latent)[:, :nope]
    return jnp.einsum("bhqn,hnl->bhql", query[..., :nope], w_uk)


def latent_to_values(out_latent, weight, nope: int):
    """out = out_latent @ W_UV^T: [B, H, Sq, L] x [H, v, L] -> [B, H, Sq, v]."""
    heads, latent = out_latent.shape[1], out_latent.shape[-1]
    w_uv = weight.reshape(heads, -1, latent)[:, nope:]
    return jnp.einsum("bhql,hvl->bhqv", out_latent, w_uv)


def _arrays(model: MlaModel, call: Call) -> dict:
    b, h, q, s = call.batch, model.heads, call.q_len, call.kv_len
    return {"query": spec(b, h, q, model.key_dim), "weight": spec(h * (model.nope + model.v), model.latent),
            "kv_nope": spec(b, 1, s, model.latent), "k_rot": spec(b, 1, s, model.rope),
            "expanded": spec(b, 1, s, h * (model.nope + model.v)), "keys": spec(b, h, s, model.key_dim),
            "out_latent": spec(b, h, q, model.latent)}


def expansion_programs(model: MlaModel, call: Call) -> list[Program]:
    """transformers' `expand_kv`: kv_b_proj over every cached token, then the keys assembled."""
    a, nope, heads = _arrays(model, call), model.nope, model.heads
    return [Program("expand: kv_b_proj over every cached token", kv_b_proj, (a["kv_nope"], a["weight"]), 1),
            Program("expand: keys assembled (k_nope and k_rot copied)",
                    lambda expanded, k_rot: assembled_keys(expanded, k_rot, nope, heads),
                    (a["expanded"], a["k_rot"]), 1)]


def transformers_programs(model: MlaModel, call: Call) -> list[Program]:
    """transformers' own path: the expansion, then sdpa as XLA compiles it."""
    a, nope, heads = _arrays(model, call), model.nope, model.heads
    return expansion_programs(model, call) + [
        Program("sdpa over the expanded keys and values (XLA)",
                lambda query, keys, expanded: sdpa(query, keys, expanded, nope, heads),
                (a["query"], a["keys"], a["expanded"]), 1)]


def absorbed_programs(model: MlaModel, call: Call) -> list[Program]:
    """The absorbed form's two matmuls around the latent kernel."""
    a, nope, latent = _arrays(model, call), model.nope, model.latent
    return [Program("absorbed: q_nope @ W_UK", lambda query, weight: query_to_latent(query, weight, nope, latent),
                    (a["query"], a["weight"]), 1),
            Program("absorbed: out_latent @ W_UV^T", lambda out, weight: latent_to_values(out, weight, nope),
                    (a["out_latent"], a["weight"]), 1)]


def expanded_programs(model: MlaModel, call: Call) -> list[Program]:
    """The expanded form's XLA part: the expansion once, the values made contiguous for the kernel."""
    a, nope, heads = _arrays(model, call), model.nope, model.heads
    return expansion_programs(model, call) + [
        Program("expanded: values made contiguous", lambda expanded: contiguous_values(expanded, nope, heads),
                (a["expanded"],), 1)]
