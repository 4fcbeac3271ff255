"""The two models of Hugging Face's seed measurement, at their real sizes, and the parallel plan assumed for them.

transformers' config defaults are not these models (Qwen3MoeConfig defaults to 24 layers; Gemma4TextConfig to a
dense 2304-wide model): every size here is the released checkpoint's, with its source in `SOURCES`.
"""

from __future__ import annotations

import dataclasses

from benchmarks.studies.model_shapes import ATTENTION_HEADS, ATTENTION_WINDOWS, EXPERTS_MODELS


@dataclasses.dataclass(frozen=True)
class AttentionKind:
    """One kind of attention layer: its head counts and how many tokens of cache it reads."""

    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    window: int | None = None  # sliding window: the cache holds at most this many tokens
    shared_kv: bool = False  # keys and values from one projection (Gemma 4's global layers)
    v_norm: bool = False

    def cached_tokens(self, context: int) -> int:
        return context if self.window is None else min(context, self.window)


@dataclasses.dataclass(frozen=True)
class DecodeModel:
    name: str
    moe_layer_model: str  # benchmarks.studies.moe_layer.MODELS key (its experts' H, I, E, k)
    layers: int
    hidden: int
    vocab: int
    experts: int
    top_k: int
    expert_intermediate: int
    attention: tuple[AttentionKind, ...]
    dense_mlp_intermediate: int = 0  # Gemma 4: a dense MLP beside the experts in every layer
    activation: str = "silu"
    # RMSNorms over the hidden size per decoder layer, besides the attention's per-head q/k(/v) norms.
    hidden_norms_per_layer: int = 2
    router_norm: bool = False  # Gemma 4's router normalises its input first
    tied_embeddings: bool = False
    scaled_embeddings: bool = False  # Gemma multiplies the looked-up rows by sqrt(H)
    logit_softcap: bool = False

    @property
    def attention_weights(self) -> int:
        """Parameters of every layer's q, k, v and o projections."""
        total = 0
        for kind in self.attention:
            q = kind.q_heads * kind.head_dim
            kv = kind.kv_heads * kind.head_dim * (1 if kind.shared_kv else 2)
            total += kind.layers * (self.hidden * (q + kv) + q * self.hidden)
        return total

    @property
    def parameters(self) -> int:
        experts = self.layers * self.experts * 3 * self.hidden * self.expert_intermediate
        dense = self.layers * 3 * self.hidden * self.dense_mlp_intermediate
        router = self.layers * self.hidden * self.experts
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return experts + dense + router + embeddings + self.attention_weights

    @property
    def active_parameters(self) -> int:
        experts = self.layers * self.top_k * 3 * self.hidden * self.expert_intermediate
        dense = self.layers * 3 * self.hidden * self.dense_mlp_intermediate
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return experts + dense + self.layers * self.hidden * self.experts + embeddings + self.attention_weights

    def kv_cache_bytes_per_token(self, itemsize: int = 2) -> int:
        """Bytes of K and V one token adds to the cache over all layers (transformers stores V even when it
        equals K)."""
        return sum(k.layers * 2 * k.kv_heads * k.head_dim * itemsize for k in self.attention)


def experts_sizes(model: str) -> dict:
    """The experts layer's sizes of `model` in the experts kernel's compile targets (`EXPERTS_MODELS`)."""
    shape = EXPERTS_MODELS[model]
    return dict(moe_layer_model=model, hidden=shape["hidden"], experts=shape["experts"], top_k=shape["top_k"],
                expert_intermediate=shape["intermediate"], activation=shape["gate"]["activation"])


QWEN3 = DecodeModel(
    name="Qwen3-30B-A3B", layers=48, vocab=151_936, **experts_sizes("qwen3-30b-a3b"),
    attention=(AttentionKind("full", 48, **ATTENTION_HEADS["qwen3-30b-a3b"]),),
)
GEMMA4 = DecodeModel(
    name="Gemma-4-26B-A4B", layers=30, vocab=262_144, **experts_sizes("gemma-4-26b-a4b"), dense_mlp_intermediate=2112,
    attention=(AttentionKind("sliding", 25, **ATTENTION_HEADS["gemma-4-26b-a4b sliding"],
                             window=ATTENTION_WINDOWS["gemma-4-26b-a4b sliding"], v_norm=True),
               AttentionKind("full", 5, **ATTENTION_HEADS["gemma-4-26b-a4b global"], shared_kv=True, v_norm=True)),
    hidden_norms_per_layer=7, router_norm=True, tied_embeddings=True, scaled_embeddings=True, logit_softcap=True,
)
MODELS = {"qwen3-30b-a3b": QWEN3, "gemma-4-26b-a4b": GEMMA4}
# Hugging Face's measured speed-up of the kernelized step over transformers' default, batch 64 on v6e-8.
HF_SPEEDUP = {"qwen3-30b-a3b": 21.5, "gemma-4-26b-a4b": 12.8}
HF_KERNELIZED_STEP_MS = {"qwen3-30b-a3b": 56.6}

SOURCES = {
    "qwen3-30b-a3b": (
        "Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, num_hidden_layers 48, num_attention_heads 32, "
        "num_key_value_heads 4, head_dim 128, num_experts 128, num_experts_per_tok 8, moe_intermediate_size 768, "
        "vocab_size 151936, tie_word_embeddings false, every layer sparse (decoder_sparse_step 1); the totals it "
        "implies (`parameters`: 30.5 B) match the model card's 30.5 B. transformers' Qwen3MoeConfig defaults "
        "(24 layers) are not this model."),
    "gemma-4-26b-a4b": (
        "google/gemma-4-26B-A4B-it's config as the public model pages summarise it (no copy of config.json here): "
        "30 layers, 25 sliding (window 1024) + 5 global, hidden 2816 (benchmarks.studies.moe_layer's shape), "
        "16 query heads, sliding layers 8 KV heads of 256, global layers 2 KV heads of 512 with keys = values "
        "(attention_k_eq_v, num_global_key_value_heads 2 per transformers' Gemma4 EP plan comment), 128 experts "
        "top-8 of I = 704, a dense MLP of 2112 beside them in every layer, vocabulary 262144, tied embeddings. "
        "Checked by what they imply: 25.2 B parameters and 3.8 B active (the model card's), 210 KiB of KV cache "
        "per token (colaberry.ai's figure; counting V of the global layers once)."),
}


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    """How the step is spread over the chips (the seed measurement does not say: an assumption, `PLAN_SOURCE`)."""

    chips: int = 8
    expert_parallel: int = 8
    experts_collective: str = "all-reduce of the B x H experts output per MoE layer"

    def local_experts(self, model: DecodeModel) -> int:
        return model.experts // self.expert_parallel


PLAN = ParallelPlan()
PLAN_SOURCE = (
    "Assumed: Hugging Face does not say which plan its v6e-8 measurement used (benchmarks/results/multichip.json: "
    "'layout not stated'). Taken: DistributedConfig(tp_size=8, ep_size=8, tp_plan={}) with ep_implementation "
    "'auto', which at inference runs 'all_reduce' (transformers 5.25 distributed/configuration_utils.py): each chip "
    "holds 16 of the 128 experts, sees every token, computes its own experts' picks (others are sentinels) and the "
    "outputs are summed by one all-reduce per MoE layer. Attention, norms, router, Gemma 4's dense MLP, embeddings "
    "and lm_head are replicated on every chip: transformers cannot shard either model's attention 8 ways "
    "(get_kv_heads_per_rank returns None for Qwen3's 4 KV heads and Gemma 4's 2 global KV heads, and Gemma 4's "
    "base_model_ep_plan says 'do not tp in attention'), so tp_plan={} is the plan under which both run exactly.")
