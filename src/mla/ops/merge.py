"""``merge_attention`` on the "triton" backend: the two-part case of the split-KV decode's LSE
combine kernel (``decode.combine``), so one kernel merges partial attention everywhere.

For disjoint key sets a and b:  lse = logaddexp(lse_a, lse_b),
out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse). A part with lse = -inf weighs 0;
when both are empty, out = 0 and lse = -inf (never NaN). Arithmetic in float32.
"""
from __future__ import annotations

import torch

from .decode.combine import combine

__all__ = ["merge_attention"]


def merge_attention(out_a, lse_a, out_b, lse_b):
    """out_* [..., d], lse_* [...] float32 -> (out [..., d] in out_a's dtype, lse [...] float32).
    The parts go to the combine as its S = 2 slots of one "sequence" whose rows are all the
    query rows ([2, 1, 1, rows, d])."""
    d = out_a.shape[-1]
    parts = torch.stack((out_a.reshape(-1, d), out_b.reshape(-1, d)))      # [2, rows, d], a common dtype
    lses = torch.stack((lse_a.reshape(-1), lse_b.reshape(-1)))
    rows = parts.shape[1]
    out = torch.empty(1, 1, rows, d, dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty(1, 1, rows, dtype=torch.float32, device=out_a.device)
    if rows > 0 and d > 0:
        combine(parts.view(2, 1, 1, rows, d), lses.view(2, 1, 1, rows), out, lse, pdl=False)
    elif rows > 0:
        lse.copy_(torch.logaddexp(lses[0], lses[1]).view(1, 1, rows))
    return out.view(out_a.shape), lse.view(lse_a.shape)
