"""Context strategies (prompt tokens): expanded ("MHA") attention.

Keys are expanded from latents: kv_b_proj(c_kv) gives k_nope [H, dn] and v [H, dv] per
row; k = [k_nope | k_pe] with the shared k_pe broadcast to every head.

- prefill: no cached prefix; the fresh latents of the new tokens are the keys (causal).
- cached:  the cache was written first; the prefix + new rows are gathered back from it,
           expanded, and attended causally (ends aligned), several sequences per pass.
- chunked: the prefix is gathered and expanded at most max_workspace_tokens rows at a
           time (full mask), the new tokens then attend to themselves (causal), and the
           partial results are merged by log-sum-exp.
"""
from __future__ import annotations

import torch

from . import ops, quant
from .plan import Group, Pass

__all__ = ["prefill", "cached", "chunked"]


def _values(layer, stored: torch.Tensor, cache) -> torch.Tensor:
    """Gathered cache rows -> latent values in the layer's dtype (FP8 rows: only this chunk)."""
    return quant.dequantize_rows(stored, cache.format, layer.cfg.kv_lora_rank, layer.dtype, cache.kv_scale)


def _keys_values(layer, latent: torch.Tensor):
    """latent rows [N, r + dr] -> k [N, H, dn + dr], v [N, H, dv] in the layer's dtype."""
    cfg = layer.cfg
    r, dn = cfg.kv_lora_rank, cfg.qk_nope_head_dim
    latent = latent.to(layer.dtype)
    kv = layer.expand_kv(latent[:, :r])                       # [N, H, dn + dv]
    k = torch.empty(latent.shape[0], layer.num_slice_heads, cfg.qk_head_dim, dtype=layer.dtype,
                    device=latent.device)
    k[..., :dn] = kv[..., :dn]
    k[..., dn:] = latent[:, None, r:]
    return k, kv[..., dn:]


def prefill(layer, q, c_kv, k_pe, group: Group, out):
    """Expanded causal attention over the new tokens only (no cached prefix)."""
    out[group.rows] = _self_attention(layer, q, c_kv, k_pe, group)[0]


def cached(layer, q, p: Pass, kv_cache, cache, out):
    """Gather prefix + new rows of the pass's sequences, expand, attend causally."""
    latent = ops.gather_latent(kv_cache, p.block_table, p.starts, p.cu_seqlens_k, p.num_keys,
                               backend=layer.op_backend)
    k, v = _keys_values(layer, _values(layer, latent, cache))
    o, _ = ops.prefill_attention(q[p.rows], k, v, p.cu_seqlens_q, p.cu_seqlens_k, layer.cfg.softmax_scale,
                                 causal=True, backend=layer.op_backend)
    out[p.rows] = o


def chunked(layer, q, c_kv, k_pe, group: Group, kv_cache, cache, out):
    """New tokens among themselves (causal), then prefix chunks (full mask), merged by log-sum-exp."""
    scale, backend = layer.cfg.softmax_scale, layer.op_backend
    acc_o, acc_lse = _self_attention(layer, q, c_kv, k_pe, group)   # every row's accumulator
    for p in group.passes:
        latent = ops.gather_latent(kv_cache, p.block_table, p.starts, p.cu_seqlens_k, p.num_keys, backend=backend)
        k, v = _keys_values(layer, _values(layer, latent, cache))
        o, lse = ops.prefill_attention(q[p.rows], k, v, p.cu_seqlens_q, p.cu_seqlens_k, scale, causal=False,
                                       backend=backend)
        i = p.group_rows
        acc_o[i], acc_lse[i] = ops.merge_attention(acc_o[i], acc_lse[i], o, lse, backend=backend)
    out[group.rows] = acc_o


def _self_attention(layer, q, c_kv, k_pe, group: Group):
    """Expanded causal attention of the group's new tokens over themselves, fresh latents as keys."""
    rows = group.rows
    k, v = _keys_values(layer, torch.cat((c_kv[rows], k_pe[rows]), dim=-1))
    return ops.prefill_attention(q[rows], k, v, group.cu_seqlens, group.cu_seqlens, layer.cfg.softmax_scale,
                                 causal=True, backend=layer.op_backend)
