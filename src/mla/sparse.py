"""The sparse path (DeepSeek Sparse Attention, DeepSeek-V3.2 and GLM-5): a lightning indexer
picks index_topk keys per query token, and the token attends to those only. GLM-5.3-Flash's
k-pool indexer picks whole pools of keys instead (kpool.py); the rest of the path is the same.

Notation as in layer.py, plus n = index_n_heads, d = index_head_dim, k = index_topk:

    q_idx  = rope(wq_b(q_a_norm(q_a)))      [T, n, d]   RoPE on the first dr values (neox in
    k_idx  = rope(LayerNorm(wk(x)))         [T, d]      DeepSeek-V3.2, interleaved in GLM-5;
                                                        neox on the last dr values in Hy4)
    w      = weights_proj(x) * n^-0.5       [T, n]      float32
    cache.index_keys[slot] = k_idx                       beside the latent row of the token (or,
                                                         with FP8 index keys, quant(H k_idx), and the
                                                         logits take quant(H q_idx): DeepSeek's form)
    per chunk of queries (plan.sparse_chunks):
        logits  = sum_h w_h relu(q_idx_h . k_idx * d^-0.5)  over the keys each query sees
        indices = top-k of logits, as flat cache slots (-1 past the visible keys)
        o_lat   = attn([q_lat | q_pe], cache rows at indices)   absorbed, as absorbed.py
        o       = o_lat @ W_UV^T

GLM-5's "shared" layers have no indexer: they attend with the indices of the nearest earlier
layer that has one, which ran on the same batch (``Batch.remember``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kpool, ops
from .absorbed import absorb_query, apply_uv
from .batch import Batch
from . import quant
from .plan import Plan, SparseChunk

__all__ = ["NoIndexer", "OwnIndexer", "SharedIndexer", "indexer", "index_query_key", "append_index_keys",
           "index_query", "selection_key", "shared_indices", "select_pools", "attend"]


class NoIndexer:
    """The indexer part of a layer (picked once by ``indexer``), called before the layer writes
    anything: dense MLA has none. Its call gives (index_qkw, shared) for ``attend``."""

    def params(self, cfg) -> dict[str, tuple[int, ...]]:
        return {}

    def load(self, layer, w) -> None:
        pass

    def __call__(self, layer, x, q_a, cos, sin, batch: Batch, plan: Plan):
        return None, None


class OwnIndexer(NoIndexer):
    """The lightning indexer, replicated on every TP rank so that all select alike. Every
    token's index row is stored, whichever path serves it (under Helix CP another rank's token
    has slot -1, which writes nothing); its (q_idx, w) go to ``attend``."""
    NAMES = (("w_idx_q", "indexer.wq_b.weight"), ("w_idx_k", "indexer.wk.weight"),
             ("idx_k_norm_w", "indexer.k_norm.weight"), ("idx_k_norm_b", "indexer.k_norm.bias"),
             ("w_idx_w", "indexer.weights_proj.weight"))
    KPOOL_NAMES = (("w_idx_gate", "indexer.index_kpool_compress_gate"),      # GLM-5.3-Flash's pool gate
                   ("idx_ape", "indexer.index_kpool_compress_ape"))          # and its position bias

    def params(self, cfg) -> dict[str, tuple[int, ...]]:
        n, d, D = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size
        shapes = {"w_idx_q": (n * d, cfg.q_lora_rank), "w_idx_k": (d, D), "idx_k_norm_w": (d,),
                  "idx_k_norm_b": (d,), "w_idx_w": (n, D)}
        if cfg.index_kpool is not None:
            shapes.update(w_idx_gate=(d, D), idx_ape=(cfg.index_kpool, d))
        return shapes

    def load(self, layer, w) -> None:
        names = self.NAMES + (self.KPOOL_NAMES if layer.cfg.index_kpool is not None else ())
        for attr, name in names:
            getattr(layer, attr).copy_(w[name])

    def __call__(self, layer, x, q_a, cos, sin, batch: Batch, plan: Plan):
        q_idx, k_idx, w_idx = index_query_key(layer, x, q_a, cos, sin)
        append_index_keys(k_idx, batch.cache.index_keys(layer.layer_idx), batch.slot_mapping,
                          batch.cache.index_format, backend=layer.op_backend)
        return (q_idx, w_idx), None


class SharedIndexer(NoIndexer):
    """GLM-5's shared layers: no indexer of their own; the top-k an earlier layer selected on
    this batch (``shared_indices``: raises, before any write, when that layer has not run)."""

    def __call__(self, layer, x, q_a, cos, sin, batch: Batch, plan: Plan):
        return None, shared_indices(layer, batch, plan.sparse)


def indexer(cfg, layer_idx: int) -> NoIndexer:
    """The indexer part of layer ``layer_idx`` of ``cfg``."""
    if not cfg.has_indexer:
        return NoIndexer()
    return SharedIndexer() if layer_idx in cfg.index_shared_layers else OwnIndexer()


def index_query_key(layer, x: torch.Tensor, q_a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """x [T, D], q_a [T, rq] (the normed q latent) -> q_idx [T, n, d], the index row the cache
    keeps (k_idx [T, d], or the k-pool indexer's [k | gate] [T, 2d]) in the layer's dtype, both
    rotated (the k-pool indexer has no RoPE), and the head weights w [T, n] float32 (scaled)."""
    cfg = layer.cfg
    T, n, d, dr = x.shape[0], cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    q = F.linear(q_a, layer.w_idx_q).view(T, n, d)
    k = F.layer_norm(F.linear(x, layer.w_idx_k), (d,), layer.idx_k_norm_w, layer.idx_k_norm_b, cfg.index_k_norm_eps)
    w = F.linear(x, layer.w_idx_w).float() * cfg.index_weights_scale
    if cfg.index_kpool is not None:
        return q, torch.cat((k, F.linear(x, layer.w_idx_gate)), -1), w
    # RoPE on the first dr values (the last in Hy4); the pairing is the same for q and k, so their
    # dot products do not depend on the layout it leaves (transformers' GLM indexer
    # de-interleaves, this keeps it)
    rot = slice(d - dr, d) if cfg.index_rope_last else slice(0, dr)
    ops.rope(q[..., rot], k[:, rot], cos, sin, cfg.index_rope_interleave, backend=layer.op_backend)
    return q, k, w


def append_index_keys(k_idx: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      index_format: str | None = None, backend: str | None = None) -> None:
    """Write k_idx [T, d] at the flat slots [T] int64 of index_cache [num_blocks, block_size, width]:
    as they are, or (an FP8 ``index_format``) Hadamard-rotated and quantized (``mla.quant``).
    The rows go through ``ops.rope_append`` with no RoPE part: one launch, and a negative slot (a
    CUDA graph's padding row) writes nothing. FP8 rows (bytes, an even count: d + 4 a group) travel
    as float16 pairs, which the op copies bit for bit (a cast to the same dtype is none)."""
    if index_format is None:
        rows, cache = k_idx, index_cache
    else:
        rows = quant.quantize_index(quant.rotate(k_idx), index_format).view(torch.float16)
        cache = index_cache.view(torch.float16)
    T = rows.shape[0]
    none = rows.new_empty(T, 1, 0)                # no RoPE part: the row is written as it is
    angles = torch.empty(T, 0, dtype=torch.float32, device=rows.device)
    ops.rope_append(none, none[:, 0], rows, angles, angles, cache, slot_mapping, False, backend=backend)


def index_query(q_idx: torch.Tensor, index_format: str | None) -> torch.Tensor:
    """The queries the logits take: q_idx [T, n, d] as it is, or for FP8 keys rotated and
    quantized as the keys are (DeepSeek scores FP8 queries against FP8 keys), in q_idx's dtype
    (exact in bf16 with power-of-two scales: e4m3 has 3 mantissa bits, bf16 7)."""
    if index_format is None:
        return q_idx
    return quant.fake_quant(quant.rotate(q_idx), index_format).to(q_idx.dtype)


def select(layer, q_idx, w, chunk: SparseChunk, index_cache, block_size: int, index_format) -> torch.Tensor:
    """The chunk's top-k cache slots [rows, index_topk] int32 (-1 padded)."""
    cfg = layer.cfg
    q = index_query(q_idx[chunk.rows], index_format)
    logits = ops.indexer_logits(q, w[chunk.rows], index_cache, chunk.block_table,
                                chunk.cache_seqlens, chunk.cu_seqlens_q, chunk.max_seqlen_k,
                                cfg.index_softmax_scale, causal=True, backend=layer.op_backend)
    return ops.topk_indices(logits, cfg.index_topk, chunk.block_table, chunk.cu_seqlens_q, block_size,
                            backend=layer.op_backend)


def selection_key(layer) -> tuple:
    """Where a step's top-k of an indexer layer is kept in the batch: the layers that share it
    have the same config, workspace, strategy and backend, hence the same chunks."""
    return ("sparse_indices", layer.cfg, layer.max_workspace_tokens, layer.strategy, layer.op_backend,
            layer.cfg.index_source_layer(layer.layer_idx))


def shared_indices(layer, batch: Batch, chunks: list[SparseChunk]):
    """For a layer without its own indexer (GLM-5's shared layers): the top-k per chunk that
    its source layer selected on this batch (None when no sequence is sparse). Raises
    ValueError, before the layer writes anything, when the source layer has not run."""
    if not chunks:
        return None
    indices = batch.recall(selection_key(layer))
    if indices is None:
        source = layer.cfg.index_source_layer(layer.layer_idx)
        raise ValueError(f"batch: layer {layer.layer_idx} reuses the top-k of layer {source} (GLM-5's shared "
                         f"indexer layers): run layer {source} on this batch first")
    return indices


def select_pools(layer, q_idx, w, plan: Plan, batch: Batch, index_cache) -> list[torch.Tensor]:
    """The k-pool indexer's selection of every sparse chunk ([rows, sparse_max_keys] int32 cache
    slots each, -1 padded), over the pooled keys of the step's sparse sequences."""
    pooled = kpool.pooled_keys(layer, plan.pools, index_cache)
    return [kpool.select(layer, q_idx[c.rows], w[c.rows], c, p, pooled, batch.positions[c.rows], batch.block_size)
            for c, p in zip(plan.sparse, plan.pools.chunks)]


def attend(layer, q, index_qkw, indices, plan: Plan, batch: Batch, kv_cache, out) -> None:
    """Sparse attention of the plan's sparse chunks, written to out[chunk.rows] ([T, H, dv]).

    index_qkw: (q_idx, w) of this layer's indexer, whose selection is computed here and kept in
    the batch for the layers that share it; or None, and ``indices`` the shared one per chunk."""
    cfg = layer.cfg
    dn, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    chunks = plan.sparse
    if index_qkw is not None:
        index_cache = batch.cache.index_keys(layer.layer_idx)
        if cfg.index_kpool is not None:
            indices = select_pools(layer, *index_qkw, plan, batch, index_cache)
        else:
            indices = [select(layer, *index_qkw, chunk, index_cache, batch.block_size, batch.cache.index_format)
                       for chunk in chunks]
        batch.remember(selection_key(layer), indices)
    for chunk, idx in zip(chunks, indices):
        qc = q[chunk.rows]
        q_full = absorb_query(layer, qc[..., :dn], qc[..., dn:])                   # [rows, H, r + dr]
        o_lat, _ = ops.sparse_mla_decode(q_full.unsqueeze(1), kv_cache, idx.unsqueeze(1), r, cfg.softmax_scale,
                                         kv_scale=batch.cache.kv_scale, attn_sink=layer.sinks,
                                         backend=layer.op_backend)
        out[chunk.rows] = apply_uv(o_lat[:, 0].to(layer.dtype), layer.W_UV)
