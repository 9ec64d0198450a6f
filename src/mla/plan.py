"""The per-step plan's structures, and one packer per path that builds its calls from a batch.

``strategy.build_plan`` decides which path serves each sequence (the cost rule); the packers
here turn each path's sequences into its calls: the index tensors every layer of the step
reads (``Plan``), built once per step (``Batch.memo``). Host ints go to the device without
waiting (``non_blocking``); each call also keeps its offsets as host ints, so that no layer
reads the device to size its work.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from . import kpool
from .batch import Batch
from .config import MLAConfig

__all__ = ["Plan", "Group", "Pass", "SparseChunk", "pack_prefill", "pack_cached", "pack_chunked", "pack_absorbed",
           "sparse_chunks", "decode_plan", "device_ints"]


@dataclass
class Pass:
    """One attention call of a context strategy: queries of `seqs`, keys of their segments."""
    seqs: list[int]                 # batch indices
    rows: torch.Tensor | slice      # token rows of the queries: [Tq] int64, or a slice where contiguous
    cu_seqlens_q: torch.Tensor      # [len(seqs) + 1] int32
    cu_seqlens_k: torch.Tensor      # [len(seqs) + 1] int32
    starts: torch.Tensor            # [len(seqs)] int32 first token of each key segment
    block_table: torch.Tensor       # [len(seqs), max_blocks] int32
    num_keys: int
    group_rows: torch.Tensor | None = None   # chunked: the queries' positions among the group's rows
    offsets_q: tuple = ()           # cu_seqlens_q / cu_seqlens_k as host ints (no device read)
    offsets_k: tuple = ()


@dataclass
class Group:
    seqs: list[int]
    rows: torch.Tensor | slice      # token rows of the group, sequence order ([Tg] int64, or a slice)
    cu_seqlens: torch.Tensor | None = None   # prefill, chunked: [len(seqs) + 1] int32 offsets in rows
    offsets: tuple = ()                      # prefill, chunked: cu_seqlens as host ints
    s_q: int = 0                    # absorbed: tokens per sequence
    block_table: torch.Tensor | None = None
    cache_seqlens: torch.Tensor | None = None
    # Helix CP with s_q > 1: query i sees this rank's first query_seqlens[i][b] rows
    query_seqlens: list[torch.Tensor] | None = None
    key_counts: tuple = ()          # absorbed: cache_seqlens as host ints (FP8 context gathers them)
    passes: list[Pass] = field(default_factory=list)


@dataclass
class SparseChunk:
    """One indexer + top-k + sparse attention call: consecutive queries of one or more sequences.

    Sequence j of the chunk brings the queries at positions ends[j] - n_j .. ends[j] - 1, so
    its causal key count is ends[j] (``cache_seqlens`` of the indexer's logits)."""
    seqs: list[int]                 # batch indices
    rows: torch.Tensor | slice      # token rows of the queries
    block_table: torch.Tensor       # [len(seqs), max_blocks] int32
    cache_seqlens: torch.Tensor     # [len(seqs)] int32, ends
    cu_seqlens_q: torch.Tensor      # [len(seqs) + 1] int32
    max_seqlen_k: int               # max(ends): the keys of the chunk's logits
    num_rows: int = 0
    ends: tuple = ()                # cache_seqlens as host ints
    counts: tuple = ()              # queries of each sequence (cu_seqlens_q's steps) as host ints


@dataclass
class Plan:
    strategy: list[str | None]      # per sequence of the batch
    prefill: Group | None = None
    cached: list[Pass] = field(default_factory=list)
    chunked: Group | None = None    # the new tokens among themselves, then its passes: prefix chunks
    absorbed: list[Group] = field(default_factory=list)
    sparse: list[SparseChunk] = field(default_factory=list)
    pools: kpool.PoolPlan | None = None     # the k-pool indexer's gathers and pool tables (kpool.py)


# ---- one packer per path: its sequences (batch indices, in batch order) -> its calls -----------

def pack_prefill(batch: Batch, seqs: list[int]) -> Group | None:
    """Prompts with no cached prefix: one varlen causal call over all their new tokens."""
    return _group(batch, seqs) if seqs else None


def pack_cached(batch: Batch, seqs: list[int], max_workspace_tokens: int) -> list[Pass]:
    """Whole sequences packed into passes whose cached prefixes together fit the workspace;
    each pass attends over prefix + new tokens (ends aligned)."""
    passes, current, used = [], [], 0
    for b in seqs:
        c = batch.num_cached[b]
        if current and used + c > max_workspace_tokens:
            passes.append(_whole_pass(batch, current))
            current, used = [], 0
        current.append(b)
        used += c
    if current:
        passes.append(_whole_pass(batch, current))
    return passes


def pack_chunked(batch: Batch, seqs: list[int], max_workspace_tokens: int) -> Group | None:
    """The group of the sequences' new tokens (attending among themselves), and its passes over
    prefix segments: at most max_workspace_tokens rows a pass, one segment a sequence (a plain
    varlen call); the partials are merged by LSE."""
    if not seqs:
        return None
    group = _group(batch, seqs)
    group_offsets = dict(zip(seqs, group.offsets))
    chunk = []   # segments (batch index, start, length) of one pass

    def flush():
        if chunk:
            group.passes.append(_pass(batch, *map(list, zip(*chunk)), group_offsets))
            chunk.clear()

    for b in seqs:
        for start in range(0, batch.num_cached[b], max_workspace_tokens):
            seg = (b, start, min(max_workspace_tokens, batch.num_cached[b] - start))
            if sum(x[2] for x in chunk) + seg[2] > max_workspace_tokens or any(x[0] == b for x in chunk):
                flush()
            chunk.append(seg)
    flush()
    return group


def pack_absorbed(batch: Batch, seqs: list[int]) -> list[Group]:
    """One decode call per distinct number of new tokens s_q. Under Helix CP with s_q > 1 a
    rank's rows are not contiguous in position: each query gets its count of visible rows."""
    groups = []
    for s_q in sorted({batch.num_new[b] for b in seqs}):
        same = [b for b in seqs if batch.num_new[b] == s_q]
        idx = device_ints(same, torch.int64, device=batch.device)
        group = Group(same, _rows(batch, same), s_q=s_q, block_table=batch.block_table[idx],
                      cache_seqlens=batch.cache_seqlens[idx],
                      key_counts=() if batch.cache.cp_size > 1 else tuple(batch.num_cached[b] + s_q for b in same))
        if batch.cache.cp_size > 1 and s_q > 1:
            local = batch.cache.local_tokens
            group.query_seqlens = [device_ints([local(batch.num_cached[b] + i + 1) for b in same],
                                               device=batch.device) for i in range(s_q)]
        groups.append(group)
    return groups


def device_ints(x, dtype=torch.int32, *, device) -> torch.Tensor:
    """Host ints to the device without waiting for the copy."""
    return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)


def _cumsum(xs) -> tuple[int, ...]:
    return tuple(itertools.accumulate(xs, initial=0))


def _rows(batch: Batch, seqs: list[int]) -> torch.Tensor | slice:
    """The token rows of ``seqs``: a slice where they are one run (a view, no gather or
    scatter: e.g. a batch of decodes only), else an index tensor."""
    offsets = batch.token_offsets()
    rows = [t for b in seqs for t in range(offsets[b], offsets[b + 1])]
    first = rows[0] if rows else 0
    if rows == list(range(first, first + len(rows))):
        return slice(first, first + len(rows))
    return device_ints(rows, torch.int64, device=batch.device)


def _group(batch: Batch, seqs: list[int]) -> Group:
    offsets = _cumsum(batch.num_new[b] for b in seqs)
    return Group(seqs, _rows(batch, seqs), cu_seqlens=device_ints(offsets, device=batch.device), offsets=offsets)


def _whole_pass(batch: Batch, seqs: list[int]) -> Pass:
    """A pass over each sequence's whole key range: cached prefix + new tokens."""
    return _pass(batch, seqs, [0] * len(seqs), [batch.num_cached[b] + batch.num_new[b] for b in seqs])


def _pass(batch: Batch, seqs: list[int], starts: list[int], lens: list[int], group_offsets=None) -> Pass:
    """The pass of key segments [starts[j], starts[j] + lens[j]) of sequences ``seqs`` for their
    new tokens; ``group_offsets`` (chunked): each sequence's first row in its group."""
    dev = batch.device
    offsets_q, offsets_k = _cumsum(batch.num_new[b] for b in seqs), _cumsum(lens)
    group_rows = None
    if group_offsets is not None:
        rows = [t for b in seqs for t in range(group_offsets[b], group_offsets[b] + batch.num_new[b])]
        group_rows = device_ints(rows, torch.int64, device=dev)
    return Pass(seqs=seqs, rows=_rows(batch, seqs), cu_seqlens_q=device_ints(offsets_q, device=dev),
                cu_seqlens_k=device_ints(offsets_k, device=dev), starts=device_ints(starts, device=dev),
                block_table=batch.block_table[device_ints(seqs, torch.int64, device=dev)], num_keys=sum(lens),
                group_rows=group_rows, offsets_q=offsets_q, offsets_k=offsets_k)


def decode_plan(batch: Batch, s_q: int) -> Plan:
    """The plan of a batch whose every sequence brings s_q tokens over a cached prefix: one
    absorbed group of all its rows, on the batch's block_table and cache_seqlens themselves
    (under Helix CP only for s_q 1, where no query needs its own count of visible rows)."""
    B = batch.num_seqs
    # host key counts only where they are the step's (not a graph's static batch, not a CP shard)
    counts = () if batch.static or batch.cache.cp_size > 1 else tuple(c + s_q for c in batch.num_cached)
    group = Group(list(range(B)), slice(0, B * s_q), s_q=s_q, block_table=batch.block_table,
                  cache_seqlens=batch.cache_seqlens, key_counts=counts)
    return Plan(["absorbed"] * B, absorbed=[group])


def sparse_chunks(batch: Batch, cfg: MLAConfig, seqs: list[int], max_workspace_tokens: int, ints,
                  gathers: bool = True) -> list[SparseChunk]:
    """The sparse sequences' queries cut into chunks whose indexer logits hold at most
    max_workspace_tokens * index_head_dim float32 values (the size of a workspace of indexer
    keys; never a T x T matrix for a long prompt; a column a key, or a complete pool with the
    k-pool indexer) and, where the attention op gathers the selected rows (``gathers``: the
    reference), whose selected rows number at most max_workspace_tokens (rows x
    sparse_max_keys); at least one query a chunk. The GPU kernel reads
    the rows in place, so there only the logits bound applies: a 4096-token prompt with top-2048
    is 2 chunks, not 128. A decode batch is one chunk; a long prompt is many, each a run of its
    queries."""
    budget = max_workspace_tokens * cfg.index_head_dim
    max_rows = max(1, max_workspace_tokens // cfg.sparse_max_keys) if gathers else budget
    offsets = batch.token_offsets()
    chunks, pieces = [], []   # pieces of the open chunk: (batch index, first query, end query)

    def flush():
        if not pieces:
            return
        ends = [batch.num_cached[b] + i1 for b, _, i1 in pieces]
        table = batch.block_table[ints([b for b, _, _ in pieces], torch.int64)]
        rows = rows_of_pieces(pieces)
        counts = tuple(i1 - i0 for _, i0, i1 in pieces)
        chunks.append(SparseChunk(seqs=[b for b, _, _ in pieces], rows=rows, block_table=table,
                                  cache_seqlens=ints(ends),
                                  cu_seqlens_q=ints(list(itertools.accumulate(counts, initial=0))),
                                  max_seqlen_k=max(ends), num_rows=sum(counts), ends=tuple(ends), counts=counts))
        pieces.clear()

    def rows_of_pieces(ps):
        rows = [offsets[b] + i for b, i0, i1 in ps for i in range(i0, i1)]
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return slice(rows[0], rows[0] + len(rows))
        return ints(rows, torch.int64)

    for b in seqs:
        c, n = batch.num_cached[b], batch.num_new[b]
        i = 0
        while i < n:
            used = sum(i1 - i0 for _, i0, i1 in pieces)
            keys = max([batch.num_cached[x] + i1 for x, _, i1 in pieces] + [c + n])
            width = max(1, cfg.index_logits_width(keys))     # a bound on the logits' width
            m = min(n - i, max_rows - used, budget // width - used)
            if m <= 0 and pieces:
                flush()
                continue
            m = max(m, 1)
            pieces.append((b, i, i + m))
            i += m
            if i < n:   # the chunk is full
                flush()
    flush()
    return chunks
