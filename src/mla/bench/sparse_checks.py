"""The checks ``mla bench sparse`` makes before it times a provider (no GPU needed).

Every provider's result is compared with ``mla.ops.reference`` (float32) on the same inputs:

- attention (sparse decode and prefill): out's norm-wise relative error at most ``OUT_TOL``
  (bf16 output rounding is about 1e-3 of it; for FP8 rows the reference reads the same FP8
  rows), lse within ``LSE_TOL`` of the reference's and -inf exactly where it has -inf;
- indexer logits: -inf at the same places, the rest within ``LOGITS_TOL`` (float32 sums of
  products of bf16 values: only the order of the sums may differ);
- top-k: valid, distinct slots of the query's own sequence whose scores, sorted, are the
  reference's: the selection is the reference's wherever scores are distinct.

The reference holds [queries, topk, 576] float32, so it checks at most ``CHECK_QUERIES``
queries per shape, sampled evenly (``check_stride``).
"""
from __future__ import annotations

import math

import torch

from .decode_providers import rel_err
from .sparse_cases import slots

__all__ = ["OUT_TOL", "FP8_OUT_TOL", "LSE_TOL", "LOGITS_TOL", "CHECK_QUERIES", "check_stride", "compare", "compare_logits",
           "compare_topk", "slot_keys"]

OUT_TOL, LSE_TOL, LOGITS_TOL = 5e-3, 1e-2, 1e-5
# FP8 tile rows: FlashMLA rounds each tile's float32 scale to bf16 (2^-9 relative) before it
# multiplies, which alone puts its output 5.0-5.1e-3 from the reference on the H200
FP8_OUT_TOL = 1e-2
CHECK_QUERIES = 512


def check_stride(n: int) -> int:
    """Every how-many-th of n queries (or sequences) the reference checks: at most CHECK_QUERIES."""
    return max(1, math.ceil(n / CHECK_QUERIES))


def compare(out, lse, ref_out, ref_lse, out_tol: float = OUT_TOL) -> dict:
    """A provider's (out, lse) against the reference's: ``rel_err`` (norm-wise, NaN when out
    holds inf or NaN), ``lse_err`` (max abs over the finite reference values; NaN when the -inf
    positions differ) and ``check``: "ok" within out_tol and LSE_TOL, else "FAIL" (saying so
    when the lse matches once read as base 2, the other convention of attention kernels)."""
    err = rel_err(out, ref_out)
    ref_lse = ref_lse.float()
    fin = torch.isfinite(ref_lse)

    def lse_error(x):
        if not torch.equal(torch.isneginf(x), torch.isneginf(ref_lse)) or not torch.isfinite(x[fin]).all():
            return float("nan")
        return (x[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    lse_err = lse_error(lse.float())
    check = "ok" if err <= out_tol and lse_err <= LSE_TOL else "FAIL"
    if check == "FAIL" and not lse_err <= LSE_TOL and lse_error(lse.float() * math.log(2)) <= LSE_TOL:
        check = "FAIL: lse in base 2"
    return dict(rel_err=err, lse_err=lse_err, check=check)


def compare_logits(logits, ref) -> dict:
    """Indexer logits [Tq, K] against the reference's: -inf at the same places, the norm-wise
    relative error of the others at most LOGITS_TOL."""
    hidden = torch.isneginf(ref)
    err = float("nan")
    if torch.equal(torch.isneginf(logits), hidden):
        err = rel_err(logits.masked_fill(hidden, 0), ref.masked_fill(hidden, 0))
    return dict(check="ok" if err <= LOGITS_TOL else "FAIL", rel_err=err, detail=f"rel err {err:.1e}")


def slot_keys(block_table, page: int, K: int, num_slots: int) -> torch.Tensor:
    """[num_slots] int64: b * K + s for the slot holding key s < K of sequence b (through
    block_table [B, blocks]), -1 for a slot of no sequence: a slot's flat index in logits [B, K]."""
    B = block_table.shape[0]
    pos = torch.arange(K, device=block_table.device).expand(B, K)
    out = torch.full((num_slots,), -1, dtype=torch.int64, device=block_table.device)
    key = torch.arange(B, device=block_table.device)[:, None] * K + pos
    out[slots(pos, block_table, page).flatten().long()] = key.flatten()
    return out


def compare_topk(top, ref_top, logits, keys_of_slots) -> dict:
    """``topk_indices``' slots [B, topk] (one query per sequence) against the reference's on the
    same logits [B, K]: every entry -1 or a slot of the query's own sequence, no slot twice, the
    selected scores, sorted, equal to the reference's. ``keys_of_slots``: ``slot_keys``.
    ``detail``: the share of queries whose sets are identical (below 100% only through ties)."""
    B, K = logits.shape
    in_range = bool(((top >= -1) & (top < keys_of_slots.numel())).all())
    key = keys_of_slots[top.clamp(0, keys_of_slots.numel() - 1).long()]
    own = (key >= 0) & (key // K == torch.arange(B, device=top.device)[:, None])
    picked = top.sort(dim=-1).values
    twice = bool(((picked[:, 1:] == picked[:, :-1]) & (picked[:, 1:] >= 0)).any())

    def scores(t):
        s = logits.reshape(-1)[keys_of_slots[t.clamp(0, keys_of_slots.numel() - 1).long()].clamp(min=0)]
        return torch.where(t >= 0, s, float("-inf")).sort(dim=-1, descending=True).values
    same_scores = in_range and torch.equal(scores(top), scores(ref_top))
    same_sets = (picked == ref_top.sort(dim=-1).values).all(-1).float().mean().item()
    ok = in_range and bool((own | (top < 0)).all()) and not twice and same_scores
    return dict(check="ok" if ok else "FAIL", detail=f"same sets {same_sets:.1%}")
