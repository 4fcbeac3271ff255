"""Tiny, seeded models of every latent-attention (MLA) architecture of transformers 5.25, for kernelize's tests.

- `MLA_ARCHITECTURES[name]()` returns `(model, text_config)`: the architecture's text-generating class
  (`...ForCausalLM`, or `...ForConditionalGeneration` where the text model has no causal LM of its own), randomly
  initialised under `torch.manual_seed(0)`, float32, in eval mode, fed text only. `text_config` is the config the
  attention modules read (the model's own config, or its `text_config`).
- `MLA_ATTENTION_MODULES[name]`: the names of the modules that carry `expand_kv`. Key on `expand_kv`, not on
  names: LongCat's are `self_attn.0` / `self_attn.1`, and in the hybrid models the linear-attention modules are
  called `self_attn` too.
- `MLA_UNBUILDABLE`: name -> why, for an `expand_kv` architecture that cannot be built. All 18 build.
- `MLA_DSA`: the architectures with DSA indexers.
- `MLA_NO_CONTINUOUS_BATCHING`: name -> the layer type for which transformers' `generate_batch` refuses the model.

Every model:
- hidden 64, 2-4 layers, 4 query heads (MLA expands the latent to as many KV heads; dots3-note's sliding-window
  layer has 2), kv_lora_rank 16, qk_rope_head_dim 8, qk_nope_head_dim 16 and v_head_dim 16: keys (24 wide) and
  values (16) differ, as DeepSeek's 192 / 128 do. The NoPE architecture (GLM-5-Next) has rope 0, nope 8, v 16.
  q_lora_rank 32 on 13 of the 18; None on DeepSeek-V2, Kimi Linear, Bailing and Youtu; Mistral Large 4 has no
  q LoRA at all.
- vocabulary 128 with bos 1, eos 2, pad 0. The multimodal ones keep their image / video token ids: text input
  never reaches their vision towers.
- MoE: 4 routed experts, top-2, one shared expert.
- DSA: each indexer keeps 4 keys, fewer than the self-check's 6-token prompt, so the sparse mask leaves keys out.
  16 index heads of 16: with few heads, ReLU'd index scores often tie at exactly 0, and which tied key the top-k
  takes then depends on the key length, so a dynamic and a static cache would select different keys.
- init: 3-D weights (experts, short convolutions) are drawn from normal(std=0.1), since some models leave experts
  empty. Parameters that come out constant (norm weights, sinks, gates that start at 0) get normal(std=0.1) noise.
  The embedding's pad row stays zero, as in every real model.
- each generates with a `DynamicCache` and with `cache_implementation="static"` on the CPU, left padding
  included, the same tokens both ways (tests/test_mla_models.py).
"""

import torch
from transformers import (AXK1Config, AXK1ForCausalLM, AXK2Config, AXK2ForCausalLM, BailingHybridConfig,
    BailingHybridForCausalLM, DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV32Config, DeepseekV32ForCausalLM,
    DeepseekV3Config, DeepseekV3ForCausalLM, Dots3NoteForCausalLM, Dots3NoteTextConfig, Glm4MoeLiteConfig,
    Glm4MoeLiteForCausalLM, Glm5NextConfig, Glm5NextForConditionalGeneration, GlmMoeDsaConfig, GlmMoeDsaForCausalLM,
    HYV4Config, HYV4ForCausalLM, HYV4VLConfig, HYV4VLForConditionalGeneration, KimiLinearConfig,
    KimiLinearForCausalLM, LongcatFlashConfig, LongcatFlashForCausalLM, MiniCPM3Config, MiniCPM3ForCausalLM,
    Mistral4Config, Mistral4ForCausalLM, MistralLarge4Config, MistralLarge4ForConditionalGeneration,
    MistralLarge4TextConfig, YoutuConfig, YoutuForCausalLM)

SHAPES = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
NOPE = {**SHAPES, "qk_rope_head_dim": 0, "qk_nope_head_dim": 8}
EXPERTS = dict(intermediate_size=96, moe_intermediate_size=32, num_experts_per_tok=2, n_shared_experts=1)
MOE = dict(**EXPERTS, n_routed_experts=4)
DSA = dict(index_topk=4, index_head_dim=16, index_n_heads=16)
# Tiny towers for the multimodal classes; text input never runs them.
GLM5_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                   projection_intermediate_size=64, patch_size=4, image_size=16)
HY_VISION = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=1,
                 out_hidden_size=64, patch_size=4, max_image_size=32)
PIXTRAL = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, patch_size=4, image_size=16, head_dim=16)


def _yarn_over(config_class, original=8):
    """`config_class`'s default YaRN parameters over a pretraining window of `original` tokens, and the context its
    factor scales that window to (max_position_embeddings), so that transformers finds them consistent."""
    rope = dict(config_class().rope_parameters, original_max_position_embeddings=original)
    rope.pop("partial_rotary_factor", None)  # the default's head dims, not ours: the config derives it again
    context = int(rope["factor"] * original)
    if "max_position_embeddings" in rope:
        rope["max_position_embeddings"] = context
    return dict(rope_parameters=rope, max_position_embeddings=context)


def _build(model_class, config, text_config=None):
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 3:
                parameter.normal_(std=0.1)
            elif (parameter == parameter.flatten()[0]).all():
                parameter.add_(torch.randn_like(parameter), alpha=0.1)
    return model, text_config or config


def axk1():
    """A.X-K1: DeepSeek-V3 MLA (q LoRA, interleaved RoPE); grouped routing (2 groups, top-1 group)."""
    return _build(AXK1ForCausalLM, AXK1Config(
        **SHAPES, **MOE, num_hidden_layers=2, q_lora_rank=32, n_group=2, topk_group=1))


def axk2():
    """A.X-K2: DSA (a full indexer on every layer, top-4). No `q_b_proj`: `q_gate_proj` maps [q_resid, q_latent]
    to the query and a per-channel sigmoid gate on the attention output. Flash and flex attention are unsupported
    in transformers (`_supports_flash_attn = False`); SDPA or eager."""
    return _build(AXK2ForCausalLM, AXK2Config(
        **SHAPES, **MOE, **DSA, num_hidden_layers=2, q_lora_rank=32, gated_norm_rank=8))


def bailing_hybrid():
    """Bailing hybrid (Ring-linear): layer 0 linear attention (KDA, `BailingHybridDeltaAttention`, also named
    `self_attn`), layer 1 MLA without q LoRA, interleaved RoPE, a per-head sigmoid gate (`g_proj`) on the output.
    On the CPU the KDA kernels fall back to transformers' PyTorch reference (flash-linear-attention is CUDA-only);
    they say so in a log line. No MTP layers."""
    config = BailingHybridConfig(
        **SHAPES, **EXPERTS, num_local_experts=4, num_hidden_layers=2, layer_group_size=2, first_k_dense_replace=1,
        q_lora_rank=None, n_group=2, topk_group=1, head_dim=16, num_mtp_layers=0)
    return _build(BailingHybridForCausalLM, config)


def deepseek_v2():
    """DeepSeek-V2 (the Lite layout: no q LoRA). RoPE through complex `freqs_cis` (`apply_rotary_emb`), greedy
    top-2 routing."""
    return _build(DeepseekV2ForCausalLM, DeepseekV2Config(
        **SHAPES, **MOE, num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=None, topk_method="greedy"))


def deepseek_v3():
    """DeepSeek-V3: q LoRA, interleaved RoPE, grouped routing. Default RoPE (the config's default has no YaRN)."""
    return _build(DeepseekV3ForCausalLM, DeepseekV3Config(
        **SHAPES, **MOE, num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=32, n_group=2, topk_group=1))


def deepseek_v32():
    """DeepSeek-V3.2: DSA, a full indexer (queries from the q LoRA residual) on every layer, top-4. No flash or
    flex attention in transformers; SDPA or eager."""
    return _build(DeepseekV32ForCausalLM, DeepseekV32Config(
        **SHAPES, **MOE, **DSA, num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=32, n_group=2,
        topk_group=1))


def dots3_note():
    """dots3-note, its text causal LM (`Dots3NoteForCausalLM` on `Dots3NoteTextConfig`; the multimodal class is
    not needed for text). Layers 0-1 DSA (full indexers, top-4); layer 2 sliding-window MLA (window 4, its cache
    keeps 3 tokens) with its own dims through `per_layer_config`: 2 heads, kv_lora 32, q_lora 32, nope 8, rope 8,
    v 8. RoPE theta and rotary fraction per layer type. The q and kv latents are scaled by sqrt(hidden / rank),
    the rope key has its own RMSNorm (`k_rope_only_layernorm`), a per-head sigmoid gate (`g_proj`) scales the
    output. Flash attention unsupported for the DSA layers; SDPA or eager."""
    config = Dots3NoteTextConfig(
        **SHAPES, **MOE, **DSA, num_hidden_layers=3, q_lora_rank=32, head_dim=24, sliding_window=4,
        shared_experts_intermediate_size=32, n_group=2, topk_group=1, swa_num_attention_heads=2,
        swa_num_key_value_heads=2, swa_q_lora_rank=32, swa_kv_lora_rank=32, swa_head_dim=16,
        swa_qk_nope_head_dim=8, swa_qk_rope_head_dim=8, swa_v_head_dim=8)
    return _build(Dots3NoteForCausalLM, config)


def glm4_moe_lite():
    """GLM-4.7-Flash (GLM-4-MoE-Lite): DeepSeek-V3 MLA with q LoRA and interleaved RoPE."""
    return _build(Glm4MoeLiteForCausalLM, Glm4MoeLiteConfig(
        **SHAPES, **MOE, num_hidden_layers=2, q_lora_rank=32))


def glm5_next():
    """GLM-5-Next (`Glm5NextForConditionalGeneration`; the text model has no causal LM of its own, a 1-layer
    vision tower rides along unused). Layer 0 linear attention (KDA, named `self_attn`), layers 1-2 NoPE MLA
    (rope 0, which the config requires for DSA, so the cached `k_rot` is 0 wide) with DSA over k-pools of 2
    (index_topk 4 = 2 pools, plus the incomplete tail pool); layer 2 reuses layer 1's top-k (`"shared"`). The
    attention mask reaching the attention interface is built from the top-k alone: the indexer applies causality
    and padding. Sharing only works between consecutive MLA layers (a linear layer passes no top-k on). mHC
    residual streams (hc_mult 2). SDPA or eager only; KDA falls back to PyTorch on the CPU."""
    text = dict(**NOPE, **MOE, **DSA, num_hidden_layers=3, q_lora_rank=32, index_kpool=2,
                layer_types=["linear_attention", "indexed_attention", "indexed_attention"],
                indexer_types=["full", "full", "shared"], mlp_layer_types=["dense", "sparse", "sparse"],
                linear_head_dim=16, linear_num_heads=4, hc_mult=2)
    config = Glm5NextConfig(text_config=text, vision_config=GLM5_VISION)
    return _build(Glm5NextForConditionalGeneration, config, config.text_config)


def glm_moe_dsa():
    """GLM-5 (GLM-MoE-DSA): DSA with q LoRA; layer 1 reuses layer 0's top-k (`"shared"`), layer 2 runs its own.
    Interleaved RoPE. No flash or flex attention in transformers; SDPA or eager."""
    return _build(GlmMoeDsaForCausalLM, GlmMoeDsaConfig(
        **SHAPES, **MOE, **DSA, num_hidden_layers=3, first_k_dense_replace=1, q_lora_rank=32,
        indexer_types=["full", "shared", "full"]))


def hy_v4():
    """HY v4: DSA, layer 1 `"shared"`; learned attention sinks (`sinks`, passed as `s_aux`), a per-channel sigmoid
    output gate (`gate_proj`), iHC residual streams (hc_mult 4). transformers supports neither SDPA nor flash
    here: the model runs eager attention (`config._attn_implementation == "eager"`)."""
    return _build(HYV4ForCausalLM, HYV4Config(
        **SHAPES, **MOE, **DSA, num_hidden_layers=2, q_lora_rank=32, indexer_types=["full", "shared"]))


def hy_v4_vl():
    """HY v4 VL (`HYV4VLForConditionalGeneration`, a 1-layer vision tower unused): HY v4's attention (DSA with a
    shared layer, sinks, output gate, eager) under 3-D M-RoPE, mrope_section [2, 1, 1] (sums to rope / 2); text
    positions are equal on the three axes."""
    text = dict(**SHAPES, **MOE, **DSA, num_hidden_layers=2, q_lora_rank=32, indexer_types=["full", "shared"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    config = HYV4VLConfig(text_config=text, vision_config=HY_VISION)
    return _build(HYV4VLForConditionalGeneration, config, config.text_config)


def kimi_linear():
    """Kimi Linear: layer 0 KDA linear attention (`KimiLinearDeltaAttention`, named `self_attn`), layer 1 NoPE
    MLA without q LoRA: its 8-wide `k_rot` is cached and shared by all heads but never rotated (no position
    embeddings reach the attention). KDA falls back to PyTorch on the CPU."""
    config = KimiLinearConfig(
        **SHAPES, **EXPERTS, num_local_experts=4, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], q_lora_rank=None, linear_head_dim=16, linear_num_heads=4)
    return _build(KimiLinearForCausalLM, config)


def longcat_flash():
    """LongCat-Flash: one decoder layer with two MLA modules, `self_attn.0` and `self_attn.1` (cache layers 0 and
    1; num_hidden_layers is 2 * num_layers). q LoRA; the q and kv latents are scaled by sqrt(hidden / rank).
    Routing includes 2 zero (identity) experts. The class declares `_can_compile_fullgraph = False`."""
    return _build(LongcatFlashForCausalLM, LongcatFlashConfig(
        **SHAPES, num_layers=1, q_lora_rank=32, head_dim=8, ffn_hidden_size=96, expert_ffn_hidden_size=32,
        n_routed_experts=4, zero_expert_num=2, moe_topk=2))


def minicpm3():
    """MiniCPM3: dense MLA with q LoRA and non-interleaved (`rotate_half`) RoPE; embedding and depth scaling."""
    return _build(MiniCPM3ForCausalLM, MiniCPM3Config(
        **SHAPES, intermediate_size=96, num_hidden_layers=2, q_lora_rank=32))


def mistral4():
    """Mistral 4: q LoRA, interleaved RoPE under the default YaRN (factor 128) over an 8-token window (so
    max_position_embeddings is 1024), and Llama-4 query scaling by position (1 + 0.1 log(1 + floor(pos / 8))). Its
    `config.head_dim` is nope + rope (24), unlike the others, where it is the rope width."""
    return _build(Mistral4ForCausalLM, Mistral4Config(
        **{**SHAPES, **_yarn_over(Mistral4Config)}, **MOE, num_hidden_layers=2, q_lora_rank=32))


def mistral_large4():
    """Mistral Large 4 (`MistralLarge4ForConditionalGeneration`, a 1-layer Pixtral tower unused). No q LoRA
    (`q_proj`). Layers 0-1 RoPE, 2-3 NoPE (their modules have qk_rope 0 and nope 24; the nope cache's `k_rot` is 0
    wide). KV sharing, `kv_sharing_modes` [store, reuse, store, reuse_but_indexer]: layers 1 and 3 have no
    `kv_a_proj_with_mqa` and attend over the latent of layer 0 / 2 (cache layer 1 is a `DummyLayer`, cache layer 3
    holds only the indexer keys). DSA with indexer queries from the hidden states; layer 1 `"shared"`. A learned
    log-position scale on the queries, default YaRN (factor 2048) over an 8-token window, final logit softcap 30.
    No flash or flex attention in transformers; SDPA or eager."""
    text = dict(**{**SHAPES, **_yarn_over(MistralLarge4TextConfig)}, **MOE, **DSA, num_hidden_layers=4,
                no_rope_layers=[1, 1, 0, 0], kv_source_layers=[0, 0, 2, 2],
                indexer_types=["full", "shared", "full", "full"])
    config = MistralLarge4Config(text_config=text, vision_config=PIXTRAL)
    return _build(MistralLarge4ForConditionalGeneration, config, config.text_config)


def youtu():
    """Youtu-LLM: dense MLA, no q LoRA, interleaved RoPE, tied embeddings."""
    return _build(YoutuForCausalLM, YoutuConfig(
        **SHAPES, intermediate_size=96, num_hidden_layers=2, q_lora_rank=None))


MLA_ARCHITECTURES = {builder.__name__: builder for builder in (
    axk1, axk2, bailing_hybrid, deepseek_v2, deepseek_v3, deepseek_v32, dots3_note, glm4_moe_lite, glm5_next,
    glm_moe_dsa, hy_v4, hy_v4_vl, kimi_linear, longcat_flash, minicpm3, mistral4, mistral_large4, youtu)}
MLA_UNBUILDABLE: dict[str, str] = {}
# The DSA ones: an indexer picks each query's top-k keys (index_topk 4, fewer than the self-check's 6 prompt tokens).
MLA_DSA = ("axk2", "deepseek_v32", "dots3_note", "glm5_next", "glm_moe_dsa", "hy_v4", "hy_v4_vl", "mistral_large4")
# transformers' continuous batching (`generate_batch`) pages the latent cache of plain MLA layers, but has no cache
# for DSA ("indexed_attention") or linear-attention layers: it raises "Invalid layer type: <the first it meets>".
# The other eight run it, with the tokens `generate` gives.
MLA_NO_CONTINUOUS_BATCHING = {
    **dict.fromkeys(("axk2", "deepseek_v32", "dots3_note", "glm_moe_dsa", "hy_v4", "hy_v4_vl", "mistral_large4"),
                    "indexed_attention"),
    **dict.fromkeys(("bailing_hybrid", "glm5_next", "kimi_linear"), "linear_attention"),
}


def _layers(prefix, indices):
    return tuple(f"{prefix}.{index}.self_attn" for index in indices)


MLA_ATTENTION_MODULES = {
    **{name: _layers("model.layers", range(2)) for name in (
        "axk1", "axk2", "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "hy_v4", "minicpm3",
        "mistral4", "youtu")},
    "bailing_hybrid": _layers("model.layers", [1]),
    "dots3_note": _layers("model.layers", range(3)),
    "glm5_next": _layers("model.language_model.layers", [1, 2]),
    "glm_moe_dsa": _layers("model.layers", range(3)),
    "hy_v4_vl": _layers("model.language_model.layers", range(2)),
    "kimi_linear": _layers("model.layers", [1]),
    "longcat_flash": ("model.layers.0.self_attn.0", "model.layers.0.self_attn.1"),
    "mistral_large4": _layers("model.language_model.layers", range(4)),
}
