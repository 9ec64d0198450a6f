"""The Triton kernel of ``prefill_attention``: varlen causal flash attention with log-sum-exp.

Shapes (packed, one row per token): q [Tq, H, dq], k [Tk, H, dq], v [Tk, H, dv];
sequence b owns q rows cu_seqlens_q[b]..[b+1] and k/v rows cu_seqlens_k[b]..[b+1].
Causal aligns the ends: query i of nq sees keys j <= i + nk - nq (a cached prefix of
nk - nq keys is visible to every query). A query with no visible key: out 0, lse -inf.

Schedule of the Triton kernel (tutorial 06, varlen):

    grid = (ceil(Tq / BLOCK_M) + B, H), from shapes only; heaviest query tiles first
    program (tile, h):  its sequence b and rows from a binary search over cu_seqlens_q
                        (sequences sit BLOCK_M rows apart in tile space); q tile
                        [BLOCK_M, dq] in registers, split into a power-of-two part DA
                        and a rest DB (192 = 128 + 64: no padding to 256)
        keys [0, full_end):   every query of the tile sees every key, no mask
        keys [full_end, hi):  the diagonal band, masked (causal / sequence end)
        S = q_a k_a^T + q_b k_b^T, online softmax in base 2, acc += P v

FP8 mode (``mla.ops.fp8_prefill_attention``, ``FP8``): k and v e4m3 with a scale a key row (or
one), one key head for every query head where k has one (stride 0); the q tile rounded to
e4m3 per row as it is loaded; S scaled by both rows' scales; P rounded to e4m3 per key block
(``reference.fp8_prefill_attention`` emulates the whole arithmetic). Which dots run on e4m3
MMAs is ``FP8_QK``'s (``launch``: where Triton 3.6 computes them right).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._jit import jit
from ..fp8_gemm import to_e4m3
from ..latent_rows import keep_nan

__all__ = ["PrefillConfig", "default_config", "fp8_config", "launch"]

_LOG2E = 1.4426950408889634
_LN2 = tl.constexpr(0.6931471805599453)   # a constexpr: kernels may read it


@dataclass(frozen=True)
class PrefillConfig:
    """Tile shapes of one launch (compile-time constants of the kernel)."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2


@jit
def _key_block(q_a, q_b, q_s, m_i, l_i, acc, start_n, offs_m, off, nk, k_ptr, v_ptr, ks_ptr, vs_ptr, v_max,
               stride_kt, stride_vt, stride_vd, stride_kst, stride_vst, qk_scale,
               DA: tl.constexpr, DB: tl.constexpr, DV: tl.constexpr, BLOCK_DA: tl.constexpr,
               BLOCK_DB: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               CAUSAL: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr, FP8_QK: tl.constexpr,
               FP8_PV: tl.constexpr, EXACT_CAST: tl.constexpr):
    """One block of BLOCK_N keys into the online softmax (m_i, l_i in base 2, acc). MASKED: the
    block may hold keys past the sequence or past a query's causal limit. FP8: k and v are
    e4m3 with a scale a key row, q_a/q_b e4m3 with q_s a query row; P is rounded to e4m3 at
    448 P w (w = the row's v scale / v_max, so P w <= 1) and l sums what P_q stands for.
    FP8_QK: Q K^T on e4m3 MMAs, else on fp16 MMAs of the same values; FP8_PV: P V likewise
    (v key-major: stride_vt 1, the layout an e4m3 MMA reads its B operand in)."""
    da = tl.arange(0, BLOCK_DA)
    db = tl.arange(0, BLOCK_DB)
    dv = tl.arange(0, BLOCK_DV)
    n = start_n + tl.arange(0, BLOCK_N)
    n_ok = n < nk
    kr = k_ptr + n.to(tl.int64)[:, None] * stride_kt
    k_a = tl.load(kr + da[None, :], mask=(n_ok[:, None] if MASKED else True) & (da[None, :] < DA), other=0.0)
    if FP8 and not FP8_QK:     # e4m3 values on fp16 MMAs (exact: e4m3 is a subset of fp16)
        k_a = _widen(k_a, EXACT_CAST)
    s = tl.dot(q_a, tl.trans(k_a), input_precision=PRECISION)
    if DB > 0:
        k_b = tl.load(kr + DA + db[None, :], mask=(n_ok[:, None] if MASKED else True) & (db[None, :] < DB),
                      other=0.0)
        if FP8 and not FP8_QK:
            k_b = _widen(k_b, EXACT_CAST)
        s = tl.dot(q_b, tl.trans(k_b), s, input_precision=PRECISION)
    if FP8:
        k_s = tl.load(ks_ptr + n.to(tl.int64) * stride_kst, mask=n_ok, other=0.0)
        s = s * (q_s[:, None] * k_s[None, :])
    if MASKED:
        visible = n_ok[None, :]
        if CAUSAL:
            visible = visible & (n[None, :] <= offs_m[:, None] + off)
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # no key yet: no NaN from -inf - -inf
    else:
        s = s * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = m_new
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    v = tl.load(v_ptr + n.to(tl.int64)[:, None] * stride_vt + dv[None, :] * stride_vd,
                mask=(n_ok[:, None] if MASKED else True) & (dv[None, :] < DV), other=0.0)
    if FP8:
        w = tl.load(vs_ptr + n.to(tl.int64) * stride_vst, mask=n_ok, other=1.0) / v_max   # <= 1
        pw = p * (w * 448.0)[None, :]
        p_q = to_e4m3(pw) if EXACT_CAST else pw.to(tl.float8e4nv)     # the interpreter: exact, NaN kept
        # e4m3 widens through fp16: straight to float32 it is wrong in some layouts (docs/kernels.md)
        p16 = _widen(p_q, EXACT_CAST)
        l_i = l_i * alpha + tl.sum(p16.to(tl.float32) * (1.0 / (w * 448.0))[None, :], 1)
        if FP8_PV:
            acc = tl.dot(p_q, v, acc * alpha[:, None])
        else:   # Triton 3.6's e4m3 MMA on row-major v gives NaN (docs/kernels.md)
            acc = tl.dot(p16, _widen(v, EXACT_CAST), acc * alpha[:, None])
    else:
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@jit
def _prefill_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K, KS, VS, VMAX,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_lt,
    stride_kst, stride_ksh, stride_vst, stride_vsh, stride_vmh,
    qk_scale, B,
    DA: tl.constexpr, DB: tl.constexpr, DV: tl.constexpr,
    BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LOG_B: tl.constexpr, FP8: tl.constexpr = False, FP8_QK: tl.constexpr = False, FP8_PV: tl.constexpr = False,
    EXACT_CAST: tl.constexpr = False,
):
    # Tiles cut a padded row space where sequence b starts at P[b] = cu_q[b] + b * BLOCK_M:
    # the BLOCK_M rows of padding after each sequence mean a tile meets at most one of them
    # (found by binary search on P, no host read, no prefix-sum tensor). Reversed: the last
    # (heaviest causal) tiles start first.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    last_row = tile * BLOCK_M + BLOCK_M - 1
    lo = 0                                # b = the largest index with P[b] <= last_row
    hi = B - 1
    for _ in tl.static_range(LOG_B):
        mid = (lo + hi + 1) // 2
        up = tl.load(CU_Q + mid) + mid * BLOCK_M <= last_row
        lo = tl.where(up, mid, lo)
        hi = tl.where(up, hi, mid - 1)
    b = lo
    q0 = tl.load(CU_Q + b)
    nq = tl.load(CU_Q + b + 1) - q0
    start_m = tile * BLOCK_M - (q0 + b * BLOCK_M)    # may be < 0: rows before the sequence
    if start_m >= nq:                                 # the tile lies in padding
        return
    k0 = tl.load(CU_K + b)
    nk = tl.load(CU_K + b + 1) - k0

    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_ok = (offs_m >= 0) & (offs_m < nq)
    da = tl.arange(0, BLOCK_DA)
    db = tl.arange(0, BLOCK_DB)
    dv = tl.arange(0, BLOCK_DV)
    q_ptr = Q + (q0 + offs_m).to(tl.int64)[:, None] * stride_qt + h * stride_qh
    q_a = tl.load(q_ptr + da[None, :], mask=m_ok[:, None] & (da[None, :] < DA), other=0.0)
    q_b = q_a
    if DB > 0:
        q_b = tl.load(q_ptr + DA + db[None, :], mask=m_ok[:, None] & (db[None, :] < DB), other=0.0)
    q_s = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    v_max = 1.0
    if FP8:   # each query row rounded to e4m3 on its own scale, in registers: no quantize pass
        q_a, q_b, q_s = _quantize_rows(q_a.to(tl.float32), q_b.to(tl.float32), DB, EXACT_CAST)
        if not FP8_QK:
            q_a, q_b = _widen(q_a, EXACT_CAST), _widen(q_b, EXACT_CAST)
        v_max = tl.load(VMAX + h * stride_vmh)
    k_ptr = K + k0.to(tl.int64) * stride_kt + h * stride_kh
    v_ptr = V + k0.to(tl.int64) * stride_vt + h * stride_vh
    ks_ptr = KS + k0.to(tl.int64) * stride_kst + h * stride_ksh
    vs_ptr = VS + k0.to(tl.int64) * stride_vst + h * stride_vsh

    off = nk - nq                  # keys before the first query (cached prefix)
    if CAUSAL:
        hi = tl.maximum(tl.minimum(nk, start_m + BLOCK_M + off), 0)
        full_end = tl.maximum(tl.minimum(start_m + 1 + off, nk), 0) // BLOCK_N * BLOCK_N
    else:
        hi = nk
        full_end = nk // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, dtype=tl.float32)
    # Keys every query of the tile sees: no mask on scores, none on key rows; then the diagonal
    # band and the sequence's last partial block, masked.
    for start_n in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _key_block(q_a, q_b, q_s, m_i, l_i, acc, start_n, offs_m, off, nk, k_ptr, v_ptr, ks_ptr,
                                   vs_ptr, v_max, stride_kt, stride_vt, stride_vd, stride_kst, stride_vst,
                                   qk_scale,
                                   DA, DB, DV, BLOCK_DA, BLOCK_DB, BLOCK_DV, BLOCK_N, False, CAUSAL, PRECISION,
                                   FP8, FP8_QK, FP8_PV, EXACT_CAST)
    for start_n in range(full_end, hi, BLOCK_N):
        m_i, l_i, acc = _key_block(q_a, q_b, q_s, m_i, l_i, acc, start_n, offs_m, off, nk, k_ptr, v_ptr, ks_ptr,
                                   vs_ptr, v_max, stride_kt, stride_vt, stride_vd, stride_kst, stride_vst,
                                   qk_scale,
                                   DA, DB, DV, BLOCK_DA, BLOCK_DB, BLOCK_DV, BLOCK_N, True, CAUSAL, PRECISION,
                                   FP8, FP8_QK, FP8_PV, EXACT_CAST)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if FP8:
        out = out * (v_max / 448.0)
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * _LN2)
    rows = (q0 + offs_m).to(tl.int64)
    tl.store(O + rows[:, None] * stride_ot + h * stride_oh + dv[None, :], out.to(O.dtype.element_ty),
             mask=m_ok[:, None] & (dv[None, :] < DV))
    tl.store(LSE + rows * stride_lt + h, lse, mask=m_ok)


@jit
def _widen(x8, EXACT_CAST: tl.constexpr):
    """e4m3 -> fp16 (exact), NaN kept under the interpreter, whose conversion makes the NaN
    byte 480 (``latent_rows.keep_nan``; the GPU's conversion keeps it)."""
    return keep_nan(x8.to(tl.float16), x8, EXACT_CAST)


@jit
def _quantize_rows(x_a, x_b, DB: tl.constexpr, EXACT_CAST: tl.constexpr):
    """float32 rows split [BLOCK_M, DA] + [BLOCK_M, DB] (padding 0) -> both halves in e4m3 and
    the row's scale max(amax, 1e-12) / 448, as ``reference.quantize_rows_fp8``."""
    amax = tl.max(tl.abs(x_a), 1)
    if DB > 0:
        amax = tl.maximum(amax, tl.max(tl.abs(x_b), 1))
    s = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
    a = tl.math.div_rn(x_a, s[:, None])
    b = tl.math.div_rn(x_b, s[:, None])
    if EXACT_CAST:   # the interpreter's own cast rounds wrongly (mla.ops.fp8_gemm)
        return to_e4m3(a), to_e4m3(b), s
    return a.to(tl.float8e4nv), b.to(tl.float8e4nv), s


# Hopper's shared memory per program (227 KB) less room for the compiler's own buffers
_SMEM_BUDGET = 220 << 10


def default_config(q: torch.Tensor, dv: int | None = None) -> PrefillConfig:
    """Tiles per device, dtype and head dims: small on the interpreter; on GPU the largest of a
    short list whose tiles (Q once, K and V per stage, padded as the kernel pads them) fit
    shared memory. (128, 128, 8 warps, 2 stages) was the fastest of four configs at 16 and 128
    heads on the H200 for DeepSeek's 192 / 128 heads; wider heads (GLM's 256 / 256) take
    smaller key tiles."""
    if q.device.type != "cuda":
        return PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    da, db = _split_dim(q.shape[-1])
    dq = max(16, da) + (max(16, triton.next_power_of_2(db)) if db else 16)
    dv = max(16, triton.next_power_of_2(dv if dv is not None else q.shape[-1]))
    elt = q.element_size()
    candidates = ((64, 32, 4, 1),) if q.dtype == torch.float32 else \
        ((128, 128, 8, 2), (128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 1))
    for bm, bn, warps, stages in candidates:
        if elt * (bm * dq + stages * bn * (dq + dv)) <= _SMEM_BUDGET:
            break
    return PrefillConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)


def _split_dim(d: int) -> tuple[int, int]:
    """d = DA + DB with DA the largest power of two <= d (192 -> 128 + 64, 24 -> 16 + 8)."""
    da = 1 << (d.bit_length() - 1)
    return da, d - da


def fp8_config(q: torch.Tensor, dq: int, dv: int) -> PrefillConfig:
    """Tiles of the FP8 kernel: the accumulator [BLOCK_M, dv] is float32 in registers, so the
    absorbed form's 512-wide values take 64 query rows (FlashMLA's tile); K and V tiles are
    1 byte an element."""
    if q.device.type != "cuda":
        return PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    if dv > 256:
        return PrefillConfig(block_m=64, block_n=64, num_warps=8, num_stages=1)
    return PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=2)


def key_major(v: torch.Tensor) -> torch.Tensor:
    """v [Tk, Hk, dv] copied into a [Hk, dv, Tk] buffer and viewed as [Tk, Hk, dv] again: stride 1
    along the keys, the layout ``launch(fp8_pv=True)`` takes."""
    return v.permute(1, 2, 0).contiguous().permute(2, 0, 1)


def launch(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, cfg: PrefillConfig, k_scale=None,
           v_scale=None, fp8_pv: bool = False):
    """The Triton kernel with an explicit tile config (the benchmark compares several).
    No host synchronisation: the grid is bounded by ceil(Tq / BLOCK_M) + B tiles.

    FP8 (k and v float8_e4m3fn, ``mla.ops.fp8_prefill_attention``): k [Tk, Hk, dq] with Hk = H
    or 1 (every head reads the one key row), k_scale / v_scale float32 [1] or [Tk, Hk]. v may be
    key-major (``v.stride(0) == 1``, ``key_major``). fp8_pv: P V
    on e4m3 MMAs, which needs key-major v (the layout an e4m3 MMA takes its B operand in; row-major
    v gives NaN on Triton 3.6) and values of at most 256 columns; off, P V runs on fp16 MMAs of
    the same e4m3 values (exact). The op leaves it off until ``benchmarks/fp8_context.py`` (its
    ``fp8_pv`` row) has shown it right and faster on the GPU."""
    Tq, H, dq = q.shape
    dv = v.shape[-1]
    B = cu_seqlens_q.shape[0] - 1
    fp8 = k.dtype == torch.float8_e4m3fn
    q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))
    key_major = fp8 and v.stride(0) == 1 and v.shape[0] > 1      # v [Tk, Hk, dv] viewing [Hk, dv, Tk]
    if not key_major and v.stride(-1) != 1:
        v = v.contiguous()
    if fp8_pv and not (key_major and dv <= 256):
        raise ValueError(f"fp8_pv: needs float8_e4m3fn v key-major (stride(0) == 1) with dv <= 256, got "
                         f"{v.dtype} v of shape {tuple(v.shape)}, strides {v.stride()}")
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()   # read at unit stride
    out = torch.empty(Tq, H, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(Tq, H, dtype=torch.float32, device=q.device)
    if Tq == 0 or H == 0 or B == 0:
        return out, lse
    shared = k.shape[1] == 1 and H > 1      # one key row for every head: stride 0 over heads
    kh, vh = (0, 0) if shared else (k.stride(1), v.stride(1))
    if fp8:
        k_scale, v_scale = k_scale.float(), v_scale.float()
        v_max = v_scale.amax(0) if v_scale.dim() == 2 else v_scale.reshape(1)   # [Hk]: the head's largest row scale
        ks = (0, 0) if k_scale.dim() < 2 else (k_scale.stride(0), 0 if shared else k_scale.stride(1))
        vs = (0, 0) if v_scale.dim() < 2 else (v_scale.stride(0), 0 if shared else v_scale.stride(1))
        vm = 0 if (shared or v_max.numel() == 1) else v_max.stride(0)
    else:
        k_scale = v_scale = v_max = lse     # not read
        ks, vs, vm = (0, 0), (0, 0), 0
    da, db = _split_dim(dq)
    grid = (triton.cdiv(Tq, cfg.block_m) + B, H)
    _prefill_kernel[grid](
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, k_scale, v_scale, v_max,
        q.stride(0), q.stride(1), k.stride(0), kh, v.stride(0), vh, v.stride(2),
        out.stride(0), out.stride(1), lse.stride(0), *ks, *vs, vm,
        softmax_scale * _LOG2E, B,
        DA=da, DB=db, DV=dv,
        BLOCK_DA=max(16, da), BLOCK_DB=max(16, triton.next_power_of_2(db)) if db else 16,
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        CAUSAL=causal, PRECISION="ieee" if q.dtype == torch.float32 and not fp8 else "tf32",
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, LOG_B=(B - 1).bit_length(),
        # e4m3 MMAs for Q K^T where Triton 3.6 gets them right: K of 32 or more (16 does not
        # lower), values of at most 256 (the absorbed 512-wide accumulator breaks them)
        # (the interpreter: fp16 MMAs of the same values, whose widening keeps NaN)
        FP8=fp8, FP8_QK=fp8 and dv <= 256 and da >= 32 and (db == 0 or db >= 32) and q.device.type == "cuda",
        FP8_PV=fp8_pv and q.device.type == "cuda",
        EXACT_CAST=fp8 and q.device.type != "cuda",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse
