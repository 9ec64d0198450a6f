"""Sparse MLA attention in Triton: each query token attends to the cache rows its own ``indices``
name (DeepSeek Sparse Attention), in the absorbed form. ``launch`` hands a Hopper GPU's calls
(rows in q's dtype, FP8 rows, FP8 tile rows) to the Gluon seesaw over gathered rows
(``decode.gluon.sparse``: 2.0-2.9x faster than this kernel on bf16 rows from 64 heads on the
H200); this module's kernel serves the rest (other GPUs, float32, the interpreter), both sparse
ops:

    sparse_mla_decode(q [B, s_q, H, d], kv_cache, indices [B, s_q, topk])   paged rows, flat slots
    sparse_prefill_attention(q [s_q, H, d], kv [s_kv, 1, d], indices [s_q, 1, topk])   a block of 1

since a query token's keys do not depend on its sequence or position: the indices are the keys.
Every token is its own "sequence" of topk keys, so decode with s_q > 1 and prefill are the same
launch over more tokens (no two tokens share a gathered row, unlike the dense decode's s_q rows).

Schedule (from shapes only: capturable in a CUDA graph):

    programs = N tokens x ceil(H / BLOCK_M) head blocks x S splits of the topk list, the head
               blocks of a token adjacent in launch order (they gather the same rows: the second
               finds them in L2)
    program (token t, heads, split s): indices k in [s * chunk, (s + 1) * chunk), BLOCK_N a step:
        slot  = indices[t, k]; valid = 0 <= slot < num_slots     (-1 = none)
        rows  = kv[slot]  (masked: an invalid index is never dereferenced)
        S     = q_nope @ c_kv^T + q_pe @ k_pe^T;  online softmax (base 2);  acc += P @ c_kv
    S > 1: float32 partials merged by ``decode.combine.combine`` (the dense decode's LSE combine)

The attention sink (``attn_sink`` [H], FlashMLA's semantics: a logit in the denominator with a
zero value) starts split 0's running softmax: max = sink, sum = 1, acc = 0. So a token with no
valid index gets out 0 and lse = sink, and the combine needs no special case.

On CUDA the indices are not checked on the host (reading them back would sync the stream): an
index outside [0, num_slots) is taken as -1, never read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._jit import jit, kv_fmt, num_sms
from .decode.combine import combine
from .decode.gluon import sparse as gluon_sparse
from .latent_rows import attend_tile, finish, latent_tile, query_rows

__all__ = ["sparse_mla_decode", "sparse_prefill_attention", "SparseConfig", "schedule", "launch", "CACHE_FORMATS"]

# the cache rows sparse_mla_decode reads (mla.quant.cache_format): all of them
CACHE_FORMATS = ("plain", "fp8", "fp8_tile")

LOG2E = 1.4426950408889634


@jit
def _sparse_kernel(
    Q, KV, IDX, SINK, O, LSE,
    stride_qn, stride_qh, stride_kv_blk, stride_kv_row, stride_in,
    stride_os, stride_on, stride_oh, stride_ls, stride_ln,
    H, DV, DR, block_size, num_slots, topk, chunk, num_splits, head_blocks, qk_scale, v_scale,
    HAS_SINK: tl.constexpr, IEEE: tl.constexpr, KV_FMT: tl.constexpr, KEEP_NAN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
):
    pid = tl.program_id(0)
    hb = pid % head_blocks
    split = (pid // head_blocks) % num_splits
    t = (pid // head_blocks // num_splits).to(tl.int64)
    h = hb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = h < H
    dv = tl.arange(0, BLOCK_DV)
    dr = tl.arange(0, BLOCK_DR)
    dv_ok = dv < DV
    dr_ok = dr < DR
    q_nope, q_pe = query_rows(Q + t * stride_qn + h * stride_qh, row_ok, dv, dv_ok, dr, dr_ok, DV)
    if KV_FMT == 1 and not IEEE:   # FP8 rows widen to fp16 in one instruction per pair (bf16: three)
        q_nope = q_nope.to(tl.float16)
        q_pe = q_pe.to(tl.float16)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    if HAS_SINK:
        if split == 0:   # the sink as one more key of value 0 (module docstring)
            sink = tl.load(SINK + h, mask=row_ok, other=float("-inf"))
            m_i = sink * 1.4426950408889634      # log2(e): the kernel's scores are in base 2
            l_i = tl.where(sink == float("-inf"), 0.0, 1.0)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, dtype=tl.float32)
    start = split * chunk
    end = tl.minimum(start + chunk, topk)
    idx_row = IDX + t * stride_in
    for k0 in range(start, end, BLOCK_N):
        k = k0 + tl.arange(0, BLOCK_N)
        slot = tl.load(idx_row + k, mask=k < end, other=-1)
        ok = (slot >= 0) & (slot < num_slots)
        slot = tl.where(ok, slot, 0).to(tl.int64)
        kv_row = KV + (slot // block_size) * stride_kv_blk + (slot % block_size) * stride_kv_row
        c_kv, k_pe = latent_tile(kv_row, ok, dv, dv_ok, dr, dr_ok, DV, q_nope, KV_FMT, KEEP_NAN, BLOCK_N, BLOCK_DV)
        m_i, l_i, acc = attend_tile(q_nope, q_pe, c_kv, k_pe, ok[None, :], qk_scale, m_i, l_i, acc, IEEE)

    out, lse = finish(acc, m_i, l_i, v_scale)
    o_row = O + split.to(tl.int64) * stride_os + t * stride_on + h * stride_oh
    tl.store(o_row[:, None] + dv[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    tl.store(LSE + split.to(tl.int64) * stride_ls + t * stride_ln + h, lse, mask=row_ok)


@dataclass(frozen=True)
class SparseConfig:
    """Tile shapes and schedule of one launch (compile-time constants of the kernel)."""

    block_m: int = 64        # heads per program, padded to >= 16
    block_n: int = 64        # indices (keys) per inner step
    num_warps: int = 8
    num_stages: int = 2
    num_splits: int = 1      # programs per token along its topk list


def schedule(N: int, H: int, topk: int, dtype: torch.dtype, device: torch.device) -> SparseConfig:
    """The launch's schedule over N tokens, from shapes only.

    Heads padded to 16..64 per program (a [64, 512] float32 accumulator already fills half the
    register file of 8 warps); 64-key steps (32 at 16 heads, where a program is memory-bound
    and more of them fit an SM). The topk list is split so that about one wave of programs
    fills the GPU (two at 16 heads, where several programs share an SM), no split shorter than
    one step: decode batches have few tokens (B 32, 128 heads: 64 programs without a split),
    prefill has thousands (no split). On the H200 (top-2048, B 32 and 128): from 64 heads one
    wave takes 0.92-1.0x the time of two, at 16 heads two take 0.91x the time of four and more
    than one; 64-key steps take 0.7-0.86x the time of 32-key ones from 64 heads; stages 1-3
    and 4 or 8 warps move it by at most 5%."""
    if device.type != "cuda":   # the interpreter: small tiles, a couple of splits to exercise the combine
        return SparseConfig(16, 16, 4, 1, max(1, min(3, math.ceil(topk / 16))))
    block_m = min(64, max(16, triton.next_power_of_2(H)))
    if dtype == torch.float32:   # fp32 operands: FMA path, small tiles to fit shared memory
        block_m, block_n = min(block_m, 32), 16
    else:
        block_n = 32 if block_m == 16 else 64
    programs = N * triton.cdiv(H, block_m)
    waves = 2 if block_m == 16 else 1
    splits = max(1, min(waves * num_sms(device.index or 0) // max(programs, 1), triton.cdiv(topk, block_n)))
    return SparseConfig(block_m, block_n, 8 if block_m > 16 else 4, 2, splits)


def launch(q, kv_rows, indices, head_dim_v, softmax_scale, kv_scale=1.0, attn_sink=None, *,
           config: SparseConfig | None = None):
    """Sparse attention of q [N, H, d] over kv_rows [num_blocks, block_size, width] (a paged cache,
    or [s_kv, 1, d] rows: block_size 1) at indices [N, topk] int32 flat slots (-1 = none).
    Returns out [N, H, head_dim_v] in q's dtype and lse [N, H] float32. On a Hopper GPU the
    Gluon seesaw runs the calls it takes (``decode.gluon.sparse.supports``); the
    rest, or any call with a config (the Triton kernel's schedule: tests, benchmarks), this
    module's kernel."""
    if config is None and gluon_sparse.supports(q, kv_rows, head_dim_v):
        return gluon_sparse.launch(q, kv_rows, indices, head_dim_v, softmax_scale, attn_sink, kv_scale=kv_scale)
    N, H, d = q.shape
    topk = indices.shape[-1]
    out = torch.empty(N, H, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(N, H, dtype=torch.float32, device=q.device)
    if N == 0 or H == 0:
        return out, lse
    fmt = kv_fmt(kv_rows)
    if kv_rows.stride(-1) != 1:
        kv_rows = kv_rows.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    indices = indices.contiguous()
    cfg = config or schedule(N, H, topk, q.dtype, q.device)
    chunk = triton.cdiv(triton.cdiv(max(topk, 1), cfg.num_splits), cfg.block_n) * cfg.block_n
    splits = max(1, triton.cdiv(topk, chunk))
    if splits == 1:
        o_part, l_part = out.unsqueeze(0), lse.unsqueeze(0)
    else:
        o_part = torch.empty(splits, N, H, head_dim_v, dtype=torch.float32, device=q.device)
        l_part = torch.empty(splits, N, H, dtype=torch.float32, device=q.device)
    dv, dr = head_dim_v, d - head_dim_v
    head_blocks = triton.cdiv(H, cfg.block_m)
    scale = kv_scale if fmt == 1 else 1.0
    _sparse_kernel[(N * head_blocks * splits,)](
        q, kv_rows, indices, attn_sink if attn_sink is not None else lse, o_part, l_part,
        q.stride(0), q.stride(1), kv_rows.stride(0), kv_rows.stride(1), indices.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), l_part.stride(0), l_part.stride(1),
        H, dv, dr, kv_rows.shape[1], kv_rows.shape[0] * kv_rows.shape[1], topk, chunk, splits, head_blocks,
        softmax_scale * LOG2E * scale, scale,
        HAS_SINK=attn_sink is not None, IEEE=q.dtype == torch.float32, KV_FMT=fmt,
        KEEP_NAN=fmt != 0 and q.device.type == "cpu",
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_DV=triton.next_power_of_2(dv),
        BLOCK_DR=max(16, triton.next_power_of_2(max(dr, 1))), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        combine(o_part.unsqueeze(2), l_part.unsqueeze(2), out.unsqueeze(1), lse.unsqueeze(1), pdl=False)
    return out, lse


def sparse_mla_decode(q, kv_cache, indices, head_dim_v, softmax_scale, kv_scale=1.0, attn_sink=None):
    """``mla.ops.reference.sparse_mla_decode`` on the kernel: q [B, s_q, H, d], kv_cache [num_blocks,
    block_size, width] (plain, FP8 or FP8 tile rows), indices [B, s_q, topk] int32 flat slots."""
    B, s_q, H, d = q.shape
    out, lse = launch(q.reshape(B * s_q, H, d), kv_cache, indices.reshape(B * s_q, indices.shape[-1]), head_dim_v,
                      softmax_scale, kv_scale, attn_sink)
    return out.view(B, s_q, H, head_dim_v), lse.view(B, s_q, H)



def sparse_prefill_attention(q, kv, indices, sm_scale, d_v, attn_sink=None):
    """``mla.ops.reference.sparse_prefill_attention`` on the kernel: q [s_q, H, d], kv [s_kv, 1, d],
    indices [s_q, 1, topk] int32 rows of kv."""
    return launch(q, kv, indices[:, 0], d_v, sm_scale, 1.0, attn_sink)
