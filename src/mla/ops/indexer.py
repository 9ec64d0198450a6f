"""The lightning indexer on the GPU: its logits over a paged key cache (a Triton kernel), and the
top-k of them as flat cache slots (composite keys and ``torch.topk``). Both keep the
reference's contracts (``mla.ops.reference.indexer_logits`` / ``topk_indices``) and read no
device value on the host, so a decode step stays capturable in a CUDA graph.

Logits (n = index_n_heads, d = index_head_dim):

    logits[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s] * scale)   for the keys query t sees

    programs = token groups x key spans. A group is BLOCK_T consecutive queries of one sequence
               (BLOCK_T * n padded heads <= 128 rows of the MMA's M): the keys a group loads
               serve all its queries. Groups are numbered sequence by sequence on the device
               (at most ceil(Tq / BLOCK_T) + B of them; the rest exit), so no host plan.
    program (group, span): for each BLOCK_N-key step of its span
        k  = index_cache[block_table[b, s // block_size], s % block_size]   [BLOCK_N, d]
        S  = relu(q @ k^T * scale) * w                                      [BLOCK_T * n, BLOCK_N]
        logits[t, s] = sum over t's n rows of S, -inf where t does not see s (causal, or past
                       the sequence); every column < max_seqlen_k is written

Top-k: a float's bits, flipped where negative, order like the float; a radix select over
those, a byte a pass, finds the k-th largest T (in one program a query, or, for few queries,
in passes over (query, chunk of keys) programs: ``topk_indices``); the keys above T and the
first (by index) equal to it are gathered, each as one int64 (its sortable bits above, its
inverted index below, so the lower index wins a tie) and sorted: the reference's stable
descending order, with no device value read on the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import jit, num_sms

__all__ = ["indexer_logits", "topk_indices", "logits_schedule", "TOPK_CHUNK"]

TOPK_CHUNK = 2048    # keys a top-k program reads (on CUDA): B 32 x 32k keys is 512 programs a pass


@jit
def _logits_kernel(
    Q, W, KC, BT, SEQLENS, CU, OUT,
    stride_qt, stride_qh, stride_wt, stride_kb, stride_kr, stride_bt, stride_ot,
    B, NH, D, block_size, max_blocks, num_blocks, K, span, scale,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr, KEY_FP8: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    g = tl.program_id(0)
    # this group's sequence b and first query t0: groups are numbered sequence by sequence
    i = tl.arange(0, BLOCK_B)
    lo = tl.load(CU + i, mask=i < B, other=0)
    hi = tl.load(CU + i + 1, mask=i < B, other=0)
    groups = (hi - lo + BLOCK_T - 1) // BLOCK_T
    ends = tl.cumsum(groups, 0)
    b = tl.sum((ends <= g).to(tl.int32), 0)
    if b >= B:
        return
    first = tl.sum(tl.where(i == b, ends - groups, 0), 0)
    q0 = tl.sum(tl.where(i == b, lo, 0), 0)
    nq = tl.sum(tl.where(i == b, hi - lo, 0), 0)
    n = tl.load(SEQLENS + b)
    i0 = (g - first) * BLOCK_T                   # the group's first query within its sequence

    ROWS: tl.constexpr = BLOCK_T * BLOCK_H
    r = tl.arange(0, ROWS)
    tt = r // BLOCK_H                            # query of the group, head
    h = r % BLOCK_H
    row_ok = (i0 + tt < nq) & (h < NH)
    t = (q0 + i0 + tt).to(tl.int64)
    dd = tl.arange(0, BLOCK_D)
    q = tl.load(Q + t[:, None] * stride_qt + h[:, None] * stride_qh + dd[None, :],
                mask=row_ok[:, None] & (dd < D)[None, :], other=0.0)
    w = tl.load(W + t * stride_wt + h, mask=row_ok, other=0.0)     # padding rows weigh 0

    tq = tl.arange(0, BLOCK_T)
    tq_ok = i0 + tq < nq
    if CAUSAL:
        limit = n - nq + i0 + tq + 1             # query i sees keys < n - nq + i + 1
    else:
        limit = tl.zeros([BLOCK_T], dtype=tl.int32) + n
    limit = tl.where(tq_ok, limit, 0)
    out_row = OUT + (q0 + i0 + tq).to(tl.int64) * stride_ot
    bt_row = BT + b.to(tl.int64) * stride_bt
    s_begin = tl.program_id(1) * span
    s_end = tl.minimum(s_begin + span, K)
    far = tl.max(limit, 0)                       # the group sees no key from here on
    for s0 in range(s_begin, s_end, BLOCK_N):
        s = s0 + tl.arange(0, BLOCK_N)
        visible = (s[None, :] < limit[:, None]) & (s < s_end)[None, :]
        logits = tl.full([BLOCK_T, BLOCK_N], float("-inf"), dtype=tl.float32)
        if s0 < far:
            s_ok = s < tl.minimum(far, s_end)
            # columns and block ids clamped: lengths and ids are unchecked on CUDA
            blk = tl.load(bt_row + tl.minimum(s // block_size, max_blocks - 1), mask=s_ok, other=0)
            blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1).to(tl.int64)
            k_row = KC + blk * stride_kb + (s % block_size) * stride_kr
            k_ok = s_ok[:, None] & (dd < D)[None, :]
            if KEY_FP8:   # DeepSeek's key rows (bytes): [d e4m3 values | a float32 scale per GROUP]
                k8 = tl.load(k_row[:, None] + dd[None, :], mask=k_ok, other=0)
                k_scale = tl.load((k_row + D).to(tl.pointer_type(tl.float32))[:, None] + (dd // GROUP)[None, :],
                                  mask=k_ok, other=0.0)
                k = (k8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * k_scale).to(q.dtype)
            else:
                k = tl.load(k_row[:, None] + dd[None, :], mask=k_ok, other=0.0)
            if IEEE:
                sc = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                sc = tl.dot(q, tl.trans(k))
            sc = tl.maximum(sc * scale, 0.0) * w[:, None]
            summed = tl.sum(tl.reshape(sc, [BLOCK_T, BLOCK_H, BLOCK_N]), 1)
            logits = tl.where(visible, summed, float("-inf"))
        tl.store(out_row[:, None] + s[None, :], logits, mask=tq_ok[:, None] & (s < s_end)[None, :])


def logits_schedule(n_heads: int, Tq: int, B: int, K: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_T, BLOCK_H, BLOCK_N, span, groups) of a launch, from shapes only: heads padded to a
    power of two (>= 16 rows in all), as many queries a group as fill 128 rows (64 heads: 2;
    the keys a group loads serve them all), 64-key steps (16 on the interpreter), and key spans
    of 16 steps, enough programs for the GPU at decode batches (B 32 x 32k keys: 1024)."""
    block_h = triton.next_power_of_2(max(n_heads, 1))
    block_t = max(1, 128 // block_h) if device.type == "cuda" else max(1, 16 // block_h)
    block_t = max(block_t, triton.cdiv(16, block_h))
    block_n = 64 if device.type == "cuda" else 16
    span = block_n * 16
    groups = triton.cdiv(Tq, block_t) + B
    return block_t, block_h, block_n, span, groups


def indexer_logits(q, weights, index_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_k, softmax_scale,
                   causal=True):
    """``mla.ops.reference.indexer_logits`` on the kernel: q [Tq, n, d], weights [Tq, n] float32,
    index_cache [num_blocks, block_size, d] (or FP8 key rows, uint8, read as they are: each key
    widened and scaled in registers, in q's dtype) -> logits [Tq, max_seqlen_k] float32."""
    Tq, nh, d = q.shape
    B = block_table.shape[0]
    out = torch.empty(Tq, max_seqlen_k, dtype=torch.float32, device=q.device)
    if Tq == 0 or max_seqlen_k == 0:
        return out
    if B == 0 or nh == 0:
        return out.fill_(float("-inf"))
    q = q if q.stride(-1) == 1 else q.contiguous()
    index_cache = index_cache if index_cache.stride(-1) == 1 else index_cache.contiguous()
    weights = weights.contiguous()
    block_t, block_h, block_n, span, groups = logits_schedule(nh, Tq, B, max_seqlen_k, q.device)
    _logits_kernel[(groups, triton.cdiv(max_seqlen_k, span))](
        q, weights, index_cache, block_table, cache_seqlens, cu_seqlens_q, out,
        q.stride(0), q.stride(1), weights.stride(0), index_cache.stride(0), index_cache.stride(1),
        block_table.stride(0), out.stride(0),
        B, nh, d, index_cache.shape[1], max(block_table.shape[1], 1), max(index_cache.shape[0], 1), max_seqlen_k,
        span, softmax_scale,
        CAUSAL=causal, IEEE=q.dtype == torch.float32, KEY_FP8=index_cache.dtype == torch.uint8,
        GROUP=d // max(1, d // 128), BLOCK_T=block_t, BLOCK_H=block_h,
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_N=block_n, BLOCK_B=triton.next_power_of_2(B + 1),
        num_warps=4 if block_t * block_h <= 64 else 8,
    )
    return out


@jit
def _topk_kernel(
    LOGITS, BT, CU, SCRATCH, OUT,
    stride_lt, stride_bt, stride_st, stride_ot,
    K, B, topk, block_size, max_blocks,
    BLOCK: tl.constexpr, KP: tl.constexpr, BLOCK_B: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    row = LOGITS + t * stride_lt
    k = tl.minimum(topk, K)
    # radix select of the k-th largest key T, a byte a pass from the top: prefix holds T's bytes
    # found so far, above counts the keys greater than T
    prefix = tl.zeros([], dtype=tl.uint32)
    known = tl.zeros([], dtype=tl.uint32)
    above = tl.zeros([], dtype=tl.int32)
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([256], dtype=tl.int32)
        for s0 in range(0, K, BLOCK):
            s = s0 + tl.arange(0, BLOCK)
            u = _sortable(tl.load(row + s, mask=s < K, other=float("-inf")))
            match = (s < K) & ((u & known) == prefix)
            hist += tl.histogram(((u >> shift) & 0xFF).to(tl.int32), 256, mask=match)
        prefix, known, above = _radix_choose(hist, k, prefix, known, above, shift)
    # the k keys: all greater than T, then those equal to T by index (ties to the lower key)
    need_eq = k - above
    taken = tl.zeros([], dtype=tl.int32)
    eq_seen = tl.zeros([], dtype=tl.int32)
    scratch = SCRATCH + t * stride_st
    for s0 in range(0, K, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        u = _sortable(tl.load(row + s, mask=s < K, other=float("-inf")))
        ok = s < K
        eq = ok & (u == prefix)
        sel = (ok & (u > prefix)) | (eq & (eq_seen + tl.cumsum(eq.to(tl.int32), 0) <= need_eq))
        at = taken + tl.cumsum(sel.to(tl.int32), 0) - 1
        tl.store(scratch + at, _composite(u, s), mask=sel)
        taken += tl.sum(sel.to(tl.int32), 0)
        eq_seen += tl.sum(eq.to(tl.int32), 0)
    tl.debug_barrier()   # the program's scratch writes before its reads
    _sorted_slots(scratch, t, k, BT, CU, OUT, stride_bt, stride_ot, B, topk, block_size, max_blocks, KP, BLOCK_B)


@jit
def _radix_prefix(H, k, PASSES: tl.constexpr):
    """The k-th largest key's bytes chosen by the first PASSES passes (their histograms H[p, 256]
    over the keys matching the bytes before): (prefix, its mask, the number of keys above it)."""
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], dtype=tl.uint32)
    known = tl.zeros([], dtype=tl.uint32)
    above = tl.zeros([], dtype=tl.int32)
    for p in tl.static_range(PASSES):
        prefix, known, above = _radix_choose(tl.load(H + p * 256 + bins), k, prefix, known, above, 24 - 8 * p)
    return prefix, known, above


@jit
def _radix_choose(hist, k, prefix, known, above, shift):
    """One radix pass's decision: of the histogram (256 bins of the byte at ``shift``) over the keys
    matching ``prefix`` so far, the bin d holding the (k - above)-th largest; returns the prefix
    and mask with d added and above counting the keys in bins over d too."""
    bins = tl.arange(0, 256)
    suffix = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist          # keys in bins >= d
    d = tl.max(tl.where(suffix >= k - above, bins, -1), 0)
    above += tl.sum(tl.where(bins > d, hist, 0), 0)
    prefix |= d.to(tl.uint32) << shift
    known |= tl.full([], 0xFF, tl.uint32) << shift
    return prefix, known, above


@jit
def _composite(u, s):
    """One int64 a key (sortable bits u at position s): its signed order above, the inverted
    position below, so that a tie sorts to the lower position."""
    return (_signed(u).to(tl.int64) << 32) | (0x7FFFFFFF - s).to(tl.int64)


@jit
def _chunk_keys(LOGITS, stride_lt, K, CH, BLOCK: tl.constexpr):
    """Program (query t, chunk c)'s keys: their positions s, which exist, and their sortable bits."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1) * CH + tl.arange(0, BLOCK)
    ok = s < K
    u = _sortable(tl.load(LOGITS + t * stride_lt + s, mask=ok, other=float("-inf")))
    return t, s, ok, u


@jit
def _radix_pass(
    LOGITS, HIST, CHUNK_HIST, stride_lt, stride_h, stride_ch, K, topk, CH,
    PASS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Radix pass PASS over one chunk of one query's keys: the histogram of byte 3 - PASS of the
    keys matching the bytes chosen so far, added into HIST[t, PASS]; the last pass also keeps
    each chunk's own (CHUNK_HIST[t, c]: where the keys equal to the k-th fall, by chunk)."""
    t, s, ok, u = _chunk_keys(LOGITS, stride_lt, K, CH, BLOCK)
    prefix, known, above = _radix_prefix(HIST + t * stride_h, tl.minimum(topk, K), PASS)
    match = ok & ((u & known) == prefix)
    hist = tl.histogram(((u >> (24 - 8 * PASS)) & 0xFF).to(tl.int32), 256, mask=match)
    bins = tl.arange(0, 256)
    tl.atomic_add(HIST + t * stride_h + PASS * 256 + bins, hist, mask=hist > 0, sem="relaxed")
    if PASS == 3:
        tl.store(CHUNK_HIST + t * stride_ch + tl.program_id(1) * 256 + bins, hist)


@jit
def _radix_gather(
    LOGITS, HIST, CHUNK_HIST, SCRATCH, stride_lt, stride_h, stride_ch, stride_st, K, topk, CH,
    BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """The chunk's share of the k keys, as composite int64s (``_topk_finish``) into SCRATCH[t]:
    every key above the k-th largest T at a place taken from the count HIST[t, 1024] (any order:
    the finish sorts), and of the keys equal to T the first k - above by position (the
    reference's tie rule), each at its rank among them: the chunks before count theirs in
    CHUNK_HIST."""
    t, s, ok, u = _chunk_keys(LOGITS, stride_lt, K, CH, BLOCK)
    k = tl.minimum(topk, K)
    T, known, above = _radix_prefix(HIST + t * stride_h, k, 4)
    c = tl.program_id(1)
    cc = tl.arange(0, BLOCK_C)
    eq_before = tl.sum(tl.load(CHUNK_HIST + t * stride_ch + cc * 256 + (T & 0xFF).to(tl.int32), mask=cc < c,
                               other=0), 0)
    gt = ok & (u > T)
    eq = ok & (u == T)
    rank = eq_before + tl.cumsum(eq.to(tl.int32), 0) - 1
    take = gt | (eq & (rank < k - above))
    base = tl.atomic_add(HIST + t * stride_h + 1024, tl.sum(gt.to(tl.int32), 0), sem="relaxed")
    at = tl.where(gt, base + tl.cumsum(gt.to(tl.int32), 0) - 1, above + rank)
    tl.store(SCRATCH + t * stride_st + at, _composite(u, s), mask=take)


@jit
def _topk_finish(
    SCRATCH, BT, CU, OUT, stride_st, stride_bt, stride_ot, K, B, topk, block_size, max_blocks,
    KP: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """The chunked path's last step, one program a query: ``_sorted_slots`` of its k keys."""
    t = tl.program_id(0).to(tl.int64)
    _sorted_slots(SCRATCH + t * stride_st, t, tl.minimum(topk, K), BT, CU, OUT, stride_bt, stride_ot, B, topk,
                  block_size, max_blocks, KP, BLOCK_B)


@jit
def _sorted_slots(scratch, t, k, BT, CU, OUT, stride_bt, stride_ot, B, topk, block_size, max_blocks,
                  KP: tl.constexpr, BLOCK_B: tl.constexpr):
    """Query t's k composite keys (at scratch) sorted best first (logit, then lower position) and
    mapped to flat cache slots through its sequence's block table into OUT[t]; -1 for keys it
    does not see (logit -inf) and past k."""
    j = tl.arange(0, KP)
    comp = tl.load(scratch + j, mask=j < k, other=-9223372036854775808)
    comp = tl.sort(comp, descending=True)      # best first; padding (the least int64) last
    pos = (0x7FFFFFFF - (comp & 0x7FFFFFFF)).to(tl.int32)
    seen = (comp >> 32).to(tl.int32) != _signed(_sortable(tl.full([KP], float("-inf"), tl.float32)))
    # the query's sequence: the number of sequences that end at or before it
    i = tl.arange(0, BLOCK_B)
    ends = tl.load(CU + 1 + i, mask=i < B, other=2147483647)
    b = tl.minimum(tl.sum((ends <= t).to(tl.int32), 0), B - 1)
    blk = tl.load(BT + b.to(tl.int64) * stride_bt + tl.minimum(pos // block_size, max_blocks - 1),
                  mask=(j < k) & seen, other=0)
    slot = tl.where((j < k) & seen, blk * block_size + pos % block_size, -1)
    tl.store(OUT + t * stride_ot + j, slot, mask=j < topk)


@jit
def _sortable(x):
    """float32 -> uint32 whose unsigned order is the floats' order (NaN aside): the bits, all of
    them flipped for a negative float, the sign bit alone for a positive one; -0.0 is taken as
    0.0 (they tie, as in the reference's sort)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) | (-2147483647 - 1))).to(tl.uint32, bitcast=True)


@jit
def _signed(u):
    """The int32 whose signed order is u's unsigned order (``_sortable``'s keys)."""
    return u.to(tl.int32, bitcast=True) ^ (-2147483647 - 1)


def topk_indices(logits, topk, block_table, cu_seqlens_q, block_size, chunked: bool | None = None):
    """``mla.ops.reference.topk_indices`` on the kernels: logits [Tq, K] float32 -> [Tq, topk] int32
    flat slots, best first, ties to the lower key, -1 past the keys a query sees (``topk`` up to
    4096). Two paths with the same result:

    - one program a query (``_topk_kernel``): four radix passes over its keys, the gather and the
      sort in one launch; each pass loops over the keys a block at a time, a memory latency a
      step, so a few queries leave the GPU idle (191 us at 32 queries x 32k keys on the H200);
    - chunked (``chunked=True``): each radix pass a launch over (query, ``TOPK_CHUNK`` keys)
      programs that add their histograms (``_radix_pass``), the chunks gather the k keys
      (``_radix_gather``), one program a query sorts and maps them (``_topk_finish``): seven
      launches with the zeroing. On the H200, 32 x 32k: 77.0 us against 190.9, 1 x 32k 55.9
      against 190.4, 32 x 128k 171.4 against 727.9, 128 x 32k 171.2 against 194.5; but 4096 x 8k
      1799.9 against 1398.1.

    chunked None: chunked on CUDA for at most one query a multiprocessor (the one-program kernel
    has less than a wave of programs there), the one-program kernel otherwise and on CPU."""
    Tq, K = logits.shape
    out = torch.empty(Tq, topk, dtype=torch.int32, device=logits.device)
    if Tq == 0:
        return out
    if K == 0 or block_table.shape[0] == 0:
        return out.fill_(-1)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    if chunked is None:
        chunked = logits.is_cuda and Tq <= num_sms(logits.device.index or 0)
    kp = triton.next_power_of_2(topk)
    scratch = torch.empty(Tq, kp, dtype=torch.int64, device=logits.device)
    B = block_table.shape[0]
    if not chunked:
        _topk_kernel[(Tq,)](
            logits, block_table, cu_seqlens_q, scratch, out,
            logits.stride(0), block_table.stride(0), scratch.stride(0), out.stride(0),
            K, B, topk, block_size, max(block_table.shape[1], 1),
            BLOCK=1024 if logits.is_cuda else 64, KP=kp, BLOCK_B=triton.next_power_of_2(B), num_warps=8,
        )
        return out
    ch = TOPK_CHUNK if logits.is_cuda else 64
    chunks = triton.cdiv(K, ch)
    state = torch.zeros(Tq, 4 * 256 + 1, dtype=torch.int32, device=logits.device)   # 4 histograms, a count
    chunk_hist = torch.empty(Tq, chunks, 256, dtype=torch.int32, device=logits.device)
    grid = (Tq, chunks)
    for p in range(4):
        _radix_pass[grid](logits, state, chunk_hist, logits.stride(0), state.stride(0), chunk_hist.stride(0), K, topk,
                          ch, PASS=p, BLOCK=ch, num_warps=8)
    _radix_gather[grid](logits, state, chunk_hist, scratch, logits.stride(0), state.stride(0),
                        chunk_hist.stride(0), scratch.stride(0), K, topk, ch, BLOCK=ch,
                        BLOCK_C=triton.next_power_of_2(chunks), num_warps=8)
    _topk_finish[(Tq,)](scratch, block_table, cu_seqlens_q, out, scratch.stride(0), block_table.stride(0),
                        out.stride(0), K, B, topk, block_size, max(block_table.shape[1], 1), KP=kp,
                        BLOCK_B=triton.next_power_of_2(B), num_warps=8)
    return out
