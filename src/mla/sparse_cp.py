"""The sparse path (sparse.py) under Helix context parallelism: the top-k over every rank's keys.

Each CP rank stores whole blocks of every sequence (global block j on CP rank j % cp_size) and,
slot for slot beside their latent rows, their indexer keys. Notation as in sparse.py, plus
cp = cp_size, k = index_topk, and a key's *global index* = its position in the sequence:

    per chunk of queries (the single-rank plan's chunks, plan.sparse_chunks):
        logits_r  = indexer logits over rank r's keys       [rows, local keys]   -inf where the
                    key's global index is past the query's position (causal by position)
        cand_r    = local top-k of logits_r: (score, global index) [rows, k]     -1: no key
        cand      = all-gather of cand_r over the CP group  [cp, rows, k]
        indices   = the best k of cand by (score descending, global index ascending), in
                    ascending global index, -1 padded: the same on every rank
        o_r, lse_r = sparse attention over the selected keys rank r owns (absorbed, with LSE)
        o          = Helix exchange + LSE combine (absorbed.helix_combine)

The merge is exact: order all keys by (score descending, global index ascending), the order of
the single-rank ``topk_indices`` (a stable sort: ties to the lower key; -0.0 ties with 0.0). A
key among the best k of all keys has fewer than k keys before it in that order, so fewer than k
of its own rank's keys before it: it is among its rank's best k. The global top-k is therefore a
subset of the union of the per-rank top-ks, and the best k of that union is the global top-k
(both then listed in key order). A rank's local rows are in global order, so its local top-k (ties to the
lower local row) is its best k in the global order too. The scores are the same op's over fewer
keys: where its float32 dot products round differently for another key count (a CPU BLAS picks
its kernel by shape), only keys whose scores tie within that rounding can be ordered otherwise
than on one rank.

Sizes: a rank's logits hold rows x (its keys) <= the single-rank chunk's bound
(max_workspace_tokens * index_head_dim values); the candidates gathered are rows x cp x k
(a float32 score and an int32 index each). An attention sink (Hy4) joins rank 0's partial only,
so the combine counts it once. GLM-5's shared layers reuse the selection as this rank's cache
slots (``sparse.selection_key``). The k-pool indexer (kpool.py) is not served here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ops, sparse
from .absorbed import absorb_query, helix_combine
from .batch import Batch
from .plan import Plan, SparseChunk

__all__ = ["HelixChunk", "merge_topk", "select", "attend"]


@dataclass
class HelixChunk:
    """This CP rank's view of one SparseChunk (built once a step)."""
    local_seqlens: torch.Tensor     # [m] int32, keys this rank stores of each sequence up to its end
    max_local: int                  # max(local_seqlens): the width of this rank's logits
    visible: torch.Tensor           # [rows] int64, this rank's rows each query sees (causal by position)
    global_table: torch.Tensor      # [m, max_blocks] int32, the global block of each local block
    row_seq: torch.Tensor           # [rows] int64, each query's sequence in the chunk


def helix_chunks(batch: Batch, plan: Plan) -> list[HelixChunk]:
    """The plan's sparse chunks as this CP rank sees them, built by the first layer that asks
    (the plan is memoized in the batch, so its id names it for the batch's life)."""
    def build():
        cache, dev = batch.cache, batch.device
        cp, rank = cache.cp_size, cache.cp_rank

        def ints(x, dtype=torch.int32):
            return torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)

        out = []
        for c in plan.sparse:
            local = [cache.local_tokens(e) for e in c.ends]
            # query i of sequence j is at position e_j - n_j + i and sees its first p + 1 tokens
            visible = [cache.local_tokens(e - n + i + 1) for e, n in zip(c.ends, c.counts) for i in range(n)]
            width = c.block_table.shape[1]
            blocks = [lb * cp + rank for lb in range(width)]
            out.append(HelixChunk(local_seqlens=ints(local), max_local=max(local + [0]),
                                  visible=ints(visible, torch.int64),
                                  global_table=ints([blocks] * len(c.seqs)).view(len(c.seqs), width),
                                  row_seq=ints([j for j, n in enumerate(c.counts) for _ in range(n)], torch.int64)))
        return out
    return batch.memo(("helix_sparse_chunks", id(plan)), build)


def _order_keys(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One int64 per candidate whose order is (score descending, index ascending): the score's
    float32 bits made signed-sortable above (-0.0 taken as 0.0), the inverted index below."""
    bits = (scores + 0.0).view(torch.int32)          # -0.0 + 0.0 = 0.0: they tie, as in a sort
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (bits.long() << 32) | (0x7FFFFFFF - index.clamp(min=0)).long()


_NO_KEY = int(_order_keys(torch.tensor([float("-inf")]), torch.tensor([0]))[0]) >> 32


def merge_topk(scores: torch.Tensor, index: torch.Tensor, topk: int) -> torch.Tensor:
    """The best ``topk`` of candidates: scores [rows, N] float32 (-inf: none) and their global key
    indices [rows, N] int32 (distinct where the score is finite) -> [rows, topk] int32 global
    indices in ascending order, ties at the k-th score to the lower index, -1 past the finite
    candidates: ``ops.topk_indices`` over all keys, whose top-k the union of per-rank top-ks holds."""
    rows, N = scores.shape
    out = torch.full((rows, topk), -1, dtype=torch.int32, device=scores.device)
    k = min(topk, N)
    if rows == 0 or k == 0:
        return out
    best = torch.topk(_order_keys(scores, index), k, dim=-1).values
    pos = torch.where((best >> 32) == _NO_KEY, 1 << 31, 0x7FFFFFFF - (best & 0x7FFFFFFF))
    pos = pos.sort(dim=-1).values       # key order, the candidates that are none (1 << 31) last
    out[:, :k] = torch.where(pos == 1 << 31, -1, pos).to(torch.int32)
    return out


def select(layer, q_idx: torch.Tensor, w: torch.Tensor, chunk: SparseChunk, hc: HelixChunk,
           index_cache: torch.Tensor, block_size: int, index_format) -> torch.Tensor:
    """The chunk's top-k over every CP rank's keys as the cache slots this rank owns: [rows,
    index_topk] int32, in the global order, -1 where another rank owns the key or none is left.
    q_idx [T, n, d] and w [T, n] float32: the step's indexer queries and head weights."""
    cfg, par = layer.cfg, layer.parallel
    cp, rank, topk = par.cp_size, par.cp_rank, cfg.index_topk
    rows = chunk.num_rows
    if hc.max_local > 0:
        q = sparse.index_query(q_idx[chunk.rows], index_format)
        # every local key of the sequence, then the causal mask by position (a rank's rows are
        # not contiguous in position, so the op's causal rule does not apply)
        logits = ops.indexer_logits(q, w[chunk.rows], index_cache, chunk.block_table, hc.local_seqlens,
                                    chunk.cu_seqlens_q, hc.max_local, cfg.index_softmax_scale, causal=False,
                                    backend=layer.op_backend)
        cols = torch.arange(hc.max_local, device=logits.device)
        logits = logits.masked_fill(cols[None, :] >= hc.visible[:, None], float("-inf"))
        # the local top-k as global indices: a table of global block ids maps row s of local
        # block s // block_size to position global_block * block_size + s % block_size
        pos = ops.topk_indices(logits, topk, hc.global_table, chunk.cu_seqlens_q, block_size,
                               backend=layer.op_backend)
        local = (pos.clamp(min=0) // block_size // cp) * block_size + pos.clamp(min=0) % block_size
        scores = torch.where(pos >= 0, logits.gather(1, local.long()), float("-inf"))
    else:   # this rank holds none of these sequences' keys yet: it still joins the gather
        pos = torch.full((rows, topk), -1, dtype=torch.int32, device=q_idx.device)
        scores = torch.full((rows, topk), float("-inf"), device=q_idx.device)
    cand = par.cp_all_gather(torch.stack((scores.view(torch.int32), pos), -1))     # [cp, rows, topk, 2]
    cand = cand.permute(1, 0, 2, 3).reshape(rows, cp * topk, 2)
    best = merge_topk(cand[..., 0].view(torch.float32), cand[..., 1], topk)
    g = best.clamp(min=0)
    mine = (best >= 0) & ((g // block_size) % cp == rank)
    blocks = chunk.block_table[hc.row_seq[:, None], (g // block_size // cp).clamp(max=chunk.block_table.shape[1] - 1)]
    return torch.where(mine, blocks * block_size + g % block_size, -1).to(torch.int32)


def attend(layer, q, index_qkw, indices, plan: Plan, batch: Batch, kv_cache, out) -> None:
    """``sparse.attend`` under Helix CP: out[chunk.rows] ([T, H_s, dv], this rank's head slice)
    for the plan's sparse chunks, from q [T, H, dn + dr] (all this rank's TP heads).

    index_qkw: (q_idx, w) of this layer's indexer, whose selection (``select``) is computed here
    and kept in the batch for the layers that share it; or None, and ``indices`` the shared one."""
    cfg = layer.cfg
    dn, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    if index_qkw is not None:
        index_cache = batch.cache.index_keys(layer.layer_idx)
        indices = [select(layer, *index_qkw, chunk, hc, index_cache, batch.block_size, batch.cache.index_format)
                   for chunk, hc in zip(plan.sparse, helix_chunks(batch, plan))]
        batch.remember(sparse.selection_key(layer), indices)
    # the sink is one more logit per head in the softmax: rank 0's partial alone carries it
    sink = layer.sinks if layer.parallel.cp_rank == 0 else None
    for chunk, idx in zip(plan.sparse, indices):
        qc = q[chunk.rows]
        q_full = absorb_query(layer, qc[..., :dn], qc[..., dn:])                   # [rows, H, r + dr]
        o_lat, lse = ops.sparse_mla_decode(q_full.unsqueeze(1), kv_cache, idx.unsqueeze(1), r, cfg.softmax_scale,
                                           kv_scale=batch.cache.kv_scale, attn_sink=sink, backend=layer.op_backend)
        out[chunk.rows] = helix_combine(layer, o_lat[:, 0].to(layer.dtype), lse[:, 0])
