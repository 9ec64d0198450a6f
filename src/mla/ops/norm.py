"""``rms_norm`` on the "triton" backend: RMSNorm of each row in one launch.

The torch formula (``reference.rms_norm``, transformers' DeepseekV3RMSNorm) is eight kernels:
widen, square, mean, add, rsqrt, scale, narrow, times the weight. At a decode step each is a
few microseconds of launch for a few kilobytes, and the layer normalizes twice (the query and
the KV latents): 25-35 us of a small batch's graphed step on the H200. One program a row, with
the reference's roundings: float32 statistics, the normalized row rounded to the input's
dtype, then the product with the weight rounded again.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import jit

__all__ = ["rms_norm", "MAX_COLUMNS"]

MAX_COLUMNS = 1 << 16     # a row in one program's registers; wider rows take the reference


@jit
def _rms_norm_kernel(X, W, Y, stride_xt, stride_xn, N, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BLOCK_N)
    ok = n < N
    x = tl.load(X + row * stride_xt + n * stride_xn, mask=ok, other=0.0).to(tl.float32)
    y = (x * tl.rsqrt(tl.sum(x * x, 0) / N + eps)).to(Y.dtype.element_ty)
    w = tl.load(W + n, mask=ok, other=0.0)
    tl.store(Y + row * N + n, (w.to(tl.float32) * y.to(tl.float32)).to(Y.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] (any strides), weight [N] of x's dtype -> [T, N] contiguous."""
    T, N = x.shape
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    block_n = triton.next_power_of_2(N)
    _rms_norm_kernel[(T,)](x, weight.contiguous(), y, x.stride(0), x.stride(1), N, eps, BLOCK_N=block_n,
                           num_warps=min(16, max(1, block_n // 256)))
    return y


rms_norm.takes = lambda x, weight, eps: x.shape[-1] <= MAX_COLUMNS
