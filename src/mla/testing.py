"""Helpers the tests, the demo and the benchmarks share: random HF-named weights of one layer
and a float64 oracle of the whole layer. Kept in the package (not under tests/) so that
benchmarks and ``mla demo`` use the same ones.
"""
from __future__ import annotations

import math

import torch

from .config import MLAConfig
from .layer import MLA
from .ops.reference import rms_norm
from .rope import apply_rope, cos_sin, query_temperature
from .weights import hf_weight_shapes

__all__ = ["random_state_dict", "randomize_model", "dense_forward"]


def random_state_dict(cfg: MLAConfig, generator: torch.Generator, prefix: str = "") -> dict[str, torch.Tensor]:
    """Random HF-named weights of one layer, unit scale so attention is peaky."""
    sd = {}
    for name, shape in hf_weight_shapes(cfg).items():
        if name.endswith("layernorm.weight"):
            sd[prefix + name] = 0.5 + torch.rand(shape, generator=generator)
        elif name.endswith("bias"):
            sd[prefix + name] = 0.1 * torch.randn(shape, generator=generator)
        else:
            sd[prefix + name] = torch.randn(shape, generator=generator) * (1.5 / math.sqrt(shape[-1]))
    return sd


@torch.no_grad()
def randomize_model(model: torch.nn.Module, generator: torch.Generator, gain: float = 2.0) -> torch.nn.Module:
    """A whole transformers model's parameters redrawn in place, in ``named_parameters`` order:
    matrices N(0, (gain / sqrt(fan_in))^2), norms in [0.5, 1.5), other vectors N(0, 0.1^2). Returns it."""
    for name, p in model.named_parameters():
        if p.ndim >= 2:
            p.copy_(torch.randn(p.shape, generator=generator) * (gain / math.sqrt(p.shape[-1])))
        elif "norm" in name:
            p.copy_(0.5 + torch.rand(p.shape, generator=generator))
        else:
            p.copy_(0.1 * torch.randn(p.shape, generator=generator))
    return model


@torch.no_grad()
def dense_forward(layer: MLA, x: torch.Tensor) -> torch.Tensor:
    """The whole sequence x [n, D] from scratch in float64: expanded causal attention."""
    cfg, H = layer.cfg, layer.num_local_heads
    n, r, dn = x.shape[0], cfg.kv_lora_rank, cfg.qk_nope_head_dim
    p = {k: v.double() for k, v in layer.state_dict().items() if v is not None}
    a = x.double() @ p["w_a"].T + (p["b_a"] if "b_a" in p else 0)
    qa = a[:, : layer.q_dim]
    q = qa if cfg.q_lora_rank is None else rms_norm(qa, p["q_a_norm"], cfg.q_norm_eps) @ p["w_q_b"].T
    q = q.view(n, H, -1)
    c_kv = rms_norm(a[:, layer.q_dim: layer.q_dim + r], p["kv_a_norm"], cfg.kv_norm_eps)
    cos, sin = cos_sin(cfg, torch.arange(n))
    q_pe = apply_rope(q[..., dn:], cos.double(), sin.double(), cfg.rope_interleave)
    k_pe = apply_rope(a[:, layer.q_dim + r:], cos.double(), sin.double(), cfg.rope_interleave)
    kv = (c_kv @ p["w_kv_b"].T).view(n, H, -1)
    k = torch.cat((kv[..., :dn], k_pe[:, None].expand(n, H, -1)), -1)
    qf = torch.cat((q[..., :dn], q_pe), -1)
    temperature = query_temperature(cfg, torch.arange(n))
    if temperature is not None:
        qf = qf * temperature.double()[:, None, None]
    s = torch.einsum("qhd,khd->hqk", qf, k) * cfg.softmax_scale
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), kv[..., dn:]).reshape(n, -1)
    return o @ p["w_o"].T + (p["b_o"] if "b_o" in p else 0)
