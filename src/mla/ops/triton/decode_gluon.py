"""Hopper (sm90) hot path of the absorbed MLA decode in Triton's Gluon dialect.

Same contract as ``mla.ops.reference.mla_decode`` for the shapes ``supports`` accepts:
CUDA tensors on a compute-capability-9.x device, bf16/fp16 queries over a cache of rows in
their dtype, of FP8 rows (float8_e4m3fn, per-tensor kv_scale) or of FP8 tile rows (uint8,
``mla.quant``); d = 576 with head_dim_v = 512, block_size a multiple of 64 and cache rows laid
out as one 2-D matrix (unit column stride). Anything else: use
``mla.ops.triton.decode.mla_decode`` (the portable kernel). ``decode_gluon_narrow`` and
``decode_gluon_fp8`` are the other Hopper kernels (few query rows; FP8 rows with few query
rows); ``decode.choose_kernel`` chooses.

Grid (ceil(H * s_q / 64), splits * B): 64 query rows m = i * H + h (zero-padded) against one
share of one sequence's keys. The split count comes from shapes only (no host sync, so a decode
step can be captured in a CUDA graph); each program finds its sequence and keys from the lengths
(``_planned_split``: a long sequence among short ones gets most of the programs); partial
(out, lse) per program -> ``decode.combine``.

Warp-specialized: the two warpgroups take alternate key tiles (a "seesaw", the schedule
FlashMLA describes; our own code). An earlier schedule here had both warpgroups compute
S = Q K^T of the same tile, 32 columns each, so each read all of Q from shared memory for
half the work and the GEMMs, the softmax and the loads ran one after another; this one was
1.2-1.4x faster at 128 heads on the H200 (docs/PERF.md).

    partitions: WG0 (default, 4 warps), WG1 (4 warps), a loader (1 warp)
    shared:     Q latent part [64, 512] (its RoPE part lives in registers), K ring of two
                64-key tiles (or four of 32 keys; even tiles for WG0, odd for WG1), P0, P1,
                row statistics (m, rescale, l) for the exchange
    the loader: TMA, 9 boxes of 64 columns per tile, one mbarrier per box, so a QK^T can
                start on the first 64 columns while the rest arrive; a buffer is refilled
                half by half: columns 0..255 once WG0's P V is done with them, 256..511 once
                WG1's is (bf16/fp16 rows; FP8 staging tiles: once widened)
    query rows: loaded by the two warpgroups, half each, after the partitions start, so the
                loader's first TMA does not wait for them
    per pair of tiles (2i in K0, 2i+1 in K1); WG0 owns output columns 0..255, WG1 256..511:
      WG0: S0 = Q K0^T; m0 = max(m, rowmax S0); P0 -> shared; O_L = O_L a0 + P0 V0_L
      WG1: S1 = Q K1^T (alongside WG0's); P1' = exp(S1 - max(m, rowmax S1)) meanwhile;
           waits P0; m1 = max(m0, rowmax S1); P1 = P1' rescaled to m1 -> shared
           O_R = (O_R a0 + P0 V0_R) a1 + P1 V1_R
      WG0: waits P1; O_L = O_L a1 + P1 V1_L; m = m1
    so the two QK^T GEMMs and one warpgroup's softmax overlap the other's MMAs, and every
    GEMM has N >= 64 (each warpgroup reads Q once per 64 keys, not twice).
    l: each warpgroup sums its own P with the same rescales; the two halves add at the end.
    output: one split with whole 64-row tiles per sequence: staged in Q's shared memory and
    written by TMA; else (partials for the combine) stored from the MMA's registers.

Masking: tail rows zeroed in shared memory by the tile's owner before
its QK^T (NaN there would survive 0 * NaN in P V), causal limits per query row, applied only
on tiles some row of the tile does not see in full.

FP8 rows: the loader fills a ring of FP8 staging tiles (32 keys; one mbarrier per tile) and
the owner of each tile widens it (``_widen``: e4m3 -> fp16 exactly, kv_scale folded into the
softmax scale and the output; tile rows: times each row's float32 scale per 128 values, into
q's dtype) into its K buffer, zeroing tail rows; the rest is the same.
"""
from __future__ import annotations

import math

import torch
import triton

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import decode as _decode, kv_fmt
from .decode import _num_sms, block_b, combine, planned_results

__all__ = ["mla_decode_gluon", "supports", "launch_gluon"]

_LOG2E = 1.4426950408889634
_D, _DV, _BLOCK_M, _BLOCK_N = 576, 512, 64, 64


# a warpgroup's layouts: S [64, BN] and its half of O [64, 256] as wgmma accumulators, and
# rows of 64 columns for plain loads and stores of a tile
_ACC_L = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
_LD_L = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])


@gluon.constexpr_function
def _s_layout(BN):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])


@gluon.jit
def _zero_tail(k_buf, kpe_buf, n0, end):
    """Rows >= end of a loaded key tile -> 0 (they may hold NaN; 0 * NaN in P V would leak)."""
    BN: gl.constexpr = k_buf.shape[0]
    rl = gl.arange(0, BN, layout=gl.SliceLayout(1, _LD_L))
    keep = (n0 + rl < end)[:, None]
    for c in gl.static_range(8):
        part = k_buf.slice(c * 64, 64, dim=1)
        x = part.load(_LD_L)
        part.store(gl.where(keep, x, gl.zeros_like(x)))
    x = kpe_buf.load(_LD_L)
    kpe_buf.store(gl.where(keep, x, gl.zeros_like(x)))


@gluon.jit
def _qk(q_smem, qpe, k_buf, kpe_buf, ready, buf, phase, n0, end,
        BN: gl.constexpr, S_L: gl.constexpr, WIDENED: gl.constexpr):
    """S = Q K^T for one BN-key tile, box by box as the loads land; zero the tail rows first.
    WIDENED: the tile was written by ``_widen`` (complete, tail rows already zero)."""
    if not WIDENED and n0 + BN > end:   # tail tile: wait for everything, zero rows >= end
        for c in gl.static_range(9):
            mbarrier.wait(ready.index(buf * 9 + c), phase)
        _zero_tail(k_buf, kpe_buf, n0, end)
        fence_async_shared()
        gl.thread_barrier()
    s = gl.zeros([64, BN], gl.float32, S_L)
    for c in gl.static_range(8):
        if not WIDENED:
            mbarrier.wait(ready.index(buf * 9 + c), phase)
        s = warpgroup_mma(q_smem.slice(c * 64, 64, dim=1), k_buf.slice(c * 64, 64, dim=1).permute((1, 0)), s,
                          use_acc=c > 0, is_async=True)
    if not WIDENED:
        mbarrier.wait(ready.index(buf * 9 + 8), phase)
    s = warpgroup_mma(qpe, kpe_buf.permute((1, 0)), s, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(s, ))


@gluon.jit
def _widen_part(x, dst, keep, full, sc, g: gl.constexpr, KV_FMT: gl.constexpr):
    """128 columns of FP8 values (registers) -> dst in its dtype, times their scales (tile
    rows); rows not kept -> 0 unless the tile is full (a select per value costs more than the
    conversion)."""
    if KV_FMT == 2:
        col = gl.sum(gl.where(gl.arange(0, 4, layout=gl.SliceLayout(0, x.type.layout))[None, :] == g, sc, 0.0),
                     axis=1)
        y = (x.to(gl.float32) * col[:, None]).to(dst.dtype)
    else:
        y = x.to(dst.dtype)
    if full:
        dst.store(y)
    else:
        dst.store(gl.where(keep, y, gl.zeros_like(y)))


@gluon.jit
def _widen(st8, ready, j, k_buf, kpe_buf, n0, end, KV_FMT: gl.constexpr):
    """FP8 tile j (staging stage j % NST) -> the compute dtype in k_buf / kpe_buf (free: the
    caller waited), rows >= end zeroed (unused slots may hold NaN); the stage goes back to the
    loader.
    KV_FMT 1: e4m3 rows (kv_scale is applied outside: in qk_scale and on the output), widened
    exactly; 2: e4m3 latent times its row's float32 scale per 128 values, k_pe copied (bf16).
    All of the tile is read into registers before anything is written: the compiler puts a
    barrier between shared-memory reads and writes it cannot tell apart, and one per 64
    columns (read, barrier, write, barrier, ...) made the widening 2-3x slower than the loads."""
    k8, pe8, sc8, free8 = st8
    BN: gl.constexpr = k_buf.shape[0]
    NST: gl.constexpr = k8.shape[0]
    WL: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])     # 16 bytes of FP8 a thread
    st = j % NST
    ph = (j // NST) & 1
    mbarrier.wait(ready.index(st * 9), ph)              # the whole tile (see _loader)
    src = k8.index(st)
    x0 = src.slice(0, 128, dim=1).load(WL)
    x1 = src.slice(128, 128, dim=1).load(WL)
    x2 = src.slice(256, 128, dim=1).load(WL)
    x3 = src.slice(384, 128, dim=1).load(WL)
    pe = pe8.index(st).load(WL)
    if KV_FMT == 2:
        sc = sc8.index(st).load(WL)                     # [BN, 4]: per row, one scale per 128 values
    else:
        sc = 0.0
    keep = (n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, WL)) < end)[:, None]
    full = n0 + BN <= end
    _widen_part(x0, k_buf.slice(0, 128, dim=1), keep, full, sc, 0, KV_FMT)
    _widen_part(x1, k_buf.slice(128, 128, dim=1), keep, full, sc, 1, KV_FMT)
    _widen_part(x2, k_buf.slice(256, 128, dim=1), keep, full, sc, 2, KV_FMT)
    _widen_part(x3, k_buf.slice(384, 128, dim=1), keep, full, sc, 3, KV_FMT)
    ype = pe.to(kpe_buf.dtype)
    kpe_buf.store(gl.where(keep, ype, gl.zeros_like(ype)))
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(free8.index(st), count=1)


@gluon.jit
def _scaled(s, n0, end, limit, full_to, qk_scale, BN: gl.constexpr, S_L: gl.constexpr):
    """Scores in base 2, -inf where a row does not see the key. Keys below full_to are seen by
    every row of the tile: a tile below it skips the mask (all but the last tile or two of a
    split; the mask is a compare and a select per score on the softmax's critical path)."""
    if n0 + BN <= full_to:
        return s * qk_scale
    n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, S_L))
    visible = (n < end)[None, :] & (n[None, :] < limit[:, None])
    return gl.where(visible, s * qk_scale, float("-inf"))


@gluon.jit
def _probs(s, n0, end, limit, full_to, m_ref, qk_scale, BN: gl.constexpr, S_L: gl.constexpr):
    """Masked scores in base 2 -> (P, new max, rescale of the old max, row sums of P)."""
    p, m_new, rs = _probs_own(s, n0, end, limit, full_to, m_ref, qk_scale, BN, S_L)
    return p, m_new, gl.exp2(m_ref - gl.where(m_new == float("-inf"), 0.0, m_new)), rs


@gluon.jit
def _probs_own(s, n0, end, limit, full_to, m_prev, qk_scale, BN: gl.constexpr, S_L: gl.constexpr):
    """WG1's exponentials before WG0's row max is known: against its own reference
    m_own = max(m_prev, rowmax S) -> (P', m_own, row sums of P'); ``_rebase`` later moves them
    to the shared reference."""
    s = _scaled(s, n0, end, limit, full_to, qk_scale, BN, S_L)
    m_own = gl.maximum(m_prev, gl.max(s, axis=1))
    p = gl.exp2(s - gl.where(m_own == float("-inf"), 0.0, m_own)[:, None])
    return p, m_own, gl.sum(p, axis=1)


@gluon.jit
def _rebase(m_own, m0):
    """The shared reference m1 = max(m0, m_own) (= max(m0, rowmax S1), as m0 >= m_prev), the
    factor c that takes P' from m_own to it (0 where nothing is visible yet: P' is 0 there),
    and a1 = 2^(m0 - m1), WG0's rescale."""
    m1 = gl.maximum(m0, m_own)
    m1_safe = gl.where(m1 == float("-inf"), 0.0, m1)
    c = gl.where(m_own == float("-inf"), 0.0, gl.exp2(m_own - m1_safe))
    return m1, c, gl.exp2(m0 - m1_safe)


@gluon.jit
def _load_qpe(Q, q_base, ml, H, S_Q, stride_qi, stride_qh, S_L: gl.constexpr, dtype: gl.constexpr):
    """The RoPE part of the query rows, straight into the QK^T A-operand registers."""
    QPE_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=2)
    rows = ml + gl.arange(0, 64, layout=gl.SliceLayout(1, QPE_L))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, QPE_L))
    ptr = Q + q_base + (rows // H) * stride_qi + (rows % H) * stride_qh
    mask = (rows < H * S_Q)[:, None] & (cols < 64)[None, :]
    return gl.load(ptr[:, None] + (512 + cols)[None, :], mask=mask, other=0.0).to(dtype)


@gluon.jit
def _load_q_half(Q, q_base, ml, H, S_Q, stride_qi, stride_qh, q_smem, q_bar, HALF: gl.constexpr, S_L: gl.constexpr):
    """This warpgroup's half of the query rows' latent part (256 columns) -> shared memory,
    then wait for the other half: inside the partitions, so the loader's first TMA does not
    wait behind the query loads. Returns the RoPE part (``_load_qpe``). All the loads go out
    before the first store: one memory latency, where storing each chunk as it came (and the
    RoPE part after the wait) took three in a row (sm_90a SASS)."""
    LD_L: gl.constexpr = _LD_L
    rows = ml + gl.arange(0, 64, layout=gl.SliceLayout(1, LD_L))
    cl = gl.arange(0, 64, layout=gl.SliceLayout(0, LD_L))
    qrow = Q + q_base + (rows // H) * stride_qi + (rows % H) * stride_qh
    qmask = (rows < H * S_Q)[:, None] & (cl < 64)[None, :]
    ptr = qrow[:, None] + (HALF * 256 + cl)[None, :]
    xs = (gl.load(ptr, mask=qmask, other=0.0), gl.load(ptr + 64, mask=qmask, other=0.0),
          gl.load(ptr + 128, mask=qmask, other=0.0), gl.load(ptr + 192, mask=qmask, other=0.0))
    qpe = _load_qpe(Q, q_base, ml, H, S_Q, stride_qi, stride_qh, S_L, q_smem.dtype)
    for c in gl.static_range(4):
        q_smem.slice(HALF * 256 + c * 64, 64, dim=1).store(xs[c].to(q_smem.dtype))
    fence_async_shared()
    mbarrier.arrive(q_bar.index(0), count=1)
    mbarrier.wait(q_bar.index(0), 0)
    return qpe


@gluon.jit
def _limits(ml, seqlen, end, H, S_Q, CAUSAL: gl.constexpr, S_L: gl.constexpr):
    """(per query row: keys < limit are visible; keys < full_to are in the split and visible to
    every row of the tile)."""
    ms = ml + gl.arange(0, 64, layout=gl.SliceLayout(1, S_L))
    if CAUSAL:                                     # query i sees keys < limit; row ml the fewest
        return seqlen - S_Q + ms // H + 1, gl.minimum(end, seqlen - S_Q + ml // H + 1)
    return gl.full([64], 0, gl.int32, gl.SliceLayout(1, S_L)) + seqlen, end


@gluon.jit
def _store_out(O, LSE, o_base, l_base, ml, H, S_Q, stride_oi, stride_oh, stride_li, acc, m_i, l_tot, col0,
               v_scale, q_smem, o_desc, o_row0, WRITE_LSE: gl.constexpr, TMA_OUT: gl.constexpr,
               S_L: gl.constexpr, ACC_L: gl.constexpr):
    """This warpgroup's 256 output columns (or the split's partial), and the LSE if WRITE_LSE.
    TMA_OUT (whole 64-row tiles of one sequence, out's dtype; the output with one split, else
    the split's slot of 16-bit partials, at row o_row0): staged in the query's shared memory,
    free once both warpgroups passed ``_add_other_l`` (their MMAs all waited), and written by
    TMA in 64-column boxes; the stores from the MMA's register layout wrote 16 bytes per row
    and instruction (on the H200 about 13 us of a 97 us 128-head B 128 x 1k step)."""
    empty = l_tot == 0.0
    inv = v_scale / gl.where(empty, 1.0, l_tot)
    out = acc * gl.convert_layout(inv, gl.SliceLayout(1, ACC_L))[:, None]
    if TMA_OUT:
        q_smem.slice(col0, 256, dim=1).store(out.to(q_smem.dtype))
        fence_async_shared()
        for c in gl.static_range(4):
            tma.async_copy_shared_to_global(o_desc, [o_row0, col0 + c * 64], q_smem.slice(col0 + c * 64, 64, dim=1))
        tma.store_wait(0)
    else:
        mo = ml + gl.arange(0, 64, layout=gl.SliceLayout(1, ACC_L))
        do = gl.arange(0, 256, layout=gl.SliceLayout(0, ACC_L))
        o_row = O + o_base + (mo // H) * stride_oi + (mo % H) * stride_oh + col0
        gl.store(o_row[:, None] + do[None, :], out.to(O.dtype.element_ty),
                 mask=(mo < H * S_Q)[:, None] & (do < 256)[None, :])
    if WRITE_LSE:
        ms = ml + gl.arange(0, 64, layout=gl.SliceLayout(1, S_L))
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_tot))) * 0.6931471805599453)
        gl.store(LSE + l_base + (ms // H) * stride_li + ms % H, lse, mask=ms < H * S_Q)


@gluon.jit
def _add_other_l(l_i, mine, theirs, l_bar, ROW_L: gl.constexpr):
    """l = l0 + l1: each warpgroup summed its own P with the same rescales (same reference max)."""
    mine.store(l_i)
    fence_async_shared()
    mbarrier.arrive(l_bar.index(0), count=1)
    mbarrier.wait(l_bar.index(0), 0)
    return l_i + theirs.load(ROW_L)


@gluon.jit
def _wg0(a, CAUSAL: gl.constexpr, KV_FMT: gl.constexpr, TMA_OUT: gl.constexpr):
    """Even tiles: S0, softmax, P0 -> shared, O_L += P0 V0_L, then O_L += P1 V1_L."""
    (Q, O, LSE, q_smem, k_smem, kpe_smem, p_smem, stats, ready, empty, p_ready, p_free, l_bar, q_bar, q_base,
     o_base, l_base, ml, seqlen, start, end, n_tiles, H, S_Q, stride_qi, stride_qh, stride_oi, stride_oh, stride_li,
     qk_scale, v_scale, st8, o_desc, o_row0) = a
    BN: gl.constexpr = k_smem.shape[1]
    NBUF: gl.constexpr = k_smem.shape[0]
    S_L: gl.constexpr = _s_layout(BN)
    ACC_L: gl.constexpr = _ACC_L
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_L, k_width=2)
    ROW_L: gl.constexpr = gl.SliceLayout(1, S_L)
    dtype: gl.constexpr = q_smem.dtype
    qpe = _load_q_half(Q, q_base, ml, H, S_Q, stride_qi, stride_qh, q_smem, q_bar, 0, S_L)
    limit, full_to = _limits(ml, seqlen, end, H, S_Q, CAUSAL, S_L)
    m_i = gl.full([64], float("-inf"), gl.float32, ROW_L)
    l_i = gl.full([64], 0.0, gl.float32, ROW_L)
    acc = gl.zeros([64, 256], gl.float32, ACC_L)
    for i in range((n_tiles + 1) // 2):
        ph = i & 1                                # p_ready / p_free phase
        kph = (2 * i // NBUF) & 1                 # K ring phase of tiles 2i and 2i+1
        b0 = (2 * i) % NBUF
        b1 = b0 + 1
        n0 = start + 2 * i * BN
        has1 = 2 * i + 1 < n_tiles
        if KV_FMT != 0:   # both warpgroups done with tile 2i - 2
            mbarrier.wait(empty.index(2 * b0), kph ^ 1)
            mbarrier.wait(empty.index(2 * b0 + 1), kph ^ 1)
            _widen(st8, ready, 2 * i, k_smem.index(b0), kpe_smem.index(b0), n0, end, KV_FMT)
        s = _qk(q_smem, qpe, k_smem.index(b0), kpe_smem.index(b0), ready, b0, kph, n0, end, BN, S_L,
                KV_FMT != 0)
        p, m0, a0, rs = _probs(s, n0, end, limit, full_to, m_i, qk_scale, BN, S_L)
        l_i = l_i * a0 + rs
        p16 = p.to(dtype)
        # hand P0, m0, a0 to WG1 once it has consumed the previous ones
        mbarrier.wait(p_free.index(0), ph ^ 1)
        p_smem.index(0).store(p16)
        stats[0].store(m0)
        stats[1].store(a0)
        fence_async_shared()
        mbarrier.arrive(p_ready.index(0), count=1)
        acc = acc * gl.convert_layout(a0, gl.SliceLayout(1, ACC_L))[:, None]
        acc = warpgroup_mma(gl.convert_layout(p16, P_L), k_smem.index(b0).slice(0, 256, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index(2 * b0), count=1)
        # P1 from WG1: rescale to its max and add P1 V1_L
        mbarrier.wait(p_ready.index(1), ph)
        m_i = stats[2].load(ROW_L)
        a1 = stats[3].load(ROW_L)
        l_i = l_i * a1
        acc = acc * gl.convert_layout(a1, gl.SliceLayout(1, ACC_L))[:, None]
        if has1:
            acc = warpgroup_mma(p_smem.index(1), k_smem.index(b1).slice(0, 256, dim=1), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index(2 * b1), count=1)
        mbarrier.arrive(p_free.index(1), count=1)
    l_tot = _add_other_l(l_i, stats[4], stats[5], l_bar, ROW_L)
    _store_out(O, LSE, o_base, l_base, ml, H, S_Q, stride_oi, stride_oh, stride_li, acc, m_i, l_tot, 0,
               v_scale, q_smem, o_desc, o_row0, True, TMA_OUT, S_L, ACC_L)


@gluon.jit
def _wg1(a, CAUSAL: gl.constexpr, KV_FMT: gl.constexpr, TMA_OUT: gl.constexpr):
    """Odd tiles: S1 alongside WG0's S0, O_R += P0 V0_R, softmax against m0, O_R += P1 V1_R."""
    (Q, O, LSE, q_smem, k_smem, kpe_smem, p_smem, stats, ready, empty, p_ready, p_free, l_bar, q_bar, q_base,
     o_base, l_base, ml, seqlen, start, end, n_tiles, H, S_Q, stride_qi, stride_qh, stride_oi, stride_oh, stride_li,
     qk_scale, v_scale, st8, o_desc, o_row0) = a
    BN: gl.constexpr = k_smem.shape[1]
    NBUF: gl.constexpr = k_smem.shape[0]
    S_L: gl.constexpr = _s_layout(BN)
    ACC_L: gl.constexpr = _ACC_L
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_L, k_width=2)
    ROW_L: gl.constexpr = gl.SliceLayout(1, S_L)
    dtype: gl.constexpr = q_smem.dtype
    qpe = _load_q_half(Q, q_base, ml, H, S_Q, stride_qi, stride_qh, q_smem, q_bar, 1, S_L)
    limit, full_to = _limits(ml, seqlen, end, H, S_Q, CAUSAL, S_L)
    l_i = gl.full([64], 0.0, gl.float32, ROW_L)
    m_prev = gl.full([64], float("-inf"), gl.float32, ROW_L)     # the shared reference of the last pair
    acc = gl.zeros([64, 256], gl.float32, ACC_L)
    for i in range((n_tiles + 1) // 2):
        ph = i & 1
        kph = (2 * i // NBUF) & 1
        b0 = (2 * i) % NBUF
        b1 = b0 + 1
        n1 = start + (2 * i + 1) * BN
        has1 = 2 * i + 1 < n_tiles
        if has1:
            if KV_FMT != 0:
                mbarrier.wait(empty.index(2 * b1), kph ^ 1)
                mbarrier.wait(empty.index(2 * b1 + 1), kph ^ 1)
                _widen(st8, ready, 2 * i + 1, k_smem.index(b1), kpe_smem.index(b1), n1, end, KV_FMT)
            s = _qk(q_smem, qpe, k_smem.index(b1), kpe_smem.index(b1), ready, b1, kph, n1, end, BN, S_L,
                    KV_FMT != 0)
        else:
            s = gl.full([64, BN], float("-inf"), gl.float32, S_L)
        # the exponentials against this warpgroup's own reference, alongside WG0's softmax
        p, m_own, rs = _probs_own(s, n1, end, limit, full_to, m_prev, qk_scale, BN, S_L)
        mbarrier.wait(p_ready.index(0), ph)
        m0 = stats[0].load(ROW_L)
        a0 = stats[1].load(ROW_L)
        acc = acc * gl.convert_layout(a0, gl.SliceLayout(1, ACC_L))[:, None]
        acc = warpgroup_mma(p_smem.index(0), k_smem.index(b0).slice(256, 256, dim=1), acc, is_async=True)
        m1, c, a1 = _rebase(m_own, m0)
        l_i = l_i * a0 * a1 + rs * c
        p16 = (p * c[:, None]).to(dtype)
        mbarrier.wait(p_free.index(1), ph ^ 1)
        p_smem.index(1).store(p16)
        stats[2].store(m1)
        stats[3].store(a1)
        fence_async_shared()
        mbarrier.arrive(p_ready.index(1), count=1)
        m_prev = m1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(p_free.index(0), count=1)
        mbarrier.arrive(empty.index(2 * b0 + 1), count=1)
        acc = acc * gl.convert_layout(a1, gl.SliceLayout(1, ACC_L))[:, None]
        if has1:
            acc = warpgroup_mma(gl.convert_layout(p16, P_L), k_smem.index(b1).slice(256, 256, dim=1), acc,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index(2 * b1 + 1), count=1)
    l_tot = _add_other_l(l_i, stats[5], stats[4], l_bar, ROW_L)
    m_i = gl.full([64], 0.0, gl.float32, ROW_L)     # unused: WG0 writes the LSE
    _store_out(O, LSE, o_base, l_base, ml, H, S_Q, stride_oi, stride_oh, stride_li, acc, m_i, l_tot, 256,
               v_scale, q_smem, o_desc, o_row0, False, TMA_OUT, S_L, ACC_L)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.constexpr_function
def _plan_layout(BLOCK_B):
    """The plan's [BLOCK_B] vectors whole in every warp (the 4 warps hold copies), so that its
    sums and prefix sum stay within a warp: shuffles, no shared memory or barrier."""
    return gl.BlockedLayout([max(1, BLOCK_B // 32)], [32], [4], [0])


@gluon.jit
def _planned_split(SEQLENS, INFO, B, p, num_splits, BN: gl.constexpr, BLOCK_B: gl.constexpr):
    """Program p's share of the batch's keys, by length (the launch has P = num_splits * B
    programs; ``planned_results``). The plan makes the busiest program's work the least it can
    be: T, the fewest 64-key chunks a program, is the least with sum_b max(1, ceil(c_b / T)) <=
    P for the sequences' chunk counts c_b (found by a binary search between ceil(total / P) and
    the smaller of the longest c_b and ceil(total / (P - B)), as FlashInfer's host plan searches
    its chunk size; none with one split, P = B, where T is the longest); sequence b gets
    max(1, ceil(c_b / T)) programs, and the programs left over go one each to the sequences in
    turn. So a long sequence among short ones is spread over many SMs. Equal lengths give
    num_splits programs a sequence, in order: the grid of a fixed split count.

    The program then takes its part of its sequence b: the k-th of count nearly equal runs of
    whole 64-key chunks. That is keys [start, end), in n_tiles tiles of BN keys. Its results go
    to slot p; INFO[b] = (first, count), b's slots, for ``decode.combine`` (written by b's
    first program). Every program computes the plan from the B lengths (BLOCK_B >= B): no host
    sync. The plan lies on the path to the first tile's copy: equal lengths (one round of
    reductions to find out) take the fixed split's arithmetic; otherwise each lane works out its
    own sequence's slots (a round of sums for each step of the search, then a scan), and one
    round of sums picks program p's sequence and its numbers. The first version, a reduction for
    each quantity and no short path, cost equal-length batches 0.6-1.1 us on the H200; one with
    the lanes' splits in parallel (int64 divisions a lane) 1.7-2.3 us at batch 128. The first
    rule, one program a sequence plus a share of the other P - B by chunks, left a long sequence
    twice the ideal work at P = 2 B (128 heads, B 32, lengths uniform in 1..16k: 128 chunks in
    the busiest program against 87 now; 261.8 -> 188.5 us). The counts in int32
    (``planned_results`` checks the range), the runs in int64. Returns (b, seqlen, start, end,
    n_tiles)."""
    i = gl.arange(0, BLOCK_B, layout=_plan_layout(BLOCK_B))
    ok = i < B
    lens = gl.load(SEQLENS + i, mask=ok, other=0)
    if gl.min(gl.where(ok, lens, 2147483647), axis=0) == gl.max(lens, axis=0):
        # equal lengths (the plan below gives the same): num_splits programs a sequence, in order
        b = p // num_splits
        k = p % num_splits
        seqlen = gl.max(lens, axis=0)
        c = (seqlen + 63) // 64
        start = k * c // num_splits * 64
        end = gl.minimum((k + 1) * c // num_splits * 64, seqlen)
        gl.store(INFO + 2 * b, p, mask=k == 0)
        gl.store(INFO + 2 * b + 1, num_splits, mask=k == 0)
    else:
        # the least T (lo) with sum_b max(1, ceil(c_b / T)) <= P, a round of sums a step
        chunks = (lens + 63) // 64
        total = gl.sum(chunks, axis=0)
        P = num_splits * B
        lo = gl.maximum((total + P - 1) // P, 1)
        # T = the longest always fits, and with P > B so does ceil(total / (P - B)) (the sum is
        # at most B + total / T); with P = B that is the answer (no search)
        hi = gl.maximum(gl.max(chunks, axis=0), lo)
        if num_splits == 1:
            lo = hi
        else:
            hi = gl.minimum(hi, gl.maximum((total + P - B - 1) // (P - B), lo))
        while lo < hi:
            mid = (lo + hi) // 2
            fits = gl.sum(gl.where(ok, gl.maximum((chunks + mid - 1) // mid, 1), 0), axis=0) <= P
            hi = gl.where(fits, mid, hi)
            lo = gl.where(fits, lo, mid + 1)
        n = gl.where(ok, gl.maximum((chunks + lo - 1) // lo, 1), 0)
        left = P - gl.sum(n, axis=0)                       # >= 0
        count = (n + gl.where(ok, left // B + (i < left % B).to(gl.int32), 0)).to(gl.int64)
        last = gl.associative_scan(count, 0, _add)
        first = last - count
        mine = ok & (first <= p) & (p < last)
        # program p's sequence and its (first, count, length, chunks), in one round of sums
        b = gl.sum(gl.where(mine, i, 0), axis=0)
        seqlen = gl.sum(gl.where(mine, lens, 0), axis=0)
        f = gl.sum(gl.where(mine, first, 0), axis=0)
        m = gl.sum(gl.where(mine, count, 0), axis=0)
        cb = gl.sum(gl.where(mine, chunks, 0), axis=0).to(gl.int64)
        kb = p - f
        start = (kb * cb // m).to(gl.int32) * 64
        end = gl.minimum(((kb + 1) * cb // m).to(gl.int32) * 64, seqlen)
        gl.store(INFO + 2 * b, f.to(gl.int32), mask=kb == 0)
        gl.store(INFO + 2 * b + 1, m.to(gl.int32), mask=kb == 0)
    # through shared memory, each thread reading all four (no cross-lane step after the load):
    # straight from the reductions, start and end made the warpgroups' branches divergent in the
    # SASS (BSSY) and spilled warpgroup 1's loop (sm_90a, 272 bytes of stack against 48)
    V: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
    t = gl.arange(0, 4, layout=V)
    buf = gl.allocate_shared_memory(gl.int32, [4], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    buf.store(gl.where(t == 0, b, gl.where(t == 1, seqlen, gl.where(t == 2, start, end))))
    gl.thread_barrier()
    v = buf.load(V)
    b = gl.sum(gl.where(t == 0, v, 0), axis=0)
    seqlen = gl.sum(gl.where(t == 1, v, 0), axis=0)
    start = gl.sum(gl.where(t == 2, v, 0), axis=0)
    end = gl.sum(gl.where(t == 3, v, 0), axis=0)
    return b, seqlen, start, end, gl.maximum(end - start + BN - 1, 0) // BN


@gluon.jit
def _plan_and_block(SEQLENS, INFO, BT, stride_bt, block_size, B, p, num_splits, BN: gl.constexpr,
                    BLOCK_B: gl.constexpr):
    """``_planned_split`` and the cache block of the split's first key (0 when it has no keys),
    which the prologue loads for ``_loader`` so that the first tile's copy does not wait on a
    load of its own. Returns (b, seqlen, start, end, n_tiles, bt_row, blk0).

    Not loaded ahead for the split of equal lengths: that needs sequence p // num_splits's
    length first, and ptxas then waited for it before it sent the lengths' own load (sm_90a
    SASS), which put a second memory latency in front of the plan."""
    b, seqlen, start, end, n_tiles = _planned_split(SEQLENS, INFO, B, p, num_splits, BN, BLOCK_B)
    bt_row = b.to(gl.int64) * stride_bt
    blk0 = gl.load(BT + bt_row + start // block_size, mask=n_tiles > 0, other=0)
    return b, seqlen, start, end, n_tiles, bt_row, blk0


@gluon.jit
def _ring_barriers(NBUF: gl.constexpr, PER_SLOT: gl.constexpr = 9):
    """The mbarriers of a ring that ``_loader`` fills: ready[PER_SLOT slot + c] (one per 64-column
    box; FP8 rows use ready[PER_SLOT slot] for the whole tile, so a kernel that reads only FP8
    rows asks for one a slot: every init costs the prologue a thread barrier) and free[slot], all
    with one arrival."""
    ready = gl.allocate_shared_memory(gl.int64, [NBUF * PER_SLOT, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF * PER_SLOT):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(NBUF):
        mbarrier.init(free.index(i), count=1)
    return ready, free


@gluon.jit
def _query_chunks(Q, q_off, H, S_Q, stride_qi, stride_qh, r0, R: gl.constexpr, QL: gl.constexpr):
    """Query rows r0 .. r0 + R - 1's nine 64-column chunks ([R, 64] in QL, zero past H * s_q) as a
    tuple, all loads in flight on return: a prologue issues them first and sets up under their
    latency."""
    rows = r0 + gl.arange(0, R, layout=gl.SliceLayout(1, QL))
    cl = gl.arange(0, 64, layout=gl.SliceLayout(0, QL))
    ptr = (Q + q_off + (rows // H) * stride_qi + (rows % H) * stride_qh)[:, None] + cl[None, :]
    mask = (rows < H * S_Q)[:, None] & (cl < 64)[None, :]
    return (gl.load(ptr, mask=mask, other=0.0), gl.load(ptr + 64, mask=mask, other=0.0),
            gl.load(ptr + 128, mask=mask, other=0.0), gl.load(ptr + 192, mask=mask, other=0.0),
            gl.load(ptr + 256, mask=mask, other=0.0), gl.load(ptr + 320, mask=mask, other=0.0),
            gl.load(ptr + 384, mask=mask, other=0.0), gl.load(ptr + 448, mask=mask, other=0.0),
            gl.load(ptr + 512, mask=mask, other=0.0))


@gluon.jit
def _plan_and_query(SEQLENS, INFO, BT, stride_bt, block_size, B, p, num_splits, BLOCK_B: gl.constexpr, Q, stride_qb,
                    H, S_Q, stride_qi, stride_qh, r0, R: gl.constexpr):
    """``_plan_and_block`` (64-key tiles) and the query rows r0 .. r0 + R - 1 of the program's
    sequence (``_query_chunks``, [R, 64] chunks in the prologue's layout). The query's loads go
    out first, for sequence p // num_splits (the plan's when the lengths are equal), so that
    they land under the plan's latency as they did under the length's before; where the plan
    gives another sequence they go out again. Returns (b, seqlen, start, end, n_tiles, bt_row,
    blk0, xq)."""
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    guess = p // num_splits
    xq = _query_chunks(Q, guess.to(gl.int64) * stride_qb, H, S_Q, stride_qi, stride_qh, r0, R, QL)
    # a barrier, so that the query's loads go out before the plan: without it ptxas put them after
    # the plan's first use of the lengths, behind the lengths' latency (sm_90a SASS)
    gl.thread_barrier()
    b, seqlen, start, end, n_tiles, bt_row, blk0 = _plan_and_block(SEQLENS, INFO, BT, stride_bt, block_size, B, p,
                                                                   num_splits, 64, BLOCK_B)
    if b != guess:      # mixed lengths
        xq = _query_chunks(Q, b.to(gl.int64) * stride_qb, H, S_Q, stride_qi, stride_qh, r0, R, QL)
    return b, seqlen, start, end, n_tiles, bt_row, blk0, xq


@gluon.jit
def _loader(ring, ring_pe, ring_sc, ready, free, start, n_tiles, kv_desc, pe_desc, sc_desc, BT, bt_row, block_size,
            blk0, KV_FMT: gl.constexpr, HALVES: gl.constexpr = False, j0=0):
    """TMA loads of n_tiles tiles of keys from ``start`` into a ring (tile j -> slot j % ring size,
    once ``free`` says the slot's last tile was consumed), 9 boxes of 64 columns. Rows in q's
    dtype: one mbarrier per box (ready[9 slot + c]), so S can start on the first columns. FP8
    rows: one mbarrier for the whole tile (ready[PER_SLOT slot], ``_ring_barriers``), as the
    widening reads all of it (every wait costs the warpgroup a barrier); tile rows: 8 latent
    boxes, k_pe and the scales.
    HALVES (rows in q's dtype): the slot is released in two halves, free[2 slot] for columns
    0..255 and free[2 slot + 1] for 256..511, k_pe going with the half of the tile's owner (even
    tiles: the first); each half is refilled as soon as it is released. blk0: tile 0's block
    (``_plan_and_block``). j0: the first tile to copy (the prologue copied those before it, each into
    its own slot)."""
    BN: gl.constexpr = ring.shape[1]
    NBUF: gl.constexpr = ring.shape[0]
    for j in range(j0, n_tiles):
        buf = j % NBUF
        n0 = start + j * BN
        blk = gl.load(BT + bt_row + n0 // block_size, mask=j > 0, other=blk0)
        row0 = blk * block_size + n0 % block_size
        if HALVES:
            fph = ((j // NBUF) & 1) ^ 1
            for h in gl.static_range(2):
                mbarrier.wait(free.index(2 * buf + h), fph)
                for c in gl.static_range(4 * h, 4 * h + 4):
                    bar = ready.index(buf * 9 + c)
                    mbarrier.expect(bar, kv_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(kv_desc, [row0, c * 64], bar,
                                                    ring.index(buf).slice(c * 64, 64, dim=1))
                if j % 2 == h:
                    bar = ready.index(buf * 9 + 8)
                    mbarrier.expect(bar, kv_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(kv_desc, [row0, 512], bar, ring_pe.index(buf))
        elif KV_FMT == 0:
            mbarrier.wait(free.index(buf), ((j // NBUF) & 1) ^ 1)
            _copy_tile(ring, ring_pe, ready, buf, row0, kv_desc)
        else:
            mbarrier.wait(free.index(buf), ((j // NBUF) & 1) ^ 1)
            _copy_fp8_tile(ring, ring_pe, ring_sc, ready, buf, row0, kv_desc, pe_desc, sc_desc, KV_FMT)


@gluon.jit
def _copy_tile(ring, ring_pe, ready, buf, row0, kv_desc):
    """The TMA copies of one tile of rows in q's dtype, from cache row row0 into ring slot buf:
    8 latent boxes and k_pe, each on its own ready barrier (ready[9 buf + c])."""
    for c in gl.static_range(8):
        bar = ready.index(buf * 9 + c)
        mbarrier.expect(bar, kv_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(kv_desc, [row0, c * 64], bar, ring.index(buf).slice(c * 64, 64, dim=1))
    bar = ready.index(buf * 9 + 8)
    mbarrier.expect(bar, kv_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(kv_desc, [row0, 512], bar, ring_pe.index(buf))


@gluon.jit
def _copy_fp8_tile(ring, ring_pe, ring_sc, ready, buf, row0, kv_desc, pe_desc, sc_desc, KV_FMT: gl.constexpr):
    """The TMA copies of one tile of FP8 rows (KV_FMT 1) or tile rows (2), from cache row row0
    into ring slot buf, all on the slot's one ready barrier."""
    NBUF: gl.constexpr = ring.shape[0]
    bar = ready.index(buf * (ready.shape[0] // NBUF))
    if KV_FMT == 1:
        mbarrier.expect(bar, 9 * kv_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(kv_desc, [row0, 512], bar, ring_pe.index(buf))
    else:
        mbarrier.expect(bar, 8 * kv_desc.block_type.nbytes + pe_desc.block_type.nbytes
                        + sc_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(pe_desc, [row0, 0], bar, ring_pe.index(buf))
        tma.async_copy_global_to_shared(sc_desc, [row0, 0], bar, ring_sc.index(buf))
    for c in gl.static_range(8):
        tma.async_copy_global_to_shared(kv_desc, [row0, c * 64], bar, ring.index(buf).slice(c * 64, 64, dim=1))


@gluon.jit
def wait_prerequisites():
    """Wait until the kernels this one follows have finished and their writes are visible. The
    Gluon decode kernels are launched as programmatic dependents (``pdl_launch``) and call this
    before they read anything (after setting up their mbarriers, which read no memory); without
    PDL it returns at once."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


def pdl_launch(rows: int) -> dict:
    """Launch options of a Gluon decode kernel for ``rows`` query rows (H * s_q): with
    ``decode.PDL`` and at most 32 rows a programmatic dependent launch, so that its programs are
    placed on the SMs as the kernel before it drains (they wait in ``wait_prerequisites``)
    instead of after it has exited. A/B on the H200 (2026-12-01, 2 rounds): 16 heads, batch 1 /
    32 / 128, 1k / 4k, bf16 and FP8: 0.93-1.00x the time (batch 1 the most); 128 heads (the
    seesaw), batch 1 / 32 x 4k: 1.03x / 1.01x, so not there. 32 rows (s_q 2) was not measured."""
    return {"launch_pdl": True} if _decode.PDL and rows <= 32 else {}


@gluon.constexpr_function
def thread_major(layout):
    """A shared layout for a tensor in the distributed linear ``layout`` (``gl.to_linear_layout``)
    of one warpgroup: register k of thread t at word 128 k + t, so that a warp's access to one
    register is 128 adjacent bytes (no bank conflicts) and a warpgroup in the same layout reads
    back what another wrote, thread for thread."""
    return gl.SharedLinearLayout(list(layout.lane_bases) + list(layout.warp_bases) + list(layout.reg_bases))


@gluon.jit
def _merge_buffers(R: gl.constexpr):
    """The mbarrier and the [2 R] row maxima and sums through which warpgroup 1 hands its state
    to warpgroup 0 (``_send_state``, ``_merge_weights``)."""
    xbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(xbar, count=1)
    xml = gl.allocate_shared_memory(gl.float32, [2 * R], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    return xbar, xml


@gluon.jit
def _send_state(xo, o, xml, m_i, l_i, xbar):
    """Warpgroup 1's half of merging the two warpgroups' results of a split: its O (into xo, a
    ``thread_major`` buffer in o's layout), row maxima and sums (xml [2 R]) into shared memory,
    then xbar (one arrival)."""
    R: gl.constexpr = m_i.shape[0]
    xo.store(o)
    xml.slice(0, R).store(m_i)
    xml.slice(R, R).store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(xbar, count=1)


@gluon.jit
def _merge_weights(xml, xbar, m_i, l_i, v_scale):
    """Warpgroup 0's half, once xbar says warpgroup 1's state is in: per query row the weights
    (w0, w1) of out = w0 O0 + w1 O1 (the rescales to the common max over the merged sum, times
    v_scale; 0 for a row that saw no key) and the merged lse (natural log, -inf without keys)."""
    R: gl.constexpr = m_i.shape[0]
    mbarrier.wait(xbar, 0)
    m1 = xml.slice(0, R).load(m_i.type.layout)
    l1 = xml.slice(R, R).load(m_i.type.layout)
    m = gl.maximum(m_i, m1)
    m_safe = gl.where(m == float("-inf"), 0.0, m)
    a0 = gl.exp2(m_i - m_safe)
    a1 = gl.exp2(m1 - m_safe)
    l_i = a0 * l_i + a1 * l1
    empty = l_i == 0.0
    inv = v_scale / gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), (m_safe + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    return a0 * inv, a1 * inv, lse


@gluon.jit
def launch_dependents():
    """Let a programmatic dependent launch (the split combine, ``decode.PDL``) start once every
    program has passed this point, instead of after the last one exits (no-op without PDL)."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _seesaw_kernel(
    Q, kv_desc, pe_desc, sc_desc, o_desc, BT, SEQLENS, O, LSE, INFO,
    stride_qb, stride_qi, stride_qh,
    stride_bt,
    stride_os, stride_ob, stride_oi, stride_oh,
    stride_ls, stride_lb, stride_li,
    H, S_Q, B, block_size, num_splits, qk_scale, v_scale,
    CAUSAL: gl.constexpr, KV_FMT: gl.constexpr, dtype: gl.constexpr, SM_L: gl.constexpr, P_SM: gl.constexpr,
    TMA_OUT: gl.constexpr, BLOCK_B: gl.constexpr, num_warps: gl.constexpr,
):
    gl.static_assert(num_warps == 4)
    BN: gl.constexpr = kv_desc.block_type.shape[0]     # keys per tile: 64, or 32 (a ring of 4)
    ST_L: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    pid_m = gl.program_id(0)
    p = gl.program_id(1)           # the plan's program (``_planned_split``)

    Q_SM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=dtype.primitive_bitwidth,
                                              rank=2)
    q_smem = gl.allocate_shared_memory(dtype, [64, 512], Q_SM)
    # K tiles in the compute dtype: the loader's ring (bf16/fp16 cache: 2 x 64 or 4 x 32 keys), or,
    # for FP8 rows, one 32-key tile per warpgroup that it widens from the FP8 staging ring into
    if KV_FMT == 0:
        NBUF: gl.constexpr = 128 // BN
        NLOAD: gl.constexpr = NBUF
    else:
        NBUF: gl.constexpr = 2
        NLOAD: gl.constexpr = 4 if KV_FMT == 1 else 3      # stages of FP8 rows (smem: 227 KB in all)
    k_smem = gl.allocate_shared_memory(dtype, [NBUF, BN, 512], SM_L)
    kpe_smem = gl.allocate_shared_memory(dtype, [NBUF, BN, 64], SM_L)
    p_smem = gl.allocate_shared_memory(dtype, [2, 64, BN], P_SM)
    # row statistics handed between the warpgroups: m0, a0, m1, a1, l0, l1
    stats = (gl.allocate_shared_memory(gl.float32, [64], ST_L), gl.allocate_shared_memory(gl.float32, [64], ST_L),
             gl.allocate_shared_memory(gl.float32, [64], ST_L), gl.allocate_shared_memory(gl.float32, [64], ST_L),
             gl.allocate_shared_memory(gl.float32, [64], ST_L), gl.allocate_shared_memory(gl.float32, [64], ST_L))
    ready = gl.allocate_shared_memory(gl.int64, [NLOAD * 9, 1], mbarrier.MBarrierLayout())
    # a K tile's halves (columns 0..255: WG0's P V; 256..511: WG1's) released separately
    empty = gl.allocate_shared_memory(gl.int64, [2 * NBUF, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    l_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())   # both halves of Q stored
    for i in gl.static_range(NLOAD * 9):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(2 * NBUF):
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(p_free.index(i), count=1)
    mbarrier.init(l_bar.index(0), count=2)
    mbarrier.init(q_bar.index(0), count=2)
    if KV_FMT == 0:
        st8 = (k_smem, kpe_smem, stats[0], empty)      # not used
        ring, ring_pe, ring_sc, free = st8              # the loader fills the K tiles themselves
    else:   # the FP8 staging ring: latent, k_pe, scales (tile rows), and the loader's "stage free"
        k8 = gl.allocate_shared_memory(kv_desc.dtype, [NLOAD, BN, 512], kv_desc.layout)
        if KV_FMT == 1:
            pe8 = gl.allocate_shared_memory(kv_desc.dtype, [NLOAD, BN, 64], kv_desc.layout)
            sc8 = stats[0]                               # not used
        else:
            pe8 = gl.allocate_shared_memory(pe_desc.dtype, [NLOAD, BN, 64], pe_desc.layout)
            sc8 = gl.allocate_shared_memory(sc_desc.dtype, [NLOAD, BN, 4], sc_desc.layout)
        free8 = gl.allocate_shared_memory(gl.int64, [NLOAD, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NLOAD):
            mbarrier.init(free8.index(i), count=1)
        st8 = (k8, pe8, sc8, free8)
        ring, ring_pe, ring_sc, free = st8

    # the barriers above read no memory: under a dependent launch they are set up while the
    # kernel before drains
    wait_prerequisites()
    b, seqlen, start, end, n_tiles, bt_row, blk0 = _plan_and_block(SEQLENS, INFO, BT, stride_bt, block_size, B, p,
                                                                   num_splits, BN, BLOCK_B)

    ml = pid_m * 64
    q_base = b.to(gl.int64) * stride_qb
    fence_async_shared()      # the barriers' init, before the partitions use them
    gl.thread_barrier()
    launch_dependents()

    o_base = p.to(gl.int64) * stride_os + b.to(gl.int64) * stride_ob
    l_base = p.to(gl.int64) * stride_ls + b.to(gl.int64) * stride_lb
    args = (Q, O, LSE, q_smem, k_smem, kpe_smem, p_smem, stats, ready, empty, p_ready, p_free, l_bar, q_bar,
            q_base, o_base, l_base, ml, seqlen, start, end, n_tiles, H, S_Q, stride_qi, stride_qh, stride_oi, stride_oh,
            stride_li, qk_scale, v_scale, st8, o_desc, p * (H * S_Q) + ml)     # one split: p is b
    gl.warp_specialize([
        (_wg0, (args, CAUSAL, KV_FMT, TMA_OUT)),
        (_wg1, (args, CAUSAL, KV_FMT, TMA_OUT)),
        (_loader, (ring, ring_pe, ring_sc, ready, free, start, n_tiles, kv_desc, pe_desc, sc_desc, BT, bt_row,
                   block_size, blk0, KV_FMT, KV_FMT == 0)),
    ], [4, 1], [240, 24])


_ROW = {0: _D, 1: _D, 2: _DV + 4 * _DV // 128 + 2 * (_D - _DV)}     # elements (bytes for FP8) per row


def supports(q: torch.Tensor, kv_cache: torch.Tensor, block_size: int | None = None) -> bool:
    """True when ``mla_decode_gluon`` handles these tensors (else use the portable kernel):
    bf16/fp16 queries over rows in their dtype, FP8 rows (float8_e4m3fn) or FP8 tile rows
    (uint8, ``mla.quant``)."""
    if kv_cache.dim() == 4:
        if kv_cache.shape[2] != 1:
            return False
        kv_cache = kv_cache.squeeze(2)
    if block_size is None:
        block_size = kv_cache.shape[1]
    if not (q.is_cuda and kv_cache.is_cuda and q.device == kv_cache.device):
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    fmt = kv_fmt(kv_cache)
    if q.dtype not in (torch.bfloat16, torch.float16) or (fmt == 0 and kv_cache.dtype != q.dtype):
        return False
    if q.dim() != 4 or q.shape[-1] != _D or kv_cache.shape[-1] != _ROW[fmt] or q.stride(-1) != 1:
        return False
    if block_size % _BLOCK_N != 0 or kv_cache.shape[1] != block_size:
        return False
    # the cache must be one 2-D matrix of rows for the TMA descriptor
    if kv_cache.stride(-1) != 1 or kv_cache.stride(0) != block_size * kv_cache.stride(1):
        return False
    if (kv_cache.stride(1) * kv_cache.element_size()) % 16 or kv_cache.data_ptr() % 16:
        return False
    return True


def default_block_n(B: int, rows: int) -> int:
    """Tiles of 32 keys (a ring of four) when there are few CTAs per split (<= 32): more loads
    in flight per SM; 64 otherwise (half the Q traffic from shared memory per key).
    Measured on the H200: 32 is 2-9% faster at batch 1 and at 16 heads batch 32, 64 is 6-18%
    faster at 128 heads batch >= 32 (docs/PERF.md)."""
    return 32 if B * triton.cdiv(rows, _BLOCK_M) <= 32 else 64


def default_splits(B: int, rows: int, max_len: int, device, waves: int = 1) -> int:
    """Splits of the cache per sequence. More splits give each program fewer keys, but each
    split leaves partials (2 KB per query row in float32, 1 KB in 16 bits) to write and
    combine: a step takes about a + b L / S + c B rows S, best at S = sqrt(b L / (c B rows)).
    Fitted on the H200 with float32 partials (benchmarks/splits_sweep.py, 128 heads, batch 1,
    4k: b = 0.019 us per key, c = 0.49 ns per row and split) that is 6.2 sqrt(L / (B rows));
    not refitted for 16-bit ones; capped at ``waves`` waves of one-per-SM
    programs and one split per 64 keys (docs/PERF.md, "Fixed costs")."""
    ctas = B * triton.cdiv(rows, _BLOCK_M)
    per_seq = max(1, waves * _num_sms(device.index or 0) // max(ctas, 1))
    balanced = 6.2 * math.sqrt(max_len / max(B * rows, 1))
    # a count that gives every split of the longest sequence whole 64-key tiles (the plan,
    # ``_planned_split``, splits in whole tiles), as many tiles as the balance asks and at least
    # what one wave needs
    tiles = max(1, round(max_len / (_BLOCK_N * balanced)), triton.cdiv(max_len, _BLOCK_N * per_seq))
    return triton.cdiv(max_len, _BLOCK_N * tiles)


def _descriptors(kv_cache, fmt: int, block_n: int, gdt):
    """TMA descriptors over the cache rows as one 2-D matrix: (rows or FP8 latent, k_pe, scales);
    the last two only for FP8 tile rows (else the first again)."""
    num_blocks, block_size, width = kv_cache.shape
    rows = kv_cache.as_strided((num_blocks * block_size, width), (kv_cache.stride(1), 1))

    def desc(t, cols, dt):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [block_n, cols],
                                gl.NVMMASharedLayout.get_default_for([block_n, cols], dt))
    if fmt == 0:
        d = desc(rows, 64, gdt)
        return d, d, d
    if fmt == 1:
        d = desc(rows, 64, gl.float8e4nv)
        return d, d, d
    lat = rows[:, :_DV].view(torch.float8_e4m3fn)
    sc = rows[:, _DV: _DV + 4 * _DV // 128].view(torch.float32)
    pe = rows[:, _DV + 4 * _DV // 128:].view(torch.bfloat16)
    return desc(lat, 64, gl.float8e4nv), desc(pe, 64, gl.bfloat16), desc(sc, 4, gl.float32)


def launch_gluon(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal=True,
                 num_splits: int | None = None, block_n: int | None = None, kv_scale: float = 1.0):
    """``mla_decode_gluon`` with an explicit split count and tile (``block_n`` keys: 64 = a ring
    of two tiles, 32 = a ring of four; default by ``default_block_n``; FP8 rows: 32 only)."""
    if block_n not in (None, 32, 64):
        raise ValueError(f"block_n: expected 32 or 64, got {block_n!r}")
    if kv_cache.dim() == 4:
        kv_cache = kv_cache.squeeze(2)
    B, s_q, H, d = q.shape
    num_blocks, block_size, _ = kv_cache.shape
    if head_dim_v != _DV or d != _D or not supports(q, kv_cache, block_size):
        raise ValueError("mla_decode_gluon: unsupported shapes/dtypes/layout (see supports())")
    fmt = kv_fmt(kv_cache)
    if fmt != 0 and block_n not in (None, 32):
        raise ValueError(f"block_n: FP8 rows are read in tiles of 32 keys, got {block_n}")
    out = torch.empty(B, s_q, H, _DV, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, s_q, H, dtype=torch.float32, device=q.device)
    if B == 0 or s_q == 0 or H == 0:
        return out, lse
    rows = H * s_q
    if num_splits is None:
        num_splits = default_splits(B, rows, block_table.shape[1] * block_size, q.device)
    if block_n is None:
        block_n = default_block_n(B, rows) if fmt == 0 else 32
    S = num_splits
    # the MMAs' dtype: q's; e4m3 rows widen to fp16 exactly in one instruction a pair (bf16: three)
    gdt = gl.float16 if q.dtype == torch.float16 or fmt == 1 else gl.bfloat16
    # whole 64-row tiles per sequence and the output in the MMAs' dtype: each split's result is
    # staged in the query's shared memory and goes out by TMA, into out itself (one split) or
    # into partials in out's dtype (slot p's rows p * rows ..); else (fp16 MMAs for a bf16
    # output, rows not whole tiles) float32 partials, stored from registers. Partials in 16 bits
    # from registers went out 16 bytes a row and instruction: 128 heads B 1 x 1k 13.4 -> 18.5 us
    # (H200). o_desc is a stand-in when unused
    tma_out = rows % _BLOCK_M == 0 and gdt == (gl.float16 if q.dtype == torch.float16 else gl.bfloat16)
    o_part, l_part, info = planned_results(out, lse, S, block_table.shape[1] * block_size,
                                           out.dtype if tma_out else torch.float32)
    kv_desc, pe_desc, sc_desc = _descriptors(kv_cache, fmt, block_n, gdt)
    v_scale = float(kv_scale) if fmt == 1 else 1.0
    grid = (triton.cdiv(rows, _BLOCK_M), S * B)
    o_desc = kv_desc
    if tma_out:
        o_rows = (out if S == 1 else o_part[:, 0]).view(-1, _DV)     # [S * B * rows, DV]: program p's at p * rows
        o_desc = TensorDescriptor(o_rows, list(o_rows.shape), [_DV, 1], [_BLOCK_M, 64],
                                  gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    _seesaw_kernel[grid](
        q, kv_desc, pe_desc, sc_desc, o_desc, block_table, cache_seqlens, o_part, l_part, info,
        q.stride(0), q.stride(1), q.stride(2),
        block_table.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        l_part.stride(0), l_part.stride(1), l_part.stride(2),
        H, s_q, B, block_size, S, softmax_scale * _LOG2E * v_scale, v_scale,
        CAUSAL=bool(causal), KV_FMT=fmt, dtype=gdt, SM_L=gl.NVMMASharedLayout.get_default_for([block_n, 64], gdt),
        P_SM=gl.NVMMASharedLayout.get_default_for([64, block_n], gdt), TMA_OUT=tma_out, BLOCK_B=block_b(B),
        # 3 warpgroups x 128 threads x 168 = the 64K register file: 240 each for WG0 and WG1, 24 for the loader
        num_warps=4, maxnreg=168, **pdl_launch(rows),
    )
    if S > 1:
        combine(o_part, l_part, out, lse, info)
    return out, lse


def mla_decode_gluon(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal=True,
                     kv_scale=1.0):
    """Absorbed MLA decode (contract of ``mla.ops.reference.mla_decode``) on Hopper via Gluon.

    Only for inputs where ``supports(q, kv_cache, block_size)`` is True. No host
    synchronisation: splits from ``block_table.shape[1] * block_size``.
    """
    return launch_gluon(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal,
                        kv_scale=kv_scale)
