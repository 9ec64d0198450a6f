"""Split-KV absorbed MLA decode in Triton: ``mla_decode`` with the reference's signature.

Notation: a cache row is ``[c_kv (dv = kv_lora_rank) | k_pe (dr = qk_rope_head_dim)]``;
the key is the whole row, the value its first ``dv`` entries. Every query row of a
sequence (``s_q`` tokens x ``H`` heads) sees the same keys, so they are flattened
into the M dimension of the tensor-core tiles: row ``m = i * H + h``.

Schedule (the split count from shapes only, so a step can be captured in a CUDA graph):

    grid = (ceil(H * s_q / BLOCK_M), num_splits * B)
    program (mb, p):     a run of BLOCK_N-key chunks of one sequence b, shared out by the
                         lengths (read on the device, ``_planned_split``: a long sequence
                         among short ones gets most of the programs), BLOCK_N keys per step:
        S   = q_nope @ c_kv^T + q_pe @ k_pe^T          # [BLOCK_M, BLOCK_N], fp32
        online softmax (base 2), acc += P @ c_kv         # [BLOCK_M, dv], fp32
        -> partial (out, lse) per program, or the final result when num_splits == 1
    combine: out = sum_s exp(lse_s - lse) out_s, lse = logsumexp_s lse_s over b's programs

Masking: loads past a sequence's end are masked with ``other=0`` (never dereferenced:
NaN in unused blocks or tail slots cannot leak), invisible scores are set to -inf
with ``tl.where``; an empty row gives out = 0, lse = -inf.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from . import jit, kv_fmt

__all__ = ["mla_decode", "DecodeConfig", "default_config", "launch"]

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    """Tile shapes and schedule of one launch (compile-time constants of the kernel)."""

    block_m: int = 64        # query rows (heads x s_q) per program, padded to >= 16
    block_n: int = 64        # keys per inner step
    num_warps: int = 8
    num_stages: int = 2
    num_splits: int = 1      # programs per sequence along the cache length
    page_tile: bool = True   # when block_size % block_n == 0: one block-table read per tile



@jit
def _planned_split(SEQLENS, INFO, B, p, num_splits, BN: tl.constexpr, BLOCK_B: tl.constexpr):
    """Program p's share of the batch's keys, by length, in whole BN-key chunks: the plan of
    ``decode_gluon._planned_split`` (which the Hopper kernels use with 64-key chunks; the same
    rule and the same steps, written twice because Gluon and Triton kernels cannot call each
    other's functions). P = num_splits * B programs; sequence b of c_b chunks gets max(1,
    ceil(c_b / T)) for the least T that fits them in P (a binary search), the programs left one
    each in turn, and program p the k-th of b's runs of chunks; equal lengths take the fixed
    split's arithmetic.
    INFO[b] = (first program, count), for ``combine``. Returns (b, seqlen, start, end)."""
    i = tl.arange(0, BLOCK_B)
    ok = i < B
    lens = tl.load(SEQLENS + i, mask=ok, other=0)
    if tl.min(tl.where(ok, lens, 2147483647), 0) == tl.max(lens, 0):
        # equal lengths (the plan below gives the same): num_splits programs a sequence, in order
        b = p // num_splits
        k = p % num_splits
        seqlen = tl.max(lens, 0)
        c = (seqlen + BN - 1) // BN
        start = k * c // num_splits * BN
        end = tl.minimum((k + 1) * c // num_splits * BN, seqlen)
        tl.store(INFO + 2 * b, p, mask=k == 0)
        tl.store(INFO + 2 * b + 1, num_splits, mask=k == 0)
    else:
        # the least T (lo) with sum_b max(1, ceil(c_b / T)) <= P, a round of sums a step
        chunks = (lens + BN - 1) // BN
        total = tl.sum(chunks, 0)
        P = num_splits * B
        lo = tl.maximum((total + P - 1) // P, 1)
        # T = the longest always fits, and with P > B so does ceil(total / (P - B)) (the sum is
        # at most B + total / T); with P = B that is the answer (no search)
        hi = tl.maximum(tl.max(chunks, 0), lo)
        if num_splits == 1:
            lo = hi
        else:
            hi = tl.minimum(hi, tl.maximum((total + P - B - 1) // (P - B), lo))
        while lo < hi:
            mid = (lo + hi) // 2
            fits = tl.sum(tl.where(ok, tl.maximum((chunks + mid - 1) // mid, 1), 0), 0) <= P
            hi = tl.where(fits, mid, hi)
            lo = tl.where(fits, lo, mid + 1)
        n = tl.where(ok, tl.maximum((chunks + lo - 1) // lo, 1), 0)
        left = P - tl.sum(n, 0)                        # >= 0: one each in turn
        count = (n + tl.where(ok, left // B + (i < left % B).to(tl.int32), 0)).to(tl.int64)
        last = tl.cumsum(count, 0)
        first = last - count
        mine = ok & (first <= p) & (p < last)
        b = tl.sum(tl.where(mine, i, 0), 0)
        seqlen = tl.sum(tl.where(mine, lens, 0), 0)
        f = tl.sum(tl.where(mine, first, 0), 0)
        m = tl.sum(tl.where(mine, count, 0), 0)
        cb = tl.sum(tl.where(mine, chunks, 0), 0).to(tl.int64)
        kb = p - f
        start = (kb * cb // m).to(tl.int32) * BN
        end = tl.minimum(((kb + 1) * cb // m).to(tl.int32) * BN, seqlen)
        tl.store(INFO + 2 * b, f.to(tl.int32), mask=kb == 0)
        tl.store(INFO + 2 * b + 1, m.to(tl.int32), mask=kb == 0)
    return b, seqlen, start, end


@jit
def _query_rows(q_row, row_ok, dv, dv_ok, dr, dr_ok, DV):
    """The query rows at q_row ([BLOCK_M] pointers): (q_nope [BLOCK_M, BLOCK_DV], q_pe [BLOCK_M,
    BLOCK_DR]), zero where masked."""
    q_nope = tl.load(q_row[:, None] + dv[None, :], mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
    q_pe = tl.load(q_row[:, None] + DV + dr[None, :], mask=row_ok[:, None] & dr_ok[None, :], other=0.0)
    return q_nope, q_pe


@jit
def _decode_split_kernel(
    Q, KV, BT, SEQLENS, O, LSE, INFO,
    stride_qb, stride_qi, stride_qh,
    stride_kv_blk, stride_kv_row,
    stride_bt,
    stride_os, stride_ob, stride_oi, stride_oh,
    stride_ls, stride_lb, stride_li,
    H, S_Q, B, DV, DR, block_size, num_splits, qk_scale, v_scale,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr, PAGE_TILE: tl.constexpr, KV_FMT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    pid_m = tl.program_id(0)
    prog = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = m < H * S_Q
    qi = m // H
    h = m % H
    dv = tl.arange(0, BLOCK_DV)
    dr = tl.arange(0, BLOCK_DR)
    dv_ok = dv < DV
    dr_ok = dr < DR

    # the query's loads go out before the plan, for sequence prog // num_splits (the plan's when
    # the lengths are equal), so that they land under its arithmetic; again where it differs
    guess = prog // num_splits
    q_row = Q + qi * stride_qi + h * stride_qh
    q_nope, q_pe = _query_rows(q_row + guess.to(tl.int64) * stride_qb, row_ok, dv, dv_ok, dr, dr_ok, DV)
    tl.debug_barrier()      # the loads out before the plan (else ptxas puts them after it)
    b, seqlen, start, end = _planned_split(SEQLENS, INFO, B, prog, num_splits, BLOCK_N, BLOCK_B)
    if b != guess:      # mixed lengths
        q_nope, q_pe = _query_rows(q_row + b.to(tl.int64) * stride_qb, row_ok, dv, dv_ok, dr, dr_ok, DV)
    if KV_FMT == 1 and not IEEE:   # FP8 rows widen to fp16 in one instruction per pair (bf16: three)
        q_nope = q_nope.to(tl.float16)
        q_pe = q_pe.to(tl.float16)

    if CAUSAL:
        limit = seqlen - S_Q + qi + 1        # query i sees keys < limit
    else:
        limit = tl.full([BLOCK_M], 0, dtype=tl.int32) + seqlen

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, dtype=tl.float32)
    bt_row = BT + b.to(tl.int64) * stride_bt
    for start_n in range(start, end, BLOCK_N):
        n = start_n + tl.arange(0, BLOCK_N)
        n_ok = n < end
        if PAGE_TILE:  # the tile lies inside one page: one block-table read, rows evenly strided
            blk = tl.load(bt_row + start_n // block_size).to(tl.int64)
            kv_row = KV + blk * stride_kv_blk + (start_n % block_size + tl.arange(0, BLOCK_N)) * stride_kv_row
        else:
            blk = tl.load(bt_row + n // block_size, mask=n_ok, other=0)
            kv_row = KV + blk.to(tl.int64) * stride_kv_blk + (n % block_size) * stride_kv_row
        if KV_FMT == 2:   # FP8 tile rows (bytes): [c_kv e4m3 | DV/128 float32 scales | k_pe bf16]
            c8 = tl.load(kv_row[:, None] + dv[None, :], mask=n_ok[:, None] & dv_ok[None, :], other=0)
            t = tl.arange(0, BLOCK_DV // 128)         # one float32 scale per 128 latent values
            scale = tl.load((kv_row + DV).to(tl.pointer_type(tl.float32))[:, None] + t[None, :],
                            mask=n_ok[:, None] & (t < DV // 128)[None, :], other=0.0)
            c = tl.reshape(c8.to(tl.float8e4nv, bitcast=True).to(tl.float32), [BLOCK_N, BLOCK_DV // 128, 128])
            c_kv = tl.reshape(c * scale[:, :, None], [BLOCK_N, BLOCK_DV]).to(Q.dtype.element_ty)
            k_pe = tl.load((kv_row + DV + 4 * (DV // 128)).to(tl.pointer_type(tl.bfloat16))[:, None] + dr[None, :],
                           mask=n_ok[:, None] & dr_ok[None, :], other=0.0).to(Q.dtype.element_ty)
        else:             # plain rows; FP8 rows (KV_FMT 1) widen exactly, kv_scale is in qk_scale and v_scale
            c_kv = tl.load(kv_row[:, None] + dv[None, :], mask=n_ok[:, None] & dv_ok[None, :],
                           other=0.0).to(q_nope.dtype)
            k_pe = tl.load(kv_row[:, None] + DV + dr[None, :], mask=n_ok[:, None] & dr_ok[None, :],
                           other=0.0).to(q_nope.dtype)
        if IEEE:
            s = tl.dot(q_nope, tl.trans(c_kv), input_precision="ieee")
            s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision="ieee")
        else:
            s = tl.dot(q_nope, tl.trans(c_kv))
            s = tl.dot(q_pe, tl.trans(k_pe), s)
        visible = n_ok[None, :] & (n[None, :] < limit[:, None])
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # empty so far: no NaN from -inf - -inf
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = tl.dot(p.to(c_kv.dtype), c_kv, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(c_kv.dtype), c_kv, acc * alpha[:, None])
        m_i = m_new

    empty = l_i == 0.0
    out = acc * (v_scale / tl.where(empty, 1.0, l_i))[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    o_row = O + prog.to(tl.int64) * stride_os + b.to(tl.int64) * stride_ob + qi * stride_oi + h * stride_oh
    tl.store(o_row[:, None] + dv[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    l_row = LSE + prog.to(tl.int64) * stride_ls + b.to(tl.int64) * stride_lb + qi * stride_li + h
    tl.store(l_row, lse, mask=row_ok)


@jit
def _combine_step(m, total, acc, l_rows, p_rows, s0, num_splits, r_ok, d, d_ok, stride_ls, stride_ps,
                  BLOCK_S: tl.constexpr):
    """One round of ``_combine_kernel``: splits s0 .. s0 + BLOCK_S - 1 (those below num_splits)
    of l_rows / p_rows ([R] pointers to split 0's rows) into the running (m, total, acc). The
    tile is [R, S, D], splits in the middle: Triton's layout (fastest D, then R, then S) puts
    warps on rows before splits. As [S, R, D] a 16-bit tile (8 values a thread) put its splits
    on two warps, summed through shared memory: bf16 partials took 128 heads B 32 x 1k from
    35.4 to 55.8 us and a 16k sequence's 33 slots among 1k ones from 64 to 155 (H200)."""
    s = s0 + tl.arange(0, BLOCK_S)
    ok = r_ok[:, None] & (s < num_splits)[None, :]
    ls = tl.load(l_rows[:, None] + s[None, :] * stride_ls, mask=ok, other=float("-inf"))
    o = tl.load(p_rows[:, None, None] + s[None, :, None] * stride_ps + d[None, None, :],
                mask=ok[:, :, None] & d_ok[None, None, :], other=0.0)
    m_new = tl.maximum(m, tl.max(ls, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)                          # 0 while nothing was seen
    w = tl.exp(ls - m_safe[:, None])                    # empty split (-inf): weight 0
    return m_new, total * alpha + tl.sum(w, 1), acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 1)


@jit
def _combine_kernel(
    O_PART, LSE_PART, OUT, LSE, INFO,
    stride_ps, stride_pb, stride_pi, stride_ph,
    stride_ls, stride_lb, stride_li,
    stride_ob, stride_oi, stride_oh,
    stride_Lb, stride_Li,
    n_rows, H, DV, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
    PLANNED: tl.constexpr, ROUND_STAGES: tl.constexpr,
):
    """out = sum_s w_s out_s / sum_s w_s with w_s = exp(lse_s - max lse), for BLOCK_R query
    rows (m = i * H + h) and BLOCK_D output columns of one sequence, BLOCK_S splits at a time.
    PDL: launched as a programmatic dependent of the split kernel, so wait for its writes; the
    kernel after it (the next step's split kernel, itself a dependent that waits for this one to
    finish before it reads anything) may be placed from the start, not only once the wait is over
    (H200, 16 heads B 32 / 64 x 1k-16k: 0.991-1.001x the time, geometric mean 0.997)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(1)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < n_rows
    qi = r // H
    h = r % H
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < DV
    l_rows = LSE_PART + b.to(tl.int64) * stride_lb + qi * stride_li + h                     # [R]
    p_rows = O_PART + b.to(tl.int64) * stride_pb + qi * stride_pi + h * stride_ph          # [R]

    # one pass, the running maximum rescaling what is summed so far (one round of loads when
    # all the splits fit in BLOCK_S, the usual case)
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    total = tl.full([BLOCK_R], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_R, BLOCK_D], 0.0, dtype=tl.float32)
    s_begin = 0
    if PLANNED:
        # sequence b's partials: slots INFO[b, 0] .. + INFO[b, 1] - 1 (planned_results). The
        # first round's loads go out with INFO's, for the slots of equal lengths (num_splits a
        # sequence here, b's from b num_splits), and are summed again from the slots INFO gives
        # where those differ
        s_first = tl.load(INFO + 2 * b).to(tl.int64)
        count = tl.load(INFO + 2 * b + 1)
        guess = b.to(tl.int64) * num_splits
        m, total, acc = _combine_step(m, total, acc, l_rows + guess * stride_ls, p_rows + guess * stride_ps, 0,
                                      num_splits, r_ok, d, d_ok, stride_ls, stride_ps, BLOCK_S)
        s_begin = BLOCK_S
        if (s_first != guess) | (count != num_splits):     # mixed lengths
            m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
            total = tl.full([BLOCK_R], 0.0, dtype=tl.float32)
            acc = tl.full([BLOCK_R, BLOCK_D], 0.0, dtype=tl.float32)
            s_begin = 0
        l_rows += s_first * stride_ls
        p_rows += s_first * stride_ps
        num_splits = count
    # mixed lengths give a long sequence many slots (16 heads B 32, one 16k among 1k ones: 33 in
    # rounds of 4): the rounds' loads pipelined ROUND_STAGES deep (2: cp.async into shared
    # memory), so that each round does not wait out a whole memory latency after the one before.
    # The branch keeps the pipeline's prologue (its predicated copies and waits) out of the
    # programs that have no round left, as all have at equal lengths
    if s_begin < num_splits:
        for s0 in tl.range(s_begin, num_splits, BLOCK_S, num_stages=ROUND_STAGES):
            m, total, acc = _combine_step(m, total, acc, l_rows, p_rows, s0, num_splits, r_ok, d, d_ok, stride_ls,
                                          stride_ps, BLOCK_S)
    lmax = tl.where(m == float("-inf"), 0.0, m)
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    o_rows = OUT + b.to(tl.int64) * stride_ob + qi * stride_oi + h * stride_oh
    tl.store(o_rows[:, None] + d[None, :], out.to(OUT.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
    if tl.program_id(2) == 0:
        lse = tl.where(total == 0.0, float("-inf"), lmax + tl.log(tl.where(total == 0.0, 1.0, total)))
        tl.store(LSE + b.to(tl.int64) * stride_Lb + qi * stride_Li + h, lse, mask=r_ok)


# Programmatic dependent launch of the combine and of the Gluon split kernels (Hopper and later):
# their programs are placed on the multiprocessors the kernel before them frees and wait there for
# its writes, instead of the stream launching them after it has drained. Off: plain stream order
# (benchmarks compare).
PDL = True


@lru_cache(maxsize=None)
def _sm_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


@lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_config(q: torch.Tensor, max_len: int) -> DecodeConfig:
    """The schedule for a launch, from host-known shapes only (no device reads).

    Query rows padded to 16..64 per program; 64-key tiles, 8 warps (measured best on an
    H200 for 16 and 128 heads, docs/PERF.md). Enough splits of the cache for about two
    waves of programs when few rows share a tile (memory-bound: latency hiding) and one
    wave otherwise, with no split shorter than one 64-key tile.
    """
    B, s_q, H, _ = q.shape
    rows = H * s_q
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    if q.device.type != "cuda":  # the interpreter: small tiles, a couple of splits to exercise the combine
        return DecodeConfig(block_m=16, block_n=16, num_warps=4, num_stages=1,
                            num_splits=max(1, min(3, math.ceil(max_len / 16))))
    if q.dtype == torch.float32:  # fp32 operands: FMA path, small key tiles to fit shared memory
        block_m = min(block_m, 32)
        return DecodeConfig(block_m=block_m, block_n=16, num_warps=8, num_stages=1,
                            num_splits=_splits(q, B * triton.cdiv(rows, block_m), 1, max_len))
    ctas = B * triton.cdiv(rows, block_m)
    return DecodeConfig(block_m=block_m, block_n=64, num_warps=8, num_stages=2,
                        num_splits=_splits(q, ctas, 2 if block_m == 16 else 1, max_len))


def _splits(q: torch.Tensor, ctas: int, waves: int, max_len: int) -> int:
    per_seq = max(1, waves * _num_sms(q.device.index or 0) // ctas)
    return max(1, min(per_seq, triton.cdiv(max_len, 64)))


def launch(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, cfg: DecodeConfig,
           kv_scale: float = 1.0):
    """``mla_decode`` with an explicit schedule (the benchmark compares several)."""
    B, s_q, H, d = q.shape
    fmt = kv_fmt(kv_cache)
    if kv_cache.stride(-1) != 1:
        kv_cache = kv_cache.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    dv, dr = head_dim_v, d - head_dim_v
    out = torch.empty(B, s_q, H, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, s_q, H, dtype=torch.float32, device=q.device)
    if B == 0 or s_q == 0 or H == 0:
        return out, lse
    S = cfg.num_splits
    o_part, l_part, info = planned_results(out, lse, S, block_table.shape[1] * kv_cache.shape[1])
    block_dv = triton.next_power_of_2(dv)
    block_dr = max(16, triton.next_power_of_2(max(dr, 1)))
    grid = (triton.cdiv(H * s_q, cfg.block_m), S * B)
    _decode_split_kernel[grid](
        q, kv_cache, block_table, cache_seqlens, o_part, l_part, info,
        q.stride(0), q.stride(1), q.stride(2),
        kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        l_part.stride(0), l_part.stride(1), l_part.stride(2),
        H, s_q, B, dv, dr, kv_cache.shape[1], S,
        softmax_scale * _LOG2E * (kv_scale if fmt == 1 else 1.0), kv_scale if fmt == 1 else 1.0,
        CAUSAL=causal, IEEE=q.dtype == torch.float32, KV_FMT=fmt,
        PAGE_TILE=cfg.page_tile and kv_cache.shape[1] % cfg.block_n == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_DV=block_dv, BLOCK_DR=block_dr, BLOCK_B=block_b(B),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if S > 1:
        combine(o_part, l_part, out, lse, info)
    return out, lse


def planned_results(out: torch.Tensor, lse: torch.Tensor, num_splits: int, max_len: int,
                    part_dtype: torch.dtype = torch.float32):
    """Where the split kernels write (the plan, ``_planned_split`` here and in ``decode_gluon``:
    P = num_splits * B programs, program p into slot p), as [P, B, ...] views that a kernel
    addresses at (p, b): out and lse themselves when there is one split (slot strides 0:
    program p is sequence p), else partials of P slots (sequence strides 0), the outputs in
    part_dtype, the lse in float32. info [B, 2] int32: each sequence's (first slot, slot count),
    written by the kernel for ``combine``. max_len: the block table's capacity (the plan counts
    chunks and splits equal lengths in int32).

    part_dtype: float32, or the output's own 16-bit dtype where a kernel stores its partials
    well in it (the FP8 kernel's 16-byte stores, the seesaw's TMA boxes), as FlashInfer's MLA
    keeps its partials: half the bytes to write and read back (1 KB a query row and split),
    for one more rounding of each split's normalized output (a relative 2^-9 in bf16).
    Returns (o_part, l_part, info)."""
    if part_dtype not in (torch.float32, out.dtype):
        raise ValueError(f"part_dtype: expected float32 or the output's dtype {out.dtype}, got {part_dtype}")
    B = out.shape[0]
    P = num_splits * B
    if max(num_splits, B) * -(-max_len // 16) >= 2 ** 31:
        raise ValueError(f"block_table: {max_len} keys a sequence in {num_splits} splits of a batch of {B} is past "
                         f"the split plan's int32 arithmetic (max(splits, batch) x keys / 16 < 2^31)")
    info = torch.empty(B, 2, dtype=torch.int32, device=out.device)
    if num_splits == 1:
        return out.unsqueeze(0).expand(P, *out.shape), lse.unsqueeze(0).expand(P, *lse.shape), info
    o = torch.empty(P, *out.shape[1:], dtype=part_dtype, device=out.device)
    l_ = torch.empty(P, *lse.shape[1:], dtype=torch.float32, device=out.device)
    return o.unsqueeze(1).expand(P, *out.shape), l_.unsqueeze(1).expand(P, *lse.shape), info


def block_b(B: int) -> int:
    """The plan's vector width (``_planned_split``) for a batch of B: B rounded up to a power of
    two, at least 16 (a compile-time constant: a new power of two compiles the kernel again)."""
    return max(16, triton.next_power_of_2(B))


def combine_tiles(num_splits: int, rows: int, dv: int, elt: int = 4) -> tuple[int, int, int, int]:
    """(BLOCK_S, BLOCK_R, BLOCK_D, warps) of the combine: about 4096 partial values a program,
    all the splits at once up to 256, so that each program's loads go out together. The first
    version (one row, 128 columns, 16 splits at a time, two passes) was latency-bound: on the
    H200 19.7 us for 2 splits x 32 x 128 rows (21 MB) and 14.1 us for 132 splits x 16 rows
    (batch 1), against 9.7 and 4.6 with these tiles (docs/PERF.md, "the split combine").

    elt: the partials' bytes a value. Triton lays a tile out 16 bytes a thread along D, then
    threads on R, then S; warps on D, R, and what is left over on S, whose sums then go through
    shared memory. 16-bit partials (8 values a thread) in a [1, 16, 256] tile put all four warps
    on S: 128 heads B 1 x 1k 13.5 -> 15.8 us against float32 partials (H200). So up to 16 splits
    a 16-bit tile covers four warps with R x D (1024 values), and beyond, the program has only
    the warps that R x D covers (float32 tiles keep four warps, as measured before)."""
    bs = min(triton.next_power_of_2(max(num_splits, 1)), 256)
    bd = min(triton.next_power_of_2(dv), max(16, 4096 // bs))
    br = min(triton.next_power_of_2(max(rows, 1)), max(1, 4096 // (bs * bd)))
    if elt != 2:
        return bs, br, bd, 4
    if bs <= 16:
        bd = min(triton.next_power_of_2(dv), 1024)
        br = min(triton.next_power_of_2(max(rows, 1)), max(br, 1024 // bd))
    t_d = min(32, max(1, bd // 8))              # threads on D, then on R
    t_r = min(32 // t_d, br)
    return bs, br, bd, max(1, min(4, (bd // (8 * t_d)) * (br // t_r)))


def combine(o_part, l_part, out, lse, info=None):
    """LSE combine of split partials o_part [S, B, s_q, H, dv] (float32 or 16-bit, summed in
    float32) and l_part [S, B, s_q, H] (float32) into out [B, s_q, H, dv] and lse [B, s_q, H].
    info (the split kernels' plan, ``planned_results``): [B, 2] int32, sequence b's partials
    are slots info[b, 0] .. + info[b, 1] - 1 of S = num_splits * B."""
    S, B, s_q, H, dv = o_part.shape
    if o_part.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("combine: o_part and out need unit stride in their last dim")
    per = S if info is None else S // B     # with info: the slots a sequence of equal lengths has
    bs, br, bd, warps = combine_tiles(per, H * s_q, dv, o_part.element_size())
    # the rounds' loop pipelines only for a sequence with more slots than the tile holds: more
    # than 256 equal splits, or mixed lengths (a plan over more than one sequence). Else (batch
    # 1: at most one round, when its plan gave fewer slots than the guess) one stage, without
    # the pipeline's shared memory (sm_90a, a float32 [1, 64, 64] tile: 17664 -> 512 bytes; a
    # bf16 [1, 256, 16] one: 1024 -> 512) and prologue: batch 1 took 0.953x (H200, 18 shapes)
    rounds = per > bs or (info is not None and B > 1)
    pdl = PDL and out.is_cuda and _sm_major(out.device.index or 0) >= 9
    _combine_kernel[(triton.cdiv(H * s_q, br), B, triton.cdiv(dv, bd))](
        o_part, l_part, out, lse, l_part if info is None else info,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        l_part.stride(0), l_part.stride(1), l_part.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        H * s_q, H, dv, per,
        BLOCK_S=bs, BLOCK_R=br, BLOCK_D=bd, PDL=pdl, PLANNED=info is not None, ROUND_STAGES=2 if rounds else 1,
        num_warps=warps,
        **({"launch_pdl": True} if pdl else {}),
    )


def mla_decode(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal=True, kv_scale=1.0):
    """Absorbed MLA attention over a paged latent cache (see ``mla.ops.reference.mla_decode``).

    q [B, s_q, H, d]; kv_cache [num_blocks, block_size, d] in q's dtype, or FP8 rows read as they
    are (float8_e4m3fn with kv_scale, or the uint8 tile layout of ``mla.quant``: the kernel
    dequantizes each tile in registers, no dequantized copy); block_table [B, max_blocks] int32;
    cache_seqlens [B] int32 (including the s_q new tokens). Returns out [B, s_q, H, head_dim_v]
    in q's dtype and lse [B, s_q, H] float32. No host synchronisation: the split count comes
    from ``block_table.shape[1] * block_size``, the longest length the table can hold.
    """
    max_len = block_table.shape[1] * kv_cache.shape[1]
    kernel = choose_kernel(q, kv_cache, head_dim_v, max_len)
    if kernel == "fp8":
        from .decode_gluon_fp8 import launch_fp8
        return launch_fp8(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, kv_scale=kv_scale)
    if kernel == "narrow":
        from .decode_gluon_narrow import launch_narrow
        return launch_narrow(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal,
                             kv_scale=kv_scale)
    if kernel == "seesaw":
        from .decode_gluon import mla_decode_gluon
        return mla_decode_gluon(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, kv_scale)
    return launch(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal,
                  default_config(q, max_len), kv_scale)


# FP8 rows with at most 16 query rows: batches whose keys (B x the table's capacity) are at most
# this many go to the portable kernel, whose fixed cost is lower
FP8_PORTABLE_KEYS = 8192


def choose_kernel(q, kv_cache, head_dim_v, max_len: int) -> str:
    """The one dispatch rule of ``mla_decode``: "seesaw" (``decode_gluon``), "narrow"
    (``decode_gluon_narrow``), "fp8" (``decode_gluon_fp8``) or "portable" (this module's kernel),
    from shapes and dtypes only (max_len: the block table's capacity, no host sync).

    FP8 rows (per-tensor scale, or tile rows) with at most 32 query rows go to the e4m3 kernel
    at any batch, except batches of at most ``FP8_PORTABLE_KEYS`` keys with at most 16 rows.
    On the H200 at 16 heads (docs/PERF.md, "Small batches" and "Ninth session"): per-tensor rows
    at batches 1-16 x 1k-16k took 0.39-0.94x the seesaw's time on the e4m3 kernel, and 0.67-0.85x
    the e4m3 kernel's on the portable kernel up to 8192 keys (1.01-1.06x at 16k keys); tile rows
    at B 32/128 x 4k/16k 0.42-0.56x the widening narrow kernel's time; 32 rows (s_q 2) at
    B 1-128 x 4k/16k 0.51-0.95x the seesaw's. The rest: ``use_gluon``, then ``use_narrow``."""
    if not use_gluon(q, kv_cache, head_dim_v):
        return "portable"
    rows = q.shape[1] * q.shape[2]
    if kv_cache.dtype in (torch.float8_e4m3fn, torch.uint8) and rows <= 32:
        return "portable" if rows <= 16 and q.shape[0] * max_len <= FP8_PORTABLE_KEYS else "fp8"
    return "narrow" if use_narrow(q, kv_cache) else "seesaw"


def use_gluon(q, kv_cache, head_dim_v) -> bool:
    """Between the portable kernel and the Hopper kernels (wgmma + TMA): a Hopper kernel
    whenever it takes the inputs (bf16/fp16 queries, dv 512, rows of 576 in q's dtype or FP8, or
    FP8 tile rows), but see ``choose_kernel`` for small FP8 batches. For plain rows, on an
    H200 (18 shapes, 16 and 128 heads) it was 1.2-2.0x faster than this kernel except at
    batch 1 with 4k tokens (14.3 vs 12.2 us at 16 heads, 20.6 vs 20.1 at 128) and at 16 heads
    batch 32 (within 1%) (docs/PERF.md)."""
    if q.device.type != "cuda" or head_dim_v != 512:
        return False
    from .decode_gluon import supports
    return supports(q, kv_cache)


def use_narrow(q, kv_cache) -> bool:
    """Between the Hopper kernels (given ``use_gluon``): a keys-on-M kernel for at most 16 query
    rows (H * s_q) and a batch of 2 or more, the query-rows-on-M kernel otherwise. On the H200
    at 16 heads, bf16 rows, the keys-on-M kernel took 0.85-0.98x the other's time at batches
    2-24 x 1k-16k and 0.83-0.99x at batch 32 and 128 (4.2 TB/s at 128 x 16k), more at batch 1;
    with 32 rows (s_q 2) 1.11-1.72x at batches 1-128 (docs/PERF.md). FP8 rows with at most 32
    query rows do not reach this rule: ``choose_kernel`` sends them to ``decode_gluon_fp8``
    (e4m3 MMAs for S, no widening: 0.49-0.69x the widening narrow kernel's time at B 32/128 x
    4k/16k)."""
    return q.shape[1] * q.shape[2] <= 16 and q.shape[0] >= 2


mla_decode.cache_formats = ("plain", "fp8", "fp8_tile")
