"""Hopper (sm90) hot path of the absorbed MLA decode in Triton's Gluon dialect.

Same contract as ``mla.ops.reference.mla_decode`` for the shapes ``supports`` accepts:
CUDA tensors on a compute-capability-9.x device, bf16/fp16 query and cache, d = 576 with
head_dim_v = 512, block_size a multiple of 64 and cache rows laid out as one 2-D
``[num_blocks * block_size, 576]`` matrix (unit column stride). Anything else: use
``mla.ops.triton.decode.mla_decode`` (the portable kernel).

Schedule (as in ``decode.py``, planned on the host from shapes only, graph-capturable):

    grid = (ceil(H * s_q / 64), num_splits, B), 8 warps = 2 warpgroups, 1 CTA per SM
    CTA (mb, s, b): query rows m = i * H + h (64 of them, zero-padded) against the keys
        [s * chunk, (s + 1) * chunk) of sequence b (chunk a multiple of 64 from the real length)
      shared memory: Q [64, 576] (loaded once), K ring of 2 x [64, 576] (one page-aligned
        64-key tile each, 9 TMA boxes of 64 x 64 landing on one mbarrier)
      per tile:
        S = Q K^T            wgmma, A and B from shared memory; [64, 64] fp32, the two
                             warpgroups own 32 columns each
        online softmax (base 2) over the 64 columns (row max / sum across warpgroups)
        acc = acc * alpha + P V    wgmma, P from registers, V = first 512 columns of the same
                             K tile in shared memory; acc [64, 512] fp32, warpgroup 0 owns
                             columns 0..255 and warpgroup 1 columns 256..511
        then the tile's buffer is refilled with the tile two ahead (TMA)
      PIPE: the QK^T of tile t+1 is issued (async) before the PV of tile t, so the tensor
        cores work on the next S while the softmax registers are being prepared.
    partial (out, lse) per split -> ``decode.combine`` (the portable kernel's combine).

Masking: keys past the split's end inside the tail tile are zeroed in shared memory after the
TMA lands (the cache may hold NaN there; 0 * NaN would leak through P V), and their scores
are -inf; padding query rows load as zeros and are never stored. Empty rows: out 0, lse -inf.
"""
from __future__ import annotations

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

from .decode import _num_sms, combine

__all__ = ["mla_decode_gluon", "supports", "launch_gluon"]

_LOG2E = 1.4426950408889634
_D, _DV, _BLOCK_M, _BLOCK_N = 576, 512, 64, 64


@gluon.jit
def _load_tile(kv_desc, bt_row, n0, block_size, bar, dst_nope, dst_pe, NCHUNK: gl.constexpr, CHUNK: gl.constexpr):
    """TMA one page-aligned 64-key tile (512 + 64 columns) into shared memory, completing on ``bar``."""
    blk = gl.load(bt_row + n0 // block_size)
    row0 = blk * block_size + n0 % block_size
    mbarrier.expect(bar, kv_desc.block_type.nbytes * (NCHUNK + 1))
    for c in gl.static_range(NCHUNK):
        tma.async_copy_global_to_shared(kv_desc, [row0, c * CHUNK], bar, dst_nope.slice(c * CHUNK, CHUNK, dim=1))
    tma.async_copy_global_to_shared(kv_desc, [row0, NCHUNK * CHUNK], bar, dst_pe)


@gluon.jit
def _zero_tail(kt, kpe, n0, end, LD_L: gl.constexpr, BLOCK_N: gl.constexpr, NCHUNK: gl.constexpr,
               CHUNK: gl.constexpr):
    """Tail tile: zero the key rows at or past ``end`` (NaN there would survive 0 * NaN in P V)."""
    if n0 + BLOCK_N > end:
        rl = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD_L))
        keep = (n0 + rl < end)[:, None]
        for c in gl.static_range(NCHUNK):
            part = kt.slice(c * CHUNK, CHUNK, dim=1)
            x = part.load(LD_L)
            part.store(gl.where(keep, x, gl.zeros_like(x)))
        x = kpe.load(LD_L)
        kpe.store(gl.where(keep, x, gl.zeros_like(x)))
        fence_async_shared()
        gl.thread_barrier()


@gluon.jit
def _softmax_step(s, n0, end, ns, limit, m_i, l_i, qk_scale, P_L: gl.constexpr, ACC_L: gl.constexpr,
                  dtype: gl.constexpr):
    """Online softmax (base 2) of one score tile: P in the PV operand layout, acc's rescale factor."""
    n = n0 + ns
    visible = (n < end)[None, :] & (n[None, :] < limit[:, None])
    s = gl.where(visible, s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p_op = gl.convert_layout(p.to(dtype), P_L)
    return p_op, gl.convert_layout(alpha, gl.SliceLayout(1, ACC_L)), m_new, l_i


@gluon.jit
def _decode_gluon_kernel(
    Q, kv_desc, BT, SEQLENS, O, LSE,
    stride_qb, stride_qi, stride_qh,
    stride_bt,
    stride_os, stride_ob, stride_oi, stride_oh,
    stride_ls, stride_lb, stride_li,
    H, S_Q, block_size, num_splits, qk_scale,
    CAUSAL: gl.constexpr, PIPE: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, DV: gl.constexpr,
    num_warps: gl.constexpr,
):
    CHUNK: gl.constexpr = 64
    NCHUNK: gl.constexpr = DV // CHUNK        # 64-column boxes of the latent part
    DR: gl.constexpr = D - DV
    gl.static_assert(DR == CHUNK)
    dtype: gl.constexpr = kv_desc.dtype

    pid_m = gl.program_id(0)
    pid_s = gl.program_id(1)
    b = gl.program_id(2)

    # ---- layouts
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_N // 2, 16])
    ACC_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                    instr_shape=[16, DV // 2, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_L, k_width=2)
    LD_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    SM_L: gl.constexpr = kv_desc.layout

    # ---- shared memory: Q, the K ring, barriers
    # (shared buffers need power-of-2 shapes: the 576 columns live as 512 + 64)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, DV], SM_L)
    qpe_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, DR], SM_L)
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, DV], SM_L)
    kpe_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, DR], SM_L)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)

    # ---- this split's keys
    seqlen = gl.load(SEQLENS + b)
    per_split = (seqlen + num_splits - 1) // num_splits
    chunk = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = pid_s * chunk
    end = gl.minimum(start + chunk, seqlen)
    n_tiles = gl.maximum(end - start + BLOCK_N - 1, 0) // BLOCK_N
    bt_row = BT + b.to(gl.int64) * stride_bt

    # start the first two tile loads before anything else
    if n_tiles > 0:
        _load_tile(kv_desc, bt_row, start, block_size, bars.index(0), k_smem.index(0), kpe_smem.index(0),
                   NCHUNK, CHUNK)
    if n_tiles > 1:
        _load_tile(kv_desc, bt_row, start + BLOCK_N, block_size, bars.index(1), k_smem.index(1),
                   kpe_smem.index(1), NCHUNK, CHUNK)

    # ---- Q rows (heads x s_q flattened) -> shared memory, zero-padded
    ml = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LD_L))
    cl = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, LD_L))
    ql = Q + b.to(gl.int64) * stride_qb + (ml // H) * stride_qi + (ml % H) * stride_qh
    qmask = (ml < H * S_Q)[:, None] & (cl < CHUNK)[None, :]
    for c in gl.static_range(NCHUNK):
        qc = gl.load(ql[:, None] + (c * CHUNK + cl)[None, :], mask=qmask, other=0.0)
        q_smem.slice(c * CHUNK, CHUNK, dim=1).store(qc)
    qc = gl.load(ql[:, None] + (DV + cl)[None, :], mask=qmask, other=0.0)
    qpe_smem.store(qc)
    fence_async_shared()
    gl.thread_barrier()

    # ---- softmax state
    ms = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_L))
    ns = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    if CAUSAL:
        limit = seqlen - S_Q + ms // H + 1          # query i sees keys < limit
    else:
        limit = gl.full([BLOCK_M], 0, gl.int32, gl.SliceLayout(1, S_L)) + seqlen
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, S_L))
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, gl.SliceLayout(1, S_L))
    acc = gl.zeros([BLOCK_M, DV], gl.float32, ACC_L)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_L)

    if PIPE:
        # S of tile t+1 (async) overlaps the P V of tile t and the softmax of t+1
        if n_tiles > 0:
            mbarrier.wait(bars.index(0), 0)
            _zero_tail(k_smem.index(0), kpe_smem.index(0), start, end, LD_L, BLOCK_N, NCHUNK, CHUNK)
            s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(qpe_smem, kpe_smem.index(0).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
            p_op, alpha, m_i, l_i = _softmax_step(s, start, end, ns, limit, m_i, l_i, qk_scale, P_L, ACC_L, dtype)
            for t in range(n_tiles):
                buf = t % 2
                kt = k_smem.index(buf)
                n0 = start + t * BLOCK_N
                acc = acc * alpha[:, None]
                if t + 1 < n_tiles:
                    kn = k_smem.index(1 - buf)
                    kpn = kpe_smem.index(1 - buf)
                    mbarrier.wait(bars.index(1 - buf), ((t + 1) // 2) & 1)
                    _zero_tail(kn, kpn, n0 + BLOCK_N, end, LD_L, BLOCK_N, NCHUNK, CHUNK)
                    s = warpgroup_mma(q_smem, kn.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                    s = warpgroup_mma(qpe_smem, kpn.permute((1, 0)), s, is_async=True)
                    acc = warpgroup_mma(p_op, kt, acc, is_async=True)
                    s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
                    p_op, alpha, m_i, l_i = _softmax_step(s, n0 + BLOCK_N, end, ns, limit, m_i, l_i, qk_scale,
                                                          P_L, ACC_L, dtype)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                else:
                    acc = warpgroup_mma(p_op, kt, acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                # every warpgroup is done reading this buffer: refill it with the tile two ahead
                gl.thread_barrier()
                if t + 2 < n_tiles:
                    _load_tile(kv_desc, bt_row, n0 + 2 * BLOCK_N, block_size, bars.index(buf), kt,
                               kpe_smem.index(buf), NCHUNK, CHUNK)
    else:
        for t in range(n_tiles):
            buf = t % 2
            kt = k_smem.index(buf)
            kpe = kpe_smem.index(buf)
            n0 = start + t * BLOCK_N
            mbarrier.wait(bars.index(buf), (t // 2) & 1)
            _zero_tail(kt, kpe, n0, end, LD_L, BLOCK_N, NCHUNK, CHUNK)
            s = warpgroup_mma(q_smem, kt.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(qpe_smem, kpe.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
            p_op, alpha, m_i, l_i = _softmax_step(s, n0, end, ns, limit, m_i, l_i, qk_scale, P_L, ACC_L, dtype)
            acc = acc * alpha[:, None]
            acc = warpgroup_mma(p_op, kt, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            # every warpgroup is done reading this buffer: refill it with the tile two ahead
            gl.thread_barrier()
            if t + 2 < n_tiles:
                _load_tile(kv_desc, bt_row, n0 + 2 * BLOCK_N, block_size, bars.index(buf), kt, kpe, NCHUNK, CHUNK)

    mbarrier.invalidate(bars.index(0))
    mbarrier.invalidate(bars.index(1))

    # ---- epilogue: out = acc / l, lse = (m + log2 l) ln 2
    empty = l_i == 0.0
    inv = 1.0 / gl.where(empty, 1.0, l_i)
    out = acc * gl.convert_layout(inv, gl.SliceLayout(1, ACC_L))[:, None]
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)

    mo = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ACC_L))
    do = gl.arange(0, DV, layout=gl.SliceLayout(0, ACC_L))
    o_row = (O + pid_s.to(gl.int64) * stride_os + b.to(gl.int64) * stride_ob
             + (mo // H) * stride_oi + (mo % H) * stride_oh)
    omask = (mo < H * S_Q)[:, None] & (do < DV)[None, :]
    gl.store(o_row[:, None] + do[None, :], out.to(O.dtype.element_ty), mask=omask)
    l_row = LSE + pid_s.to(gl.int64) * stride_ls + b.to(gl.int64) * stride_lb + (ms // H) * stride_li + ms % H
    gl.store(l_row, lse, mask=ms < H * S_Q)


def supports(q: torch.Tensor, kv_cache: torch.Tensor, block_size: int | None = None) -> bool:
    """True when ``mla_decode_gluon`` handles these tensors (else use the portable kernel)."""
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
    if q.dtype not in (torch.bfloat16, torch.float16) or kv_cache.dtype != q.dtype:
        return False
    if q.dim() != 4 or q.shape[-1] != _D or kv_cache.shape[-1] != _D or q.stride(-1) != 1:
        return False
    if block_size % _BLOCK_N != 0 or kv_cache.shape[1] != block_size:
        return False
    # the cache must be one 2-D matrix of rows for the TMA descriptor
    if kv_cache.stride(-1) != 1 or kv_cache.stride(0) != block_size * kv_cache.stride(1):
        return False
    if (kv_cache.stride(1) * kv_cache.element_size()) % 16 or kv_cache.data_ptr() % 16:
        return False
    return True


def default_splits(B: int, rows: int, max_len: int, device, waves: int = 1) -> int:
    """Splits of the cache per sequence: about ``waves`` waves of 1-CTA-per-SM programs."""
    ctas = B * triton.cdiv(rows, _BLOCK_M)
    per_seq = max(1, waves * _num_sms(device.index or 0) // max(ctas, 1))
    return max(1, min(per_seq, triton.cdiv(max_len, _BLOCK_N)))


def launch_gluon(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal=True,
                 num_splits: int | None = None, pipe: bool = False):
    """``mla_decode_gluon`` with an explicit split count (the benchmark compares several)."""
    if kv_cache.dim() == 4:
        kv_cache = kv_cache.squeeze(2)
    B, s_q, H, d = q.shape
    num_blocks, block_size, _ = kv_cache.shape
    if head_dim_v != _DV or d != _D or not supports(q, kv_cache, block_size):
        raise ValueError("mla_decode_gluon: unsupported shapes/dtypes/layout (see supports())")
    out = torch.empty(B, s_q, H, _DV, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, s_q, H, dtype=torch.float32, device=q.device)
    if B == 0 or s_q == 0 or H == 0:
        return out, lse
    rows = H * s_q
    if num_splits is None:
        num_splits = default_splits(B, rows, block_table.shape[1] * block_size, q.device)
    S = num_splits
    if S == 1:
        o_part, l_part = out.unsqueeze(0), lse.unsqueeze(0)
    else:
        o_part = torch.empty(S, B, s_q, H, _DV, dtype=torch.float32, device=q.device)
        l_part = torch.empty(S, B, s_q, H, dtype=torch.float32, device=q.device)
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([_BLOCK_N, 64], gdt)
    kv2 = kv_cache.as_strided((num_blocks * block_size, _D), (kv_cache.stride(1), 1))
    kv_desc = TensorDescriptor(kv2, list(kv2.shape), list(kv2.stride()), [_BLOCK_N, 64], layout)
    grid = (triton.cdiv(rows, _BLOCK_M), S, B)
    _decode_gluon_kernel[grid](
        q, kv_desc, block_table, cache_seqlens, o_part, l_part,
        q.stride(0), q.stride(1), q.stride(2),
        block_table.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        l_part.stride(0), l_part.stride(1), l_part.stride(2),
        H, s_q, block_size, S, softmax_scale * _LOG2E,
        CAUSAL=bool(causal), PIPE=bool(pipe),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, D=_D, DV=_DV,
        num_warps=8,
    )
    if S > 1:
        combine(o_part, l_part, out, lse)
    return out, lse


def mla_decode_gluon(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal=True):
    """Absorbed MLA decode (contract of ``mla.ops.reference.mla_decode``) on Hopper via Gluon.

    Only for inputs where ``supports(q, kv_cache, block_size)`` is True. No host
    synchronisation: splits from ``block_table.shape[1] * block_size``.
    """
    return launch_gluon(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal)
