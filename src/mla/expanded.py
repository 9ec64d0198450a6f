"""Context strategies (prompt tokens): expanded ("MHA") attention.

Keys are expanded from latents: kv_b_proj(c_kv) gives k_nope [H, dn] and v [H, dv] per
row; k = [k_nope | k_pe] with the shared k_pe broadcast to every head. The expansion
writes k_nope and v straight into the k and v buffers that attention reads.

- prefill: no cached prefix; the fresh latents of the new tokens are the keys (causal).
- cached:  the cache was written first; the prefix + new rows are gathered back from it,
           expanded, and attended causally (ends aligned), several sequences per pass.
- chunked: the prefix is gathered and expanded at most max_workspace_tokens rows at a
           time (full mask), the new tokens then attend to themselves (causal), and the
           partial results are merged by log-sum-exp.

With ``fp8_attention`` on (an FP8 latent cache), the expanded K and V are rounded to e4m3 one
(token, head) row at a time and every path above attends in e4m3 arithmetic
(``ops.fp8_prefill_attention``: the query rounded per row inside the kernel, P per key block).
"""
from __future__ import annotations

import torch

from . import ops, quant
from .plan import Group, Pass

__all__ = ["prefill", "cached", "chunked"]


def _gathered(layer, p: Pass, kv_cache, cache):
    """The pass's prefix + new rows from the cache -> c_kv [N, r], k_pe [N, dr] in the layer's
    dtype (views of one [N, r + dr] chunk; FP8 rows are dequantized for this chunk only)."""
    r = layer.cfg.kv_lora_rank
    stored = ops.gather_latent(kv_cache, p.block_table, p.starts, p.cu_seqlens_k, p.num_keys,
                               backend=layer.op_backend)
    latent = quant.dequantize_rows(stored, cache.format, r, layer.dtype, cache.kv_scale)
    return latent[:, :r], latent[:, r:]


def _keys_values(layer, c_kv: torch.Tensor, k_pe: torch.Tensor):
    """c_kv [N, r], k_pe [N, dr] -> k [N, H, dn + dr], v [N, H, dv], contiguous, in the layer's dtype.

    kv_b_proj writes k_nope into k[..., :dn] and v into v in place (layer.expand_kv): no
    [N, H, dn + dv] temporary and no copy of either half. The one other write is k_pe,
    broadcast into each head's last dr columns.
    """
    cfg, N = layer.cfg, c_kv.shape[0]
    k = torch.empty(N, layer.num_slice_heads, cfg.qk_head_dim, dtype=layer.dtype, device=c_kv.device)
    v = torch.empty(N, layer.num_slice_heads, cfg.v_head_dim, dtype=layer.dtype, device=c_kv.device)
    layer.expand_kv(c_kv, k[..., :cfg.qk_nope_head_dim], v)
    k[..., cfg.qk_nope_head_dim:] = k_pe[:, None]
    return k, v


def _attention(layer, q, k, v, cu_q, cu_k, causal, offsets_q, offsets_k):
    """Varlen attention of the expanded heads: bf16 (``ops.prefill_attention``), or FP8 with
    ``layer.fp8_attention``, K and V quantized a row at a time (one scale per token and head)."""
    scale, backend = layer.cfg.softmax_scale, layer.op_backend
    if not layer.fp8_attention:
        return ops.prefill_attention(q, k, v, cu_q, cu_k, scale, causal=causal, offsets_q=offsets_q,
                                     offsets_k=offsets_k, backend=backend)
    (k8, k_scale), (v8, v_scale) = (ops.quantize_rows_fp8(t, backend=backend) for t in (k, v))
    return ops.fp8_prefill_attention(q, k8, v8, k_scale, v_scale, cu_q, cu_k, scale, causal, offsets_q=offsets_q,
                                     offsets_k=offsets_k, backend=backend)


def prefill(layer, q, c_kv, k_pe, group: Group, out):
    """Expanded causal attention over the new tokens only (no cached prefix)."""
    out[group.rows] = _self_attention(layer, q, c_kv, k_pe, group)[0]


def cached(layer, q, p: Pass, kv_cache, cache, out):
    """Gather prefix + new rows of the pass's sequences, expand, attend causally."""
    k, v = _keys_values(layer, *_gathered(layer, p, kv_cache, cache))
    out[p.rows] = _attention(layer, q[p.rows], k, v, p.cu_seqlens_q, p.cu_seqlens_k, True, p.offsets_q,
                             p.offsets_k)[0]


def chunked(layer, q, c_kv, k_pe, group: Group, kv_cache, cache, out):
    """New tokens among themselves (causal), then prefix chunks (full mask), merged by log-sum-exp."""
    acc_o, acc_lse = _self_attention(layer, q, c_kv, k_pe, group)   # every row's accumulator
    for p in group.passes:
        k, v = _keys_values(layer, *_gathered(layer, p, kv_cache, cache))
        o, lse = _attention(layer, q[p.rows], k, v, p.cu_seqlens_q, p.cu_seqlens_k, False, p.offsets_q, p.offsets_k)
        i = p.group_rows
        acc_o[i], acc_lse[i] = ops.merge_attention(acc_o[i], acc_lse[i], o, lse, backend=layer.op_backend)
    out[group.rows] = acc_o


def _self_attention(layer, q, c_kv, k_pe, group: Group):
    """Expanded causal attention of the group's new tokens over themselves, fresh latents as keys."""
    rows = group.rows
    k, v = _keys_values(layer, c_kv[rows], k_pe[rows])
    return _attention(layer, q[rows], k, v, group.cu_seqlens, group.cu_seqlens, True, group.offsets, group.offsets)
