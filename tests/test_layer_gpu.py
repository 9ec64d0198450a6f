"""The whole layer on the GPU through the Triton kernels, against the PyTorch reference path:
DeepSeek-V3 attention dimensions (r 512, rope 64, nope 128, v 128), 16 heads, bf16."""
from __future__ import annotations

import pytest
import torch

import mla
from mla.testing import random_state_dict

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _run(cfg, sd, dtype, backend, steps, workspace, cache_dtype, fp8_scaling="tensor"):
    layer = mla.MLA(cfg, dtype=dtype, device="cuda", backend=backend, max_workspace_tokens=workspace)
    layer.load_hf_state_dict(sd)
    cache = mla.PagedLatentCache(cfg, num_blocks=256, block_size=64, dtype=cache_dtype or dtype, device="cuda",
                                 fp8_scaling=fp8_scaling)
    g = torch.Generator().manual_seed(3)
    outs = []
    for step in steps:
        x = torch.randn(sum(n for _, n in step), cfg.hidden_size, generator=g) * 0.5
        outs.append(layer(x.to("cuda", dtype), cache.prepare(step)).float())
    return outs


STEPS = [
    [("a", 700), ("b", 33)],                 # prefills
    [("a", 1), ("b", 1)],                    # decode
    [("a", 4), ("b", 3)],                    # speculative verify
    [("c", 300), ("a", 1)],                  # a new prompt beside a decode
    [("b", 400)],                            # a long prompt over a cached prefix (cached / chunked)
]


@pytest.mark.parametrize("workspace", [65536, 128])
@pytest.mark.parametrize("cache_dtype,scaling", [(None, "tensor"), (torch.float8_e4m3fn, "tensor"),
                                                 (torch.float8_e4m3fn, "tile")])
def test_layer_triton_matches_reference(workspace, cache_dtype, scaling):
    cfg = mla.MLAConfig.preset("deepseek-v3").replace(hidden_size=1024, num_heads=16)
    sd = random_state_dict(cfg, torch.Generator().manual_seed(0))
    ref = _run(cfg, sd, torch.float32, "torch", STEPS, workspace, cache_dtype, scaling)
    low = _run(cfg, sd, torch.bfloat16, "torch", STEPS, workspace, cache_dtype, scaling)
    fast = _run(cfg, sd, torch.bfloat16, "auto", STEPS, workspace, cache_dtype, scaling)
    for r, lo, f in zip(ref, low, fast):
        assert torch.isfinite(f).all()
        assert _rel(f, r) <= 2 * _rel(lo, r) + 1e-3


# MLA families whose shapes the Hopper decode kernels do not take (latent 256, rope 32, no RoPE,
# nope 192 / v 256 in the expanded path): they run through the portable kernels, which must be
# as exact as on DeepSeek-V3's shapes. Dims are the published ones, hidden size and heads cut.
_FAMILY_SHAPES = {
    # MiniCPM3-4B: kv_lora 256, rope 32, nope 64, v 64, neox RoPE
    "minicpm3": dict(q_lora_rank=768, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                     rope_interleave=False),
    # Mistral Small 4: kv_lora 256, nope 64, v 128, the Llama-4 query temperature
    "mistral4": dict(q_lora_rank=1024, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=128,
                     temperature_floor_scale=64.0, temperature_beta=0.1),
    # GLM-4.7-Flash: nope 192, v 256 (latent 576 as DeepSeek's)
    "glm4_moe_lite": dict(q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
                          v_head_dim=256),
    # Kimi Linear's MLA layers: no q_lora, no RoPE
    "kimi_linear": dict(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, rope_type="none"),
    # LongCat-Flash: the latent scales folded into the weights at load
    "longcat_flash": dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                          v_head_dim=128, q_lora_scale=2.0, kv_lora_scale=1.5 ** 0.5),
}


@pytest.mark.parametrize("family", list(_FAMILY_SHAPES))
def test_family_shapes_match_reference(family):
    cfg = mla.MLAConfig(hidden_size=1024, num_heads=16, max_position_embeddings=4096, **_FAMILY_SHAPES[family])
    sd = random_state_dict(cfg, torch.Generator().manual_seed(0))
    ref = _run(cfg, sd, torch.float32, "torch", STEPS, 128, None)
    low = _run(cfg, sd, torch.bfloat16, "torch", STEPS, 128, None)
    fast = _run(cfg, sd, torch.bfloat16, "auto", STEPS, 128, None)
    for r, lo, f in zip(ref, low, fast):
        assert torch.isfinite(f).all()
        assert _rel(f, r) <= 2 * _rel(lo, r) + 1e-3
    q = torch.empty(2, 1, 16, cfg.kv_dim, dtype=torch.bfloat16, device="cuda")
    kv = torch.empty(4, 64, cfg.kv_dim, dtype=torch.bfloat16, device="cuda")
    kernel = mla.ops.decode.choose_kernel(q, kv, cfg.kv_lora_rank, 256)
    assert kernel == ("portable" if cfg.kv_dim != 576 else "narrow")
