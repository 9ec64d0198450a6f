"""``mla bench sparse``: sparse MLA decode, sparse prefill and the lightning indexer, beside FlashMLA.

    mla bench sparse [--section decode prefill indexer step] [--quick] [--heads 16 64 128] [--batch 32 128]
                     [--s-q 1 2] [--topk 2048] [--context 32768] [--page 64] [--kv bf16 fp8_tile]
                     [--prefill-heads 64 128] [--prefill-queries 4096] [--prefill-kv 32768]
                     [--index-heads 64] [--index-dim 128] [--index-keys bf16 fp8_ue8m0] [--no-peers] [--csv F]

DeepSeek-V3.2 dimensions: rows of r + dr = 512 + 64 values, the value the first 512, scale
1/sqrt(192). ``--quick`` shrinks the defaults it is not given (topk 512 of 4096, B 4). Inputs:
``mla.bench.sparse_cases`` (distinct random positions per query through a shuffled block
table, a few -1 at the tail of every 7th query, NaN in every row no index names).

1. decode: ``mla.ops.sparse_mla_decode`` on bf16 rows [blocks, page, 576] and FlashMLA's FP8
   rows (uint8 [blocks, page, 656], ``mla.quant``; ``--kv fp8``: per-tensor e4m3 rows), against
   FlashMLA's sparse decode (FP8 tile rows, 64 or 128 heads) and, on bf16 rows, FlashMLA's
   sparse prefill kernel over the cache's slots.
   One CUDA graph over copies of the cache rotated past the L2 (``graph_time_us``);
       bytes = B * s_q * topk * row_bytes + B * s_q * H * (576 + 512) * 2   (rows read, q in, out)
       FLOPs = 2 * B * s_q * H * topk * (576 + 512)
2. prefill: ``mla.ops.sparse_prefill_attention`` against ``flash_mla_sparse_fwd``, eager with
   the L2 flushed (``eager_time_us``); FLOPs = 2 * s_q * H * topk * (576 + 512), bytes = every
   kv row once + the indices + q + out.
3. indexer: ``mla.ops.indexer_logits`` and ``mla.ops.topk_indices`` (top ``--topk`` of
   ``--context`` keys, one query per sequence, index keys in bf16 [blocks, page, dim] and in
   DeepSeek's FP8 rows [blocks, page, dim + 4], ``--index-keys``) apart and
   chained, and their sum as a fraction of the 128-head s_q 1 sparse decode at the same B
   (the issue's target: at most 25%).
4. step: a whole DeepSeek-V3.2 layer's decode step against the dense DeepSeek-V3 step at
   ``--context`` (``mla.bench.sparse_step``).

Every provider is checked against ``mla.ops.reference`` on the shape before it is timed
(``mla.bench.sparse_checks``: out within 5e-3 norm-wise (1e-2 on FP8 tile rows), lse within 1e-2, indexer logits
within 1e-5, top-k sets equal where scores are distinct; at most 512 queries a shape, sampled
evenly). A call that reads the device back (the reference indexer reads the lengths) cannot
be captured in a graph: it is timed eagerly, and its row's ``timing`` says so. A provider's
error is printed in its row and the run goes on; the exit status is 1 when one of mla's rows
failed its check or errored.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from dataclasses import dataclass

import torch

from .. import quant
from . import report
from . import sparse_cases as cases
from . import sparse_checks as checks
from . import sparse_providers as prov
from .decode import positive_int, row_bytes
from .roofline import COPY_BYTES_PER_S, GEMM_FLOPS_PER_S, fraction
from .timing import eager_time_us, graph_time_us, rotated_copies

__all__ = ["add_args", "validate", "run", "Grid", "grid", "sparse_decode_bytes", "sparse_decode_flops",
           "sparse_prefill_bytes", "sparse_prefill_flops", "indexer_bytes", "indexer_flops", "time_calls",
           "indexer_budget"]

SECTIONS = ("decode", "prefill", "indexer", "step")
INDEX_KEYS = ("bf16", "fp8_ue8m0")   # the indexer's key rows (mla.quant)
KV_FORMATS = ("bf16", "fp8", "fp8_tile")
INDEXER_TARGET = 0.25      # the goal: indexer + top-k at most this fraction of the sparse decode
FULL = dict(heads=(16, 64, 128), batch=(32, 128), s_q=(1, 2), topk=2048, context=32768,
            prefill_heads=(64, 128), prefill_queries=4096, prefill_kv=32768)
QUICK = dict(heads=(16, 128), batch=(4,), s_q=(1, 2), topk=512, context=4096,
             prefill_heads=(128,), prefill_queries=512, prefill_kv=4096)


# ------------------------------------------------------------------ what is counted

def sparse_decode_bytes(H, B, s_q, topk, kv_format="bf16") -> int:
    """Each query token's topk rows once, the queries in and the outputs out."""
    return B * s_q * topk * row_bytes(kv_format) + B * s_q * H * (cases.D + cases.R) * 2


def sparse_decode_flops(H, B, s_q, topk) -> int:
    """QK^T over 576 and PV over 512 for every (query row, selected key) pair."""
    return 2 * B * s_q * H * topk * (cases.D + cases.R)


def sparse_prefill_bytes(H, s_q, s_kv, topk) -> int:
    """Every kv row once (queries share rows through the L2), the int32 indices, q in, out."""
    return s_kv * 2 * cases.D + s_q * topk * 4 + s_q * H * (cases.D + cases.R) * 2


def sparse_prefill_flops(H, s_q, topk) -> int:
    return 2 * s_q * H * topk * (cases.D + cases.R)


def indexer_bytes(step, B, K, n_heads, head_dim, topk, keys: str = "bf16") -> int:
    """One query per sequence. "logits": the keys (bf16, or DeepSeek's FP8 rows of
    ``quant.index_width`` bytes), bf16 q and float32 weights in, float32 logits out; "topk":
    logits in, int32 slots out; "both": what a fused pair needs (no logits)."""
    key_bytes = head_dim * 2 if keys == "bf16" else quant.index_width(head_dim)
    inputs = B * K * key_bytes + B * n_heads * head_dim * 2 + B * n_heads * 4
    return {"logits": inputs + B * K * 4, "topk": B * K * 4 + B * topk * 4, "both": inputs + B * topk * 4}[step]


def indexer_flops(step, B, K, n_heads, head_dim) -> int:
    """q . k for every (query, head, key); the top-k computes no FLOPs worth counting."""
    return 0 if step == "topk" else 2 * B * n_heads * K * head_dim


def _metrics(us: float, nbytes: int, flops: int) -> dict:
    return dict(us=us, TBps=nbytes / us / 1e6, TFLOPs=flops / us / 1e6, roof=fraction(us, nbytes, flops))


# ------------------------------------------------------------------ options

@dataclass(frozen=True)
class Grid:
    """The resolved options: what ``run`` measures."""

    sections: tuple
    heads: tuple
    batch: tuple
    s_q: tuple
    topk: int
    context: int
    page: int
    kv: tuple
    prefill_heads: tuple
    prefill_queries: int
    prefill_kv: int
    index_heads: int
    index_dim: int
    index_keys: tuple
    peers: bool


def add_args(p: argparse.ArgumentParser) -> None:
    """The options; a shape option left out takes ``--quick``'s value or the full default."""
    many = dict(type=positive_int, nargs="+", default=None)
    one = dict(type=positive_int, default=None)
    p.add_argument("--section", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="what to run (default all)")
    p.add_argument("--quick", action="store_true", help="small shapes: topk 512 of 4096, B 4, 512 prefill queries")
    p.add_argument("--heads", **many, help="decode heads (default 16 64 128)")
    p.add_argument("--batch", **many, help="decode and indexer batch (default 32 128)")
    p.add_argument("--s-q", **many, help="decode query tokens per sequence (default 1 2)")
    p.add_argument("--topk", **one, help="indices per query (default 2048)")
    p.add_argument("--context", **one, help="tokens per sequence, decode and indexer (default 32768)")
    p.add_argument("--page", type=positive_int, default=64, help="block size of the paged caches")
    p.add_argument("--kv", nargs="+", choices=KV_FORMATS, default=["bf16", "fp8_tile"],
                   help="decode cache rows: bf16 (1152 B), per-tensor FP8 (576 B), FlashMLA's FP8 rows (656 B)")
    p.add_argument("--prefill-heads", **many, help="prefill heads (default 64 128)")
    p.add_argument("--prefill-queries", **one, help="prefill query tokens (default 4096)")
    p.add_argument("--prefill-kv", **one, help="prefill kv rows (default 32768)")
    p.add_argument("--index-heads", type=positive_int, default=64, help="index_n_heads")
    p.add_argument("--index-dim", type=positive_int, default=128, help="index_head_dim")
    p.add_argument("--index-keys", nargs="+", choices=INDEX_KEYS, default=list(INDEX_KEYS),
                   help="indexer keys: bf16 (as transformers) and DeepSeek's FP8 rows (132 B at dim 128)")
    p.add_argument("--no-peers", action="store_true", help="time only mla (FlashMLA is not imported)")
    p.add_argument("--csv", default=None, help="every row to this CSV file (written after each shape)")


def grid(args) -> Grid:
    """The options with the defaults of ``--quick`` or of the full run filled in."""
    base = QUICK if args.quick else FULL

    def pick(name):
        v = getattr(args, name)
        return base[name] if v is None else (tuple(v) if isinstance(v, list) else v)
    return Grid(sections=tuple(dict.fromkeys(args.section)), heads=pick("heads"), batch=pick("batch"), s_q=pick("s_q"),
                topk=pick("topk"), context=pick("context"), page=args.page, kv=tuple(dict.fromkeys(args.kv)),
                prefill_heads=pick("prefill_heads"), prefill_queries=pick("prefill_queries"),
                prefill_kv=pick("prefill_kv"), index_heads=args.index_heads, index_dim=args.index_dim,
                index_keys=tuple(dict.fromkeys(args.index_keys)), peers=not args.no_peers)


def validate(args) -> None:
    """Every check that needs no GPU: ValueError naming the bad option."""
    g = grid(args)
    if g.topk > g.context and {"decode", "indexer"} & set(g.sections):
        raise ValueError(f"--topk: expected at most --context ({g.context}) distinct positions, got {g.topk}")
    if g.topk > g.prefill_kv and "prefill" in g.sections:
        raise ValueError(f"--topk: expected at most --prefill-kv ({g.prefill_kv}) distinct rows, got {g.topk}")


# ------------------------------------------------------------------ timing one provider

def makes_no_host_sync(fn) -> bool:
    """Whether one call of fn runs without reading the device back, which a CUDA graph cannot
    capture: torch's sync debug mode turns such a read into an error."""
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return True
    except RuntimeError as e:   # "called a synchronizing CUDA operation"
        if "synchronizing" not in str(e):
            raise
        return False
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def time_calls(calls, graph: bool = True) -> tuple[float, str]:
    """Microseconds per call and how: one CUDA graph over the calls (each on its own copy of the
    inputs, ``graph_time_us``) when asked and the call can be captured, else eager calls of
    the first with the L2 flushed (``eager_time_us``)."""
    if graph and makes_no_host_sync(calls[0]):
        try:
            return graph_time_us(calls), "graph"
        except Exception:
            # a capture that fails inside leaves its side stream current: the next provider runs on the default
            torch.cuda.set_stream(torch.cuda.default_stream())
            raise
    return eager_time_us(calls[0]), "eager"


def measure(row: dict, make, c: dict, ref: tuple, sub: slice, copies: list, nbytes: int, flops: int,
            graph: bool) -> dict:
    """One provider on the case c: its result on ``copies[0]`` checked against ``ref`` (the
    reference's (out, lse) of the queries ``sub``), then timed over ``copies``."""
    try:
        t = make(c)
    except prov.NotApplicable as e:
        return dict(row, check="n/a", note=f"n/a: {e}")
    except Exception as e:   # one provider failing a shape: its row says why, the others go on
        return dict(row, check="error", error=report.error_text(e))
    row["config"] = t.config
    try:
        out, lse = t.result(t.call(copies[0]))
        tol = checks.FP8_OUT_TOL if c.get("kv_format") == "fp8_tile" else checks.OUT_TOL
        row.update(checks.compare(out[sub], lse[sub], *ref, out_tol=tol))
        del out, lse
        us, how = time_calls([lambda kv=kv: t.call(kv) for kv in copies], graph)
        row.update(_metrics(us, nbytes, flops), timing=how)
    except Exception as e:
        row.setdefault("check", "error")
        row["error"] = report.error_text(e)
    return row


def add_peer_ratio(rows: list[dict]) -> None:
    """``mla/flashmla`` on the mla row of one shape: its time over the FlashMLA row's there."""
    peer = next((r["us"] for r in rows if r["provider"].startswith("flashmla") and "us" in r), None)
    for r in rows:
        if r["provider"] == "mla.ops" and "us" in r and peer:
            r["mla/flashmla"] = r["us"] / peer


# ------------------------------------------------------------------ the sections

DECODE_COLS = [("H", 4, "d"), ("B", 4, "d"), ("s_q", 3, "d"), ("kv", 8, ""), ("provider", 12, "<"),
               ("check", 5, "<"), ("rel_err", 8, ".1e"), ("lse_err", 8, ".1e"), ("us", 9, ".1f"), ("TBps", 6, ".2f"),
               ("TFLOPs", 6, ".0f"), ("roof", 5, ".0%"), ("mla/flashmla", 12, ".2f"), ("timing", 6, "")]
PREFILL_COLS = [("H", 4, "d"), ("s_q", 6, "d"), ("s_kv", 6, "d"), ("provider", 12, "<"), ("check", 5, "<"),
                ("rel_err", 8, ".1e"), ("lse_err", 8, ".1e"), ("us", 9, ".0f"), ("TFLOPs", 6, ".0f"),
                ("roof", 5, ".0%"), ("mla/flashmla", 12, ".2f"), ("timing", 6, "")]
INDEXER_COLS = [("B", 4, "d"), ("K", 6, "d"), ("keys", 9, "<"), ("step", 7, "<"), ("check", 5, "<"), ("detail", 16, "<"),
                ("us", 9, ".1f"), ("TBps", 6, ".2f"), ("TFLOPs", 6, ".0f"), ("roof", 5, ".0%"), ("timing", 6, "")]


def decode_shape(cache: dict, copies: list, H: int, s_q: int, provs: dict) -> list[dict]:
    """Every provider's row on one decode shape over ``cache`` (``sparse_cases.decode_cache``)."""
    from mla.ops import reference

    c = cases.decode_case(cache, H, s_q)
    B, topk, fmt = c["B"], c["topk"], c["kv_format"]
    sub = slice(None, None, checks.check_stride(B * s_q))
    ref = reference.sparse_mla_decode(c["q"][sub], c["kv"], c["indices"][sub], cases.R, c["scale"])
    base = dict(section="decode", H=H, B=B, s_q=s_q, topk=topk, context=c["context"], kv=fmt, page=c["page"])
    nbytes, flops = sparse_decode_bytes(H, B, s_q, topk, fmt), sparse_decode_flops(H, B, s_q, topk)
    shape = [measure(dict(base, provider=name), make, c, ref, sub, copies, nbytes, flops, True)
             for name, make in provs.items()]
    add_peer_ratio(shape)
    return shape


def run_decode(g: Grid, fm, rows: list, csv: str | None) -> None:
    """The decode grid: one cache per (format, B), shared by its head and query counts."""
    print(f"\n## sparse decode: top-{g.topk} of {g.context} tokens per query, page {g.page} "
          f"(roofline {COPY_BYTES_PER_S / 1e12:.2f} TB/s, {GEMM_FLOPS_PER_S / 1e12:.0f} TFLOP/s)")
    print(report.fixed_header(DECODE_COLS), flush=True)
    provs = prov.decode_providers(fm)
    for kv_format in g.kv:
        for B in g.batch:
            try:
                cache = cases.decode_cache(B, g.context, g.page, max(g.s_q), g.topk, kv_format)
                copies = rotated_copies(cache["kv"])
            except Exception as e:   # e.g. out of memory: the other shapes go on
                report.emit([dict(section="decode", B=B, kv=kv_format, provider="inputs", error=report.error_text(e))], rows,
                      DECODE_COLS, "check", csv)
                continue
            for H in g.heads:
                for s_q in g.s_q:
                    try:
                        shape = decode_shape(cache, copies, H, s_q, provs)
                    except Exception as e:   # the reference itself failed on this shape
                        shape = [dict(section="decode", H=H, B=B, s_q=s_q, kv=kv_format, provider="reference",
                                      error=report.error_text(e))]
                    report.emit(shape, rows, DECODE_COLS, "check", csv)
            del cache, copies
            torch.cuda.empty_cache()


def prefill_shape(g: Grid, H: int, provs: dict) -> list[dict]:
    from mla.ops import reference

    c = cases.prefill_case(H, g.prefill_queries, g.prefill_kv, g.topk)
    sub = slice(None, None, checks.check_stride(g.prefill_queries))
    ref = reference.sparse_prefill_attention(c["q"][sub], c["kv"], c["indices"][sub], c["scale"], cases.R)
    base = dict(section="prefill", H=H, s_q=g.prefill_queries, s_kv=g.prefill_kv, topk=g.topk)
    nbytes = sparse_prefill_bytes(H, g.prefill_queries, g.prefill_kv, g.topk)
    flops = sparse_prefill_flops(H, g.prefill_queries, g.topk)
    shape = [measure(dict(base, provider=name), make, c, ref, sub, [c["kv"]], nbytes, flops, False)
             for name, make in provs.items()]
    add_peer_ratio(shape)
    return shape


def run_prefill(g: Grid, fm, rows: list, csv: str | None) -> None:
    print(f"\n## sparse prefill: {g.prefill_queries} queries, top-{g.topk} of {g.prefill_kv} kv rows, bf16")
    print(report.fixed_header(PREFILL_COLS), flush=True)
    provs = prov.prefill_providers(fm)
    for H in g.prefill_heads:
        try:
            shape = prefill_shape(g, H, provs)
        except Exception as e:
            shape = [dict(section="prefill", H=H, s_q=g.prefill_queries, s_kv=g.prefill_kv, provider="reference",
                          error=report.error_text(e))]
        report.emit(shape, rows, PREFILL_COLS, "check", csv)
        torch.cuda.empty_cache()


def indexer_shape(g: Grid, B: int, keys_fmt: str = "bf16") -> list[dict]:
    """indexer_logits, topk_indices (on the reference's logits) and the two chained at one B,
    each checked (the chain by its parts), then timed. keys_fmt "fp8"/"fp8_ue8m0": the keys
    stored and the queries quantized as the layer does for an FP8 ``index_format``."""
    from mla.ops import indexer_logits, reference, topk_indices

    c = cases.indexer_case(B, g.context, g.index_heads, g.index_dim, g.page)
    if keys_fmt != "bf16":
        n, page = c["keys"].shape[:2]
        c["keys"] = quant.quantize_index(quant.rotate(c["keys"].view(n * page, -1)), keys_fmt).view(n, page, -1)
        c["q"] = quant.fake_quant(quant.rotate(c["q"]), keys_fmt).to(c["q"].dtype)

    def logits_of(keys):
        return indexer_logits(c["q"], c["weights"], keys, c["table"], c["seqlens"], c["cu_seqlens_q"], g.context,
                              c["scale"])

    def top_of(logits):
        return topk_indices(logits, g.topk, c["table"], c["cu_seqlens_q"], g.page)

    ref = reference.indexer_logits(c["q"], c["weights"], c["keys"], c["table"], c["seqlens"], c["cu_seqlens_q"],
                                   g.context, c["scale"])
    ref_top = reference.topk_indices(ref, g.topk, c["table"], c["cu_seqlens_q"], g.page)
    found = {"both": dict(check="parts")}
    for step, check in (("logits", lambda: checks.compare_logits(logits_of(c["keys"]), ref)),
                        ("topk", lambda: checks.compare_topk(top_of(ref), ref_top, ref, checks.slot_keys(
                            c["table"], g.page, g.context, c["keys"].shape[0] * g.page)))):
        try:
            found[step] = check()
        except Exception as e:
            found[step] = dict(check="error", error=report.error_text(e))
    keys, logits = rotated_copies(c["keys"]), rotated_copies(ref)
    calls = {"logits": [lambda k=k: logits_of(k) for k in keys], "topk": [lambda x=x: top_of(x) for x in logits],
             "both": [lambda k=k: top_of(logits_of(k)) for k in keys]}
    shape = []
    for step, fns in calls.items():
        row = dict(section="indexer", B=B, K=g.context, n_heads=g.index_heads, head_dim=g.index_dim, topk=g.topk,
                   keys=keys_fmt, step=step, provider="mla.ops", **found[step])
        try:
            us, how = time_calls(fns)
            row.update(_metrics(us, indexer_bytes(step, B, g.context, g.index_heads, g.index_dim, g.topk, keys_fmt),
                                indexer_flops(step, B, g.context, g.index_heads, g.index_dim)), timing=how)
        except Exception as e:
            row["error"] = report.error_text(e)
        shape.append(row)
    return shape


def run_indexer(g: Grid, fm, rows: list, csv: str | None) -> None:
    print(f"\n## indexer: {g.index_heads} heads x {g.index_dim}, top-{g.topk} of {g.context}, "
          f"one query per sequence")
    print(report.fixed_header(INDEXER_COLS), flush=True)
    for keys_fmt in g.index_keys:
        for B in g.batch:
            try:
                shape = indexer_shape(g, B, keys_fmt)
            except Exception as e:
                shape = [dict(section="indexer", B=B, K=g.context, keys=keys_fmt, step="inputs", provider="mla.ops",
                              error=report.error_text(e))]
            report.emit(shape, rows, INDEXER_COLS, "check", csv)
            torch.cuda.empty_cache()
    budget = indexer_budget(rows, g.batch, g.index_keys)
    print("\n".join(b["text"] for b in budget), flush=True)
    rows += budget


def indexer_budget(rows: list[dict], batches, index_keys=("bf16",)) -> list[dict]:
    """At each B and key format: indexer_logits + topk_indices (timed apart) over the 128-head
    s_q 1 sparse decode of each cache format, mla's and FlashMLA's where timed (the issue's
    target: <= 25%)."""
    out = []
    for keys_fmt, B in ((k, B) for k in index_keys for B in batches):
        us = {r["step"]: r.get("us") for r in rows if r.get("section") == "indexer" and r["B"] == B
              and r.get("keys", "bf16") == keys_fmt}
        if us.get("logits") is None or us.get("topk") is None:
            out.append(dict(section="indexer_budget", B=B, keys=keys_fmt,
                            text=f"indexer budget, {keys_fmt} keys, B {B}: not timed"))
            continue
        total = us["logits"] + us["topk"]
        dec = [r for r in rows if r.get("section") == "decode" and (r.get("H"), r["B"], r.get("s_q")) == (128, B, 1)
               and "us" in r]
        parts = ", ".join(f"{total / r['us']:.0%} of {r['provider']} {r['kv']} ({r['us']:.1f} us)" for r in dec)
        text = (f"indexer budget, {keys_fmt} keys, B {B}: logits {us['logits']:.1f} + topk {us['topk']:.1f} = {total:.1f} us = "
                f"{parts or 'n/a (no 128-head s_q 1 sparse decode timed at this B)'}; "
                f"target <= {INDEXER_TARGET:.0%} of the decode")
        out.append(dict(section="indexer_budget", B=B, keys=keys_fmt, us=total, text=text,
                        **{f"of_{r['provider']}_{r['kv']}": total / r["us"] for r in dec}))
    return out


def run_step(g: Grid, fm, rows: list, csv: str | None) -> None:
    from .sparse_step import run_step as run

    run(g, fm, rows, csv)


RUNS = {"decode": run_decode, "prefill": run_prefill, "indexer": run_indexer, "step": run_step}


def run(args) -> int:
    """The sections asked for (``validate`` first), each printing its rows as they come."""
    g = grid(args)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}")
    fm = prov.flash_mla_or_reason(g.peers)
    if isinstance(fm, str):
        print(f"# FlashMLA: {fm}")
    rows: list[dict] = []
    failed = 0
    for name in g.sections:
        try:
            RUNS[name](g, fm, rows, args.csv)
        except Exception:  # noqa: BLE001 - report what ran, then the failure
            traceback.print_exc()
            failed = 1
    if args.csv:
        report.write_csv(rows, args.csv)
    ours = [r for r in rows if r.get("provider") in ("mla.ops", "reference", "inputs")]
    bad = [r for r in ours if r.get("check") not in ("ok", "parts") or "error" in r]
    if bad:
        print(f"\n{len(bad)} of mla's {len(ours)} rows failed a check or errored", file=sys.stderr)
    return 1 if failed or bad else 0
