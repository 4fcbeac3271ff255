"""Tiny, seeded builders of every latent-attention (MLA) architecture of transformers 5.25, for kernelize's tests."""

import torch
import transformers

SHAPES = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
NOPE = {**SHAPES, "qk_rope_head_dim": 0, "qk_nope_head_dim": 8}
MOE = dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
           n_shared_experts=1)
DSA = dict(index_topk=4, index_head_dim=16, index_n_heads=16)


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
    return _build(transformers.AXK1ForCausalLM, transformers.AXK1Config(
        **SHAPES, **MOE, num_hidden_layers=2, q_lora_rank=32, n_group=2, topk_group=1))


def axk2():
    return _build(transformers.AXK2ForCausalLM, transformers.AXK2Config(
        **SHAPES, **MOE, **DSA, num_hidden_layers=2, q_lora_rank=32, gated_norm_rank=8))


def bailing_hybrid():
    config = transformers.BailingHybridConfig(
        **{**SHAPES, "n_routed_experts": None}, **{k: v for k, v in MOE.items() if k != "n_routed_experts"},
        num_local_experts=4, num_hidden_layers=2, layer_group_size=2, first_k_dense_replace=1, q_lora_rank=None,
        n_group=2, topk_group=1, head_dim=16, num_mtp_layers=0)
    return _build(transformers.BailingHybridForCausalLM, config)


def deepseek_v2():
    return _build(transformers.DeepseekV2ForCausalLM, transformers.DeepseekV2Config(
        **SHAPES, **MOE, num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=None, topk_method="greedy"))


def deepseek_v3():
    return _build(transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config(
        **SHAPES, **MOE, num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=32, n_group=2, topk_group=1))


def deepseek_v32():
    return _build(transformers.DeepseekV32ForCausalLM, transformers.DeepseekV32Config(
        **SHAPES, **MOE, **DSA, num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=32, n_group=2,
        topk_group=1))


def glm4_moe_lite():
    return _build(transformers.Glm4MoeLiteForCausalLM, transformers.Glm4MoeLiteConfig(
        **SHAPES, **MOE, num_hidden_layers=2, q_lora_rank=32))


def glm_moe_dsa():
    return _build(transformers.GlmMoeDsaForCausalLM, transformers.GlmMoeDsaConfig(
        **SHAPES, **MOE, **DSA, num_hidden_layers=3, first_k_dense_replace=1, q_lora_rank=32,
        indexer_types=["full", "shared", "full"]))


def hy_v4():
    return _build(transformers.HYV4ForCausalLM, transformers.HYV4Config(
        **SHAPES, **MOE, **DSA, num_hidden_layers=2, q_lora_rank=32, indexer_types=["full", "shared"]))


def kimi_linear():
    config = transformers.KimiLinearConfig(
        **{k: v for k, v in SHAPES.items()}, intermediate_size=96, moe_intermediate_size=32, num_local_experts=4,
        num_experts_per_token=2, num_shared_experts=1, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], q_lora_rank=None, linear_head_dim=16, linear_num_heads=4)
    return _build(transformers.KimiLinearForCausalLM, config)


def longcat_flash():
    return _build(transformers.LongcatFlashForCausalLM, transformers.LongcatFlashConfig(
        **SHAPES, num_layers=1, q_lora_rank=32, head_dim=8, ffn_hidden_size=96, expert_ffn_hidden_size=32, n_routed_experts=4,
        zero_expert_num=2, moe_topk=2))


def minicpm3():
    return _build(transformers.MiniCPM3ForCausalLM, transformers.MiniCPM3Config(
        **SHAPES, intermediate_size=96, num_hidden_layers=2, q_lora_rank=32))


def mistral4():
    return _build(transformers.Mistral4ForCausalLM, transformers.Mistral4Config(
        **{**SHAPES, **_yarn_over(transformers.Mistral4Config)}, **MOE, num_hidden_layers=2, q_lora_rank=32))


def dots3_note():
    config = transformers.Dots3NoteTextConfig(
        **SHAPES, **MOE, **DSA, num_hidden_layers=3, q_lora_rank=32, head_dim=24, sliding_window=4,
        shared_experts_intermediate_size=32, n_group=2, topk_group=1, swa_num_attention_heads=2,
        swa_num_key_value_heads=2, swa_q_lora_rank=32, swa_kv_lora_rank=32, swa_head_dim=16,
        swa_qk_nope_head_dim=8, swa_qk_rope_head_dim=8, swa_v_head_dim=8)
    return _build(transformers.Dots3NoteForCausalLM, config)


def glm5_next():
    text = dict(**NOPE, **MOE, **DSA, num_hidden_layers=3, q_lora_rank=32, index_kpool=2,
                layer_types=["linear_attention", "indexed_attention", "indexed_attention"],
                indexer_types=["full", "full", "shared"], mlp_layer_types=["dense", "sparse", "sparse"],
                linear_head_dim=16, linear_num_heads=4, hc_mult=2)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                  projection_intermediate_size=64, patch_size=4, image_size=16)
    config = transformers.Glm5NextConfig(text_config=text, vision_config=vision)
    return _build(transformers.Glm5NextForConditionalGeneration, config, config.text_config)


def hy_v4_vl():
    text = dict(**SHAPES, **MOE, **DSA, num_hidden_layers=2, q_lora_rank=32, indexer_types=["full", "shared"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    vision = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=1,
                  out_hidden_size=64, patch_size=4, max_image_size=32)
    config = transformers.HYV4VLConfig(text_config=text, vision_config=vision)
    return _build(transformers.HYV4VLForConditionalGeneration, config, config.text_config)


def mistral_large4():
    text = dict(**{**SHAPES, **_yarn_over(transformers.MistralLarge4TextConfig)}, **MOE, **DSA, num_hidden_layers=4, no_rope_layers=[1, 1, 0, 0], kv_source_layers=[0, 0, 2, 2],
                indexer_types=["full", "shared", "full", "full"])
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, patch_size=4, image_size=16, head_dim=16)
    config = transformers.MistralLarge4Config(text_config=text, vision_config=vision)
    return _build(transformers.MistralLarge4ForConditionalGeneration, config, config.text_config)


def youtu():
    return _build(transformers.YoutuForCausalLM, transformers.YoutuConfig(
        **SHAPES, intermediate_size=96, num_hidden_layers=2, q_lora_rank=None))


MLA_ARCHITECTURES = {builder.__name__: builder for builder in (
    axk1, axk2, bailing_hybrid, deepseek_v2, deepseek_v3, deepseek_v32, dots3_note, glm4_moe_lite, glm5_next, glm_moe_dsa, hy_v4, hy_v4_vl,
    kimi_linear, longcat_flash, minicpm3, mistral4, mistral_large4, youtu)}
MLA_UNBUILDABLE = {}
