"""The providers of ``mla bench decode``: one signature for our kernels and the peers.

A provider is a function ``make(case) -> Timed``; ``case`` is a dict of ``decode_case``, and
``Timed.call(kv)`` runs the provider on the cache ``kv`` (the case's cache or a rotated copy
of it) and returns out [B, s_q, H, r]. Whatever a provider prepares once per shape (a
FlashInfer plan, FlashMLA's scheduling metadata, a mask) happens in ``make``, outside the timed
call, as a serving engine plans once per step. A provider that does not take a case (a peer's
documented limits) raises ``NotApplicable`` from ``make``; its row reads "n/a: why".
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, NamedTuple

import torch

from .sparse_providers import NotApplicable

__all__ = ["Timed", "NotApplicable", "GLUON_KERNELS", "decode_variant", "triton_provider", "gluon_provider",
           "op_provider", "flashinfer_provider", "flashmla_refusal", "flashmla_provider", "naive_provider", "rel_err"]

GLUON_KERNELS = ("gluon:seesaw", "gluon:narrow", "gluon:fp8reg")


class Timed(NamedTuple):
    """A provider's call on one shape: ``call(kv) -> out``; ``config`` describes its schedule;
    ``kernel`` names our kernel that runs (one of ``mla.ops.decode.KERNELS``), "" for a peer."""

    call: Callable[[torch.Tensor], torch.Tensor]
    config: str
    kernel: str = ""


def decode_variant(name: str, cfg):
    """A portable-kernel schedule derived from ``cfg`` (``mla.ops.decode.portable.DecodeConfig``).

    ``default``, or dash-separated changes: ``w8`` warps, ``n32`` keys per tile, ``m32`` query
    rows per program, ``s3`` pipeline stages, ``x2`` / ``h2`` splits times / divided by 2,
    ``g`` gather every row's page (no one-page tile), ``f`` the flattened plan (runs across
    sequences, ``split_plan.flat_plan``), ``p`` the persistent schedule (``split_plan.schedule``).
    Raises ValueError on an unknown part.
    """
    if name == "default":
        return cfg
    for part in name.split("-"):
        k, v = part[:1], part[1:]
        if k in "wnmsxh" and not v.isdigit() or k in "gfp" and v:
            raise ValueError(f"--variants: bad part {part!r} in {name!r}")
        if k == "w":
            cfg = replace(cfg, num_warps=int(v))
        elif k == "n":
            cfg = replace(cfg, block_n=int(v))
        elif k == "m":
            cfg = replace(cfg, block_m=min(cfg.block_m, int(v)))
        elif k == "s":
            cfg = replace(cfg, num_stages=int(v))
        elif k == "x":
            cfg = replace(cfg, num_splits=cfg.num_splits * int(v))
        elif k == "h":
            cfg = replace(cfg, num_splits=max(1, cfg.num_splits // int(v)))
        elif k == "g":
            cfg = replace(cfg, page_tile=False)
        elif k == "f":
            cfg = replace(cfg, flat=True, persistent=False)
        elif k == "p":
            cfg = replace(cfg, persistent=True, flat=False)
        else:
            raise ValueError(f"--variants: unknown part {part!r} in {name!r}")
    return cfg


def triton_provider(variant: str):
    """The portable Triton kernel with the schedule ``variant`` (``decode_variant``)."""
    from mla.ops.decode import portable

    def make(c):
        cfg = decode_variant(variant, portable.default_config(c["q"], c["table"].shape[1] * c["page"]))

        def call(kv):
            return portable.launch(c["q"], kv, c["table"], c["seqlens"], c["r"], c["scale"], True, cfg)[0]
        return Timed(call, str(cfg), "portable")
    return make


def gluon_provider(name: str):
    """One Hopper kernel by name, whatever the dispatch would pick: gluon:seesaw (query rows
    on M, ``mla.ops.decode.gluon.seesaw``), gluon:narrow (keys on M, ``gluon.narrow``) or
    gluon:fp8reg (FP8 rows, e4m3 MMAs for S, ``gluon.fp8``)."""
    from mla.ops.decode.gluon import fp8, narrow, seesaw

    launch = {"gluon:seesaw": seesaw.launch, "gluon:narrow": narrow.launch, "gluon:fp8reg": fp8.launch}[name]
    kernel = {"gluon:seesaw": "seesaw", "gluon:narrow": "narrow", "gluon:fp8reg": "fp8"}[name]

    def make(c):
        def call(kv):
            return launch(c["q"], kv, c["table"], c["seqlens"], c["r"], c["scale"], True)[0]
        return Timed(call, name, kernel)
    return make


def op_provider():
    """The public op ``mla.ops.mla_decode`` as the library dispatches it; ``Timed.kernel`` is the
    kernel ``mla.ops.decode.choose_kernel`` picks for the shape."""
    from mla.ops import mla_decode
    from mla.ops.decode import choose_kernel

    def make(c):
        kernel = choose_kernel(c["q"], c["kv"], c["r"], c["table"].shape[1] * c["page"])

        def call(kv):
            return mla_decode(c["q"], kv, c["table"], c["seqlens"], c["r"], c["scale"], True)[0]
        return Timed(call, "dispatch", kernel)
    return make


def flashinfer_provider():
    """FlashInfer's ``BatchMLAPagedAttentionWrapper`` (backend fa3), planned per case outside
    the timed call over the pages each sequence fills (``kv_indptr`` from the lengths, as an
    engine builds it); one 256 MiB workspace for every case. Raises ImportError without flashinfer."""
    import flashinfer  # the one place the decode benchmark imports FlashInfer

    ws = torch.empty(256 << 20, dtype=torch.int8, device="cuda")

    def make(c):
        if c["kv_format"] == "fp8_tile":   # its per-128 scales come with an FP8 rope part; ours is bf16
            raise NotApplicable("FlashInfer has no MLA cache with bf16 rope beside scaled e4m3 latents")
        if (c["r"], c["dr"]) != (512, 64):   # its MLA kernels are instantiated for DeepSeek's dims
            raise NotApplicable(f"the FlashInfer peer runs r 512, rope 64; got r {c['r']}, rope {c['dr']}")
        B, s_q, H, P, r = c["B"], c["s_q"], c["H"], c["table"].shape[1], c["r"]
        dev = c["q"].device
        pages = (c["seqlens"] + c["page"] - 1) // c["page"]
        used = torch.arange(P, device=dev)[None, :] < pages[:, None]
        w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend="fa3")
        w.plan(qo_indptr=torch.arange(B + 1, device=dev, dtype=torch.int32) * s_q,
               kv_indptr=torch.cat([pages.new_zeros(1), pages.cumsum(0).to(pages.dtype)]),
               kv_indices=c["table"][used].contiguous(), kv_len_arr=c["seqlens"], num_heads=H,
               head_dim_ckv=r, head_dim_kpe=c["dr"], page_size=c["page"], causal=s_q > 1, sm_scale=c["scale"],
               q_data_type=torch.bfloat16, kv_data_type=c["kv"].dtype)
        # FP8 rows (one e4m3 scale for all the row's values, 1.0 here): FlashInfer takes it per part
        scales = dict(ckv_scale=1.0, kpe_scale=1.0) if c["kv_format"] == "fp8" else {}
        q = c["q"].reshape(B * s_q, H, -1)
        out = torch.empty(B * s_q, H, r, dtype=torch.bfloat16, device=dev)

        def call(kv):
            w.run(q_nope=q[..., :r], q_pe=q[..., r:], ckv_cache=kv[..., :r], kpe_cache=kv[..., r:], out=out,
                  **scales)
            return out.view(B, s_q, H, r)
        return Timed(call, "fa3")
    return make


def flashmla_refusal(kv_format: str, r: int, dr: int, page: int) -> str | None:
    """Why FlashMLA's dense decode does not take a case, or None when it does. Its checks
    (9241ae3, csrc/api/dense_decode.h): the cache in q's dtype (no FP8 rows on Hopper), rows
    of 576 with values of 512, blocks of 64 rows."""
    if kv_format != "bf16":
        return "FlashMLA's dense decode reads bf16 rows only (the cache must be in q's dtype)"
    if (r, dr) != (512, 64):
        return f"FlashMLA's dense decode takes r 512, rope 64; got r {r}, rope {dr}"
    if page != 64:
        return f"FlashMLA's dense decode takes blocks of 64 rows, not {page}"
    return None


def flashmla_provider(fm):
    """FlashMLA's dense decode, ``fm.flash_mla_with_kvcache`` over the cache viewed [blocks, 64,
    1, 576]; ``fm`` its module (``sparse_providers.load_flash_mla``). Its scheduling metadata
    (a ``FlashMLASchedMeta`` from ``get_mla_metadata()``) is filled from the lengths by the
    first call on it: ``make`` makes that call, outside any graph, so the timed calls run the
    split kernel and its combine only, over the metadata of their case (same shapes, same
    lengths, as FlashMLA requires for reuse)."""
    def make(c):
        why = flashmla_refusal(c["kv_format"], c["r"], c["dr"], c["page"])
        if why:
            raise NotApplicable(why)
        meta, _ = fm.get_mla_metadata()

        def call(kv):
            return fm.flash_mla_with_kvcache(c["q"], kv.unsqueeze(2), c["table"], c["seqlens"], c["r"], meta, None,
                                             softmax_scale=c["scale"], causal=c["s_q"] > 1)[0]
        call(c["kv"])
        if not getattr(meta, "have_initialized", False):   # else the graph would capture the planning too
            raise RuntimeError("flash_mla: the first call left its FlashMLASchedMeta unfilled; this benchmark "
                               "follows FlashMLA 9241ae3's interface (metadata filled by the first call)")
        return Timed(call, "dense, bf16")
    return make


def naive_provider():
    """Plain PyTorch: gather the pages, bmm, softmax, bmm (FP8 caches dequantized whole first);
    every sequence L long, so it does not take a mixed-length case."""
    def make(c):
        B, s_q, H, L, r, d = c["B"], c["s_q"], c["H"], c["L"], c["r"], c["r"] + c["dr"]
        if c.get("keys", B * L) != B * L:
            raise NotApplicable("naive PyTorch masks every sequence at L: equal lengths only")
        q = c["q"].reshape(B, s_q * H, d)
        key = torch.arange(c["table"].shape[1] * c["page"], device=q.device)
        limit = L - s_q + 1 + torch.arange(s_q, device=q.device).repeat_interleave(H)
        bias = torch.where(key[None, :] < limit[:, None], 0.0, float("-inf")).to(torch.bfloat16)

        def call(kv):
            if c["kv_format"] != "bf16":
                from mla import quant
                kv = quant.dequantize_rows(kv.view(-1, kv.shape[-1]), c["kv_format"], r, torch.bfloat16).view(
                    kv.shape[0], kv.shape[1], d)
            k = kv[c["table"].long()].reshape(B, -1, d)
            s = torch.bmm(q, k.transpose(1, 2)) * c["scale"] + bias
            return torch.bmm(torch.softmax(s, -1), k[..., :r]).view(B, s_q, H, r)
        return Timed(call, "naive")
    return make


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float32; NaN when out holds any inf or NaN."""
    out = out.float()
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out - ref).norm() / ref.norm()).item()
