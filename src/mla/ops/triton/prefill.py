"""Varlen causal flash attention with log-sum-exp: ``prefill_attention`` (the expanded path).

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

Which path runs (the one place that chooses, :func:`prefill_attention`): FlashInfer's fa3
ragged prefill where it is installed and the caller gives the offsets on the host
(:func:`use_flashinfer`; it measured fastest on the H200, docs/PERF.md "Prefill"), else
PyTorch's cuDNN attention where it measured faster than ours (:func:`use_cudnn`:
equal-length batches with no prefix, 16-bit), else the Triton kernel. cuDNN's causal mask is
aligned at the top-left, which equals ours only when nq == nk; FlashInfer's at the ends, as
ours. The reference stays behind all three in ``reference.py``.
"""
from __future__ import annotations

import functools
import math
import os
import warnings
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import jit

__all__ = ["prefill_attention", "PrefillConfig", "default_config", "launch", "use_cudnn", "cudnn_prefill",
           "use_flashinfer", "flashinfer_prefill"]

_LOG2E = 1.4426950408889634
_CUDNN_MIN_LEN_CHECKED = 1024   # see use_cudnn
_LN2 = tl.constexpr(0.6931471805599453)   # a constexpr: kernels may read it


@dataclass(frozen=True)
class PrefillConfig:
    """Tile shapes of one launch (compile-time constants of the kernel)."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2


@jit
def _prefill_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lt,
    qk_scale, B,
    DA: tl.constexpr, DB: tl.constexpr, DV: tl.constexpr,
    BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LOG_B: tl.constexpr,
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
    if DB > 0:
        q_b = tl.load(q_ptr + DA + db[None, :], mask=m_ok[:, None] & (db[None, :] < DB), other=0.0)
    k_ptr = K + k0.to(tl.int64) * stride_kt + h * stride_kh
    v_ptr = V + k0.to(tl.int64) * stride_vt + h * stride_vh

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
    # Keys every query of the tile sees: no mask on scores, none on key rows.
    for start_n in range(0, full_end, BLOCK_N):
        n = start_n + tl.arange(0, BLOCK_N)
        kr = k_ptr + n.to(tl.int64)[:, None] * stride_kt
        k_a = tl.load(kr + da[None, :], mask=da[None, :] < DA, other=0.0)
        s = tl.dot(q_a, tl.trans(k_a), input_precision=PRECISION)
        if DB > 0:
            k_b = tl.load(kr + DA + db[None, :], mask=db[None, :] < DB, other=0.0)
            s = tl.dot(q_b, tl.trans(k_b), s, input_precision=PRECISION)
        s = s * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + n.to(tl.int64)[:, None] * stride_vt + dv[None, :], mask=dv[None, :] < DV, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    # The diagonal band and the sequence's last partial tile: masked.
    for start_n in range(full_end, hi, BLOCK_N):
        n = start_n + tl.arange(0, BLOCK_N)
        n_ok = n < nk
        kr = k_ptr + n.to(tl.int64)[:, None] * stride_kt
        k_a = tl.load(kr + da[None, :], mask=n_ok[:, None] & (da[None, :] < DA), other=0.0)
        s = tl.dot(q_a, tl.trans(k_a), input_precision=PRECISION)
        if DB > 0:
            k_b = tl.load(kr + DA + db[None, :], mask=n_ok[:, None] & (db[None, :] < DB), other=0.0)
            s = tl.dot(q_b, tl.trans(k_b), s, input_precision=PRECISION)
        visible = n_ok[None, :]
        if CAUSAL:
            visible = visible & (n[None, :] <= offs_m[:, None] + off)
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # no key yet: no NaN from -inf - -inf
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + n.to(tl.int64)[:, None] * stride_vt + dv[None, :],
                    mask=n_ok[:, None] & (dv[None, :] < DV), other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * _LN2)
    rows = (q0 + offs_m).to(tl.int64)
    tl.store(O + rows[:, None] * stride_ot + h * stride_oh + dv[None, :], out.to(O.dtype.element_ty),
             mask=m_ok[:, None] & (dv[None, :] < DV))
    tl.store(LSE + rows * stride_lt + h, lse, mask=m_ok)


def default_config(q: torch.Tensor) -> PrefillConfig:
    """Tiles per device and dtype: small on the interpreter, Hopper-sized for 16-bit on GPU."""
    if q.device.type != "cuda":
        return PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    if q.dtype == torch.float32:  # fp32 operands (ieee dot): small tiles to fit shared memory
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=1)
    # (128, 128, 8 warps, 2 stages) measured fastest of four configs at 16 and 128 heads (PERF.md)
    return PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=2)


def _split_dim(d: int) -> tuple[int, int]:
    """d = DA + DB with DA the largest power of two <= d (192 -> 128 + 64, 24 -> 16 + 8)."""
    da = 1 << (d.bit_length() - 1)
    return da, d - da


def launch(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, cfg: PrefillConfig):
    """The Triton kernel with an explicit tile config (the benchmark compares several).
    No host synchronisation: the grid is bounded by ceil(Tq / BLOCK_M) + B tiles."""
    Tq, H, dq = q.shape
    dv = v.shape[-1]
    B = cu_seqlens_q.shape[0] - 1
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty(Tq, H, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(Tq, H, dtype=torch.float32, device=q.device)
    if Tq == 0 or H == 0 or B == 0:
        return out, lse
    da, db = _split_dim(dq)
    grid = (triton.cdiv(Tq, cfg.block_m) + B, H)
    _prefill_kernel[grid](
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        softmax_scale * _LOG2E, B,
        DA=da, DB=db, DV=dv,
        BLOCK_DA=max(16, da), BLOCK_DB=max(16, triton.next_power_of_2(db)) if db else 16,
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        CAUSAL=causal, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, LOG_B=(B - 1).bit_length(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse


# ---------------------------------------------------------------------------------------------
# cuDNN (through PyTorch) and the rule that chooses.

def use_cudnn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None) -> bool:
    """The rule, from the H200 measurements in docs/PERF.md ("Prefill"): cuDNN (through
    PyTorch, with log-sum-exp) ran 1.1-2.3x faster than our Triton kernel on every shape it
    can serve, so it serves 16-bit inputs on CUDA devices of compute capability >= 9.0 with
    head dims <= 256 (multiples of 8) when all B sequences have the same length n and as many
    queries as keys (cuDNN's causal mask is aligned top-left, ours at the ends: the two agree
    only without a prefix; equal lengths make [Tq, H, d] a free [B, H, n, d] view). Everything
    else (varlen batches, cached prefixes, fp32, CPU) runs the Triton kernel.

    Shapes decide first (inputs are packed: cu_seqlens[-1] is the row count). One sequence
    with Tq == Tk qualifies without a host read, and so do B sequences when the caller gives
    the longest lengths (the layer does): all are equal exactly when B * max_seqlen == Tq.
    Without them several sequences need one read of the offsets, which drains the stream (it
    cost 0.1-0.2 ms a call in the benchmark), so they are checked only when n = Tq / B >=
    1024, where cuDNN's lead is larger than that."""
    Tq, Tk, B = q.shape[0], k.shape[0], cu_seqlens_q.shape[0] - 1
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        return False
    if torch.cuda.get_device_capability(q.device)[0] < 9:
        return False
    dq, dv = q.shape[-1], v.shape[-1]
    if dq > 256 or dv > 256 or dq % 8 or dv % 8:
        return False
    if B <= 0 or Tq == 0 or Tq != Tk or Tq % B:
        return False
    if B == 1:
        return True
    if max_seqlen_q is not None and max_seqlen_k is not None:
        return B * max_seqlen_q == Tq and B * max_seqlen_k == Tk
    if Tq // B < _CUDNN_MIN_LEN_CHECKED:
        return False
    equal = torch.arange(B + 1, device=q.device, dtype=torch.int32) * (Tq // B)
    return bool(((cu_seqlens_q != equal) | (cu_seqlens_k != equal)).any().logical_not().item())


def cudnn_prefill(q, k, v, batch: int, softmax_scale: float, causal: bool):
    """cuDNN attention on B equal-length sequences with nq == nk, packed [B * n, H, d]."""
    Tq, H, dq = q.shape
    n = Tq // batch

    def bhnd(t):  # [B * n, H, d] -> [B, H, n, d] as a strided view
        return t.view(batch, n, H, t.shape[-1]).transpose(1, 2)

    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        bhnd(q), bhnd(k), bhnd(v), None, True, 0.0, causal, False, scale=softmax_scale)
    out, lse = res[0], res[1]
    out = out.transpose(1, 2).reshape(Tq, H, v.shape[-1])
    lse = lse.reshape(batch, H, n).transpose(1, 2).reshape(Tq, H).float()
    return out, lse


# ---------------------------------------------------------------------------------------------
# FlashInfer's fa3 ragged prefill (an optional library: used only where it imports).

# MLA_PREFILL_FLASHINFER=0 keeps the op off FlashInfer even where it is installed.
FLASHINFER = os.environ.get("MLA_PREFILL_FLASHINFER", "1") != "0"
_FI_DIMS = ((192, 128),)         # (dq, dv) measured on the H200: DeepSeek-V2/V3 and Kimi K2 heads
_fi_workspace: dict = {}         # device -> the float scratch all wrappers of that device share
_fi_wrappers: dict = {}          # (device, dtype, H, dq, dv, scale, causal) -> [wrapper, planned offsets],
                                 # or False where its first call failed


@functools.cache
def _flashinfer():
    """The flashinfer module, imported on first use; None where it does not import."""
    try:
        import flashinfer
    except Exception:   # noqa: BLE001 - absent, or a build that does not load here
        return None
    return flashinfer


def _tma_friendly(t: torch.Tensor) -> bool:
    """Unit stride along the head dim, 16-byte aligned start and other strides (TMA's terms)."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(x * t.element_size() % 16 == 0 for x in t.stride()[:-1]))


def use_flashinfer(q, k, v, causal, offsets_q, offsets_k) -> bool:
    """The rule: FlashInfer (0.6.18 measured) serves bfloat16 q/k 192, v 128 on compute
    capability 9.0 (float16 compiled there but is not yet checked against the reference) when
    the caller gives the offsets on the host (its plan reads them there; from device offsets
    it would drain the stream), outside CUDA-graph capture (the plan copies to the device), and
    when every query sees at least one key (causal: nk >= nq; full: nk > 0 where nq > 0),
    since a query with none is ours to define (out 0, lse -inf). Views are fine where TMA can
    read them (:func:`_tma_friendly`)."""
    if not FLASHINFER or offsets_q is None or offsets_k is None or q.shape[0] == 0:
        return False
    if q.device.type != "cuda" or q.dtype != torch.bfloat16:
        return False
    if (q.shape[-1], v.shape[-1]) not in _FI_DIMS or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    if not all(_tma_friendly(t) for t in (q, k, v)):
        return False
    if torch.cuda.is_current_stream_capturing():
        return False
    for b in range(len(offsets_q) - 1):
        nq, nk = offsets_q[b + 1] - offsets_q[b], offsets_k[b + 1] - offsets_k[b]
        if nq > 0 and (nk < nq if causal else nk == 0):
            return False
    return _flashinfer() is not None


def flashinfer_prefill(q, k, v, offsets_q, offsets_k, softmax_scale: float, causal: bool):
    """FlashInfer's ragged prefill (fa3 backend) on host offsets; out [Tq, H, dv], lse [Tq, H]
    float32 in base e (FlashInfer's is in base 2). The plan (host work, ~0.3 ms) is redone
    only when the offsets change. The first call of a configuration compiles FlashInfer's
    kernel (nvcc); if that call fails (e.g. no CUDA toolkit), this warns once and returns None
    for that configuration from then on, and the op takes its other paths."""
    fi = _flashinfer()
    H, dq, dv = q.shape[1], q.shape[-1], v.shape[-1]
    key = (q.device, q.dtype, H, dq, dv, softmax_scale, causal)
    entry = _fi_wrappers.get(key)
    if entry is False:
        return None
    first = entry is None
    offsets = (tuple(offsets_q), tuple(offsets_k))
    try:
        if first:
            if q.device not in _fi_workspace:
                _fi_workspace[q.device] = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
            entry = [fi.BatchPrefillWithRaggedKVCacheWrapper(_fi_workspace[q.device], "NHD", backend="fa3"), None]
        if entry[1] != offsets:
            entry[0].plan(torch.tensor(offsets[0], dtype=torch.int32), torch.tensor(offsets[1], dtype=torch.int32),
                          H, H, dq, head_dim_vo=dv, causal=causal, sm_scale=softmax_scale,
                          q_data_type=q.dtype, kv_data_type=k.dtype)
            entry[1] = offsets
        out, lse = entry[0].run(q, k, v, return_lse=True)
    except Exception as e:  # noqa: BLE001 - only a configuration's first call is forgiven
        if not first:
            raise
        _fi_wrappers[key] = False
        warnings.warn(f"mla prefill_attention: FlashInfer failed on its first call for {H} heads, "
                      f"{q.dtype}, causal={causal} ({type(e).__name__}: {str(e)[:200]}); using the other "
                      f"paths for it (MLA_PREFILL_FLASHINFER=0 skips FlashInfer)", RuntimeWarning, stacklevel=3)
        return None
    _fi_wrappers[key] = entry
    return out, lse.mul_(math.log(2))


def prefill_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal=True, max_seqlen_q=None,
                      max_seqlen_k=None, offsets_q=None, offsets_k=None):
    """Varlen packed attention with LSE (see ``mla.ops.reference.prefill_attention``).

    q [Tq, H, dq], k [Tk, H, dq], v [Tk, H, dv]; cu_seqlens_q/k [B + 1] int32 (from 0);
    offsets_q/k: the same offsets as host ints, or None. Returns out [Tq, H, dv] in q's dtype
    and lse [Tq, H] float32. The path: FlashInfer (:func:`use_flashinfer`), cuDNN
    (:func:`use_cudnn`) or the Triton kernel, which reads nothing on the host.
    """
    if use_flashinfer(q, k, v, causal, offsets_q, offsets_k):
        res = flashinfer_prefill(q, k, v, offsets_q, offsets_k, softmax_scale, causal)
        if res is not None:
            return res
    if use_cudnn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        return cudnn_prefill(q, k, v, cu_seqlens_q.shape[0] - 1, softmax_scale, causal)
    return launch(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, default_config(q))
