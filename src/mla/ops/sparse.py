"""Sparse MLA ops (DeepSeek Sparse Attention): the lightning indexer's logits, their top-k,
and attention over the selected keys, in FlashMLA's conventions: ``indices`` are flat cache
slots (block * block_size + offset) or rows of a contiguous kv, -1 = none.

    logits  = indexer_logits(q_idx, w, index_cache, block_table, seqlens, cu_seqlens_q, K, scale)
    indices = topk_indices(logits, topk, block_table, cu_seqlens_q, block_size)   # [Tq, topk] slots
    out, lse = sparse_mla_decode(q [B, s_q, H, r + dr], kv_cache, indices [B, s_q, topk], r, scale)

Backends: "torch" is the reference (``mla.ops.reference``); "triton" runs ``indexer`` (the
indexer's logits kernel; the top-k as composite keys through ``torch.topk``) and
``sparse_attention`` (one kernel for both attention ops). Validation follows the dense ops:
``ValueError`` naming the argument, values checked on CPU tensors only (on CUDA reading them
back would sync the stream).
"""
from __future__ import annotations

import torch

from .. import quant
from . import _library
from ._checks import (FLOAT, as_float, check, check_flag, check_int, check_int_vector, check_latent_query_cache,
                      dense, describe)
from .backend import resolve_backend

__all__ = ["indexer_logits", "topk_indices", "sparse_mla_decode", "sparse_prefill_attention"]


def _check_indices(name: str, indices: torch.Tensor, shape: tuple, device) -> None:
    check(isinstance(indices, torch.Tensor) and indices.dim() == len(shape) and indices.dtype == torch.int32
          and tuple(indices.shape[:-1]) == shape[:-1],
          lambda: f"{name}: expected int32 [{', '.join(map(str, shape))}], got {describe(indices)}")
    check(indices.device == device, lambda: f"{name}: expected device {device}, got {indices.device}")


def indexer_logits(q, weights, index_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_k, softmax_scale,
                   causal=True, *, backend=None):
    """The indexer's score of every key each query sees (paged keys, packed varlen queries).

    q:             [Tq, n_heads, d] float16/bfloat16/float32, the indexer's queries (RoPE applied),
                   rows of sequence b at cu_seqlens_q[b] .. cu_seqlens_q[b + 1]
    weights:       [Tq, n_heads] float32, the head weights (weights_proj(x) * index_weights_scale)
    index_cache:   [num_blocks, block_size, d] float, the indexer's keys (``PagedLatentCache.index_keys``),
                   or DeepSeek's FP8 key rows, uint8 [num_blocks, block_size, quant.index_width(d)]
                   (e4m3 values, then a float32 scale per 128; q then rotated and quantized alike)
    block_table:   [B, max_blocks] int32; cache_seqlens [B] int32, keys of each sequence including
                   its queries (or 0: a padding sequence, whose queries see no key); cu_seqlens_q
                   [B + 1] int32
    max_seqlen_k:  int >= every cache_seqlens, the width of the result
    softmax_scale: the scale of q . k inside the relu (index_head_dim^-0.5)
    causal:        query i of nq sees keys < cache_seqlens - nq + i + 1; else all of its sequence's
    Returns logits [Tq, max_seqlen_k] float32: sum_h weights[t, h] * relu(q[t, h] . k[s] * scale)
    for the keys a query sees, -inf elsewhere.
    """
    check(isinstance(q, torch.Tensor) and q.dim() == 3 and q.dtype in FLOAT,
          lambda: f"q: expected float [Tq, n_heads, d], got {describe(q)}")
    Tq, n_heads, d = q.shape
    check(isinstance(weights, torch.Tensor) and tuple(weights.shape) == (Tq, n_heads)
          and weights.dtype == torch.float32,
          lambda: f"weights: expected float32 [{Tq}, {n_heads}], got {describe(weights)}")
    check(isinstance(index_cache, torch.Tensor) and index_cache.dim() == 3 and (
          (index_cache.dtype in FLOAT and index_cache.shape[-1] == d)
          or (index_cache.dtype == torch.uint8 and index_cache.shape[-1] == quant.index_width(d))),
          lambda: f"index_cache: expected float [num_blocks, block_size, {d}] or FP8 key rows uint8 [num_blocks, "
          f"block_size, {quant.index_width(d)}], got {describe(index_cache)}")
    check(isinstance(block_table, torch.Tensor) and block_table.dim() == 2 and block_table.dtype == torch.int32,
          lambda: f"block_table: expected [B, max_blocks] int32, got {describe(block_table)}")
    B = block_table.shape[0]
    for name, t in (("weights", weights), ("index_cache", index_cache), ("block_table", block_table)):
        check(t.device == q.device, lambda: f"{name}: expected device {q.device}, got {t.device}")
    check_int_vector("cache_seqlens", cache_seqlens, B, q.device)
    check_int_vector("cu_seqlens_q", cu_seqlens_q, B + 1, q.device)
    check_int("max_seqlen_k", max_seqlen_k, 0)
    check_flag("causal", causal)
    softmax_scale = as_float("softmax_scale", softmax_scale)
    resolve_backend(backend, q.device)
    # the values (lengths, offsets, block ids) are checked where the op runs: _library.indexer_logits
    return _library.indexer_logits(q, weights, index_cache, dense(block_table), dense(cache_seqlens),
                                   dense(cu_seqlens_q), max_seqlen_k, softmax_scale, bool(causal), backend)


def topk_indices(logits, topk, block_table, cu_seqlens_q, block_size, *, backend=None):
    """The ``topk`` best keys of each query as flat cache slots, FlashMLA's sparse ``indices``.

    logits:       [Tq, K] float32, -inf for keys a query does not see (``indexer_logits``)
    topk:         int >= 1
    block_table:  [B, max_blocks] int32; key s of sequence b is at slot
                  block_table[b, s // block_size] * block_size + s % block_size
    cu_seqlens_q: [B + 1] int32, the rows of each sequence in logits
    Returns [Tq, topk] int32: the selected keys in key order (ascending position; attention
    does not depend on the order, and the kernels need no sort), then -1. Ties at the k-th
    score go to the lower key index, so the selection is deterministic; a query that sees at
    most topk keys gets all of them.
    """
    check(isinstance(logits, torch.Tensor) and logits.dim() == 2 and logits.dtype == torch.float32,
          lambda: f"logits: expected float32 [Tq, K], got {describe(logits)}")
    check_int("topk", topk, 1)
    check_int("block_size", block_size, 1)
    check(isinstance(block_table, torch.Tensor) and block_table.dim() == 2 and block_table.dtype == torch.int32,
          lambda: f"block_table: expected [B, max_blocks] int32, got {describe(block_table)}")
    check(block_table.device == logits.device,
          lambda: f"block_table: expected device {logits.device}, got {block_table.device}")
    B = block_table.shape[0]
    check_int_vector("cu_seqlens_q", cu_seqlens_q, B + 1, logits.device)
    check(block_table.shape[1] * block_size >= logits.shape[1] or logits.shape[0] == 0,
          lambda: f"block_table: expected room for K = {logits.shape[1]} keys (max_blocks * block_size), got "
          f"{block_table.shape[1]} x {block_size}")
    resolve_backend(backend, logits.device)
    return _library.topk_indices(logits, topk, dense(block_table), dense(cu_seqlens_q), block_size, backend)


def _check_sink(attn_sink, H: int, device) -> None:
    check(attn_sink is None or (isinstance(attn_sink, torch.Tensor) and tuple(attn_sink.shape) == (H,)
                                and attn_sink.dtype == torch.float32),
          lambda: f"attn_sink: expected None or float32 [{H}] (one logit per head), got {describe(attn_sink)}")
    check(attn_sink is None or attn_sink.device == device, lambda: f"attn_sink: expected device {device}, "
                                                           f"got {getattr(attn_sink, 'device', None)}")


def sparse_mla_decode(q, kv_cache, indices, head_dim_v, softmax_scale, *, kv_scale=1.0, attn_sink=None,
                      backend=None):
    """Absorbed MLA attention over the cache rows each query's ``indices`` name
    (``flash_mla_with_kvcache(..., indices=...)``): no block table, no lengths, no causal mask:
    the indices are the keys.

    q:          [B, s_q, H, d] float16/bfloat16/float32, d = kv_lora_rank + qk_rope_head_dim
    kv_cache:   [num_blocks, block_size, d] (or [num_blocks, block_size, 1, d]) in q's dtype, or
                FP8 rows as in ``mla_decode`` (float8_e4m3fn with kv_scale, uint8 tile rows)
    indices:    [B, s_q, topk] int32 flat slots block * block_size + offset, -1 = none
    head_dim_v: values are the first head_dim_v (= kv_lora_rank) entries of each row
    attn_sink:  None, or [H] float32: FlashMLA's attention sink, one logit per head that joins
                the softmax's denominator and contributes no value (Hy4's learnable sinks):
                p_j = exp(s_j - lse) with lse = log(exp(sink_h) + sum_j exp(s_j)); out = sum_j p_j v_j
    Returns out [B, s_q, H, head_dim_v] in q's dtype and lse [B, s_q, H] float32, the sink
    included (a query with no index: out 0, lse -inf, or lse = sink_h with a sink). Partial
    results over disjoint key sets merge by LSE as usual when one part only carries the sink.
    """
    kv_cache, _ = check_latent_query_cache(q, kv_cache, head_dim_v)
    B, s_q = q.shape[:2]
    check(isinstance(indices, torch.Tensor) and indices.dim() == 3,
          lambda: f"indices: expected int32 [{B}, {s_q}, topk], got {describe(indices)}")
    _check_indices("indices", indices, (B, s_q, indices.shape[-1]), q.device)
    _check_sink(attn_sink, q.shape[2], q.device)
    softmax_scale, kv_scale = as_float("softmax_scale", softmax_scale), as_float("kv_scale", kv_scale, positive=True)
    resolve_backend(backend, q.device)
    return _library.sparse_mla_decode(q, kv_cache, dense(indices), head_dim_v, softmax_scale, kv_scale,
                                      None if attn_sink is None else dense(attn_sink), backend)


def sparse_prefill_attention(q, kv, indices, sm_scale, d_v, *, attn_sink=None, backend=None):
    """Sparse attention of packed queries over a contiguous latent kv (``flash_mla_sparse_fwd``).

    q:       [s_q, H, d] float16/bfloat16/float32 (absorbed queries, d = kv_lora_rank + qk_rope_head_dim)
    kv:      [s_kv, 1, d] in q's dtype (the latent rows, one KV head)
    indices: [s_q, 1, topk] int32 rows of kv, -1 = none
    d_v:     values are the first d_v entries of each row
    attn_sink: None, or [H] float32, the attention sink as in ``sparse_mla_decode``
    Returns out [s_q, H, d_v] in q's dtype and lse [s_q, H] float32, natural log, the sink
    included (FlashMLA also returns the max logits; a query with no index: out 0, lse -inf, or
    the sink).
    """
    check(isinstance(q, torch.Tensor) and q.dim() == 3 and q.dtype in FLOAT,
          lambda: f"q: expected float [s_q, H, d], got {describe(q)}")
    s_q, H, d = q.shape
    check(isinstance(kv, torch.Tensor) and kv.dim() == 3 and kv.shape[1:] == (1, d) and kv.dtype == q.dtype,
          lambda: f"kv: expected {q.dtype} [s_kv, 1, {d}], got {describe(kv)}")
    check(kv.device == q.device, lambda: f"kv: expected device {q.device}, got {kv.device}")
    check(isinstance(indices, torch.Tensor) and indices.dim() == 3,
          lambda: f"indices: expected int32 [{s_q}, 1, topk], got {describe(indices)}")
    _check_indices("indices", indices, (s_q, 1, indices.shape[-1]), q.device)
    check_int("d_v", d_v, 1, d)
    _check_sink(attn_sink, H, q.device)
    sm_scale = as_float("sm_scale", sm_scale)
    resolve_backend(backend, q.device)
    return _library.sparse_prefill_attention(q, kv, dense(indices), sm_scale, d_v,
                                             None if attn_sink is None else dense(attn_sink), backend)
