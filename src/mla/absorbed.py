"""The absorbed ("MQA") path: decode of 1 to k tokens per sequence over the latent cache.

W_UK [H, dn, r] folds into the query and W_UV [H, dv, r] into the output, so every head
attends to the cached latent rows [c_kv | k_pe] directly (576 values, one per token):

    q_lat = q_nope @ W_UK                     [T, H, r]
    o_lat = attn([q_lat | q_pe], cache)       [T, H, r]   (value = first r of each row)
    o     = o_lat @ W_UV^T                    [T, H, dv]

The scale is the model's softmax_scale, not 1/sqrt(r + dr).

With ``fp8_attention`` and an FP8 cache, a group of context chunks (at least
``FP8_CONTEXT_MIN_NEW`` new tokens a sequence) attends in e4m3 arithmetic instead
(``fp8_context``): the sequences' stored rows gathered once, every head reading the same row
(``ops.fp8_prefill_attention`` with one key head), the query rounded per (token, head) row
inside the kernel. Decode rows and short drafts stay on the decode kernels, which read FP8
rows with a bf16 query.
"""
from __future__ import annotations

import itertools

import torch

from . import ops, quant
from .plan import Group

__all__ = ["attend", "query_buffer", "absorb_query", "apply_uv", "bmm_into", "helix_combine", "fp8_context",
           "FP8_CONTEXT_MIN_NEW"]

FP8_CONTEXT_MIN_NEW = 16    # new tokens a sequence from which a group takes the FP8 context kernel


def bmm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = a @ b (batched), written through ``out``'s strides. Eagerly cuBLAS writes a strided
    view in place; torch.compile does not trace ``out=`` into a non-contiguous view, so there the
    product is a graph value copied into the view (the compiler places or fuses the copy)."""
    if torch.compiler.is_compiling():
        out.copy_(torch.bmm(a, b))
    else:
        torch.bmm(a, b, out=out)


def query_buffer(layer, T: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Storage of the fused query of T tokens: [T, H, r + dr], a view of [H, T, r + dr] (each
    head's rows one matrix, which the bmm over heads of ``absorb_query`` writes in place)."""
    cfg = layer.cfg
    return torch.empty(layer.num_local_heads, T, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=dtype,
                       device=device).transpose(0, 1)


def absorb_query(layer, q_nope: torch.Tensor, q_pe: torch.Tensor | None, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """[T, H, dn], [T, H, dr] -> fused query [T, H, r + dr] (``query_buffer``). ``out``: a
    query_buffer whose RoPE columns hold the rotated q_pe already (``ops.rope_append`` wrote them
    there, q_pe None): only the absorb is left."""
    r = layer.cfg.kv_lora_rank
    q = query_buffer(layer, q_nope.shape[0], q_nope.dtype, q_nope.device) if out is None else out
    # bmm over heads, [H, T, dn] @ [H, dn, r], written straight into the fused buffer (no copy)
    bmm_into(q_nope.transpose(0, 1), layer.W_UK, q.transpose(0, 1)[..., :r])
    if out is None:
        q[..., r:] = q_pe
    return q


def apply_uv(o_lat: torch.Tensor, W_UV: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """o_lat [T, H, r] @ W_UV^T per head -> [T, H, dv], into ``out`` when given (a [T, H, dv]
    view with unit last stride, e.g. rows of the layer's output: cuBLAS writes it in place)."""
    if out is None:
        return torch.bmm(o_lat.transpose(0, 1), W_UV.transpose(1, 2)).transpose(0, 1)
    bmm_into(o_lat.transpose(0, 1), W_UV.transpose(1, 2), out.transpose(0, 1))
    return out


def attend(layer, q, group: Group, kv_cache, out, kv_scale: float = 1.0, q_rope: torch.Tensor | None = None):
    """Absorbed attention for the group's sequences, all with group.s_q new tokens.

    Writes out[group.rows] for this rank's head slice (rows: a slice or an index tensor). Under Helix CP the attention over
    this rank's share of the cache is a partial, combined with the other ranks' by LSE. q_rope: a
    ``query_buffer`` of the group's rows whose RoPE columns hold the rotated queries (then q's
    are not read).
    """
    cfg, par = layer.cfg, layer.parallel
    dn, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    rows = group.rows
    qg = q[rows]
    B, s_q, H = len(group.seqs), group.s_q, layer.num_local_heads
    q_full = absorb_query(layer, qg[..., :dn], None if q_rope is not None else qg[..., dn:], q_rope)
    q_full = q_full.view(B, s_q, H, -1)
    if layer.fp8_attention and s_q >= FP8_CONTEXT_MIN_NEW and group.query_seqlens is None and group.key_counts:
        o_lat, lse = fp8_context(layer, q_full.flatten(0, 1), group, kv_cache, kv_scale)
    elif group.query_seqlens is None:
        o_lat, lse = ops.mla_decode(q_full, kv_cache, group.block_table, group.cache_seqlens, r, cfg.softmax_scale,
                                    causal=True, kv_scale=kv_scale, backend=layer.op_backend)
    else:   # one query at a time, each with the rows of this rank it may see
        parts = [ops.mla_decode(q_full[:, i: i + 1].contiguous(), kv_cache, group.block_table, seqlens, r,
                                cfg.softmax_scale, causal=True, kv_scale=kv_scale, backend=layer.op_backend)
                 for i, seqlens in enumerate(group.query_seqlens)]
        o_lat, lse = torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)
    o_lat, lse = o_lat.reshape(B * s_q, H, r).to(layer.dtype), lse.reshape(B * s_q, H)
    if par is None or par.cp_size == 1:
        if isinstance(rows, slice):     # one run of rows (decode-only batches): W_UV writes them in place
            apply_uv(o_lat, layer.W_UV, out[rows])
        else:
            out[rows] = apply_uv(o_lat, layer.W_UV)
        return
    out[rows] = helix_combine(layer, o_lat, lse)


def fp8_context(layer, q_full: torch.Tensor, group: Group, kv_cache: torch.Tensor, kv_scale: float):
    """q_full [B * s_q, H, r + dr] over the group's cached rows (causal, ends aligned) in e4m3
    arithmetic -> (o_lat [B * s_q, H, r], lse). Rows of one scale ("fp8") are attended as
    stored; tile rows (per-128 scales, bf16 k_pe) are rounded again to one scale a row."""
    r, dev = layer.cfg.kv_lora_rank, q_full.device
    B, s_q = len(group.seqs), group.s_q
    offsets = list(itertools.accumulate(group.key_counts, initial=0))
    cu_k = torch.tensor(offsets, dtype=torch.int32).to(dev, non_blocking=True)
    cu_q = torch.arange(0, (B + 1) * s_q, s_q, dtype=torch.int32, device=dev)
    stored = ops.gather_latent(kv_cache, group.block_table, torch.zeros(B, dtype=torch.int32, device=dev), cu_k,
                               offsets[-1], backend=layer.op_backend)
    fmt = quant.cache_format(kv_cache)
    if fmt == "fp8":
        rows, scale = stored[:, None], torch.full((1,), kv_scale, dtype=torch.float32, device=dev)
    else:
        rows, scale = ops.quantize_rows_fp8(quant.dequantize_rows(stored, fmt, r, torch.float32)[:, None],
                                            backend=layer.op_backend)
    return ops.fp8_prefill_attention(q_full, rows, rows[..., :r], scale, scale, cu_q, cu_k, layer.cfg.softmax_scale,
                                     True, offsets_q=list(range(0, (B + 1) * s_q, s_q)), offsets_k=offsets,
                                     backend=layer.op_backend)


def helix_combine(layer, o_lat: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Helix CP: o_lat [T, H, r] (the layer's dtype) and lse [T, H] float32, this rank's partial
    attention over its share of the keys for all its TP heads -> [T, H_s, dv], its head slice's
    attention over every rank's keys: W_UV (before or after the exchange, ``v_before_exchange``),
    the all-to-all, and the LSE combine. A rank without keys for a query sends lse -inf: weight 0."""
    par = layer.parallel
    o = apply_uv(o_lat, layer.W_UV) if par.v_before_exchange else o_lat
    parts_o, parts_lse = par.helix_exchange(o, lse)
    o, lse = parts_o[0], parts_lse[0]
    for j in range(1, par.cp_size):
        o, lse = ops.merge_attention(o, lse, parts_o[j], parts_lse[j], backend=layer.op_backend)
    return o if par.v_before_exchange else apply_uv(o, layer.W_UV_slice)
