"""The per-step plan: which strategy serves each sequence, and the index tensors each
strategy needs. Built once per step (``Batch.memo``) and shared by every layer.

The cost rule (DESIGN.md section 2), per sequence with c cached and n new tokens:

- n == 0: nothing to do.
- c == 0: **prefill**, expanded attention over the n new tokens (causal).
- c > 0 and n <= absorb_max_new(cfg): **absorbed** (latent MQA over the paged cache).
  Per key row the absorbed path costs 2*H*n*(r + dr + r) FLOPs against the expanded
  path's 2*H*(r*(dn + dv) + n*(dn + dr + dv)); they cross at
  n* = r*(dn + dv) / (2r + dr - dn - dr - dv) (170 for DeepSeek-V3: 512*256 / 768).
  Decode rows (1 token, or 1 + k draft tokens) are always below it.
- c > 0, larger n, c <= max_workspace_tokens: **cached**, expanded attention over the
  gathered prefix + new rows (causal, ends aligned). Sequences are packed into passes
  whose prefixes together fit the workspace.
- c > max_workspace_tokens: **chunked**, the prefix expanded chunk by chunk (full mask),
  then the new tokens among themselves (causal), merged by log-sum-exp.
- a config with a sparse indexer (DeepSeek Sparse Attention) and c + n > cfg.sparse_max_keys
  (index_topk; with GLM-5.3-Flash's k-pool indexer index_topk + index_kpool - 1):
  **sparse**, every new token attends to the keys its indexer selects (absorbed form over the
  latent cache, sparse.py). With c + n <= sparse_max_keys every query sees at most that many
  keys, so the selection holds all of them (with k-pool: all its complete pools and its open
  pool's tokens): the dense paths above give the identical result, and serve those sequences.

A batch of decodes only (every sequence absorbed, all with the same s_q) gets the **decode
plan** (``decode_plan``): one absorbed group over all rows, on the batch's own block table and
lengths, with no index tensor built and nothing copied to the device. It is the only plan of a
static batch (a ``mla.StepGraph``'s bucket), whose host lengths are not the replay's: a CUDA
graph replays it whatever the lengths in its buffers. With a sparse indexer a static batch is
sparse throughout instead, one chunk over its own tensors (``_static_plan``).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from . import kpool
from .batch import Batch
from .config import MLAConfig

__all__ = ["STRATEGIES", "absorb_max_new", "choose_strategy", "Plan", "Group", "Pass", "SparseChunk", "build_plan",
           "static_sparse_problem",
           "decode_plan", "sparse_chunks"]

STRATEGIES = ("prefill", "cached", "chunked", "absorbed", "sparse")


def absorb_max_new(cfg: MLAConfig) -> int:
    """Largest n for which absorbed attention over a cached prefix costs fewer FLOPs."""
    r, dn, dr, dv = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    extra_per_query = 2 * r + dr - (dn + dr + dv)   # absorbed minus expanded attention width
    if extra_per_query <= 0:
        return 1 << 30
    return max(1, (r * (dn + dv)) // extra_per_query)


def choose_strategy(cfg: MLAConfig, num_cached: int, num_new: int, max_workspace_tokens: int) -> str | None:
    if num_new == 0:
        return None
    if num_cached == 0:
        return "prefill"
    if num_new <= absorb_max_new(cfg):
        return "absorbed"
    return "cached" if num_cached <= max_workspace_tokens else "chunked"


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


def build_plan(batch: Batch, cfg: MLAConfig, max_workspace_tokens: int, force: str | None = None,
               gathers: bool = True) -> Plan:
    """Assign every sequence a strategy (``force`` overrides the rule where it applies) and
    build the index tensors of each group once. ``gathers``: the sparse attention op copies the
    selected rows (the reference does; the kernel reads them in place), see ``sparse_chunks``.

    Under Helix CP (the batch's cache split over cp ranks) a cached prefix is never whole on
    one rank: every sequence with one takes the absorbed path, whose partials the ranks combine.
    """
    cp_size = batch.cache.cp_size
    if batch.static:
        return _static_plan(batch, cfg, force)
    dev = batch.device
    offsets = batch.token_offsets()
    strategy = []
    for c, n in zip(batch.num_cached, batch.num_new):
        s = choose_strategy(cfg, c, n, max_workspace_tokens)
        # a forced strategy applies to sequences with a cached prefix ("prefill" there would drop it)
        if force is not None and force != "prefill" and s is not None and c > 0:
            s = "chunked" if force == "cached" and c > max_workspace_tokens else force
        if cp_size > 1 and s in ("cached", "chunked"):
            s = "absorbed"
        # attention sinks exist in the sparse ops only: every sequence of such a config is sparse
        if s is not None and cfg.has_indexer and (c + n > cfg.sparse_max_keys or force == "sparse"
                                                  or cfg.attention_sinks):
            s = "sparse"
        strategy.append(s)
    s_q = batch.num_new[0] if batch.num_new else 0
    if strategy and all(s == "absorbed" for s in strategy) and all(n == s_q for n in batch.num_new) and (
            cp_size == 1 or s_q == 1):
        return decode_plan(batch, s_q)
    plan = Plan(strategy)

    def ints(x, dtype=torch.int32):
        return torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)

    def rows_of(seqs):
        """The token rows of ``seqs``: a slice where they are one run (a view, no gather or
        scatter: e.g. a batch of decodes only), else an index tensor."""
        rows = [t for b in seqs for t in range(offsets[b], offsets[b + 1])]
        first = rows[0] if rows else 0
        if rows == list(range(first, first + len(rows))):
            return slice(first, first + len(rows))
        return ints(rows, torch.int64)

    def cumsum(xs):
        return tuple(itertools.accumulate(xs, initial=0))

    def make_pass(seqs, starts, lens, group_offsets=None):
        offsets_q, offsets_k = cumsum(batch.num_new[b] for b in seqs), cumsum(lens)
        return Pass(seqs=seqs, rows=rows_of(seqs), cu_seqlens_q=ints(offsets_q), cu_seqlens_k=ints(offsets_k),
                    starts=ints(starts),
                    block_table=batch.block_table[ints(seqs, torch.int64)], num_keys=sum(lens),
                    group_rows=None if group_offsets is None else ints(
                        [t for b in seqs for t in range(group_offsets[b], group_offsets[b] + batch.num_new[b])],
                        torch.int64),
                    offsets_q=offsets_q, offsets_k=offsets_k)

    def make_group(seqs):
        offsets_q = cumsum(batch.num_new[b] for b in seqs)
        return Group(seqs, rows_of(seqs), cu_seqlens=ints(offsets_q), offsets=offsets_q)

    by = {s: [b for b, x in enumerate(strategy) if x == s] for s in STRATEGIES}
    if by["prefill"]:
        plan.prefill = make_group(by["prefill"])
    # cached: pack whole sequences into passes whose prefixes fit the workspace
    current, used = [], 0
    for b in by["cached"]:
        c = batch.num_cached[b]
        if current and used + c > max_workspace_tokens:
            plan.cached.append(make_pass(current, [0] * len(current), [batch.num_cached[x] + batch.num_new[x] for x in current]))
            current, used = [], 0
        current.append(b)
        used += c
    if current:
        plan.cached.append(make_pass(current, [0] * len(current), [batch.num_cached[x] + batch.num_new[x] for x in current]))
    # chunked: prefix segments of all its sequences, max_workspace_tokens rows per pass
    if by["chunked"]:
        group = plan.chunked = make_group(by["chunked"])
        group_offsets = dict(zip(group.seqs, cumsum(batch.num_new[b] for b in group.seqs)))

        def flush(chunk):
            if chunk:
                group.passes.append(make_pass(*map(list, zip(*chunk)), group_offsets))

        chunk = []   # segments (batch index, start, length) of one pass
        for b in by["chunked"]:
            for start in range(0, batch.num_cached[b], max_workspace_tokens):
                seg = (b, start, min(max_workspace_tokens, batch.num_cached[b] - start))
                # a pass holds at most the workspace, and one segment per sequence (a plain varlen call)
                if sum(x[2] for x in chunk) + seg[2] > max_workspace_tokens or any(x[0] == b for x in chunk):
                    flush(chunk)
                    chunk = []
                chunk.append(seg)
        flush(chunk)
    # absorbed: one decode call per distinct number of new tokens
    for s_q in sorted({batch.num_new[b] for b in by["absorbed"]}):
        seqs = [b for b in by["absorbed"] if batch.num_new[b] == s_q]
        idx = ints(seqs, torch.int64)
        group = Group(seqs, rows_of(seqs), s_q=s_q, block_table=batch.block_table[idx],
                      cache_seqlens=batch.cache_seqlens[idx])
        if cp_size > 1 and s_q > 1:
            # a rank's rows are not contiguous in position: count what each query may see
            local = batch.cache.local_tokens
            group.query_seqlens = [ints([local(batch.num_cached[b] + i + 1) for b in seqs]) for i in range(s_q)]
        plan.absorbed.append(group)
    if by["sparse"]:
        plan.sparse = sparse_chunks(batch, cfg, by["sparse"], max_workspace_tokens, ints, gathers)
        if cfg.index_kpool is not None:
            plan.pools = kpool.pool_plan(batch, cfg, by["sparse"], plan.sparse, max_workspace_tokens, ints)
    return plan


def decode_plan(batch: Batch, s_q: int) -> Plan:
    """The plan of a batch whose every sequence brings s_q tokens over a cached prefix: one
    absorbed group of all its rows, on the batch's block_table and cache_seqlens themselves
    (under Helix CP only for s_q 1, where no query needs its own count of visible rows)."""
    B = batch.num_seqs
    group = Group(list(range(B)), slice(0, B * s_q), s_q=s_q, block_table=batch.block_table,
                  cache_seqlens=batch.cache_seqlens)
    return Plan(["absorbed"] * B, absorbed=[group])


def static_sparse_problem(cfg: MLAConfig, cache) -> str | None:
    """Why a static (CUDA-graph) decode batch of a sparse-indexer config over ``cache`` cannot be
    served, or None. It is served on the sparse path for every sequence, whatever its length (a
    sequence within sparse_max_keys keys gets all of them: the dense paths' result), over the
    batch's own tensors; what needs host lengths is refused: the k-pool indexer (its pool
    tables) and Helix CP (each rank's key counts)."""
    if cfg.index_kpool is not None:
        return f"{cfg.name!r} has the k-pool indexer, whose pool tables are built from host lengths"
    if cache.cp_size > 1:
        return f"Helix CP (cp_size {cache.cp_size}) with a sparse indexer needs each rank's key counts on the host"
    return None


def _static_plan(batch: Batch, cfg: MLAConfig, force: str | None) -> Plan:
    """The decode plan of a static batch, or a ValueError where the rule would choose another
    path for some lengths (the plan of a CUDA graph cannot depend on them). With a sparse indexer
    every sequence is sparse: one chunk over the batch's tensors, the logits as wide as its
    block table (``static_sparse_problem`` says what is refused)."""
    s_q = batch.num_new[0]
    if force not in (None, "absorbed", "prefill", "sparse"):   # "prefill" never applies over a cached prefix
        raise ValueError(f"strategy: a static (CUDA-graph) decode batch runs the absorbed (or, with a sparse "
                         f"indexer, the sparse) path, the layer forces {force!r}; expected None, 'absorbed' or "
                         "'sparse'")
    if s_q > absorb_max_new(cfg) or (batch.cache.cp_size > 1 and s_q > 1):
        raise ValueError(f"batch: a static batch of s_q={s_q} is not a decode batch the absorbed path serves alone "
                         f"(s_q <= {absorb_max_new(cfg)}, and 1 under Helix CP)")
    if not cfg.has_indexer:
        return decode_plan(batch, s_q)
    problem = static_sparse_problem(cfg, batch.cache)
    if problem:
        raise ValueError(f"batch: a static (CUDA-graph) batch cannot serve this sparse layer: {problem}")
    B = batch.num_seqs
    chunk = SparseChunk(seqs=list(range(B)), rows=slice(0, B * s_q), block_table=batch.block_table,
                        cache_seqlens=batch.cache_seqlens, cu_seqlens_q=batch.cu_seqlens_q,
                        max_seqlen_k=batch.block_table.shape[1] * batch.block_size, num_rows=B * s_q)
    return Plan(["sparse"] * B, sparse=[chunk])


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
