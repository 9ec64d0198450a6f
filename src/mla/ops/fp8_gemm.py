"""Block-scaled FP8 GEMM (DeepSeek-V3's scheme): ``quantize_act_1x128``, ``fp8_linear``, ``fp8_bmm``.

    y[m, n] = sum_g (x_q[m, C_g] . w_q[n, C_g]) * x_scale[m, g] * w_scale[n // 128, g]

C_g are the columns 128 g .. 128 g + 127 (the last group partial); x_q, x_scale the activation
quantized per token per group; w_q, w_scale the checkpoint's float8_e4m3fn weight [N, K] and its
128 x 128 block scales ``weight_scale_inv`` [ceil(N/128), ceil(K/128)].

- ``_act_quant_kernel``: one program per BLOCK_M rows x one group: amax, scale = amax / 448,
  x / scale rounded to the e4m3 grid in float32 (``round_to_e4m3``), then cast. Rounding
  first makes the cast exact, so the values are the reference's (a zero may differ in sign) on
  the GPU and in the interpreter too (Triton 3.6's interpreter casts float32 -> e4m3 with wrong
  rounding: no carry into the exponent, no ties to even).
- ``_gemm_kernel``: one BLOCK_M x BLOCK_N tile of y per program, K walked one group per step:
  tl.dot on e4m3 operands with a float32 result, times the group's two scales, added to a
  float32 accumulator. Split-K: program (tile, s) walks its own run of groups and writes a
  float32 partial that a sum over splits finishes. Grid axis 2 is the batch (fp8_bmm).

Schedule from the shapes alone (``gemm_config``, no autotuning): decode-sized M (<= 64) is
memory-bound on the weight: BLOCK_M 16..64, BLOCK_N 64 and K splits to fill the GPU. Larger M:
64 x 128 tiles in grouped order (GROUP_M row tiles sweep the columns together, so their weight
tiles are reused from L2). On an H200 these kernels beat bf16 F.linear at decode sizes; at
M >= 512 cuBLAS bf16 and torch's block-scaled scaled_mm are faster, so ``fp8_linear`` hands
M > 64 to scaled_mm where torch has it (``choose_kernel``, the one rule between the two).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._jit import jit, num_sms

__all__ = ["quantize_act_1x128", "quantize_rows_fp8", "fp8_linear", "fp8_linear_triton", "scaled_mm_blockwise", "fp8_bmm", "GemmConfig",
           "gemm_config", "choose_kernel", "round_to_e4m3", "to_e4m3", "nan_if_any", "round_to_bf16"]

GROUP = 128   # columns per activation scale = the weight's block size
_GROUP = tl.constexpr(GROUP)   # the same, as kernels see it


@jit
def round_to_e4m3(v):
    """float32 v, |v| <= 448 -> the nearest e4m3 value (ties to even), as float32."""
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127        # floor(log2 |v|)
    e = tl.maximum(e, -6) - 3                                         # log2 of e4m3's spacing at v
    ulp = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - e) << 23).to(tl.float32, bitcast=True)
    t = v * inv_ulp                                                   # exact: powers of two
    t = (t + 12582912.0) - 12582912.0                                 # + 1.5 * 2^23: rint, ties to even
    return tl.where(t == 0.0, v * 0.0, t * ulp)                       # keeps the sign of a zero


@jit
def to_e4m3(v):
    """float32 v -> float8e4nv: clamped to +-448 (e4m3fn has no inf: +-inf saturate to +-448) and
    rounded to the nearest e4m3 value, ties to even (``round_to_e4m3``, so the cast is exact);
    NaN stays NaN (0x7F), as torch's cast keeps it: a clamp and a cast may turn NaN into a
    finite value (Triton 3.6's interpreter stores it as 384)."""
    q = round_to_e4m3(tl.clamp(v, -448.0, 448.0)).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return tl.where(v != v, 0x7F, q).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@jit
def nan_if_any(amax, x, axis: tl.constexpr):
    """amax, or NaN where x holds a NaN along ``axis``: the max of a GPU (and of the interpreter)
    skips NaN, torch's amax keeps it; a group with a NaN quantizes to NaN, as in the reference."""
    return tl.where(tl.max((x != x).to(tl.int32), axis=axis) > 0, float("nan"), amax)


@jit
def round_to_bf16(v):
    """float32 v -> the nearest bfloat16 value (ties to even), as float32 (finite v)."""
    b = v.to(tl.int32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@jit
def _act_quant_kernel(X, XQ, XS, M, K, G, stride_x, BLOCK_M: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    k = g * _GROUP + tl.arange(0, _GROUP)
    ok = (m < M)[:, None] & (k < K)[None, :]
    m64 = m.to(tl.int64)
    x = tl.load(X + m64[:, None] * stride_x + k[None, :], mask=ok, other=0.0).to(tl.float32)
    scale = nan_if_any(tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12), 448.0), x, 1)
    tl.store(XQ + m64[:, None] * K + k[None, :], to_e4m3(tl.math.div_rn(x, scale[:, None])), mask=ok)
    tl.store(XS + m64 * G + g, scale, mask=m < M)


@jit
def _row_quant_kernel(X, XQ, XS, M, D, stride_x, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    ok = (m < M)[:, None] & (d < D)[None, :]
    m64 = m.to(tl.int64)
    x = tl.load(X + m64[:, None] * stride_x + d[None, :], mask=ok, other=0.0).to(tl.float32)
    scale = nan_if_any(tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12), 448.0), x, 1)
    tl.store(XQ + m64[:, None] * D + d[None, :], to_e4m3(tl.math.div_rn(x, scale[:, None])), mask=ok)
    tl.store(XS + m64, scale, mask=m < M)


def quantize_rows_fp8(x):
    """x [..., D] float -> (x_q [..., D] float8_e4m3fn, scale [...] float32), one scale a row
    (``reference.quantize_rows_fp8``'s values, exactly): one read of x, one write of x_q."""
    D = x.shape[-1]
    x_q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return x_q, scale
    rows = x.reshape(-1, D)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    M = rows.shape[0]
    if M > 0:
        block_d = max(16, triton.next_power_of_2(D))
        block_m = max(1, min(64, 4096 // block_d)) if x.device.type == "cuda" else 4
        _row_quant_kernel[(triton.cdiv(M, block_m),)](rows, x_q, scale, M, D, rows.stride(0), BLOCK_M=block_m,
                                                     BLOCK_D=block_d, num_warps=4)
    return x_q, scale


@jit
def _gemm_kernel(XQ, XS, W, WS, Y, M, N, K, G, groups_per_split,
                 stride_xb, stride_xsb, stride_wb, stride_wsb, stride_ys, stride_yb,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    pid, split, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    tiles_n = tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * tiles_n)) * GROUP_M
    rows_here = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_here
    pid_n = (pid % (GROUP_M * tiles_n)) // rows_here

    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    x_rows = XQ + b * stride_xb + m.to(tl.int64)[:, None] * K       # [BLOCK_M, 1]
    w_cols = W + b * stride_wb + n.to(tl.int64)[None, :] * K        # [1, BLOCK_N]: w^T, K-contiguous
    xs_rows = XS + b * stride_xsb + m * G
    ws_cols = WS + b * stride_wsb + (n // _GROUP) * G
    kk = tl.arange(0, _GROUP)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    g0 = split * groups_per_split
    for g in range(g0, tl.minimum(g0 + groups_per_split, G)):
        k = g * _GROUP + kk
        k_ok = k < K
        a = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        a_s = tl.load(xs_rows + g, mask=m_ok, other=0.0)
        w_s = tl.load(ws_cols + g, mask=n_ok, other=0.0)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
    y = Y + split.to(tl.int64) * stride_ys + b * stride_yb + m.to(tl.int64)[:, None] * N + n[None, :]
    tl.store(y, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class GemmConfig:
    """Tile shapes and schedule of one GEMM launch."""

    block_m: int
    block_n: int
    num_splits: int = 1      # programs per output tile along K
    num_warps: int = 4
    num_stages: int = 4
    group_m: int = 8


def gemm_config(M: int, N: int, K: int, batch: int = 1, num_sms: int = 132) -> GemmConfig:
    """The schedule for y [batch, M, N] = x [batch, M, K] @ w^T, from the shapes alone.

    Measured on an H200 at DeepSeek-V3's projections (benchmarks/fp8_gemm.py): decode-sized M
    reads the weight once with BLOCK_N 64, 4 stages, and K split for about four waves of
    programs at M <= 16 (two above), at most 8 ways; larger M: 64 x 128 tiles, 4 warps
    (128 x 64 where N is narrow: more column tiles). Quantizing x inside the GEMM was slower.
    """
    if M > 64:
        if N < 4096:
            return GemmConfig(block_m=128, block_n=64)
        return GemmConfig(block_m=64, block_n=128)
    groups = triton.cdiv(K, GROUP)
    block_m = max(16, triton.next_power_of_2(M))   # tl.dot needs >= 16 rows
    waves = 4 if block_m == 16 else 2
    splits = max(1, min(groups, 8, waves * num_sms // (batch * triton.cdiv(N, 64))))
    splits = triton.cdiv(groups, triton.cdiv(groups, splits))   # no split left without a group
    return GemmConfig(block_m=block_m, block_n=64, num_splits=splits)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4   # the interpreter: few "SMs", so tiny shapes still take the split-K path
    return num_sms(device.index if device.index is not None else torch.cuda.current_device())


def quantize_act_1x128(x):
    """x [M, K] float -> (x_q [M, K] float8_e4m3fn, x_scale [M, ceil(K/128)] float32)."""
    M, K = x.shape
    G = triton.cdiv(K, GROUP)
    x_q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    x_scale = torch.empty(M, G, dtype=torch.float32, device=x.device)
    if M > 0 and K > 0:
        x = x if x.stride(-1) == 1 else x.contiguous()
        block_m = 8
        _act_quant_kernel[(triton.cdiv(M, block_m), G)](x, x_q, x_scale, M, K, G, x.stride(0),
                                                       BLOCK_M=block_m, num_warps=4)
    return x_q, x_scale


def fp8_bmm(x, weight, weight_scale_inv, out_dtype):
    """x [B, M, K] float; weight [B, N, K] float8_e4m3fn; weight_scale_inv [B, ceil(N/128),
    ceil(K/128)] float32 -> [B, M, N] in out_dtype."""
    B, M, K = x.shape
    N = weight.shape[1]
    out = torch.empty(B, M, N, dtype=out_dtype, device=x.device)
    if out.numel() == 0 or K == 0:
        return out.zero_()
    x_q, x_scale = quantize_act_1x128(x.reshape(B * M, K))
    weight, scale = weight.contiguous(), weight_scale_inv.contiguous()
    G = x_scale.shape[1]
    cfg = gemm_config(M, N, K, B, _num_sms(x.device))
    splits = cfg.num_splits
    y = out if splits == 1 else torch.empty(splits, B, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n), splits, B)
    _gemm_kernel[grid](x_q, x_scale, weight, scale, y, M, N, K, G, triton.cdiv(G, splits),
                       M * K, M * G, N * K, scale.stride(0), B * M * N, M * N,
                       BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m,
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        out.copy_(y.sum(0))
    return out


def choose_kernel(x, weight, out_dtype) -> str:
    """The one rule between the two GEMMs of ``fp8_linear``: "scaled_mm" (torch's block-scaled
    ``scaled_mm``, cuBLAS) above 64 rows, "triton" (this module's kernel) at decode sizes. On an
    H200 at DeepSeek-V3's projections scaled_mm takes 0.56-0.96x this kernel's time at M 512 and
    4096 and 1.02-1.76x at M 8-64 (it refuses M 1). scaled_mm needs K and N in whole
    128-blocks, bf16 output and a CUDA device; elsewhere the kernel serves."""
    M, K = x.shape
    N = weight.shape[0]
    if (M > 64 and x.is_cuda and out_dtype == torch.bfloat16 and K % GROUP == 0 and N % GROUP == 0
            and _SCALED_MM is not None):
        return "scaled_mm"
    return "triton"


def fp8_linear(x, weight, weight_scale_inv, out_dtype):
    """x [M, K] float; weight [N, K] float8_e4m3fn; weight_scale_inv [ceil(N/128), ceil(K/128)]
    float32 -> [M, N] in out_dtype, on the GEMM ``choose_kernel`` names."""
    if choose_kernel(x, weight, out_dtype) == "scaled_mm":
        return scaled_mm_blockwise(x, weight, weight_scale_inv)
    return fp8_linear_triton(x, weight, weight_scale_inv, out_dtype)


def fp8_linear_triton(x, weight, weight_scale_inv, out_dtype):
    """``fp8_linear`` through this module's kernels at any M."""
    return fp8_bmm(x[None], weight[None], weight_scale_inv[None], out_dtype)[0]


try:   # torch >= 2.10 on sm90: 1x128 x 128x128 block scaling in cuBLAS
    from torch.nn.functional import ScalingType, scaled_mm as _SCALED_MM
except ImportError:
    _SCALED_MM = None


def scaled_mm_blockwise(x, weight, weight_scale_inv):
    """y [M, N] bf16 = x @ W^T through torch's scaled_mm (x quantized by this module's kernel).
    cuBLAS refuses (CUBLAS_STATUS_NOT_SUPPORTED) scales whose leading dimension M is not a
    multiple of 4 (16 bytes), so such an x gets zero rows up to the next multiple of 16, and
    the result is cut back to M."""
    M = x.shape[0]
    if M % 16:
        return scaled_mm_blockwise(F.pad(x, (0, 0, 0, -M % 16)), weight, weight_scale_inv)[:M]
    x_q, x_s = quantize_act_1x128(x)
    x_s = x_s.t().contiguous().t()                                        # scales outer-dim-major
    padded = F.pad(weight_scale_inv, (0, -weight_scale_inv.shape[1] % 4))   # K blocks padded to 4
    return _SCALED_MM(x_q, weight.t(), x_s, ScalingType.BlockWise1x128, padded.t(),
                      ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
