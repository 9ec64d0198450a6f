"""The MLA layer on its paged latent cache against transformers' DeepSeek attention.

Each test drives the public API (``mla.MLAConfig.from_hf``, ``mla.MLA``,
``mla.PagedLatentCache``) through a serving trace, and at every step compares the
rows of the new tokens with HF attention recomputed from scratch over each whole
sequence (``hf_util.hf_reference``).

Tolerances: float32 relative error (norm of difference / norm of reference) at most
``FP32_TOL`` per step, set from the arithmetic (HF float32 against float64 differs by
about 5e-7 overall, 2e-6 on a single row). bfloat16: our bf16 layer against the
float32 reference must be within 2x the error of HF's own module run in bf16 against
the same reference, plus ``BF16_SLACK``; both see the same bf16-rounded weights and inputs.
"""
from __future__ import annotations

import math

import pytest
import torch

import hf_util as H
import mla
from hf_util import FP32_TOL, Harness, layer_prefix

VARIANTS = list(H.VARIANTS)
DTYPES = [torch.float32, torch.bfloat16]


# ---------------------------------------------------------------------------------------
# Configuration


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("source", ["object", "legacy_dict", "dict"])
def test_from_hf_attributes(variant, source):
    hf_cfg = H.make_config(variant)
    cfg = mla.MLAConfig.from_hf(H.config_source(hf_cfg, source))
    assert cfg.hidden_size == hf_cfg.hidden_size
    assert cfg.num_heads == hf_cfg.num_attention_heads
    assert cfg.q_lora_rank == hf_cfg.q_lora_rank
    assert cfg.kv_lora_rank == hf_cfg.kv_lora_rank
    assert cfg.qk_nope_head_dim == hf_cfg.qk_nope_head_dim
    assert cfg.qk_rope_head_dim == hf_cfg.qk_rope_head_dim
    assert cfg.v_head_dim == hf_cfg.v_head_dim
    attn, _ = H.make_attention(hf_cfg, seed=0)
    assert cfg.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)


_YARN_V3 = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
_YARN_V2 = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
_YARN_K2 = {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}

# Published dimensions: (hidden, heads, q_lora_rank, kv_lora_rank, nope, rope, v), HF config.
PRESETS = {
    "deepseek-v3": ((7168, 128, 1536, 512, 128, 64, 128),
                    ("v3", dict(max_position_embeddings=163840, rope_theta=10000.0, rope_scaling=_YARN_V3))),
    "deepseek-v2": ((5120, 128, 1536, 512, 128, 64, 128),
                    ("v2", dict(max_position_embeddings=163840, rope_theta=10000.0, rope_scaling=_YARN_V2))),
    "deepseek-v2-lite": ((2048, 16, None, 512, 128, 64, 128),
                         ("v2", dict(max_position_embeddings=163840, rope_theta=10000.0,
                                     rope_scaling=_YARN_V2))),
    "kimi-k2": ((7168, 64, 1536, 512, 128, 64, 128),
                ("v3", dict(max_position_embeddings=131072, rope_theta=50000.0, rope_scaling=_YARN_K2))),
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_published_dims_and_scale(name):
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    dims, (arch, extra) = PRESETS[name]
    cfg = mla.MLAConfig.preset(name)
    got = (cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
           cfg.qk_rope_head_dim, cfg.v_head_dim)
    assert got == dims
    D, Hh, rq, r, dn, dr, dv = dims
    cls, attn_cls = (DeepseekV3Config, DeepseekV3Attention) if arch == "v3" else (DeepseekV2Config, DeepseekV2Attention)
    hf_cfg = cls(hidden_size=D, num_attention_heads=Hh, num_key_value_heads=Hh, q_lora_rank=rq, kv_lora_rank=r,
                 qk_nope_head_dim=dn, qk_rope_head_dim=dr, v_head_dim=dv, **extra)
    with torch.device("meta"):          # only .scaling is needed: no 100M-parameter allocation
        scaling = attn_cls(hf_cfg, 0).scaling
    assert cfg.softmax_scale == pytest.approx(scaling, rel=1e-12)
    factor, mscale_all_dim = extra["rope_scaling"]["factor"], extra["rope_scaling"]["mscale_all_dim"]
    mscale = 0.1 * mscale_all_dim * math.log(factor) + 1
    assert cfg.softmax_scale == pytest.approx(mscale ** 2 / math.sqrt(dn + dr), rel=1e-12)
    if name == "deepseek-v3":
        assert cfg.softmax_scale == pytest.approx(0.1352337788608801, rel=1e-12)
    # from_hf of the same published config agrees with the preset.
    from_hf = mla.MLAConfig.from_hf(hf_cfg)
    for attr in ("hidden_size", "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                 "qk_rope_head_dim", "v_head_dim", "softmax_scale"):
        assert getattr(from_hf, attr) == getattr(cfg, attr), attr


@torch.no_grad()
def _random_hf_state_dict(cfg, seed, prefix=layer_prefix(0)):
    """HF-named random weights for an MLAConfig known only through its public attributes."""
    g = torch.Generator().manual_seed(seed)
    Hh, D, dq = cfg.num_heads, cfg.hidden_size, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    shapes = {"kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, D),
              "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
              "kv_b_proj.weight": (Hh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
              "o_proj.weight": (D, Hh * cfg.v_head_dim)}
    if cfg.q_lora_rank is None:
        shapes["q_proj.weight"] = (Hh * dq, D)
    else:
        shapes.update({"q_a_proj.weight": (cfg.q_lora_rank, D), "q_a_layernorm.weight": (cfg.q_lora_rank,),
                       "q_b_proj.weight": (Hh * dq, cfg.q_lora_rank)})
    sd = {}
    for k, s in shapes.items():
        if len(s) == 1:
            sd[prefix + k] = 0.5 + torch.rand(s, generator=g)
        else:
            sd[prefix + k] = torch.randn(s, generator=g) * (2.0 / math.sqrt(s[1]))
    return sd


@torch.no_grad()
def test_tiny_preset_runs_and_paths_agree():
    """The tiny preset: one prefill of a sequence equals the same tokens fed in chunks and decodes."""
    cfg = mla.MLAConfig.preset("tiny")
    assert cfg.hidden_size <= 1024 and cfg.num_heads <= 16
    sd = _random_hf_state_dict(cfg, seed=3)
    layer = mla.MLA(cfg, layer_idx=0, dtype=torch.float32, device="cpu", backend="torch")
    layer.load_hf_state_dict(sd, prefix=layer_prefix(0))
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    outs = []
    for chunks in ([40], [30] + [1] * 10, [7, 13, 3, 1, 16], [5] + [3] * 11 + [2]):
        cache = mla.PagedLatentCache(cfg, num_layers=1, num_blocks=32, block_size=8, dtype=torch.float32,
                                     device="cpu")
        o, off = [], 0
        for n in chunks:
            o.append(layer(x[off:off + n], cache.prepare([(0, n)])))
            off += n
        assert cache.length(0) == 40
        outs.append(torch.cat(o))
    assert outs[0].abs().max() > 0.1
    for o in outs[1:]:
        assert H.rel_err(o, outs[0]) <= FP32_TOL


# ---------------------------------------------------------------------------------------
# The layer against transformers through serving traces.


@pytest.mark.parametrize("source", ["object", "legacy_dict", "dict"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_prefill(variant, dtype, source):
    h = Harness(variant, dtype, seed=1, source=source)
    h.step([(0, 23)])
    h.step([(1, 1), (2, 40), (3, 6)])        # several prompts in one call, one of them 1 token
    h.check_bf16()


@pytest.mark.parametrize("variant", ["v3", "v3_neox_mscale"])
def test_kimi_k2_config_dict(variant):
    """A Kimi K2 config.json (model_type kimi_k2) is DeepSeek-V3's attention."""
    h = Harness(variant, torch.float32, seed=12, source="kimi_dict")
    h.step([(0, 13)])
    h.step([(0, 1)])
    h.step([(0, 3)])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_decode(variant, dtype):
    h = Harness(variant, dtype, seed=2)
    h.step([(0, 10), (1, 5)])
    for i in range(8):
        h.step([(0, 1), (1, 1)] if i % 3 else [(1, 1), (0, 1)])
    h.step([(1, 1)])
    h.check_bf16()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_multi_token_decode_truncate(variant, dtype):
    """Speculative verify: 3 tokens per step, rejected ones truncated, decoding continues."""
    h = Harness(variant, dtype, seed=3, block_size=4)
    h.step([(0, 12), (1, 7)])              # 0 ends on a block boundary, 1 inside a block
    h.step([(0, 3), (1, 3)])               # 15, 10
    h.truncate(0, 13)                      # one accepted draft token
    h.truncate(1, 8)                       # drops back across a block boundary
    h.step([(1, 3), (0, 3)])               # 11, 16
    h.truncate(0, 16)                      # all accepted (a no-op truncate)
    h.truncate(1, 9)
    h.step([(0, 1), (1, 1)])
    h.step([(0, 3), (1, 3)])               # 20, 13
    h.truncate(0, 11)                      # drops whole blocks
    h.step([(0, 1)])
    h.step([(0, 2), (1, 1)])
    h.check_bf16()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_fork_divergent_continuations(variant, dtype):
    h = Harness(variant, dtype, seed=4, block_size=4)
    h.step([(0, 10)])                      # a partial last block (2 of 4)
    h.fork(0, 1)
    h.step([(0, 1), (1, 1)])               # both write into the shared partial block
    h.step([(1, 3)])
    h.step([(0, 2), (1, 1)])
    h.fork(1, 2)                           # a block boundary (length 15 -> partial 3 of 4)
    h.step([(2, 5)])                       # a prefill-size chunk on top of a forked prefix
    h.step([(1, 1), (2, 1), (0, 1)])
    h.fork(0, 3)
    h.truncate(3, 6)                       # the fork is truncated into a shared block
    h.step([(3, 3), (0, 1)])
    h.release(1)
    h.step([(2, 1), (3, 1), (0, 1)])
    h.check_bf16()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_cached_prefix_prefill(variant, dtype):
    """A prompt prefilled in chunks: every later chunk attends to a cached prefix."""
    h = Harness(variant, dtype, seed=5, block_size=4)
    h.step([(0, 9)])
    h.step([(0, 13)])
    h.step([(0, 1)])
    h.step([(1, 7), (2, 4)])
    h.step([(2, 10), (1, 5)])
    h.step([(1, 16), (2, 2)])
    h.check_bf16()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_mixed_batch(variant, dtype):
    """One call carrying a new prompt, a decode and a multi-token decode, in the caller's order."""
    h = Harness(variant, dtype, seed=6, block_size=4)
    h.step([(1, 11), (2, 8)])
    h.step([(0, 9), (1, 1), (2, 3)])       # prefill, decode, verify
    h.truncate(2, 10)
    h.step([(2, 3), (0, 1), (1, 5)])       # verify, decode, cached-prefix prefill
    h.step([(1, 1), (3, 6), (0, 3), (2, 1)])
    h.check_bf16()


@pytest.mark.parametrize("variant", ["v3", "v2_lite", "v3_neox_mscale"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_two_layers_share_one_batch(variant, dtype):
    """Two layers with different weights on one cache (num_layers=2), one batch per step."""
    h = Harness(variant, dtype, seed=7, num_layers=2, block_size=4)
    h.step([(0, 9), (1, 4)])
    h.step([(1, 1), (0, 3)])
    h.fork(0, 2)
    h.step([(2, 1), (0, 1), (1, 6)])
    h.truncate(0, 10)
    h.step([(0, 2), (2, 3), (1, 1)])
    h.check_bf16()


@pytest.mark.parametrize("variant", VARIANTS)
def test_paths_agree(variant):
    """Expanded prefill, cached-prefix prefill and absorbed decode of the same tokens agree
    with each other (float32), not only with transformers."""
    outs = []
    x = None
    for chunks in ([30], [24] + [1] * 6, [4, 11, 5, 3, 3, 1, 3], [10] * 3, [2] + [1] * 28):
        h = Harness(variant, torch.float32, seed=8, block_size=4)
        if x is None:
            x = h.new_inputs(30)
        o, off = [], 0
        for n in chunks:
            ours, _ = h.step([(0, n)], inputs=[x[off:off + n]])
            o.append(ours[0])
            off += n
        outs.append(torch.cat(o))
    for o in outs[1:]:
        assert H.rel_err(o, outs[0]) <= FP32_TOL


@pytest.mark.parametrize("variant", ["v3", "v2_lite"])
def test_block_sizes(variant):
    """Block sizes 1, 3 and 64 (one block holds everything) give the same answers."""
    for bs in (1, 3, 64):
        h = Harness(variant, torch.float32, seed=9, block_size=bs, num_blocks=128)
        h.step([(0, 14), (1, 3)])
        h.fork(0, 2)
        h.step([(1, 2), (0, 1), (2, 3)])
        h.truncate(2, 15)
        h.step([(2, 1), (1, 1)])


@pytest.mark.parametrize("variant", ["v3", "v2_lite"])
def test_positions_reach_max(variant):
    """A sequence filled to max_position_embeddings (64) stays exact at the last position."""
    h = Harness(variant, torch.float32, seed=10, block_size=8, num_blocks=16)
    h.step([(0, 60)])
    h.step([(0, 3)])
    h.step([(0, 1)])
    assert h.cache.length(0) == h.cfg.max_position_embeddings


@pytest.mark.parametrize("workspace", [1, 4, 7])
@pytest.mark.parametrize("variant", ["v3", "v2_lite", "v3_neox_mscale"])
def test_small_workspace(variant, workspace):
    """max_workspace_tokens far below the cached prefixes (chunked prefix passes) changes nothing."""
    h = Harness(variant, torch.float32, seed=11, block_size=4, max_workspace_tokens=workspace)
    h.step([(0, 17), (1, 5)])
    h.step([(0, 9), (1, 12), (2, 3)])
    h.fork(0, 3)
    h.step([(3, 6), (2, 20), (0, 1), (1, 3)])
    h.truncate(1, 18)
    h.step([(1, 8), (3, 1)])
