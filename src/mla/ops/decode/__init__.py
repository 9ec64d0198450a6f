"""Absorbed MLA decode over a paged latent cache: the one dispatch that chooses the kernel.

Kernels (each a ``launch`` with ``mla.ops.reference.mla_decode``'s contract):

    portable       ``portable``: Triton, any GPU and CPU (interpreter), any shapes and formats
    seesaw         ``gluon.seesaw``: Hopper, query rows on the MMAs' M (many query rows)
    narrow         ``gluon.narrow``: Hopper, keys on M, for at most 16 query rows from batch 2
    fp8            ``gluon.fp8``: Hopper, e4m3 MMAs over FP8 rows, at most 32 query rows

All of them split each sequence's keys over several programs by the split plan
(``split_plan``) and merge the partials with ``combine``; ``choose_kernel`` holds the rule.
"""
from __future__ import annotations

import torch

from . import portable
from .gluon import common, fp8, narrow, seesaw

__all__ = ["mla_decode", "choose_kernel", "use_gluon", "use_narrow", "KERNELS", "CACHE_FORMATS", "FP8_PORTABLE_KEYS"]

KERNELS = ("portable", "seesaw", "narrow", "fp8")
# the cache rows mla_decode reads (mla.quant.cache_format): all of them
CACHE_FORMATS = ("plain", "fp8", "fp8_tile")

# FP8 rows with at most 16 query rows: batches whose keys (B x the table's capacity) are at most
# this many go to the portable kernel, whose fixed cost is lower
FP8_PORTABLE_KEYS = 8192


def mla_decode(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal=True, kv_scale=1.0, *,
               pdl: bool = True):
    """Absorbed MLA attention over a paged latent cache (see ``mla.ops.reference.mla_decode``).

    q [B, s_q, H, d]; kv_cache [num_blocks, block_size, d] in q's dtype, or FP8 rows read as they
    are (float8_e4m3fn with kv_scale, or the uint8 tile layout of ``mla.quant``: the kernel
    dequantizes each tile in registers, no dequantized copy); block_table [B, max_blocks] int32;
    cache_seqlens [B] int32 (including the s_q new tokens). Returns out [B, s_q, H, head_dim_v]
    in q's dtype and lse [B, s_q, H] float32. No host synchronisation: the split count comes
    from ``block_table.shape[1] * block_size``, the longest length the table can hold.
    pdl: launch the Hopper kernels and the combine as programmatic dependents (Hopper and later:
    their programs are placed as the kernel before them drains); False keeps plain stream order.
    """
    max_len = block_table.shape[1] * kv_cache.shape[1]
    if kv_cache.shape[0] == 0:
        # an empty pool holds no keys: every row is empty (a length past 0 is the caller's error,
        # and no kernel may read a row of a tensor that has none)
        B, s_q, H, _ = q.shape
        return (q.new_zeros(B, s_q, H, head_dim_v),
                torch.full((B, s_q, H), float("-inf"), dtype=torch.float32, device=q.device))
    kernel = choose_kernel(q, kv_cache, head_dim_v, max_len)
    if kernel == "portable":
        return portable.launch(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal,
                               portable.default_config(q, max_len), kv_scale, pdl=pdl)
    launch = {"seesaw": seesaw.launch, "narrow": narrow.launch, "fp8": fp8.launch}[kernel]
    return launch(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, kv_scale=kv_scale, pdl=pdl)



def choose_kernel(q, kv_cache, head_dim_v, max_len: int) -> str:
    """The one dispatch rule of ``mla_decode``: one of ``KERNELS``, from shapes and dtypes only
    (max_len: the block table's capacity, no host sync).

    FP8 rows (per-tensor scale, or tile rows) with at most 32 query rows go to the e4m3 kernel
    at any batch, except batches of at most ``FP8_PORTABLE_KEYS`` keys with at most 16 rows.
    On the H200 at 16 heads: per-tensor rows at batches 1-16 x 1k-16k take 0.39-0.94x the
    seesaw's time on the e4m3 kernel, and 0.67-0.85x the e4m3 kernel's on the portable kernel
    up to 8192 keys (1.01-1.06x at 16k keys); tile rows at B 32/128 x 4k/16k 0.42-0.56x the
    widening narrow kernel's time; 32 rows (s_q 2) at B 1-128 x 4k/16k 0.51-0.95x the seesaw's,
    measured at 9f0aff3, whose seesaw widened FP8 rows in its warpgroups: the producer
    warpgroup it has now takes 0.72-0.80x that time at 128 heads, and is not measured against
    the e4m3 kernel at 16-32 rows.
    The rest: ``use_gluon``, then ``use_narrow``."""
    if not use_gluon(q, kv_cache, head_dim_v):
        return "portable"
    rows = q.shape[1] * q.shape[2]
    if kv_cache.dtype in (torch.float8_e4m3fn, torch.uint8) and rows <= 32:
        return "portable" if rows <= 16 and q.shape[0] * max_len <= FP8_PORTABLE_KEYS else "fp8"
    return "narrow" if use_narrow(q, kv_cache) else "seesaw"


def use_gluon(q, kv_cache, head_dim_v) -> bool:
    """Between the portable kernel and the Hopper kernels (wgmma + TMA): a Hopper kernel
    whenever it takes the inputs (bf16/fp16 queries, dv 512, rows of 576 in q's dtype or FP8, or
    FP8 tile rows: ``common.supports``), but see ``choose_kernel`` for small FP8 batches. For
    plain rows on an H200 (18 shapes, 16 and 128 heads) the Hopper kernels are 1.2-2.0x faster
    than the portable one except at batch 1 with 4k tokens (1.03-1.17x slower) and at 16 heads
    batch 32 (within 1%)."""
    if q.device.type != "cuda" or head_dim_v != 512:
        return False
    return common.supports(q, kv_cache)


def use_narrow(q, kv_cache) -> bool:
    """Between the Hopper kernels (given ``use_gluon``): a keys-on-M kernel for at most 16 query
    rows (H * s_q) and a batch of 2 or more, the query-rows-on-M kernel otherwise. On the H200
    at 16 heads, bf16 rows, the keys-on-M kernel takes 0.85-0.98x the other's time at batches
    2-24 x 1k-16k and 0.83-0.99x at batch 32 and 128, more at batch 1; with 32 rows (s_q 2)
    1.11-1.72x at batches 1-128. FP8 rows with at most 32 query rows do not reach this rule:
    ``choose_kernel`` sends them to ``gluon.fp8`` (e4m3 MMAs for S, no widening)."""
    return q.shape[1] * q.shape[2] <= 16 and q.shape[0] >= 2
