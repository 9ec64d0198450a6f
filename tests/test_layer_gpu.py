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
