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
those, a byte a pass, finds the k-th largest T, each pass a launch over (query, chunk of keys)
programs that add their histograms (one program a query, looping over its keys, waited on a
memory latency per step: 191 us at B 32 x 32k on the H200); the keys above T and the first
(by index) equal to it are gathered, each as one int64 (its sortable bits above, its inverted
index below, so the lower index wins a tie) and sorted: the reference's stable descending
order, with no device value read on the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import jit

__all__ = ["indexer_logits", "topk_indices", "logits_schedule", "TOPK_CHUNK"]

TOPK_CHUNK = 2048    # keys a top-k program reads (on CUDA): B 32 x 32k keys is 512 programs a pass


@jit
def _logits_kernel(
    Q, W, KC, BT, SEQLENS, CU, OUT,
    stride_qt, stride_qh, stride_wt, stride_kb, stride_kr, stride_bt, stride_ot,
    B, NH, D, block_size, max_blocks, num_blocks, K, span, scale,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr, KEY_FP8: tl.constexpr, GROUP: tl.constexpr, ONE_SCALE: tl.constexpr,
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
    # keys below s_live: some query of the group sees them. The loop over them has no branch and
    # asks for 3 stages, so its block-id and key loads go out as cp.async ahead of the MMA (with
    # a branch around them, or without tl.range's stages, sm_90 got plain loads and each step
    # waited two memory latencies in a row)
    s_live = tl.minimum(s_end, tl.max(limit, 0))
    for s0 in tl.range(s_begin, s_live, BLOCK_N, num_stages=3):
        s = s0 + tl.arange(0, BLOCK_N)
        s_ok = s < s_live
        # columns and block ids clamped: lengths and ids are unchecked on CUDA
        blk = tl.load(bt_row + tl.minimum(s // block_size, max_blocks - 1), mask=s_ok, other=0)
        blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1).to(tl.int64)
        k_row = KC + blk * stride_kb + (s % block_size) * stride_kr
        k_ok = s_ok[:, None] & (dd < D)[None, :]
        if KEY_FP8:   # DeepSeek's key rows (bytes): [d e4m3 values | a float32 scale per GROUP]
            k8 = tl.load(k_row[:, None] + dd[None, :], mask=k_ok, other=0)
            if ONE_SCALE:   # one scale a key: the dot over its e4m3 values (exact in q's dtype), then it
                k = k8.to(tl.float8e4nv, bitcast=True).to(q.dtype)
                k_scale = tl.load((k_row + D).to(tl.pointer_type(tl.float32)), mask=s_ok, other=0.0)
            else:
                k_scale = tl.load((k_row + D).to(tl.pointer_type(tl.float32))[:, None] + (dd // GROUP)[None, :],
                                  mask=k_ok, other=0.0)
                k = (k8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * k_scale).to(q.dtype)
        else:
            k = tl.load(k_row[:, None] + dd[None, :], mask=k_ok, other=0.0)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        if KEY_FP8 and ONE_SCALE:
            sc = sc * k_scale[None, :]
        sc = tl.maximum(sc * scale, 0.0) * w[:, None]
        summed = tl.sum(tl.reshape(sc, [BLOCK_T, BLOCK_H, BLOCK_N]), 1)
        visible = (s[None, :] < limit[:, None]) & (s < s_end)[None, :]
        tl.store(out_row[:, None] + s[None, :], tl.where(visible, summed, float("-inf")),
                 mask=tq_ok[:, None] & (s < s_end)[None, :])
    # the span's columns past every query's keys (from the step after the loop's last): -inf
    dead = s_begin + tl.cdiv(tl.maximum(s_live - s_begin, 0), BLOCK_N) * BLOCK_N
    for s0 in range(dead, s_end, BLOCK_N):
        s = s0 + tl.arange(0, BLOCK_N)
        tl.store(out_row[:, None] + s[None, :], tl.full([BLOCK_T, BLOCK_N], float("-inf"), tl.float32),
                 mask=tq_ok[:, None] & (s < s_end)[None, :])


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
    widened to q's dtype in registers, exactly, and its scale applied to its dot; with several
    scales a key, d >= 256, each value scaled and rounded before the dot) -> logits
    [Tq, max_seqlen_k] float32."""
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
        GROUP=d // max(1, d // 128), ONE_SCALE=d < 256, BLOCK_T=block_t, BLOCK_H=block_h,
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_N=block_n, BLOCK_B=triton.next_power_of_2(B + 1),
        num_warps=4 if block_t * block_h <= 64 else 8,
    )
    return out


@jit
def _radix_prefix(H, k, PASSES: tl.constexpr):
    """The k-th largest key's bytes chosen by the first PASSES passes (their histograms H[p, 256]
    over the keys matching the bytes before): (prefix, its mask, the number of keys above it)."""
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], dtype=tl.uint32)
    known = tl.zeros([], dtype=tl.uint32)
    above = tl.zeros([], dtype=tl.int32)
    for p in tl.static_range(PASSES):
        hist = tl.load(H + p * 256 + bins)
        suffix = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist          # keys in bins >= d
        d = tl.max(tl.where(suffix >= k - above, bins, -1), 0)           # the bin of the (k - above)-th
        above += tl.sum(tl.where(bins > d, hist, 0), 0)
        prefix |= d.to(tl.uint32) << (24 - 8 * p)
        known |= tl.full([], 0xFF, tl.uint32) << (24 - 8 * p)
    return prefix, known, above


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
    every key above the k-th largest T at a place taken from HIST[t, 1024], a count (any order: the finish
    sorts), and of the keys equal to T the first k - above by position (the reference's tie
    rule), each at its rank among them: the chunks before count theirs in CHUNK_HIST."""
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
    # one int64 a key: its signed order above, the inverted position below (a tie sorts to the
    # lower position)
    comp = (_signed(u).to(tl.int64) << 32) | (0x7FFFFFFF - s).to(tl.int64)
    tl.store(SCRATCH + t * stride_st + at, comp, mask=take)


@jit
def _topk_finish(
    SCRATCH, BT, CU, OUT, stride_st, stride_bt, stride_ot, K, B, topk, block_size, max_blocks,
    KP: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """A query's k keys sorted best first (the composites' order: logit, then lower position) and
    mapped to flat cache slots through its sequence's block table; -1 for keys it does not see
    (logit -inf) and past k."""
    t = tl.program_id(0).to(tl.int64)
    k = tl.minimum(topk, K)
    j = tl.arange(0, KP)
    comp = tl.load(SCRATCH + t * stride_st + j, mask=j < k, other=-9223372036854775808)
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


def topk_indices(logits, topk, block_table, cu_seqlens_q, block_size):
    """``mla.ops.reference.topk_indices`` on the kernels: logits [Tq, K] float32 -> [Tq, topk] int32
    flat slots, best first, ties to the lower key, -1 past the keys a query sees (``topk`` up to
    4096). Programs (query, chunk of ``TOPK_CHUNK`` keys): four radix passes, a byte each, find
    the k-th largest logit T (``_radix_pass``: histograms added across a query's chunks), the
    chunks gather the k keys (``_radix_gather``), one program a query sorts and maps them
    (``_topk_finish``). Seven launches with the histograms' zeroing, no device value read on
    the host."""
    Tq, K = logits.shape
    out = torch.empty(Tq, topk, dtype=torch.int32, device=logits.device)
    if Tq == 0:
        return out
    if K == 0 or block_table.shape[0] == 0:
        return out.fill_(-1)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    ch = TOPK_CHUNK if logits.is_cuda else 64
    chunks = triton.cdiv(K, ch)
    kp = triton.next_power_of_2(topk)
    scratch = torch.empty(Tq, kp, dtype=torch.int64, device=logits.device)
    state = torch.zeros(Tq, 4 * 256 + 1, dtype=torch.int32, device=logits.device)   # 4 histograms, a count
    chunk_hist = torch.empty(Tq, chunks, 256, dtype=torch.int32, device=logits.device)
    B = block_table.shape[0]
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
