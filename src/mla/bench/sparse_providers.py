"""The providers of ``mla bench sparse``: the library's sparse ops and FlashMLA's, one signature.

A provider is a function ``make(case) -> Timed``; ``case`` is a dict of ``sparse_cases``.
``Timed.call(kv)`` is what is timed: the provider on the cache or kv ``kv`` (the case's, or a
rotated copy of it), returning its raw result; ``Timed.result(raw)`` turns that into
(out, lse) in mla's conventions (natural-log lse of out's shape minus its last dim, -inf for a
query with no index), outside the timed call. A provider that does not take a shape raises
``NotApplicable`` from ``make``, and its row reads "n/a: why".

FlashMLA (deepseek-ai/FlashMLA at 9241ae3, built on the GPU machine) is imported in one place,
``load_flash_mla``. What its sources say, and these providers follow:

- sparse decode, ``flash_mla_with_kvcache(..., indices=, is_fp8_kvcache=True)``: FP8 656-byte
  rows only, 64 or 128 heads, topk a multiple of 64; lse comes back [B, H, s_q] (a transposed
  view), natural log, +inf for a query with no index. The scheduling metadata is computed by
  the first call and reused by every later one, so ``make`` makes that call, outside any graph.
- sparse prefill, ``flash_mla_sparse_fwd``: bf16, 64 or 128 heads, topk a multiple of 128;
  returns (out, max_logits, lse) with lse in natural log (``log(sum) + max * ln 2`` in
  csrc/sm90/prefill/sparse/phase1.cuh) and +inf for a query with no valid index.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from .sparse_cases import R

__all__ = ["NotApplicable", "Timed", "load_flash_mla", "flashmla_refusal",
           "mla_decode_provider", "flashmla_decode_provider", "flashmla_fwd_decode_provider", "mla_prefill_provider",
           "flashmla_prefill_provider", "neg_inf_empty", "flash_mla_or_reason", "decode_providers", "prefill_providers"]


class NotApplicable(Exception):
    """The provider does not take this shape (a peer's documented limits): printed as n/a."""


class Timed(NamedTuple):
    """A provider on one shape: ``call(kv)`` is timed and returns the raw result; ``result(raw)``
    gives (out, lse) in mla's conventions; ``config`` names the kernel or path."""

    call: Callable[[torch.Tensor], Any]
    result: Callable[[Any], tuple[torch.Tensor, torch.Tensor]]
    config: str


def load_flash_mla():
    """FlashMLA's Python package (the one import of it in the benchmarks); ImportError where it
    is not built (it exists on the GPU machine only when built in the same call)."""
    import flash_mla

    return flash_mla


# FlashMLA's sparse kernels (9241ae3, csrc/api and the sm90 kernels' launch checks): the rows they
# read, the multiple topk must be (their top-k tile), the heads they are built for
FLASHMLA_KERNELS = {"decode": ("FlashMLA's sparse decode", "fp8_tile", 64),
                    "fwd": ("FlashMLA's sparse prefill kernel", "bf16", 128)}
ROWS = {"fp8_tile": "FP8 656-byte", "bf16": "bf16"}


def flashmla_refusal(kernel: str, H: int, topk: int, kv_format: str) -> str | None:
    """Why FlashMLA's ``kernel`` ("decode" or "fwd") does not take a shape, or None when it does."""
    name, rows, multiple = FLASHMLA_KERNELS[kernel]
    if kv_format != rows:
        return f"{name} reads {ROWS[rows]} rows only"
    if H not in (64, 128):
        return f"{name} takes 64 or 128 heads, not {H}"
    if topk % multiple:
        return f"{name} takes topk a multiple of {multiple}, not {topk}"
    return None


def neg_inf_empty(lse: torch.Tensor) -> torch.Tensor:
    """FlashMLA's lse in mla's convention: a query with no index has -inf (FlashMLA: +inf)."""
    return torch.where(lse == float("inf"), float("-inf"), lse.float())


def _as_pair(raw):
    return raw[0], raw[1]


def mla_decode_provider():
    """``mla.ops.sparse_mla_decode`` as the library dispatches it."""
    from mla.ops import sparse_mla_decode

    def make(c):
        def call(kv):
            return sparse_mla_decode(c["q"], kv, c["indices"], R, c["scale"], kv_scale=1.0, backend=None)
        return Timed(call, _as_pair, "dispatch")
    return make


def flashmla_decode_provider(fm):
    """FlashMLA's sparse decode on the FP8 656-byte cache, one scheduling metadata per shape."""
    def make(c):
        why = flashmla_refusal("decode", c["H"], c["topk"], c["kv_format"])
        if why:
            raise NotApplicable(why)
        meta, _ = fm.get_mla_metadata()

        def call(kv):
            return fm.flash_mla_with_kvcache(c["q"], kv.view(kv.shape[0], kv.shape[1], 1, kv.shape[2]), None, None,
                                             R, meta, None, softmax_scale=c["scale"], causal=False,
                                             is_fp8_kvcache=True, indices=c["indices"])

        def result(raw):
            return raw[0], neg_inf_empty(raw[1].transpose(1, 2))
        call(c["kv"])   # fills meta: it must be computed before any graph captures the call
        return Timed(call, result, "sparse decode, fp8")
    return make


def flashmla_fwd_decode_provider(fm):
    """FlashMLA's sparse prefill kernel serving decode on a bf16 cache: the B * s_q query
    tokens as its queries, the cache's slots as its kv rows (what engines run for sparse
    decode over bf16 rows on Hopper, FlashMLA's decode kernel being FP8 only)."""
    def make(c):
        why = flashmla_refusal("fwd", c["H"], c["topk"], c["kv_format"])
        if why:
            raise NotApplicable(why)
        B, s_q, H = c["B"], c["s_q"], c["H"]
        q, idx = c["q"].view(B * s_q, H, -1), c["indices"].view(B * s_q, 1, -1)

        def call(kv):
            return fm.flash_mla_sparse_fwd(q, kv.view(-1, 1, kv.shape[-1]), idx, c["scale"], R)

        def result(raw):
            return raw[0].view(B, s_q, H, R), neg_inf_empty(raw[2]).view(B, s_q, H)
        return Timed(call, result, "sparse prefill kernel, bf16")
    return make


def mla_prefill_provider():
    """``mla.ops.sparse_prefill_attention`` as the library dispatches it."""
    from mla.ops import sparse_prefill_attention

    def make(c):
        def call(kv):
            return sparse_prefill_attention(c["q"], kv, c["indices"], c["scale"], R, backend=None)
        return Timed(call, _as_pair, "dispatch")
    return make


def flashmla_prefill_provider(fm):
    """FlashMLA's ``flash_mla_sparse_fwd``."""
    def make(c):
        why = flashmla_refusal("fwd", c["H"], c["topk"], "bf16")
        if why:
            raise NotApplicable(why)

        def call(kv):
            return fm.flash_mla_sparse_fwd(c["q"], kv, c["indices"], c["scale"], R)

        def result(raw):
            return raw[0], neg_inf_empty(raw[2])
        return Timed(call, result, "sparse prefill")
    return make


def _unavailable(why: str):
    def make(c):
        raise NotApplicable(why)
    return make


def flash_mla_or_reason(peers: bool):
    """FlashMLA's module; None when peers are not wanted; or why it is not importable (a str),
    which its rows then print as n/a."""
    if not peers:
        return None
    try:
        return load_flash_mla()
    except Exception as e:   # not built in this call, or built for another GPU: mla runs alone
        return f"flash_mla is not importable ({type(e).__name__}: {str(e)[:120]})"


def decode_providers(fm) -> dict:
    """name -> make for sparse decode: mla, and FlashMLA's two kernels when ``fm`` is its module."""
    out = {"mla.ops": mla_decode_provider()}
    if isinstance(fm, str):
        out["flashmla"] = _unavailable(fm)
    elif fm is not None:
        out.update({"flashmla": flashmla_decode_provider(fm), "flashmla-fwd": flashmla_fwd_decode_provider(fm)})
    return out


def prefill_providers(fm) -> dict:
    """name -> make for sparse prefill: mla, and FlashMLA's when ``fm`` is its module."""
    out = {"mla.ops": mla_prefill_provider()}
    if isinstance(fm, str):
        out["flashmla"] = _unavailable(fm)
    elif fm is not None:
        out["flashmla"] = flashmla_prefill_provider(fm)
    return out
