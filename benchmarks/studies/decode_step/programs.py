"""The XLA programs of one decode step on one chip: what transformers' eager torch ops compute, written in jnp.

Each function is one program the benchmark compiles ahead of time for v6e and prices with the calibrated model
(`benchmarks.perf.program_time`). Eager torch runs every op as its own program, so an op whose output is
large and read again by the next op (batched_mm's weight gathers) is its own program here too: XLA cannot fuse
the gather into the matmul as it would under jit. Small ops on [B, H] rows are grouped where their bytes are
negligible; `run.py` lists what is grouped and what is left out.

Shapes are one chip's under `models.PLAN` (experts: the chip's local experts; everything else replicated).
Linear weights are [out, in] as torch stores them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from .models import AttentionKind, DecodeModel

DTYPE = jnp.bfloat16
EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Program:
    """One XLA program of the step: its name, function, abstract arguments and how many times a step runs it."""

    name: str
    fn: Callable
    avals: tuple
    per_step: int
    note: str = ""


def spec(*shape, dtype=DTYPE) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def rms_norm(x, weight):
    """transformers' RMSNorm: f32 mean of squares, rsqrt, scale (the XLA reference the default path runs)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + EPS)
    return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def projections(x, *weights):
    """x @ W.T for each weight (q, k, v; or gate, up): one dot each, every weight read once."""
    return tuple(x @ w.T for w in weights)


def kv_append(cache, new):
    """DynamicCache.update: torch.cat([cache, new], dim=-2), a new tensor holding the whole cache (a sliding layer
    keeps window - 1 tokens and concatenates the same way; its slice of the last ones is a view)."""
    return jnp.concatenate([cache, new], axis=2)


def sdpa(q, key, value):
    """Decode attention as XLA compiles plain softmax attention: q [B, Hq, 1, D], K/V [B, Hkv, C, D] (GQA heads
    broadcast, not copied: a lower bound on eager repeat_kv, which writes the repeated cache)."""
    batch, q_heads, _, dim = q.shape
    kv_heads = key.shape[1]
    grouped = q.reshape(batch, kv_heads, q_heads // kv_heads, dim)
    logits = jnp.einsum("bhgd,bhkd->bhgk", grouped, key, preferred_element_type=jnp.float32) * dim**-0.5
    weights = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
    return jnp.einsum("bhgk,bhkd->bhgd", weights, value).reshape(batch, q_heads, 1, dim)


def router(x, weight, top_k: int, normalise_input: bool):
    """The router: (Gemma 4: unscaled RMSNorm first) logits, f32 softmax, top-k, weights renormalised."""
    if normalise_input:
        x = rms_norm(x, jnp.ones((x.shape[-1],), x.dtype))
    probabilities = jax.nn.softmax((x @ weight.T).astype(jnp.float32), axis=-1)
    top_weights, top_index = jax.lax.top_k(probabilities, top_k)
    return top_weights / top_weights.sum(-1, keepdims=True), top_index


def gather_weights(weights, expert_ids):
    """batched_mm's `gate_up_proj[expert_ids]` / `down_proj[expert_ids]`: one copy of an expert's weights per pick."""
    return weights[expert_ids]


def batched_matvec(selected, rows):
    """batched_mm's `_batched_linear`: torch.bmm(weight [S, out, in], rows [S, in, 1])."""
    return jnp.einsum("soi,si->so", selected, rows, preferred_element_type=jnp.float32).astype(rows.dtype)


def picks_prologue(hidden, top_k_index, local_experts: int):
    """batched_mm before the gathers: each token repeated top-k times, sentinel ids clamped to local experts."""
    return jnp.repeat(hidden, top_k_index.shape[1], axis=0), jnp.clip(top_k_index.reshape(-1), 0, local_experts - 1)


def gated(projected, activation: str):
    gate, up = jnp.split(projected, 2, axis=-1)
    act = jax.nn.silu if activation == "silu" else (lambda v: jax.nn.gelu(v, approximate=True))
    return act(gate) * up


def picks_epilogue(down_out, top_k_weights):
    """batched_mm after the down projection: routing weights applied, each token's picks summed in f32."""
    tokens, k = top_k_weights.shape
    weighted = down_out.astype(jnp.float32) * top_k_weights.reshape(-1, 1).astype(jnp.float32)
    return weighted.reshape(tokens, k, -1).sum(1).astype(down_out.dtype)


def dense_mlp(x, gate, up, down):
    """Gemma 4's dense MLP beside the experts: down(gelu_tanh(gate x) * up x)."""
    return (jax.nn.gelu(x @ gate.T, approximate=True) * (x @ up.T)) @ down.T


def lm_head(x, weight, softcap: bool):
    """Final logits (f32), Gemma's final soft-capping, and greedy sampling's argmax."""
    logits = (x @ weight.T).astype(jnp.float32)
    if softcap:
        logits = jnp.tanh(logits / 30.0) * 30.0
    return jnp.argmax(logits, axis=-1)


def embed(table, ids, scale: bool):
    rows = jnp.take(table, ids, axis=0)
    return rows * jnp.asarray(table.shape[1] ** 0.5, rows.dtype) if scale else rows


def attention_programs(model: DecodeModel, kind: AttentionKind, batch: int, context: int) -> list[Program]:
    """Per layer of `kind`: q/k/v projections, the cache append and o_proj (the same on both paths)."""
    h, d = model.hidden, kind.head_dim
    cached = kind.cached_tokens(context)
    kv_weights = (spec(kind.kv_heads * d, h),) * (1 if kind.shared_kv else 2)
    layers = kind.layers
    return [
        Program(f"{kind.name} attention: q/k/v projections", projections,
                (spec(batch, h), spec(kind.q_heads * d, h), *kv_weights), layers),
        Program(f"{kind.name} attention: KV cache append (K and V)", kv_append,
                (spec(batch, kind.kv_heads, cached - 1, d), spec(batch, kind.kv_heads, 1, d)), 2 * layers,
                "DynamicCache (generate's default) concatenates: the whole cache is read and written again"),
        Program(f"{kind.name} attention: o_proj", lambda x, w: x @ w.T,
                (spec(batch, kind.q_heads * d), spec(h, kind.q_heads * d)), layers),
    ]


def sdpa_program(kind: AttentionKind, batch: int, context: int) -> Program:
    cached = kind.cached_tokens(context)
    return Program(f"{kind.name} attention: softmax attention (XLA)", sdpa,
                   (spec(batch, kind.q_heads, 1, kind.head_dim), spec(batch, kind.kv_heads, cached, kind.head_dim),
                    spec(batch, kind.kv_heads, cached, kind.head_dim)), kind.layers)


def norm_shapes(model: DecodeModel, batch: int) -> list[tuple[str, int, int, int]]:
    """(what, rows, width, per step) of every RMSNorm of a step."""
    shapes = [("hidden-size norms", batch, model.hidden, model.layers * model.hidden_norms_per_layer + 1)]
    for kind in model.attention:
        shapes.append((f"{kind.name} q_norm", batch * kind.q_heads, kind.head_dim, kind.layers))
        shapes.append((f"{kind.name} k_norm", batch * kind.kv_heads, kind.head_dim, kind.layers))
        if kind.v_norm:
            shapes.append((f"{kind.name} v_norm", batch * kind.kv_heads, kind.head_dim, kind.layers))
    return shapes


def xla_norm_programs(model: DecodeModel, batch: int) -> list[Program]:
    return [Program(f"RMSNorm (XLA): {what} [{rows}, {width}]", rms_norm, (spec(rows, width), spec(width)), count)
            for what, rows, width, count in norm_shapes(model, batch)]


def moe_programs(model: DecodeModel, batch: int, local_experts: int) -> list[Program]:
    """Per MoE layer, besides the experts: the router, and Gemma 4's dense MLP (the same on both paths)."""
    h, n = model.hidden, model.layers
    found = [Program("router: logits, softmax, top-k", lambda x, w: router(x, w, model.top_k, model.router_norm),
                     (spec(batch, h), spec(model.experts, h)), n)]
    if model.dense_mlp_intermediate:
        i = model.dense_mlp_intermediate
        found.append(Program("dense MLP beside the experts", dense_mlp,
                             (spec(batch, h), spec(i, h), spec(i, h), spec(h, i)), n))
    return found


def batched_mm_programs(model: DecodeModel, batch: int, local_experts: int) -> list[Program]:
    """transformers' batched_mm experts under EP router masking, one program per eager op that moves weights."""
    h, i, k, n = model.hidden, model.expert_intermediate, model.top_k, model.layers
    picks = batch * k
    ids = spec(picks, dtype=jnp.int32)
    return [
        Program("batched_mm: repeat rows, clamp sentinel ids", lambda x, idx: picks_prologue(x, idx, local_experts),
                (spec(batch, h), spec(batch, k, dtype=jnp.int32)), n),
        Program("batched_mm: gate_up_proj[expert_ids] gather", gather_weights,
                (spec(local_experts, 2 * i, h), ids), n,
                "every pick copies its expert's [2I, H] weights, sentinels included (clamped to expert 0)"),
        Program("batched_mm: bmm gate_up", batched_matvec, (spec(picks, 2 * i, h), spec(picks, h)), n),
        Program("batched_mm: gate", lambda p: gated(p, model.activation), (spec(picks, 2 * i),), n),
        Program("batched_mm: down_proj[expert_ids] gather", gather_weights, (spec(local_experts, h, i), ids), n),
        Program("batched_mm: bmm down", batched_matvec, (spec(picks, h, i), spec(picks, i)), n),
        Program("batched_mm: routing weights, sum over picks", picks_epilogue,
                (spec(picks, h), spec(batch, k)), n),
    ]


def step_programs(model: DecodeModel, batch: int) -> list[Program]:
    """Once per step: the embedding lookup and the LM head with greedy sampling."""
    h, v = model.hidden, model.vocab
    return [
        Program("embedding lookup", lambda t, ids: embed(t, ids, model.scaled_embeddings),
                (spec(v, h), spec(batch, dtype=jnp.int32)), 1),
        Program("lm_head and argmax", lambda x, w: lm_head(x, w, model.logit_softcap), (spec(batch, h), spec(v, h)), 1),
    ]
