"""Gather latent rows of cached prefixes into one contiguous workspace: ``gather_latent``.

Row j of the result belongs to the sequence b with cu_seqlens[b] <= j < cu_seqlens[b + 1]
(found by a binary search over cu_seqlens, so the grid needs no host read), and is the
cache row of token starts[b] + j - cu_seqlens[b] of that sequence:
kv_cache[block_table[b, tok // block_size], tok % block_size]. One program copies
BLOCK_T rows, d values each, in BLOCK_D slices. Unused blocks are never read.

On CUDA the index values are unchecked (``mla.ops.gather_latent`` checks them on CPU only:
reading them would sync the stream), so every index is clamped into its tensor: a wrong
value gives a wrong row, never a read out of bounds, and rows past cu_seqlens[B] are zeros.
For valid values the clamps change nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import jit

__all__ = ["gather_latent"]


@jit
def _gather_kernel(KV, BT, STARTS, CU, OUT, num_tokens, B, block_size, num_blocks, max_blocks,
                   stride_kvb, stride_kvr, stride_bt, stride_ot,
                   D: tl.constexpr, LOG_B: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    j = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j_ok = j < num_tokens
    # b = the largest index with cu[b] <= j (cu[0] = 0 <= j; cu[B] = num_tokens > j).
    lo = tl.full([BLOCK_T], 0, dtype=tl.int32)
    hi = tl.full([BLOCK_T], 0, dtype=tl.int32) + (B - 1)
    for _ in range(LOG_B):
        mid = (lo + hi + 1) // 2
        go_up = tl.load(CU + mid, mask=j_ok, other=0) <= j
        lo = tl.where(go_up, mid, lo)
        hi = tl.where(go_up, hi, mid - 1)
    b = lo
    in_seq = j < tl.load(CU + B)          # rows past the last offset (a wrong num_tokens): zeros
    tok = tl.load(STARTS + b, mask=j_ok, other=0) + j - tl.load(CU + b, mask=j_ok, other=0)
    tok = tl.maximum(tok, 0)
    col = tl.minimum(tok // block_size, max_blocks - 1)
    blk = tl.load(BT + b.to(tl.int64) * stride_bt + col, mask=j_ok, other=0)
    blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1)
    src = KV + blk.to(tl.int64) * stride_kvb + (tok % block_size).to(tl.int64) * stride_kvr
    dst = OUT + j.to(tl.int64) * stride_ot
    for d0 in tl.static_range(0, D, BLOCK_D):   # unrolled: every slice's load in flight
        d = d0 + tl.arange(0, BLOCK_D)
        ok = j_ok[:, None] & (d[None, :] < D)
        x = tl.load(src[:, None] + d[None, :], mask=ok & in_seq[:, None], other=0)
        tl.store(dst[:, None] + d[None, :], x, mask=ok)


def gather_latent(kv_cache, block_table, starts, cu_seqlens, num_tokens):
    """kv_cache [num_blocks, block_size, d]; block_table [B, max_blocks] int32; starts [B] int32;
    cu_seqlens [B + 1] int32 -> [num_tokens, d] in kv_cache's dtype (no host synchronisation)."""
    d = kv_cache.shape[-1]
    out = torch.empty(num_tokens, d, dtype=kv_cache.dtype, device=kv_cache.device)
    B = block_table.shape[0]
    if num_tokens == 0:
        return out
    if B == 0 or block_table.shape[1] == 0 or kv_cache.shape[0] == 0:   # no row to read
        return out.zero_()
    if kv_cache.stride(-1) != 1:
        kv_cache = kv_cache.contiguous()
    # a copy of rows as stored: FP8 rows travel as their bytes (Triton has no FP8 constant for
    # the zeros of masked loads on the GPU)
    src, dst = (kv_cache.view(torch.uint8), out.view(torch.uint8)) if kv_cache.element_size() == 1 \
        else (kv_cache, out)
    # the kernel takes the table's row stride only, and reads starts and offsets at unit stride
    block_table, starts, cu_seqlens = block_table.contiguous(), starts.contiguous(), cu_seqlens.contiguous()
    on_gpu = kv_cache.device.type == "cuda"
    block_t = 32 if on_gpu else 8
    block_d = min(64 if on_gpu else 32, triton.next_power_of_2(d))
    _gather_kernel[(triton.cdiv(num_tokens, block_t),)](
        src, block_table, starts, cu_seqlens, dst, num_tokens, B, kv_cache.shape[1], kv_cache.shape[0],
        block_table.shape[1],
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0), out.stride(0),
        D=d, LOG_B=(B - 1).bit_length(), BLOCK_T=block_t, BLOCK_D=block_d,
        num_warps=4)
    return out
