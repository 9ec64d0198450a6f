"""The lightning indexer on the GPU: its logits over a paged key cache (a Triton kernel), and the
top-k of them as flat cache slots (a radix select). Both keep the reference's contracts
(``mla.ops.reference.indexer_logits`` / ``topk_indices``) and read no device value on the host,
so a decode step stays capturable in a CUDA graph.

Logits (n = index_n_heads, d = index_head_dim):

    logits[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s] * scale)   for the keys query t sees

    programs = token groups x key spans. A group is BLOCK_T consecutive queries of one sequence
               (BLOCK_T * n padded heads <= 128 columns of the MMA's N): the keys a group loads
               serve all its queries. Groups are numbered sequence by sequence on the device
               (at most ceil(Tq / BLOCK_T) + B of them; the rest exit), so no host plan.
    program (group, span): for each BLOCK_N-key step of its span (cp.async two steps ahead)
        k  = index_cache[block_table[b, s // block_size], s % block_size]   [BLOCK_N, d]
        S  = relu(k @ q^T * scale) * w                                      [BLOCK_N, BLOCK_T * n]
        logits[t, s] = sum over t's n columns of S, -inf where t does not see s (causal, or
                       past the sequence); every column < max_seqlen_k is written
    Keys are the MMA's rows so that the sum over heads stays inside a thread's accumulator and
    its quad (with keys as the MMA's columns it went through shared memory: 57 shuffles a thread
    against 8 in the SASS). d is a constexpr: a run-time mask on it kept the loads from being
    vectorized. The two together: 2.1x faster at B 32 x 32k on the H200. FP8 keys (one scale a
    key at d = 128) widen to q's dtype exactly, and the scale multiplies the key's scores after
    the MMA.

Top-k: a float's bits, flipped where negative, order like the float; a radix select over
those, a byte a pass, finds the k-th largest T (in one program a query, or, for few queries,
in passes over (query, chunk of keys) programs: ``topk_indices``); then the keys above T and
the first (by index) equal to it are written in key order, each at its rank among them: no
sort, and no device value read on the host.
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
    B, NH, block_size, max_blocks, num_blocks, K, span, scale,
    D: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr, KEY_FP8: tl.constexpr, GROUP: tl.constexpr,
    ONE_SCALE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, STAGES: tl.constexpr,
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
    qt = tl.trans(q)                             # [D, ROWS]: keys are the MMA's M, query rows its N
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
    # the keys some query of the group sees end at far: steps up to there score, the rest of the
    # span is -inf. A step's keys are the rows of its MMA, so the sum over a query's heads is
    # along the accumulator's columns (within a thread and its quad, no shared memory)
    far = tl.minimum(tl.max(limit, 0), s_end)
    s_mid = s_begin + tl.maximum(far - s_begin + BLOCK_N - 1, 0) // BLOCK_N * BLOCK_N
    for s0 in tl.range(s_begin, s_mid, BLOCK_N, num_stages=STAGES):
        s = s0 + tl.arange(0, BLOCK_N)
        s_ok = s < far
        # columns and block ids clamped: lengths and ids are unchecked on CUDA
        blk = tl.load(bt_row + tl.minimum(s // block_size, max_blocks - 1), mask=s_ok, other=0)
        blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1).to(tl.int64)
        k_row = KC + blk * stride_kb + (s % block_size) * stride_kr
        k_ok = s_ok[:, None] & (dd < D)[None, :]
        if KEY_FP8:   # DeepSeek's key rows (bytes): [d e4m3 values | a float32 scale per GROUP]
            k_row = tl.multiple_of(k_row, 4)     # rows of 4 * 33 bytes (the launch checks)
            k8 = tl.load(k_row[:, None] + dd[None, :], mask=k_ok, other=0).to(tl.float8e4nv, bitcast=True)
            if ONE_SCALE:    # one scale a key: it scales the key's row of the scores
                k = k8.to(q.dtype)
                k_scale = tl.load((k_row + D).to(tl.pointer_type(tl.float32)), mask=s_ok, other=0.0) * scale
            else:
                k_scale = tl.load((k_row + D).to(tl.pointer_type(tl.float32))[:, None] + (dd // GROUP)[None, :],
                                  mask=k_ok, other=0.0)
                k = (k8.to(tl.float32) * k_scale).to(q.dtype)
                k_scale = tl.zeros([BLOCK_N], dtype=tl.float32) + scale
        else:
            k = tl.load(k_row[:, None] + dd[None, :], mask=k_ok, other=0.0)
            k_scale = tl.zeros([BLOCK_N], dtype=tl.float32) + scale
        if IEEE:
            sc = tl.dot(k, qt, input_precision="ieee")
        else:
            sc = tl.dot(k, qt)
        sc = tl.maximum(sc * k_scale[:, None], 0.0) * w[None, :]
        summed = tl.sum(tl.reshape(sc, [BLOCK_N, BLOCK_T, BLOCK_H]), 2)      # [BLOCK_N, BLOCK_T]
        logits = tl.where(s[:, None] < limit[None, :], summed, float("-inf"))
        tl.store(out_row[None, :] + s[:, None], logits, mask=tq_ok[None, :] & (s < s_end)[:, None])
    for s0 in range(s_mid, s_end, BLOCK_N):
        s = s0 + tl.arange(0, BLOCK_N)
        tl.store(out_row[None, :] + s[:, None], tl.full([BLOCK_N, BLOCK_T], float("-inf"), dtype=tl.float32),
                 mask=tq_ok[None, :] & (s < s_end)[:, None])


def logits_schedule(n_heads: int, Tq: int, B: int, K: int, key_fp8: bool,
                    device: torch.device) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_T, BLOCK_H, BLOCK_N, span, groups, stages) of a launch, from shapes only: heads
    padded to a power of two (>= 16 columns in all), as many queries a group as fill 128 columns
    (64 heads: 2; the keys a group loads serve them all) but no more than a sequence has on
    average (decode: one). A group of one query (decode) takes 64-key steps in spans of up to 32,
    cp.async two steps ahead (bf16 keys; FP8 keys, widened in registers, load one step at a
    time); a wider group 128-key steps in spans of up to 8 (the MMA then bounds it); spans
    shorter where that gives the GPU 4 programs a multiprocessor. Measured on the H200 (64 heads
    x 128): B 32 x 32k bf16 keys 94.9 us at 64 x 32 against 96.8 at 64 x 16, FP8 107.9 at one
    stage against 114.0 at two; 4096 queries x 8k 1189.8 us at 128 x 8 against 1247.6 at 64 x 16.
    On the interpreter: 16-key steps, spans of 16."""
    block_h = triton.next_power_of_2(max(n_heads, 1))
    block_t = max(1, 128 // block_h) if device.type == "cuda" else max(1, 16 // block_h)
    block_t = min(block_t, triton.next_power_of_2(triton.cdiv(Tq, max(B, 1))))
    block_t = max(block_t, triton.cdiv(16, block_h))
    groups = triton.cdiv(Tq, block_t) + B
    if device.type != "cuda":
        return block_t, block_h, 16, 16 * 16, groups, 1
    wide = block_t * block_h > 64
    block_n, most = (128, 8) if wide else (64, 32)
    steps = triton.cdiv(triton.cdiv(Tq, block_t) * triton.cdiv(K, block_n), 4 * num_sms(device.index or 0))
    stages = 1 if key_fp8 and not wide else 2
    return block_t, block_h, block_n, block_n * min(most, max(4, steps)), groups, stages


def indexer_logits(q, weights, index_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_k, softmax_scale,
                   causal=True, config: tuple | None = None):
    """``mla.ops.reference.indexer_logits`` on the kernel: q [Tq, n, d], weights [Tq, n] float32,
    index_cache [num_blocks, block_size, d] (or FP8 key rows, uint8, read as they are: each key
    widened in q's dtype, its scale applied to its scores) -> logits [Tq, max_seqlen_k] float32.
    config: (BLOCK_N, span steps, pipeline stages, warps) in place of the defaults, for tuning."""
    Tq, nh, d = q.shape
    B = block_table.shape[0]
    out = torch.empty(Tq, max_seqlen_k, dtype=torch.float32, device=q.device)
    if Tq == 0 or max_seqlen_k == 0:
        return out
    if B == 0 or nh == 0:
        return out.fill_(float("-inf"))
    q = q if q.stride(-1) == 1 else q.contiguous()
    fp8 = index_cache.dtype == torch.uint8
    if index_cache.stride(-1) != 1 or (fp8 and (index_cache.data_ptr() % 4 or index_cache.stride(0) % 4
                                                or index_cache.stride(1) % 4)):
        index_cache = index_cache.contiguous()     # the kernel reads FP8 rows 4 bytes at a time
    weights = weights.contiguous()
    block_t, block_h, block_n, span, groups, stages = logits_schedule(nh, Tq, B, max_seqlen_k, fp8, q.device)
    warps = 4
    if config is not None:
        block_n, steps, stages, warps = config
        span = block_n * steps
    _logits_kernel[(groups, triton.cdiv(max_seqlen_k, span))](
        q, weights, index_cache, block_table, cache_seqlens, cu_seqlens_q, out,
        q.stride(0), q.stride(1), weights.stride(0), index_cache.stride(0), index_cache.stride(1),
        block_table.stride(0), out.stride(0),
        B, nh, index_cache.shape[1], max(block_table.shape[1], 1), max(index_cache.shape[0], 1), max_seqlen_k,
        span, softmax_scale,
        D=d, CAUSAL=causal, IEEE=q.dtype == torch.float32, KEY_FP8=fp8,
        GROUP=d // max(1, d // 128), ONE_SCALE=d < 256, BLOCK_T=block_t, BLOCK_H=block_h,
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_N=block_n, BLOCK_B=triton.next_power_of_2(B + 1),
        STAGES=stages, num_warps=warps,
    )
    return out


@jit
def _topk_kernel(
    LOGITS, BT, CU, OUT,
    stride_lt, stride_bt, stride_ot,
    K, B, topk, block_size, max_blocks,
    BLOCK: tl.constexpr, BLOCK_B: tl.constexpr,
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
    # the k keys in key order: all greater than T, and the first (by index) of those equal to it
    need_eq = _needed_equal(prefix, k, above)
    bt_row = BT + _sequence_of(CU, t, B, BLOCK_B).to(tl.int64) * stride_bt
    taken = tl.zeros([], dtype=tl.int32)
    eq_seen = tl.zeros([], dtype=tl.int32)
    for s0 in range(0, K, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        u = _sortable(tl.load(row + s, mask=s < K, other=float("-inf")))
        ok = s < K
        eq = ok & (u == prefix)
        sel = (ok & (u > prefix)) | (eq & (eq_seen + tl.cumsum(eq.to(tl.int32), 0) <= need_eq))
        at = taken + tl.cumsum(sel.to(tl.int32), 0) - 1
        tl.store(OUT + t * stride_ot + at, _slot_of(bt_row, s, block_size, max_blocks, sel), mask=sel)
        taken += tl.sum(sel.to(tl.int32), 0)
        eq_seen += tl.sum(eq.to(tl.int32), 0)
    _pad(OUT + t * stride_ot, taken, topk, BLOCK)


@jit
def _needed_equal(T, k, above):
    """How many keys equal to the k-th largest T the top-k takes: k - above, or none where T is
    -inf (the query sees fewer than k keys; an unseen key is never selected)."""
    unseen = _sortable(tl.full([], float("-inf"), tl.float32))
    return tl.where(T == unseen, 0, k - above)


@jit
def _sequence_of(CU, t, B, BLOCK_B: tl.constexpr):
    """Query t's sequence: the number of sequences that end at or before it (cu_seqlens_q)."""
    i = tl.arange(0, BLOCK_B)
    ends = tl.load(CU + 1 + i, mask=i < B, other=2147483647)
    return tl.minimum(tl.sum((ends <= t).to(tl.int32), 0), B - 1)


@jit
def _slot_of(bt_row, s, block_size, max_blocks, mask):
    """Key positions s -> flat cache slots through the sequence's block table row."""
    blk = tl.load(bt_row + tl.minimum(s // block_size, max_blocks - 1), mask=mask, other=0)
    return blk * block_size + s % block_size


@jit
def _pad(out_row, taken, topk, BLOCK: tl.constexpr):
    """-1 in out_row[taken:topk]: a query that sees fewer than topk keys."""
    for j0 in range(taken, topk, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        tl.store(out_row + j, tl.full([BLOCK], -1, tl.int32), mask=j < topk)


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
    keys matching the bytes chosen so far, added into HIST[t, PASS]. The last pass also keeps
    the chunk's own counts, CHUNK_HIST[t, c]: that histogram (256 bins) and the keys whose top
    three bytes are above the prefix (one more), so that each chunk knows where its share of the
    top-k starts (``_radix_select``)."""
    t, s, ok, u = _chunk_keys(LOGITS, stride_lt, K, CH, BLOCK)
    prefix, known, above = _radix_prefix(HIST + t * stride_h, tl.minimum(topk, K), PASS)
    match = ok & ((u & known) == prefix)
    hist = tl.histogram(((u >> (24 - 8 * PASS)) & 0xFF).to(tl.int32), 256, mask=match)
    bins = tl.arange(0, 256)
    tl.atomic_add(HIST + t * stride_h + PASS * 256 + bins, hist, mask=hist > 0, sem="relaxed")
    if PASS == 3:
        row = CHUNK_HIST + t * stride_ch + tl.program_id(1) * 257
        tl.store(row + bins, hist)
        tl.store(row + 256, tl.sum((ok & ((u >> 8) > (prefix >> 8))).to(tl.int32), 0))


@jit
def _radix_select(
    LOGITS, HIST, CHUNK_HIST, BT, CU, OUT, stride_lt, stride_h, stride_ch, stride_bt, stride_ot,
    K, B, topk, CH, block_size, max_blocks, num_chunks,
    BLOCK: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """The chunk's share of the top-k, as cache slots in key order, into OUT[t]: its keys above
    the k-th largest T and, of those equal to T, the first k - above by position (the reference's
    tie rule), placed after the shares of the chunks before it, counted from their CHUNK_HIST:
    keys above T there = those above in the top three bytes + those in the last byte's bins
    over T's; keys equal to T taken there = min(their count, k - above). The last chunk pads
    the row with -1."""
    t, s, ok, u = _chunk_keys(LOGITS, stride_lt, K, CH, BLOCK)
    k = tl.minimum(topk, K)
    T, known, above = _radix_prefix(HIST + t * stride_h, k, 4)
    need_eq = _needed_equal(T, k, above)
    c = tl.program_id(1)
    d = (T & 0xFF).to(tl.int32)
    bins = tl.arange(0, 256)
    cc = tl.arange(0, 16)
    gt_before = tl.zeros([], dtype=tl.int32)
    eq_before = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, c, 16):
        rows = CHUNK_HIST + t * stride_ch + (c0 + cc) * 257
        before = c0 + cc < c
        h = tl.load(rows[:, None] + bins[None, :], mask=before[:, None], other=0)
        gt_before += tl.sum(tl.load(rows + 256, mask=before, other=0), 0)
        gt_before += tl.sum(tl.sum(tl.where(bins[None, :] > d, h, 0), 1), 0)
        eq_before += tl.sum(tl.sum(tl.where(bins[None, :] == d, h, 0), 1), 0)
    gt = ok & (u > T)
    eq = ok & (u == T)
    take = gt | (eq & (eq_before + tl.cumsum(eq.to(tl.int32), 0) <= need_eq))
    base = gt_before + tl.minimum(eq_before, need_eq)
    at = base + tl.cumsum(take.to(tl.int32), 0) - 1
    bt_row = BT + _sequence_of(CU, t, B, BLOCK_B).to(tl.int64) * stride_bt
    tl.store(OUT + t * stride_ot + at, _slot_of(bt_row, s, block_size, max_blocks, take), mask=take)
    if c == num_chunks - 1:
        _pad(OUT + t * stride_ot, base + tl.sum(take.to(tl.int32), 0), topk, BLOCK)


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
    flat slots in key order, ties at the k-th score to the lower key, -1 past the keys a query
    sees. Two paths with the same result:

    - one program a query (``_topk_kernel``): four radix passes over its keys, then the selected
      keys written in order, in one launch; each pass loops over the keys a block at a time, a
      memory latency a step, so a few queries leave the GPU idle;
    - chunked (``chunked=True``): each radix pass a launch over (query, ``TOPK_CHUNK`` keys)
      programs that add their histograms (``_radix_pass``), then each chunk writes its share
      of the top-k where the counts of the chunks before it place it (``_radix_select``): six
      launches with the zeroing.

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
    B = block_table.shape[0]
    max_blocks = max(block_table.shape[1], 1)
    if not chunked:
        _topk_kernel[(Tq,)](
            logits, block_table, cu_seqlens_q, out, logits.stride(0), block_table.stride(0), out.stride(0),
            K, B, topk, block_size, max_blocks,
            BLOCK=1024 if logits.is_cuda else 64, BLOCK_B=triton.next_power_of_2(B), num_warps=8,
        )
        return out
    ch = TOPK_CHUNK if logits.is_cuda else 64
    chunks = triton.cdiv(K, ch)
    state = torch.zeros(Tq, 4 * 256, dtype=torch.int32, device=logits.device)    # the passes' histograms
    chunk_hist = torch.empty(Tq, chunks, 257, dtype=torch.int32, device=logits.device)
    grid = (Tq, chunks)
    for p in range(4):
        _radix_pass[grid](logits, state, chunk_hist, logits.stride(0), state.stride(0), chunk_hist.stride(0), K, topk,
                          ch, PASS=p, BLOCK=ch, num_warps=8)
    _radix_select[grid](logits, state, chunk_hist, block_table, cu_seqlens_q, out, logits.stride(0), state.stride(0),
                        chunk_hist.stride(0), block_table.stride(0), out.stride(0), K, B, topk, ch, block_size,
                        max_blocks, chunks, BLOCK=ch, BLOCK_B=triton.next_power_of_2(B), num_warps=8)
    return out
