"""The MLA layers priced, the calls priced on each, and what a call must at least read.

Per chip, an MLA layer's attention is its query heads and four widths: the latent L (kv_lora_rank), the rope keys R,
the no-rope part of a query or key head (nope) and a value head (v). Every size is the released checkpoint's config
(`SOURCES`); heads are per chip under the stated parallel plan.
"""

from __future__ import annotations

import dataclasses

ITEMSIZE = 2  # bf16 activations, weights and cache
GENERATIONS = ("v5e", "v6e", "v5p", "tpu7x")


@dataclasses.dataclass(frozen=True)
class MlaModel:
    """One MLA layer as one chip runs it."""

    key: str
    name: str
    heads: int  # query heads on the chip
    latent: int  # L
    rope: int  # R
    nope: int
    v: int
    generations: tuple[str, ...]
    plan: str
    decode_only: bool = False

    @property
    def key_dim(self) -> int:
        """An expanded key head: nope + R."""
        return self.nope + self.rope

    @property
    def latent_key_dim(self) -> int:
        """A latent key: L + R."""
        return self.latent + self.rope


MODELS = (
    MlaModel("moonlight-16b-a3b", "Moonlight-16B-A3B / DeepSeek-V2-Lite / DeepSeek-V3 TP8", heads=16, latent=512,
             rope=64, nope=128, v=128, generations=GENERATIONS,
             plan="16 heads per chip: Moonlight-16B-A3B and DeepSeek-V2-Lite whole (attention replicated), and "
                  "DeepSeek-V3 (128 heads) under TP8 over a v5p or TPU7x slice: the same per-chip layer"),
    MlaModel("deepseek-v3", "DeepSeek-V3, attention data-parallel", heads=128, latent=512, rope=64, nope=128, v=128,
             generations=("v5p", "tpu7x"), decode_only=True,
             plan="all 128 heads on each chip, each chip its own requests (vLLM's data-parallel attention for "
                  "DeepSeek; its MLA kernel's tuned table is keyed at 128 heads)"),
    MlaModel("glm-4.7-flash", "GLM-4.7-Flash", heads=20, latent=512, rope=64, nope=192, v=256, generations=("v6e",),
             plan="one v6e-8, attention replicated (20 heads do not split 8 ways)"),
)
MODELS_BY_KEY = {model.key: model for model in MODELS}

SOURCES = {
    "moonlight-16b-a3b": "moonshotai/Moonlight-16B-A3B and deepseek-ai/DeepSeek-V2-Lite config.json: "
                         "num_attention_heads 16, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, "
                         "v_head_dim 128, q_lora_rank null; deepseek-ai/DeepSeek-V3: 128 heads of the same widths, "
                         "16 per chip under TP8",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3 config.json: num_attention_heads 128, kv_lora_rank 512, "
                   "qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128",
    "glm-4.7-flash": "zai-org/GLM-4.7-Flash config.json (Glm4MoeLite): num_attention_heads 20, kv_lora_rank 512, "
                     "qk_rope_head_dim 64, qk_nope_head_dim 192, v_head_dim 256",
}


@dataclasses.dataclass(frozen=True)
class Call:
    """One attention call: B sequences, each with q_len new queries as the last of kv_len keys (causal)."""

    kind: str  # "decode" | "prefill"
    batch: int
    q_len: int
    kv_len: int

    @property
    def label(self) -> str:
        if self.kind == "decode":
            return f"decode B={self.batch} cache={self.kv_len}"
        cached = self.kv_len - self.q_len
        return f"prefill {self.q_len}" + (f" over {cached} cached" if cached else " from empty")

    @property
    def visible_pairs(self) -> int:
        """Causal (query, key) pairs per head, over the batch."""
        q, s = self.q_len, self.kv_len
        return self.batch * (q * (s - q + 1) + q * (q - 1) // 2)


# Key lengths at bucket boundaries (powers of two), so no call pads its keys (`padding.Buckets`).
# The tracked set: the largest decode batch over a short cache and the smallest over a long one, a chunk over a
# cache, a prefill from empty and a long chunk over a long cache (each call costs compiles on every generation).
DECODE = (Call("decode", 64, 1, 4096), Call("decode", 8, 1, 32768))
PREFILL = (Call("prefill", 1, 1024, 4096), Call("prefill", 1, 4096, 4096), Call("prefill", 1, 8192, 16384))
QUICK = (DECODE[0], PREFILL[0])


def calls(model: MlaModel, quick: bool = False) -> tuple[Call, ...]:
    found = QUICK if quick else DECODE + PREFILL
    if model.decode_only:
        return found[:1]
    return found


def latent_cache_bytes(model: MlaModel, call: Call) -> int:
    """The latent cache read once: every sequence's kv_len keys, L + R wide."""
    return call.batch * call.kv_len * model.latent_key_dim * ITEMSIZE


def absorbed_flops(model: MlaModel, call: Call) -> int:
    """The absorbed form's useful work: W_UK and W_UV per query head, and the visible pairs' (L + R) + L products."""
    queries = call.batch * call.q_len * model.heads
    return (2 * queries * model.latent * (model.nope + model.v)
            + 2 * call.visible_pairs * model.heads * (model.latent_key_dim + model.latent))
