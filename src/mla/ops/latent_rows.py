"""Triton device functions of the sparse attention kernel (``sparse_attention``): the query rows
of the absorbed form, a tile of latent cache rows in each row format of ``mla.quant``
(``KV_FMT``: 0 plain, 1 FP8 with a per-tensor scale, 2 FP8 tile rows) widened to the query's
dtype, the online-softmax step over such a tile and the epilogue that turns the running state
into (out, lse).

The portable paged decode (``decode.portable``) holds the same steps inline. Calling these from
it changed what the sanitizer saw: on the H200, under compute-sanitizer memcheck and synccheck
(no error reported), its page-16 case at 128 heads returned NaN where the inline kernel does
not; until that is understood the measured inline kernel stays as it is.

Masked rows are never dereferenced (``other=0``): NaN in unused blocks, tail slots or rows a
sparse index does not name cannot leak into a result.
"""
from __future__ import annotations

import triton.language as tl

from ._jit import LN2, jit

__all__ = ["query_rows", "keep_nan", "latent_tile", "tile_scores", "softmax_step", "attend_tile", "finish"]


@jit
def query_rows(q_row, row_ok, dv, dv_ok, dr, dr_ok, DV):
    """The query rows at q_row ([BLOCK_M] pointers): (q_nope [BLOCK_M, BLOCK_DV], q_pe [BLOCK_M,
    BLOCK_DR]), zero where masked."""
    q_nope = tl.load(q_row[:, None] + dv[None, :], mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
    q_pe = tl.load(q_row[:, None] + DV + dr[None, :], mask=row_ok[:, None] & dr_ok[None, :], other=0.0)
    return q_nope, q_pe


@jit
def keep_nan(x, x8, KEEP_NAN: tl.constexpr):
    """x widened from e4m3 bytes x8, NaN where x8 is e4m3's NaN (0x7F, 0xFF). Only where
    KEEP_NAN (the interpreter): Triton 3.6's interpreter widens the NaN byte to a finite value,
    so a NaN token's row would be attended as a large finite one; the GPU's conversion keeps
    NaN, and its code is unchanged (KEEP_NAN is a constexpr False there)."""
    if KEEP_NAN:
        x = tl.where((x8.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F, float("nan"), x)
    return x


@jit
def latent_tile(kv_row, n_ok, dv, dv_ok, dr, dr_ok, DV, like, KV_FMT: tl.constexpr, KEEP_NAN: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The cache rows at kv_row ([BLOCK_N] pointers, rows n_ok only) as (c_kv [BLOCK_N, BLOCK_DV],
    k_pe [BLOCK_N, BLOCK_DR]) in like's dtype (the query's, or float16 for FP8 rows: e4m3
    widens to it exactly, in one instruction a pair). FP8 rows (KV_FMT 1) come back unscaled:
    the caller folds kv_scale into its score and value scales."""
    if KV_FMT == 2:   # FP8 tile rows (bytes): [c_kv e4m3 | DV/128 float32 scales | k_pe bf16]
        c8 = tl.load(kv_row[:, None] + dv[None, :], mask=n_ok[:, None] & dv_ok[None, :], other=0)
        t = tl.arange(0, BLOCK_DV // 128)         # one float32 scale per 128 latent values
        scale = tl.load((kv_row + DV).to(tl.pointer_type(tl.float32))[:, None] + t[None, :],
                        mask=n_ok[:, None] & (t < DV // 128)[None, :], other=0.0)
        c = keep_nan(c8.to(tl.float8e4nv, bitcast=True).to(tl.float32), c8, KEEP_NAN)
        c = tl.reshape(c, [BLOCK_N, BLOCK_DV // 128, 128])
        c_kv = tl.reshape(c * scale[:, :, None], [BLOCK_N, BLOCK_DV]).to(like.dtype)
        k_pe = tl.load((kv_row + DV + 4 * (DV // 128)).to(tl.pointer_type(tl.bfloat16))[:, None] + dr[None, :],
                       mask=n_ok[:, None] & dr_ok[None, :], other=0.0).to(like.dtype)
    else:             # plain rows; FP8 rows (KV_FMT 1) widen exactly
        c_kv = tl.load(kv_row[:, None] + dv[None, :], mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
        k_pe = tl.load(kv_row[:, None] + DV + dr[None, :], mask=n_ok[:, None] & dr_ok[None, :], other=0.0)
        if KV_FMT == 1:
            c_kv = keep_nan(c_kv.to(like.dtype), c_kv, KEEP_NAN)
            k_pe = keep_nan(k_pe.to(like.dtype), k_pe, KEEP_NAN)
        else:
            c_kv = c_kv.to(like.dtype)
            k_pe = k_pe.to(like.dtype)
    return c_kv, k_pe


@jit
def tile_scores(q_nope, q_pe, c_kv, k_pe, IEEE: tl.constexpr):
    """S = q_nope c_kv^T + q_pe k_pe^T [BLOCK_M, BLOCK_N] float32, unscaled."""
    if IEEE:
        s = tl.dot(q_nope, tl.trans(c_kv), input_precision="ieee")
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision="ieee")
    else:
        s = tl.dot(q_nope, tl.trans(c_kv))
        s = tl.dot(q_pe, tl.trans(k_pe), s)
    return s


@jit
def softmax_step(s, c_kv, visible, qk_scale, m_i, l_i, acc, IEEE: tl.constexpr):
    """One online-softmax step over a tile's scores s (``tile_scores``): scaled to base 2 by
    qk_scale, invisible scores -inf, then the running max m_i, sum l_i and accumulator acc
    ([BLOCK_M, BLOCK_DV] float32, values = c_kv) updated. Returns them."""
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
    return m_new, l_i, acc


@jit
def attend_tile(q_nope, q_pe, c_kv, k_pe, visible, qk_scale, m_i, l_i, acc, IEEE: tl.constexpr):
    """``tile_scores`` then ``softmax_step``: one online-softmax step over a tile of keys.
    Returns (m_i, l_i, acc)."""
    s = tile_scores(q_nope, q_pe, c_kv, k_pe, IEEE)
    return softmax_step(s, c_kv, visible, qk_scale, m_i, l_i, acc, IEEE)


@jit
def finish(acc, m_i, l_i, v_scale):
    """(out = acc * v_scale / l_i, lse in natural log) of the running state; a row that saw
    nothing (l_i = 0) gets out 0 and lse -inf."""
    empty = l_i == 0.0
    out = acc * (v_scale / tl.where(empty, 1.0, l_i))[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    return out, lse
