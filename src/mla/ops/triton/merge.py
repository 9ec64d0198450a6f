"""Exact merge of two partial attentions by log-sum-exp: ``merge_attention``.

For disjoint key sets a and b:  lse = logaddexp(lse_a, lse_b),
out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse). A part with lse = -inf weighs 0;
when both are empty, out = 0 and lse = -inf (never NaN). One program per BLOCK_R rows,
the head dim walked in BLOCK_D slices; arithmetic in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import jit

__all__ = ["merge_attention"]


@jit
def _merge_kernel(OA, LA, OB, LB, O, L, rows, D,
                  stride_oa, stride_ob, stride_o,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rows
    la = tl.load(LA + r, mask=r_ok, other=float("-inf"))
    lb = tl.load(LB + r, mask=r_ok, other=float("-inf"))
    mx = tl.maximum(la, lb)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)       # both empty: no -inf - -inf
    ea = tl.exp(la - mx_safe)                               # exp(-inf) = 0: an empty part weighs 0
    eb = tl.exp(lb - mx_safe)
    tot = ea + eb
    empty = tot == 0.0
    lse = tl.where(empty, float("-inf"), mx_safe + tl.log(tl.where(empty, 1.0, tot)))
    wa = ea / tl.where(empty, 1.0, tot)
    wb = eb / tl.where(empty, 1.0, tot)
    tl.store(L + r, lse, mask=r_ok)
    r64 = r.to(tl.int64)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        ok = r_ok[:, None] & (d[None, :] < D)
        oa = tl.load(OA + r64[:, None] * stride_oa + d[None, :], mask=ok, other=0.0).to(tl.float32)
        ob = tl.load(OB + r64[:, None] * stride_ob + d[None, :], mask=ok, other=0.0).to(tl.float32)
        out = oa * wa[:, None] + ob * wb[:, None]
        tl.store(O + r64[:, None] * stride_o + d[None, :], out.to(O.dtype.element_ty), mask=ok)


def merge_attention(out_a, lse_a, out_b, lse_b):
    """out_* [..., d], lse_* [...] float32 -> (out [..., d] in out_a's dtype, lse [...] float32)."""
    d = out_a.shape[-1]
    oa, ob = out_a.reshape(-1, d), out_b.reshape(-1, d)   # views when the rows are evenly strided
    oa, ob = (t if t.stride(-1) == 1 else t.contiguous() for t in (oa, ob))
    la, lb = lse_a.reshape(-1).contiguous(), lse_b.reshape(-1).contiguous()
    rows = oa.shape[0]
    out = torch.empty(rows, d, dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty(rows, dtype=torch.float32, device=out_a.device)
    if rows > 0:
        block_d = min(256, max(16, triton.next_power_of_2(d)))
        block_r = max(1, min(64, 4096 // block_d)) if out_a.device.type == "cuda" else 16
        _merge_kernel[(triton.cdiv(rows, block_r),)](
            oa, la, ob, lb, out, lse, rows, d, oa.stride(0), ob.stride(0), out.stride(0),
            BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)
    return out.view(out_a.shape), lse.view(lse_a.shape)
