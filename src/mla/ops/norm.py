"""``rms_norm`` and ``rms_norm_pair`` on the "triton" backend: RMSNorm of each row in one launch.

The torch formula (``reference.rms_norm``, transformers' DeepseekV3RMSNorm) is eight kernels:
widen, square, mean, add, rsqrt, scale, narrow, times the weight. At a decode step each is a
few microseconds of launch for a few kilobytes, and the layer normalizes twice (the query and
the KV latents): 25-35 us of a small batch's graphed step on the H200. One program a row, with
the reference's roundings: float32 statistics, the normalized row rounded to the input's
dtype, then the product with the weight rounded again. ``rms_norm_pair`` normalizes the rows of
two tensors in the same launch (the layer's query and KV latents: one launch fewer a step).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import jit

__all__ = ["rms_norm", "rms_norm_pair", "MAX_COLUMNS"]

MAX_COLUMNS = 1 << 16     # a row in one program's registers; wider rows take the reference


@jit
def _norm_row(X, W, Y, row, stride_xt, stride_xn, N, eps, BLOCK_N: tl.constexpr):
    """Row ``row`` of X [T, N] normalized into Y [T, N] (contiguous), times W [N]."""
    n = tl.arange(0, BLOCK_N)
    ok = n < N
    x = tl.load(X + row * stride_xt + n * stride_xn, mask=ok, other=0.0).to(tl.float32)
    y = (x * tl.rsqrt(tl.sum(x * x, 0) / N + eps)).to(Y.dtype.element_ty)
    w = tl.load(W + n, mask=ok, other=0.0)
    tl.store(Y + row * N + n, (w.to(tl.float32) * y.to(tl.float32)).to(Y.dtype.element_ty), mask=ok)


@jit
def _rms_norm_kernel(X, W, Y, stride_xt, stride_xn, N, eps, BLOCK_N: tl.constexpr):
    _norm_row(X, W, Y, tl.program_id(0).to(tl.int64), stride_xt, stride_xn, N, eps, BLOCK_N)


@jit
def _rms_norm_pair_kernel(X1, W1, Y1, X2, W2, Y2, stride_1t, stride_1n, stride_2t, stride_2n, N1, N2, eps1, eps2,
                          BLOCK_N: tl.constexpr):
    """Program (t, 0) normalizes row t of X1, program (t, 1) row t of X2."""
    row = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        _norm_row(X1, W1, Y1, row, stride_1t, stride_1n, N1, eps1, BLOCK_N)
    else:
        _norm_row(X2, W2, Y2, row, stride_2t, stride_2n, N2, eps2, BLOCK_N)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] (any strides), weight [N] of x's dtype -> [T, N] contiguous."""
    T, N = x.shape
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    block_n = triton.next_power_of_2(N)
    _rms_norm_kernel[(T,)](x, weight.contiguous(), y, x.stride(0), x.stride(1), N, eps, BLOCK_N=block_n,
                           num_warps=_warps(block_n))
    return y


def rms_norm_pair(x1: torch.Tensor, weight1: torch.Tensor, eps1: float, x2: torch.Tensor, weight2: torch.Tensor,
                  eps2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm`` of x1 [T, N1] and of x2 [T, N2] (any strides) in one launch: T x 2 programs,
    each as wide as the wider row (the narrower one's programs mask the rest)."""
    T, N1 = x1.shape
    N2 = x2.shape[1]
    y1 = torch.empty(T, N1, dtype=x1.dtype, device=x1.device)
    y2 = torch.empty(T, N2, dtype=x2.dtype, device=x2.device)
    if T == 0:
        return y1, y2
    block_n = triton.next_power_of_2(max(N1, N2))
    _rms_norm_pair_kernel[(T, 2)](x1, weight1.contiguous(), y1, x2, weight2.contiguous(), y2, x1.stride(0),
                                  x1.stride(1), x2.stride(0), x2.stride(1), N1, N2, eps1, eps2, BLOCK_N=block_n,
                                  num_warps=_warps(block_n))
    return y1, y2


def _warps(block_n: int) -> int:
    return min(16, max(1, block_n // 256))

