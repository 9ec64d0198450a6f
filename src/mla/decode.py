"""The absorbed ("MQA") path: decode of 1 to k tokens per sequence over the latent cache.

W_UK [H, dn, r] folds into the query and W_UV [H, dv, r] into the output, so every head
attends to the cached latent rows [c_kv | k_pe] directly (576 values, one per token):

    q_lat = q_nope @ W_UK                     [T, H, r]
    o_lat = attn([q_lat | q_pe], cache)       [T, H, r]   (value = first r of each row)
    o     = o_lat @ W_UV^T                    [T, H, dv]

The scale is the model's softmax_scale, not 1/sqrt(r + dr).
"""
from __future__ import annotations

import torch

from . import ops
from .plan import Group

__all__ = ["absorbed"]


def absorb_query(layer, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
    """[T, H, dn], [T, H, dr] -> fused query [T, H, r + dr]."""
    T, H, _ = q_nope.shape
    r = layer.cfg.kv_lora_rank
    q = torch.empty(T, H, r + q_pe.shape[-1], dtype=q_nope.dtype, device=q_nope.device)
    # bmm over heads: [H, T, dn] @ [H, dn, r] -> [H, T, r]
    q[..., :r] = torch.bmm(q_nope.transpose(0, 1), layer.W_UK).transpose(0, 1)
    q[..., r:] = q_pe
    return q


def absorbed(layer, q, group: Group, kv_cache, out):
    """Absorbed attention for the group's sequences, all with group.s_q new tokens."""
    cfg = layer.cfg
    dn, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    rows = group.rows
    qg = q[rows]
    q_full = absorb_query(layer, qg[..., :dn], qg[..., dn:])
    B, s_q, H = len(group.seqs), group.s_q, layer.num_local_heads
    q_full = q_full.view(B, s_q, H, -1)
    o_lat, _ = ops.mla_decode(q_full, kv_cache, group.block_table, group.cache_seqlens, r,
                              cfg.softmax_scale, causal=True, backend=layer.op_backend)
    o_lat = o_lat.view(B * s_q, H, r).to(layer.dtype)
    out[rows] = torch.bmm(o_lat.transpose(0, 1), layer.W_UV.transpose(1, 2)).transpose(0, 1)
