"""``mla bench decode``: absorbed MLA decode over a paged latent cache, our kernels beside the peers.

    mla bench decode [--heads 16 128] [--batch 1 32 128] [--kv-len 1024 4096 16384] [--s-q 1]
                     [--page 64] [--kv bf16] [--kv-lora 512] [--rope 64] [--variants default,...]
                     [--no-peers] [--csv F] [--json F] [--png F]

Shapes: latent r = ``--kv-lora`` (512) and rope dr = ``--rope`` (64), as in DeepSeek-V3; a row
is d = r + dr values, the value its first r; bf16 queries, scale 1/sqrt(128 + dr). What is
counted, for B sequences of L cached keys, s_q query tokens of H heads (``decode_bytes``,
``decode_flops``):

    bytes = B * L * row_bytes  +  B * s_q * H * (d + r) * 2     (each cache row read once; q in, out)
    FLOPs = 2 * B * s_q * H * L * (d + r)                       (QK^T over d, PV over r; causal s_q > 1
                                                                  counted as if every query saw every key)
    row_bytes: bf16 2 * d, fp8 d, fp8_tile r + 4 * r / 128 + 2 * dr (mla.quant)

against ``mla.bench.roofline``. Timing: ``mla.bench.timing.graph_time_us`` over rotated copies
of the cache. Providers (``decode_providers``): the public op as dispatched (its ``kernel``
column names the kernel ``mla.ops.decode.choose_kernel`` picks: any r or dr other than
DeepSeek's runs on the portable Triton kernel), the portable kernel by schedule, the Hopper
kernels by name, FlashInfer's fa3 MLA when importable, naive PyTorch. Each is checked against
``mla.ops.reference.mla_decode`` on every shape before it is timed.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from . import decode_providers as prov
from . import report
from .roofline import roofline_us
from .timing import graph_time_us, rotated_copies

__all__ = ["add_args", "validate", "run", "decode_case", "decode_bytes", "decode_flops", "decode_metrics",
           "decode_grid", "row_bytes", "positive_int"]

KV_FORMATS = ("bf16", "fp8", "fp8_tile")


def row_bytes(kv_format: str, r: int = 512, dr: int = 64) -> int:
    """Bytes of one cache row: 1152 (bf16), 576 (fp8), 656 (fp8_tile) for r 512, dr 64."""
    from mla import quant

    if kv_format == "bf16":
        return 2 * (r + dr)
    return quant.row_width(kv_format, r, dr)


def decode_bytes(H, B, L, s_q, kv_format="bf16", r=512, dr=64) -> int:
    """The fewest bytes a decode call moves: every cache row once, the queries in and out out."""
    return B * L * row_bytes(kv_format, r, dr) + B * s_q * H * (r + dr + r) * 2


def decode_flops(H, B, L, s_q, r=512, dr=64) -> int:
    """QK^T over r + dr and PV over r for every (query row, key) pair."""
    return 2 * B * s_q * H * L * (r + dr + r)


def decode_metrics(H, B, L, s_q, us, kv_format="bf16", r=512, dr=64) -> dict:
    """The timing row of a measured ``us``: TB/s, TFLOP/s and the fraction of the roofline."""
    nbytes, flops = decode_bytes(H, B, L, s_q, kv_format, r, dr), decode_flops(H, B, L, s_q, r, dr)
    return dict(us=us, TBps=nbytes / us / 1e6, TFLOPs=flops / us / 1e6, roof=roofline_us(nbytes, flops) / us)


def decode_case(H, B, L, s_q, page, seed=0, kv_format="bf16", r=512, dr=64, device="cuda") -> dict:
    """One shape's inputs: q [B, s_q, H, r + dr] bf16, a cache of B * ceil(L / page) blocks in
    ``kv_format`` (FP8 rows quantize the same bf16 values, kv_scale 1), a shuffled block table,
    every sequence L long. Seeded by the shape, so every run and tree sees the same values on
    a device."""
    from mla import quant

    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed + 7919 * H + 131 * B + L + 17 * s_q)
    pages_per_seq = math.ceil(L / page)
    kv = torch.randn(B * pages_per_seq, page, r + dr, device=dev, dtype=torch.bfloat16, generator=g)
    if kv_format != "bf16":
        kv = quant.quantize_rows(kv.view(-1, r + dr), kv_format, r).view(B * pages_per_seq, page, -1)
    q = torch.randn(B, s_q, H, r + dr, device=dev, dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(B * pages_per_seq, device=dev, generator=g).to(torch.int32)
    return dict(H=H, B=B, L=L, s_q=s_q, page=page, r=r, dr=dr, q=q, kv=kv, kv_format=kv_format,
                table=perm.view(B, pages_per_seq),
                seqlens=torch.full((B,), L, dtype=torch.int32, device=dev), scale=1 / math.sqrt(128 + dr))


def decode_grid(args) -> list[tuple[int, int, int, int]]:
    """(heads, batch, kv_len, s_q) of every shape to run."""
    shapes = []
    for H in args.heads or [16, 128]:
        for s_q in args.s_q or ([1, 2] if H == 128 else [1]):
            for B in args.batch:
                for L in args.kv_len:
                    shapes.append((H, B, L, s_q))
    return shapes


def positive_int(text: str) -> int:
    """argparse type of the benchmarks' sizes: an integer >= 1, else argparse's usage error."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return n


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heads", type=positive_int, nargs="+", default=None, help="head counts (default 16 128)")
    p.add_argument("--batch", type=positive_int, nargs="+", default=[1, 32, 128])
    p.add_argument("--kv-len", type=positive_int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--s-q", type=positive_int, nargs="+", default=None,
                   help="query tokens per sequence (default: 1, and also 2 for 128 heads)")
    p.add_argument("--page", type=positive_int, default=64, help="block size of the paged cache")
    p.add_argument("--kv", nargs="+", default=["bf16"], choices=KV_FORMATS,
                   help="cache formats: bf16 rows (1152 B), fp8 per-tensor (576 B), fp8 tile rows (656 B)")
    p.add_argument("--kv-lora", type=positive_int, default=512, metavar="R",
                   help="latent width r (kv_lora_rank, default 512); the value is the first r of each row")
    p.add_argument("--rope", type=positive_int, default=64, metavar="DR",
                   help="rope width dr (qk_rope_head_dim, default 64); a row holds r + dr values")
    p.add_argument("--variants", default="default",
                   help="comma list of portable-kernel schedules to time: default, or e.g. w4-n32-s3-x2 "
                        "(decode_providers.decode_variant); gluon:seesaw, gluon:narrow and gluon:fp8reg time "
                        "those Hopper kernels by name")
    p.add_argument("--no-peers", action="store_true", help="time only our kernels")
    p.add_argument("--csv", default=None, help="every row to this CSV file (written after each shape)")
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None, help="roofline fractions as a bar chart (needs matplotlib)")


def validate(args) -> None:
    """Every check that needs no GPU, before any GPU work: ValueError with the bad option."""
    from mla.ops.decode.portable import DecodeConfig

    for v in args.variants.split(","):
        if v.startswith("gluon:"):
            if v not in prov.GLUON_KERNELS:
                raise ValueError(f"--variants: unknown kernel {v!r} (expected one of {', '.join(prov.GLUON_KERNELS)})")
        elif v:
            prov.decode_variant(v, DecodeConfig())
    if "fp8_tile" in args.kv and args.kv_lora % 128:
        raise ValueError(f"--kv-lora: the fp8_tile rows take a multiple of 128, got {args.kv_lora}")


def providers(args) -> dict:
    names = [v for v in args.variants.split(",") if v]
    out = {"mla.ops": prov.op_provider(),
           **{f"triton:{v}": prov.triton_provider(v) for v in names if not v.startswith("gluon:")},
           **{v: prov.gluon_provider(v) for v in names if v.startswith("gluon:")}}
    if not args.no_peers:
        try:
            out["flashinfer-fa3"] = prov.flashinfer_provider()
        except Exception as e:  # not installed / no GPU build: the run goes on without it
            print(f"flashinfer not available: {type(e).__name__}: {e}", file=sys.stderr)
        out["naive-torch"] = prov.naive_provider()
    return out


def measure(c: dict, providers: dict, page: int) -> list[dict]:
    """One row per provider on the case c: checked against the reference, then timed."""
    from mla.ops import reference

    H, B, L, s_q, fmt, r, dr = (c[k] for k in ("H", "B", "L", "s_q", "kv_format", "r", "dr"))
    ref = reference.mla_decode(c["q"], c["kv"], c["table"], c["seqlens"], r, c["scale"], True)[0].float()
    copies = rotated_copies(c["kv"])
    rows = []
    for name, make in providers.items():
        row = dict(H=H, B=B, L=L, s_q=s_q, kv=fmt, r=r, dr=dr, page=page, provider=name)
        try:
            t = make(c)
            row.update(config=t.config, kernel=t.kernel, rel_err=prov.rel_err(t.call(c["kv"]), ref))
            row.update(decode_metrics(H, B, L, s_q, graph_time_us([lambda kv=kv: t.call(kv) for kv in copies]),
                                      fmt, r, dr))
        except Exception as e:   # one provider failing a shape: its row says why, the others go on
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        rows.append(row)
    return rows


def run(args) -> int:
    """The grid on the GPU (``validate`` first): the table, the summary, and the files asked for."""
    provs = providers(args)
    shapes = [(H, B, L, s_q, kv) for kv in args.kv for (H, B, L, s_q) in decode_grid(args)]
    rows = []
    t0 = time.time()
    for i, (H, B, L, s_q, kv_format) in enumerate(shapes):
        c = decode_case(H, B, L, s_q, args.page, seed=i, kv_format=kv_format, r=args.kv_lora, dr=args.rope)
        rows += measure(c, provs, args.page)
        del c
        torch.cuda.empty_cache()
        print(f"[{i + 1}/{len(shapes)}] H={H} B={B} L={L} s_q={s_q} kv={kv_format} done "
              f"({time.time() - t0:.0f} s)", flush=True)
        if args.csv:      # after every shape, so that a run cut short keeps what it measured
            report.write_csv(rows, args.csv)

    report.add_ratios(rows)
    print(f"# r {args.kv_lora}, rope {args.rope}")
    print(report.decode_table(rows))
    print()
    print(report.decode_summary(rows))
    if args.csv:
        report.write_csv(rows, args.csv)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
    if args.png:
        report.decode_plot(rows, args.png)
    return 0
