"""The portable split-KV absorbed MLA decode in Triton (any GPU, and CPU through the interpreter).

Notation: a cache row is ``[c_kv (dv = kv_lora_rank) | k_pe (dr = qk_rope_head_dim)]``;
the key is the whole row, the value its first ``dv`` entries. Every query row of a
sequence (``s_q`` tokens x ``H`` heads) sees the same keys, so they are flattened
into the M dimension of the tensor-core tiles: row ``m = i * H + h``.

Schedule (the split count from shapes only, so a step can be captured in a CUDA graph):

    grid = (ceil(H * s_q / BLOCK_M), num_splits * B)
    program (mb, p):     a run of BLOCK_N-key chunks of one sequence b, shared out by the
                         lengths (read on the device, ``split_plan``: a long sequence
                         among short ones gets most of the programs; ``flat``: B - 1 more
                         programs, each a piece of the batch's chunks laid end to end,
                         ``split_plan.planned_split(FLAT)``; ``persistent``: the same
                         pieces, each program running those of its window of the batch's
                         chunks in turn, read from ``split_plan.schedule``), BLOCK_N keys
                         per step:
        S   = q_nope @ c_kv^T + q_pe @ k_pe^T          # [BLOCK_M, BLOCK_N], fp32
        online softmax (base 2), acc += P @ c_kv         # [BLOCK_M, dv], fp32
        -> partial (out, lse) per program, or the final result when num_splits == 1
    combine (``combine.py``): out = sum_s exp(lse_s - lse) out_s, lse = logsumexp_s lse_s over b's programs

Masking: loads past a sequence's end are masked with ``other=0`` (never dereferenced:
NaN in unused blocks or tail slots cannot leak), invisible scores are set to -inf
with ``tl.where``; an empty row gives out = 0, lse = -inf. Values the op cannot check on
the device without a sync stay in bounds: block ids are clamped to the pool, lengths to the
table's capacity (a wrong value reads a wrong row, never outside the tensors).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._jit import LOG2E, jit, kv_fmt, num_sms
from ..latent_rows import finish, latent_tile, query_rows, softmax_step, tile_scores
from .combine import run_splits
from .split_plan import block_b, flat_programs, planned_split, schedule

__all__ = ["DecodeConfig", "default_config", "launch"]


@dataclass(frozen=True)
class DecodeConfig:
    """Tile shapes and schedule of one launch (compile-time constants of the kernel)."""

    block_m: int = 64        # query rows (heads x s_q) per program, padded to >= 16
    block_n: int = 64        # keys per inner step
    num_warps: int = 8
    num_stages: int = 2
    num_splits: int = 1      # programs per sequence along the cache length
    page_tile: bool = True   # when block_size % block_n == 0: one block-table read per tile
    flat: bool = False       # the flattened plan (``split_plan.flat_plan``) when num_splits > 1
    persistent: bool = False  # the persistent schedule (``split_plan.schedule``) when num_splits > 1

    def __post_init__(self):
        if self.flat and self.persistent:
            raise ValueError("DecodeConfig: flat and persistent are two schedules; choose one")


@jit
def _decode_split_kernel(
    Q, KV, BT, SEQLENS, O, LSE, INFO,
    stride_qb, stride_qi, stride_qh,
    stride_kv_blk, stride_kv_row,
    stride_bt,
    stride_os, stride_ob, stride_oi, stride_oh,
    stride_ls, stride_lb, stride_li,
    H, S_Q, B, DV, DR, block_size, num_blocks, max_len, num_splits, eq_splits, qk_scale, v_scale,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr, PAGE_TILE: tl.constexpr, KV_FMT: tl.constexpr, KEEP_NAN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_B: tl.constexpr, FLAT: tl.constexpr, PERSISTENT: tl.constexpr = False,
):
    """PERSISTENT: INFO is the persistent schedule (``split_plan.schedule``; the combine's info
    is the schedule's to write): program p runs its pieces INFO[p] .. INFO[p + 1] - 1 in turn,
    piece k's (b, start, end) read from it and its result written into slot k, no plan in the
    kernel."""
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

    if PERSISTENT:
        q_row = Q + qi * stride_qi + h * stride_qh
        P = num_splits * B
        for k in range(tl.load(INFO + prog), tl.load(INFO + prog + 1)):
            piece = INFO + (P + 1) + 3 * k
            b = tl.minimum(tl.maximum(tl.load(piece), 0), B - 1)
            seqlen = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), max_len)
            end = tl.minimum(tl.load(piece + 2), seqlen)
            q_nope, q_pe = query_rows(q_row + b.to(tl.int64) * stride_qb, row_ok, dv, dv_ok, dr, dr_ok, DV)
            _attend_piece(q_nope, q_pe, KV, BT, stride_bt, O, LSE, k, b, seqlen, tl.load(piece + 1), end, qi, h,
                          row_ok, dv, dv_ok, dr, dr_ok, stride_kv_blk, stride_kv_row, stride_os, stride_ob, stride_oi,
                          stride_oh, stride_ls, stride_lb, stride_li, S_Q, DV, block_size, num_blocks, qk_scale,
                          v_scale, CAUSAL, IEEE, PAGE_TILE, KV_FMT, KEEP_NAN, BLOCK_M, BLOCK_N, BLOCK_DV)
    else:
        # the query's loads go out before the plan, for sequence prog // eq_splits (the plan's
        # when the lengths are equal), so that they land under its arithmetic; again where it
        # differs (idle programs and the flattened plan's last B - 1 guess past the batch: clamped)
        guess = tl.minimum(prog // eq_splits, B - 1)
        q_row = Q + qi * stride_qi + h * stride_qh
        q_nope, q_pe = query_rows(q_row + guess.to(tl.int64) * stride_qb, row_ok, dv, dv_ok, dr, dr_ok, DV)
        tl.debug_barrier()      # the loads out before the plan (else ptxas puts them after it)
        b, seqlen, start, end = planned_split(SEQLENS, INFO, B, prog, num_splits, eq_splits, max_len, BLOCK_N,
                                              BLOCK_B, FLAT)
        if b != guess:      # mixed lengths
            q_nope, q_pe = query_rows(q_row + b.to(tl.int64) * stride_qb, row_ok, dv, dv_ok, dr, dr_ok, DV)
        _attend_piece(q_nope, q_pe, KV, BT, stride_bt, O, LSE, prog, b, seqlen, start, end, qi, h, row_ok,
                      dv, dv_ok, dr, dr_ok, stride_kv_blk, stride_kv_row, stride_os, stride_ob, stride_oi, stride_oh,
                      stride_ls, stride_lb, stride_li, S_Q, DV, block_size, num_blocks, qk_scale, v_scale,
                      CAUSAL, IEEE, PAGE_TILE, KV_FMT, KEEP_NAN, BLOCK_M, BLOCK_N, BLOCK_DV)


@jit
def _attend_piece(q_nope, q_pe, KV, BT, stride_bt, O, LSE, slot, b, seqlen, start, end, qi, h, row_ok, dv, dv_ok,
                  dr, dr_ok, stride_kv_blk, stride_kv_row, stride_os, stride_ob, stride_oi, stride_oh, stride_ls,
                  stride_lb, stride_li, S_Q, DV, block_size, num_blocks, qk_scale, v_scale,
                  CAUSAL: tl.constexpr, IEEE: tl.constexpr, PAGE_TILE: tl.constexpr, KV_FMT: tl.constexpr,
                  KEEP_NAN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Keys [start, end) of sequence b (seqlen keys, its block-table row at BT + b stride_bt) for
    the query rows (q_nope, q_pe): the online softmax over BLOCK_N-key tiles, (out, lse) stored at
    (slot, b)."""
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
            blk = tl.minimum(tl.maximum(tl.load(bt_row + start_n // block_size), 0), num_blocks - 1).to(tl.int64)
            kv_row = KV + blk * stride_kv_blk + (start_n % block_size + tl.arange(0, BLOCK_N)) * stride_kv_row
        else:
            blk = tl.minimum(tl.maximum(tl.load(bt_row + n // block_size, mask=n_ok, other=0), 0), num_blocks - 1)
            kv_row = KV + blk.to(tl.int64) * stride_kv_blk + (n % block_size) * stride_kv_row
        c_kv, k_pe = latent_tile(kv_row, n_ok, dv, dv_ok, dr, dr_ok, DV, q_nope, KV_FMT, KEEP_NAN, BLOCK_N, BLOCK_DV)
        s = tile_scores(q_nope, q_pe, c_kv, k_pe, IEEE)
        visible = n_ok[None, :] & (n[None, :] < limit[:, None])
        m_i, l_i, acc = softmax_step(s, c_kv, visible, qk_scale, m_i, l_i, acc, IEEE)

    out, lse = finish(acc, m_i, l_i, v_scale)
    o_row = O + tl.cast(slot, tl.int64) * stride_os + b.to(tl.int64) * stride_ob + qi * stride_oi + h * stride_oh
    tl.store(o_row[:, None] + dv[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    l_row = LSE + tl.cast(slot, tl.int64) * stride_ls + b.to(tl.int64) * stride_lb + qi * stride_li + h
    tl.store(l_row, lse, mask=row_ok)


def default_config(q: torch.Tensor, max_len: int) -> DecodeConfig:
    """The schedule for a launch, from host-known shapes only (no device reads).

    Query rows padded to 16..64 per program; 64-key tiles, 8 warps (the fastest on an H200
    at 16 and 128 heads). Enough splits of the cache for about two
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
    per_seq = max(1, waves * num_sms(q.device.index or 0) // ctas)
    return max(1, min(per_seq, triton.cdiv(max_len, 64)))


def launch(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, cfg: DecodeConfig,
           kv_scale: float = 1.0, *, pdl: bool = True):
    """``mla_decode`` on this kernel with an explicit schedule (the benchmark compares several)."""
    B, s_q, H, d = q.shape
    fmt = kv_fmt(kv_cache)
    if kv_cache.stride(-1) != 1:
        kv_cache = kv_cache.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    # the kernel takes the table's row stride only, and reads lengths at unit stride
    block_table, cache_seqlens = block_table.contiguous(), cache_seqlens.contiguous()
    dv, dr = head_dim_v, d - head_dim_v
    max_len = block_table.shape[1] * kv_cache.shape[1]
    block_dv = triton.next_power_of_2(dv)
    block_dr = max(16, triton.next_power_of_2(max(dr, 1)))

    def split_kernel(o_part, l_part, info, S, eq, direct):    # run_splits gives direct only when asked
        flat, persistent = cfg.flat and S > 1, cfg.persistent and S > 1
        if persistent:      # the kernel reads the schedule where the plan's kernel writes info
            info = schedule(cache_seqlens, S, max_len, cfg.block_n, info=info)[0]
        _decode_split_kernel[(triton.cdiv(H * s_q, cfg.block_m), flat_programs(S, B) if flat else S * B)](
            q, kv_cache, block_table, cache_seqlens, o_part, l_part, info,
            q.stride(0), q.stride(1), q.stride(2),
            kv_cache.stride(0), kv_cache.stride(1),
            block_table.stride(0),
            o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
            l_part.stride(0), l_part.stride(1), l_part.stride(2),
            H, s_q, B, dv, dr, kv_cache.shape[1], kv_cache.shape[0], max_len, S, eq,
            softmax_scale * LOG2E * (kv_scale if fmt == 1 else 1.0), kv_scale if fmt == 1 else 1.0,
            CAUSAL=causal, IEEE=q.dtype == torch.float32, KV_FMT=fmt, KEEP_NAN=fmt != 0 and q.device.type == "cpu",
            PAGE_TILE=cfg.page_tile and kv_cache.shape[1] % cfg.block_n == 0,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_DV=block_dv, BLOCK_DR=block_dr, BLOCK_B=block_b(B),
            FLAT=flat, PERSISTENT=persistent, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return run_splits(q, dv, max_len, cfg.num_splits, split_kernel, pdl=pdl, flat=cfg.flat or cfg.persistent)
