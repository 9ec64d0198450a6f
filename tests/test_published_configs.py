"""The attention fields of every family's published config.json load in ``MLAConfig.from_hf``
and give the MLA fields that matter (dimensions, softmax scale, RoPE type and scaling, indexer,
MLA layers, latent scales), each checked against a value computed here from the published
numbers, not from mla.

The dicts are config.json as published, cut to the keys the attention reads plus a few others a
config.json carries (which from_hf ignores by design), typed from the model cards. Where a
public repository holds a copy, its values agree: Kimi-Linear-48B's dimensions, 27 layers and
linear_attn_config.full_attn_layers (a third-party test's copy of the released config), GLM-5's
78 layers (a third-party check of the official config). MiniCPM3-4B's long and short factors
are its model card's 16 values (qk_rope_head_dim / 2); with original_max_position_embeddings
= max_position_embeddings its attention_factor is 1.
"""
from __future__ import annotations

import math

import pytest
import torch

import mla

_V3_YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096, "type": "yarn"}
_MINICPM3_FACTORS = [1.0591234137867171, 1.1241891283591912, 1.2596935748670968, 1.5380380402321725,
                     2.093455103147521, 3.1754131163793253, 5.133010681668758, 8.406398880851477,
                     13.10016154429218, 18.57131298124567, 24.105458755046007, 29.126106697567396,
                     33.28143108440587, 36.38640193924856, 38.52063614233416, 39.905011931562376]

PUBLISHED = {
    "deepseek-ai/DeepSeek-V2-Lite": {
        "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048,
        "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 27, "q_lora_rank": None,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "max_position_embeddings": 163840, "rope_theta": 10000, "attention_bias": False, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                         "original_max_position_embeddings": 4096, "type": "yarn"}},
    "deepseek-ai/DeepSeek-V3": {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
        "num_attention_heads": 128, "num_key_value_heads": 128, "num_hidden_layers": 61, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "max_position_embeddings": 163840, "rope_theta": 10000, "attention_bias": False, "rms_norm_eps": 1e-06,
        "rope_scaling": dict(_V3_YARN),
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]}},
    "moonshotai/Kimi-K2-Instruct": {
        "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
        "num_attention_heads": 64, "num_key_value_heads": 64, "num_hidden_layers": 61, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "max_position_embeddings": 131072, "rope_theta": 50000.0, "attention_bias": False,
        "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"}},
    "deepseek-ai/DeepSeek-V3.2-Exp": {
        "model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"], "hidden_size": 7168,
        "num_attention_heads": 128, "num_key_value_heads": 128, "num_hidden_layers": 61, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048,
        "max_position_embeddings": 163840, "rope_theta": 10000, "rope_scaling": dict(_V3_YARN)},
    "zai-org/GLM-4.7-Flash": {
        "model_type": "glm4_moe_lite", "architectures": ["Glm4MoeLiteForCausalLM"], "hidden_size": 2048,
        "num_attention_heads": 20, "num_key_value_heads": 20, "num_hidden_layers": 47, "q_lora_rank": 768,
        "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
        "max_position_embeddings": 202752, "rope_theta": 1000000, "attention_bias": False, "rms_norm_eps": 1e-05},
    "zai-org/GLM-5": {
        "model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"], "hidden_size": 6144,
        "num_attention_heads": 64, "num_key_value_heads": 64, "num_hidden_layers": 78, "q_lora_rank": 2048,
        "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
        "index_topk": 2048, "index_n_heads": 32, "index_head_dim": 128, "max_position_embeddings": 202752,
        "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"}, "rms_norm_eps": 1e-05},
    "openbmb/MiniCPM3-4B": {
        "model_type": "minicpm3", "architectures": ["MiniCPM3ForCausalLM"], "hidden_size": 2560,
        "num_attention_heads": 40, "num_key_value_heads": 40, "num_hidden_layers": 62, "q_lora_rank": 768,
        "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "max_position_embeddings": 32768,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-05, "scale_emb": 12, "dim_model_base": 256, "scale_depth": 1.4,
        "rope_scaling": {"type": "longrope", "long_factor": list(_MINICPM3_FACTORS),
                         "short_factor": list(_MINICPM3_FACTORS), "original_max_position_embeddings": 32768}},
    "mistralai/Mistral-Small-4": {   # a mistral3 wrapper: the attention is its text_config's
        "model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"],
        "vision_config": {"model_type": "pixtral"},
        "text_config": {
            "model_type": "mistral4", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32,
            "num_hidden_layers": 36, "q_lora_rank": 1024, "kv_lora_rank": 256, "qk_nope_head_dim": 64,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 1048576,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0,
                                "original_max_position_embeddings": 8192, "beta_fast": 32.0, "beta_slow": 1.0,
                                "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}}},
    "meituan-longcat/LongCat-Flash-Chat": {
        "model_type": "longcat_flash", "architectures": ["LongcatFlashForCausalLM"], "hidden_size": 6144,
        "num_attention_heads": 64, "num_layers": 28, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 131072,
        "rope_theta": 10000000.0, "mla_scale_q_lora": True, "mla_scale_kv_lora": True, "attention_bias": False,
        "rms_norm_eps": 1e-05},
    "moonshotai/Kimi-Linear-48B-A3B-Instruct": {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "hidden_size": 2304,
        "num_attention_heads": 32, "num_key_value_heads": 32, "num_hidden_layers": 27, "q_lora_rank": None,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "mla_use_nope": True, "rms_norm_eps": 1e-05, "model_max_length": 1048576,
        "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                               "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25,
                                              26],
                               "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4}},
}


def yarn_scale(dq: int, factor: float, mscale_all_dim: float) -> float:
    m = 0.1 * mscale_all_dim * math.log(factor) + 1
    return m * m / math.sqrt(dq)


# name -> (H, D, rq, r, dn, dr, dv, softmax_scale, rope_type, rope_interleave or None (unchecked))
EXPECTED = {
    "deepseek-ai/DeepSeek-V2-Lite": (16, 2048, None, 512, 128, 64, 128, yarn_scale(192, 40, 0.707), "yarn", True),
    "deepseek-ai/DeepSeek-V3": (128, 7168, 1536, 512, 128, 64, 128, 0.1352337788608801, "yarn", True),
    "moonshotai/Kimi-K2-Instruct": (64, 7168, 1536, 512, 128, 64, 128, yarn_scale(192, 32, 1.0), "yarn", True),
    "deepseek-ai/DeepSeek-V3.2-Exp": (128, 7168, 1536, 512, 128, 64, 128, 0.1352337788608801, "yarn", True),
    "zai-org/GLM-4.7-Flash": (20, 2048, 768, 512, 192, 64, 256, 256 ** -0.5, "default", True),
    "zai-org/GLM-5": (64, 6144, 2048, 512, 192, 64, 256, 256 ** -0.5, "default", True),
    "openbmb/MiniCPM3-4B": (40, 2560, 768, 256, 64, 32, 64, 96 ** -0.5, "longrope", False),
    "mistralai/Mistral-Small-4": (32, 4096, 1024, 256, 64, 64, 128, yarn_scale(128, 128, 1.0), "yarn", None),
    "meituan-longcat/LongCat-Flash-Chat": (64, 6144, 1536, 512, 128, 64, 128, 192 ** -0.5, "default", True),
    "moonshotai/Kimi-Linear-48B-A3B-Instruct": (32, 2304, None, 512, 128, 64, 128, 192 ** -0.5, "none", None),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_config_loads(name):
    cfg = mla.MLAConfig.from_hf(PUBLISHED[name])
    H, D, rq, r, dn, dr, dv, scale, rope_type, interleave = EXPECTED[name]
    assert (cfg.num_heads, cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank) == (H, D, rq, r)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (dn, dr, dv)
    assert cfg.softmax_scale == pytest.approx(scale, rel=1e-12)
    assert cfg.rope_type == rope_type
    if interleave is not None:
        assert cfg.rope_interleave is interleave
    if rope_type == "yarn":     # mscale == mscale_all_dim in every published YaRN config: cos/sin unscaled
        assert cfg.rope_scaling.cos_sin_scale == pytest.approx(1.0)
    # a layer builds from it (on the meta device: no memory)
    layer_idx = cfg.mla_layers[0] if cfg.mla_layers else 0
    mla.MLA(cfg, layer_idx=layer_idx, dtype=torch.bfloat16, device="meta")


def test_published_family_features():
    load = lambda name: mla.MLAConfig.from_hf(PUBLISHED[name])     # noqa: E731
    v3 = load("deepseek-ai/DeepSeek-V3")
    assert v3.rope_scaling.factor == 40 and v3.rope_scaling.original_max_position_embeddings == 4096
    assert v3.rope_theta == 10000 and v3.max_position_embeddings == 163840 and not v3.has_indexer
    assert load("moonshotai/Kimi-K2-Instruct").rope_theta == 50000.0
    v32 = load("deepseek-ai/DeepSeek-V3.2-Exp")
    assert (v32.index_topk, v32.index_n_heads, v32.index_head_dim) == (2048, 64, 128)
    assert not v32.index_rope_interleave and v32.index_weights_scale == pytest.approx(64 ** -0.5)
    glm5 = load("zai-org/GLM-5")
    assert (glm5.index_topk, glm5.index_n_heads, glm5.index_head_dim) == (2048, 32, 128)
    assert glm5.index_rope_interleave and glm5.rope_theta == 1000000
    cpm = load("openbmb/MiniCPM3-4B")
    assert cpm.longrope.short_factor == tuple(_MINICPM3_FACTORS) == cpm.longrope.long_factor
    assert cpm.longrope.original_max_position_embeddings == 32768 and cpm.longrope.attention_factor == 1.0
    m4 = load("mistralai/Mistral-Small-4")
    assert (m4.temperature_floor_scale, m4.temperature_beta) == (8192, 0.1)
    assert m4.rope_scaling.factor == 128.0 and m4.max_position_embeddings == 1048576
    longcat = load("meituan-longcat/LongCat-Flash-Chat")
    assert longcat.q_lora_scale == pytest.approx(2.0) and longcat.kv_lora_scale == pytest.approx(math.sqrt(12))
    kimi_linear = load("moonshotai/Kimi-Linear-48B-A3B-Instruct")
    assert kimi_linear.mla_layers == (3, 7, 11, 15, 19, 23, 26)
    assert kimi_linear.max_position_embeddings == 1048576
