"""GLM-5.3-Flash's k-pool indexer: the sparse path's selection by pools of index_kpool tokens.

Notation as in sparse.py, plus P = index_kpool, d = index_head_dim, the pool gate
G = index_kpool_compress_gate [d, D] and its position bias A = index_kpool_compress_ape [P, d]:

    k      = LayerNorm(wk(x))                  [T, d]   no RoPE anywhere in this indexer
    gate   = x @ G^T                           [T, d]
    cache.index_keys[slot] = [k | gate]                  beside the latent row of the token
    pool j of a sequence: its tokens jP .. jP + P - 1 (from its first token)
        pooled_j = sum_i softmax_i(gate_i + A_i) * k_i   [d]   per channel, over the pool's P tokens
    a query at position p sees the n_p = (p + 1) // P pools complete at p:
        score_j  = sum_h w_h relu(q_idx_h . pooled_j * d^-0.5)       j < n_p
        keys     = the tokens of its min(index_topk / P, n_p) best pools (torch.topk's order)
                   + the tokens of its open pool, n_p P .. p (up to P - 1)
        indices  = their cache slots, -1 padded to index_topk + P - 1 (cfg.sparse_max_keys)

A layer computes the pooled keys of every sparse sequence of the step once (``pooled_keys``),
from the cached rows, gathering at most max_workspace_tokens rows at a time (``pool_plan``:
whole pools, host metadata built once a step). The scores run on ``ops.indexer_logits`` over
the pooled keys held as a cache of one-row blocks (its Triton kernel on the GPU), all pools of
a sequence visible, and the pools a query does not see yet are masked after; the top-k of the
pools, their tokens, the open pool and the slots are PyTorch on every device.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from . import ops

__all__ = ["PoolGather", "PoolChunk", "PoolPlan", "pool_plan", "pooled_keys", "select"]


@dataclass
class PoolGather:
    """One gather of index rows: a run of whole pools of each of its sequences."""
    block_table: torch.Tensor       # [g, max_blocks] int32
    starts: torch.Tensor            # [g] int32, the run's first token in its sequence
    cu_seqlens: torch.Tensor        # [g + 1] int32, the runs' offsets in the gathered rows
    num_tokens: int                 # rows gathered (a multiple of P)


@dataclass
class PoolChunk:
    """The pools of one SparseChunk's sequences, as ``ops.indexer_logits`` takes them."""
    table: torch.Tensor             # [m, max_pools] int32, each sequence's rows of the pooled keys
    num_pools: torch.Tensor         # [m] int32, pools complete at the sequence's last query here
    max_pools: int                  # the logits' width
    row_seq: torch.Tensor           # [rows] int64, each query's sequence in the chunk


@dataclass
class PoolPlan:
    num_pools: int                  # pooled keys of the step's sparse sequences, in sequence order
    gathers: list[PoolGather]       # in the same order
    chunks: list[PoolChunk]         # one per SparseChunk of the plan


def pool_plan(batch, cfg, seqs: list[int], chunks: list, max_workspace_tokens: int, ints) -> PoolPlan:
    """The step's k-pool metadata: the complete pools of every sparse sequence (batch indices
    ``seqs``, at its length after the step) gathered in runs of at most max_workspace_tokens
    rows (whole pools, one run a sequence per gather), and each chunk's pool table."""
    P = cfg.index_kpool
    span = max(P, max_workspace_tokens // P * P)
    first, total, segments = {}, 0, []     # segments: (batch index, first token, tokens)
    for b in seqs:
        tokens = (batch.num_cached[b] + batch.num_new[b]) // P * P
        first[b] = total
        total += tokens // P
        segments += [(b, s, min(span, tokens - s)) for s in range(0, tokens, span)]
    gathers, run = [], []

    def flush():
        if run:
            lens = [n for _, _, n in run]
            gathers.append(PoolGather(block_table=batch.block_table[ints([b for b, _, _ in run], torch.int64)],
                                      starts=ints([s for _, s, _ in run]),
                                      cu_seqlens=ints(list(itertools.accumulate(lens, initial=0))),
                                      num_tokens=sum(lens)))
            run.clear()

    for seg in segments:
        if run and (sum(n for _, _, n in run) + seg[2] > span or any(b == seg[0] for b, _, _ in run)):
            flush()
        run.append(seg)
    flush()
    out = []
    for c in chunks:
        counts = [e // P for e in c.ends]
        width = max(counts + [0])
        # row j of sequence b: its pool j; the entries past a sequence's count are never read
        cols = torch.arange(width, dtype=torch.int32, device=batch.device)
        out.append(PoolChunk(table=ints([first[b] for b in c.seqs])[:, None] + cols[None, :], num_pools=ints(counts),
                             max_pools=width,
                             row_seq=ints([j for j, n in enumerate(c.counts) for _ in range(n)], torch.int64)))
    return PoolPlan(num_pools=total, gathers=gathers, chunks=out)


def pooled_keys(layer, pools: PoolPlan, index_cache: torch.Tensor) -> torch.Tensor:
    """The pooled key of every complete pool of the step's sparse sequences, in the layer's dtype
    as transformers computes it (the softmax in float32, its weights cast back, a sum of
    products in the keys' dtype): [num_pools, 1, d], a cache of one-row blocks for
    ``ops.indexer_logits``. index_cache [num_blocks, block_size, 2d] holds the rows [k | gate]."""
    cfg = layer.cfg
    P, d = cfg.index_kpool, cfg.index_head_dim
    parts = []
    for g in pools.gathers:
        rows = ops.gather_latent(index_cache, g.block_table, g.starts, g.cu_seqlens, g.num_tokens,
                                 backend=layer.op_backend)
        rows = rows.to(layer.dtype).view(-1, P, 2 * d)
        k, gate = rows[..., :d], rows[..., d:]
        weights = torch.softmax(gate.float() + layer.idx_ape.float(), dim=1).to(layer.dtype)
        parts.append((weights * k).sum(1))
    if not parts:
        return index_cache.new_empty(0, 1, d, dtype=layer.dtype)
    return torch.cat(parts).unsqueeze(1)


def select(layer, q_idx: torch.Tensor, w: torch.Tensor, chunk, pool: PoolChunk, pooled: torch.Tensor,
           positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """A chunk's selected cache slots [rows, index_topk + P - 1] int32 (-1 padded): its queries
    q_idx [rows, n, d] and head weights w [rows, n] float32, at positions [rows] int64, over
    ``pooled`` (``pooled_keys``)."""
    cfg = layer.cfg
    P = cfg.index_kpool
    logits = ops.indexer_logits(q_idx, w, pooled, pool.table, pool.num_pools, chunk.cu_seqlens_q, pool.max_pools,
                                cfg.index_softmax_scale, causal=False, backend=layer.op_backend)
    seen = (positions + 1) // P                                    # pools complete at each query
    later = torch.arange(pool.max_pools, device=logits.device)[None, :] >= seen[:, None]
    logits = logits.masked_fill(later, float("-inf"))
    values, best = torch.topk(logits, min(cfg.index_topk // P, pool.max_pools), dim=-1)
    offsets = torch.arange(P, device=logits.device)
    tokens = (best[..., None] * P + offsets).masked_fill(torch.isneginf(values)[..., None], -1).flatten(1)
    tail = seen[:, None] * P + offsets[:-1]                        # the open pool, up to the query
    tail = tail.masked_fill(tail > positions[:, None], -1)
    tokens = torch.cat((tokens, tail), 1)
    blocks = chunk.block_table[pool.row_seq[:, None], tokens.clamp(min=0) // block_size].long()
    slots = torch.where(tokens >= 0, blocks * block_size + tokens % block_size, -1)
    out = slots.new_full((slots.shape[0], cfg.sparse_max_keys), -1)
    out[:, : slots.shape[1]] = slots
    return out.to(torch.int32)
