"""``mla bench decode``: absorbed MLA decode over a paged latent cache, our kernels beside the peers.

    mla bench decode [--heads 16 128] [--batch 1 32 128] [--kv-len 1024 4096 16384] [--s-q 1]
                     [--mixed [MIX ...]] [--page 64] [--kv bf16] [--kv-lora 512] [--rope 64]
                     [--variants default,...] [--no-peers] [--profile] [--csv F] [--json F] [--png F]

Shapes: latent r = ``--kv-lora`` (512) and rope dr = ``--rope`` (64), as in DeepSeek-V3; a row
is d = r + dr values, the value its first r; bf16 queries, scale 1/sqrt(128 + dr). What is
counted, for B sequences holding K cached keys together (B * L when each holds L), s_q query
tokens of H heads (``decode_bytes``, ``decode_flops``):

    bytes = K * row_bytes  +  B * s_q * H * (d + r) * 2     (each cache row read once; q in, out)
    FLOPs = 2 * s_q * H * K * (d + r)                       (QK^T over d, PV over r; causal s_q > 1
                                                              counted as if every query saw every key)
    row_bytes: bf16 2 * d, fp8 d, fp8_tile r + 4 * r / 128 + 2 * dr (mla.quant)

against ``mla.bench.roofline``. ``--mixed``: batches of mixed lengths at a max length L
(``--kv-len``; defaults B 32 128, L 4096 16384, s_q 1), in the mixes named (all three when
none is): "equal" (every sequence L), "uniform" (lengths uniform in [s_q, L], seeded),
"one-long" (one sequence L, the others L / 16) (``mix_lengths``); the cache holds just the
blocks the lengths fill, and each row names its mix and its K.

Timing: ``mla.bench.timing.graph_time_us`` over rotated copies of the cache. Providers
(``decode_providers``): the public op as dispatched (its ``kernel`` column names the kernel
``mla.ops.decode.choose_kernel`` picks: any r or dr other than DeepSeek's runs on the portable
Triton kernel), the portable kernel by schedule, the Hopper kernels by name, and the peers
(not with ``--no-peers``): FlashInfer's fa3 MLA and FlashMLA's dense decode (bf16 rows, blocks
of 64) where they import (a line on stderr says which is skipped), naive PyTorch (equal
lengths). A peer's planning (FlashInfer's plan, FlashMLA's scheduling metadata) happens once
per case, outside the timed calls. Each provider is checked against
``mla.ops.reference.mla_decode`` on every case before it is timed: out within ``CHECK_TOL``
norm-wise (2e-2 on bf16 rows, 8e-2 on FP8 rows), else its row says so and it is not timed.
The exit status is 1 when the dispatched op errs or fails its check on any case.
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
from .sparse_providers import flash_mla_or_reason
from .timing import graph_time_us, kernel_times_us, rotated_copies

__all__ = ["add_args", "validate", "run", "decode_case", "decode_bytes", "decode_flops", "decode_metrics",
           "decode_grid", "mixed_grid", "mix_lengths", "row_bytes", "positive_int", "providers", "CHECK_TOL", "MIXES"]

KV_FORMATS = ("bf16", "fp8", "fp8_tile")
MIXES = ("equal", "uniform", "one-long")
# the grids' defaults (heads, batch, kv_len), uniform lengths and --mixed
GRID = ((16, 128), (1, 32, 128), (1024, 4096, 16384))
MIXED_GRID = ((16, 128), (32, 128), (4096, 16384))
# norm-wise relative error against the float32 reference above which a result is wrong: 2x that
# of attention in PyTorch's bf16 (naive-torch: 0.8-1.0e-2 on these inputs); on FP8 rows 2x that
# of a query rounded to e4m3 too (4e-2), as a kernel of e4m3 MMAs may round it. Reading the tail
# of each last block past the lengths (uniform mix) misses by 7e-2 to 2.6e-1
CHECK_TOL = {"bf16": 2e-2, "fp8": 8e-2, "fp8_tile": 8e-2}


def row_bytes(kv_format: str, r: int = 512, dr: int = 64) -> int:
    """Bytes of one cache row: 1152 (bf16), 576 (fp8), 656 (fp8_tile) for r 512, dr 64."""
    from mla import quant

    if kv_format == "bf16":
        return 2 * (r + dr)
    return quant.row_width(kv_format, r, dr)


def decode_bytes(H, B, L, s_q, kv_format="bf16", r=512, dr=64, keys=None) -> int:
    """The fewest bytes a decode call moves: every cache row once, the queries in and out out.
    keys: the cached keys of the batch together (default B * L, every sequence L long)."""
    keys = B * L if keys is None else keys
    return keys * row_bytes(kv_format, r, dr) + B * s_q * H * (r + dr + r) * 2


def decode_flops(H, B, L, s_q, r=512, dr=64, keys=None) -> int:
    """QK^T over r + dr and PV over r for every (query row, key) pair; keys as in ``decode_bytes``."""
    keys = B * L if keys is None else keys
    return 2 * s_q * H * keys * (r + dr + r)


def decode_metrics(H, B, L, s_q, us, kv_format="bf16", r=512, dr=64, keys=None) -> dict:
    """The timing row of a measured ``us``: TB/s, TFLOP/s and the fraction of the roofline;
    keys as in ``decode_bytes``."""
    nbytes, flops = decode_bytes(H, B, L, s_q, kv_format, r, dr, keys), decode_flops(H, B, L, s_q, r, dr, keys)
    return dict(us=us, TBps=nbytes / us / 1e6, TFLOPs=flops / us / 1e6, roof=roofline_us(nbytes, flops) / us)


def mix_lengths(mix: str, B: int, L: int, s_q: int = 1, seed: int = 0) -> list[int]:
    """The B cache lengths of a mix at max length L: "equal" all L; "uniform" uniform in [s_q,
    L] (a sequence holds at least its s_q new tokens), drawn on the host from seed, B and L, so
    every machine draws the same; "one-long" the middle sequence L, the others L // 16 (at least
    s_q)."""
    if mix == "equal":
        return [L] * B
    if mix == "uniform":
        g = torch.Generator().manual_seed(seed + 1_000_003 * B + L)
        return torch.randint(s_q, L + 1, (B,), generator=g).tolist()
    if mix == "one-long":
        lengths = [max(s_q, L // 16)] * B
        lengths[B // 2] = L
        return lengths
    raise ValueError(f"mix: expected one of {MIXES}, got {mix!r}")


def decode_case(H, B, L, s_q, page, seed=0, kv_format="bf16", r=512, dr=64, device="cuda", lengths=None) -> dict:
    """One case's inputs: q [B, s_q, H, r + dr] bf16, a cache in ``kv_format`` (FP8 rows quantize
    the same bf16 values, kv_scale 1) of the blocks the lengths fill, shuffled, and a block
    table [B, ceil(L / page)]. lengths: the B cache lengths, each at most L (default: all L).
    Table entries past a sequence's last block name block 0: a kernel that reads past a
    length reads wrong keys there, which the check against the reference catches. Seeded by the
    shape, so every run and tree sees the same values on a device. The dict also holds
    ``lengths`` (host ints) and ``keys``, their sum."""
    from mla import quant

    lengths = [L] * B if lengths is None else [int(n) for n in lengths]
    if len(lengths) != B or not all(0 <= n <= L for n in lengths):
        raise ValueError(f"lengths: expected {B} lengths in [0, {L}], got {lengths}")
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed + 7919 * H + 131 * B + L + 17 * s_q)
    pages = torch.tensor([math.ceil(n / page) for n in lengths], device=dev)
    blocks = int(pages.sum())
    kv = torch.randn(blocks, page, r + dr, device=dev, dtype=torch.bfloat16, generator=g)
    if kv_format != "bf16":
        kv = quant.quantize_rows(kv.view(-1, r + dr), kv_format, r).view(blocks, page, -1)
    q = torch.randn(B, s_q, H, r + dr, device=dev, dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(blocks, device=dev, generator=g).to(torch.int32)
    table = torch.zeros(B, math.ceil(L / page), dtype=torch.int32, device=dev)
    table[torch.arange(table.shape[1], device=dev)[None, :] < pages[:, None]] = perm   # row by row
    return dict(H=H, B=B, L=L, s_q=s_q, page=page, r=r, dr=dr, q=q, kv=kv, kv_format=kv_format, table=table,
                seqlens=torch.tensor(lengths, dtype=torch.int32, device=dev), lengths=lengths, keys=sum(lengths),
                scale=1 / math.sqrt(128 + dr))


def decode_grid(args) -> list[tuple[int, int, int, int]]:
    """(heads, batch, kv_len, s_q) of every shape of the grid of equal lengths."""
    heads, batch, kv_len = GRID
    shapes = []
    for H in args.heads or heads:
        for s_q in args.s_q or ([1, 2] if H == 128 else [1]):
            for B in args.batch or batch:
                for L in args.kv_len or kv_len:
                    shapes.append((H, B, L, s_q))
    return shapes


def mixed_grid(args) -> list[tuple[int, int, int, int, str]]:
    """(heads, batch, max len, s_q, mix) of every case of ``--mixed``: s_q 1 unless --s-q is given."""
    heads, batch, kv_len = MIXED_GRID
    return [(H, B, L, s_q, mix) for H in args.heads or heads for s_q in args.s_q or [1] for B in args.batch or batch
            for L in args.kv_len or kv_len for mix in args.mixed or MIXES]


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
    p.add_argument("--batch", type=positive_int, nargs="+", default=None,
                   help="sequences (default 1 32 128; --mixed: 32 128)")
    p.add_argument("--kv-len", type=positive_int, nargs="+", default=None,
                   help="cache lengths; with --mixed the max length L (default 1024 4096 16384; --mixed: 4096 16384)")
    p.add_argument("--s-q", type=positive_int, nargs="+", default=None,
                   help="query tokens per sequence (default: 1, and also 2 for 128 heads; --mixed: 1)")
    p.add_argument("--mixed", nargs="*", default=None, choices=MIXES, metavar="MIX",
                   help=f"batches of mixed lengths instead of the grid: the mixes {', '.join(MIXES)} "
                        "(all three when none is named)")
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
    p.add_argument("--profile", action="store_true",
                   help="also print each provider's mean device time per kernel (torch.profiler, eager calls)")
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
    shortest, s_q = min(args.kv_len or MIXED_GRID[2]), max(args.s_q or [1])
    if args.mixed is not None and shortest < s_q:
        raise ValueError(f"--kv-len: a sequence holds its --s-q new tokens, so L is at least {s_q}, got {shortest}")


def providers(args) -> dict:
    """name -> make of every provider the options ask for; a peer that does not import is left
    out with a line on stderr saying so."""
    names = [v for v in args.variants.split(",") if v]
    out = {"mla.ops": prov.op_provider(),
           **{f"triton:{v}": prov.triton_provider(v) for v in names if not v.startswith("gluon:")},
           **{v: prov.gluon_provider(v) for v in names if v.startswith("gluon:")}}
    if not args.no_peers:
        try:
            out["flashinfer-fa3"] = prov.flashinfer_provider()
        except Exception as e:  # not installed / no GPU build: the run goes on without it
            print(f"flashinfer not available: {type(e).__name__}: {e}", file=sys.stderr)
        fm = flash_mla_or_reason(True)
        if isinstance(fm, str):
            print(f"flashmla skipped: {fm}", file=sys.stderr)
        else:
            out["flashmla"] = prov.flashmla_provider(fm)
        out["naive-torch"] = prov.naive_provider()
    return out


def measure(c: dict, providers: dict, page: int, profile: bool = False) -> list[dict]:
    """One row per provider on the case c: checked against the reference (``CHECK_TOL``), then
    timed; a wrong result is an error row with no time. A case of ``mix`` rows names it and K."""
    from mla.ops import reference

    H, B, L, s_q, fmt, r, dr = (c[k] for k in ("H", "B", "L", "s_q", "kv_format", "r", "dr"))
    ref = reference.mla_decode(c["q"], c["kv"], c["table"], c["seqlens"], r, c["scale"], True)[0].float()
    copies = rotated_copies(c["kv"])
    mix = dict(mix=c["mix"], keys=c["keys"]) if c.get("mix") else {}
    rows = []
    for name, make in providers.items():
        row = dict(H=H, B=B, L=L, s_q=s_q, kv=fmt, r=r, dr=dr, page=page, **mix, provider=name)
        rows.append(row)
        try:
            t = make(c)
            out = t.call(c["kv"])
            if out.shape != ref.shape:
                raise RuntimeError(f"out: expected {tuple(ref.shape)}, got {tuple(out.shape)}")
            row.update(config=t.config, kernel=t.kernel, rel_err=prov.rel_err(out, ref))
            if not row["rel_err"] <= CHECK_TOL[fmt]:   # NaN too
                row["error"] = f"wrong result: rel_err {row['rel_err']:.2e} > {CHECK_TOL[fmt]:.0e}, not timed"
                continue
            us = graph_time_us([lambda kv=kv: t.call(kv) for kv in copies])
            row.update(decode_metrics(H, B, L, s_q, us, fmt, r, dr, c["keys"]))
            if profile:
                row["kernels"] = ", ".join(f"{k} {v:.1f}" for k, v in kernel_times_us(lambda: t.call(c["kv"])).items())
        except prov.NotApplicable as e:
            row["note"] = f"n/a: {e}"
        except Exception as e:   # one provider failing a case: its row says why, the others go on
            row["error"] = report.error_text(e)
    return rows


def run(args) -> int:
    """The grid (or the mixed-length cases) on the GPU (``validate`` first): the table, the
    summary, and the files asked for; 1 when the dispatched op erred or was wrong on a case."""
    provs = providers(args)
    shapes = mixed_grid(args) if args.mixed is not None else [(*s, None) for s in decode_grid(args)]
    cases = [(kv, *s) for kv in args.kv for s in shapes]
    rows = []
    t0 = time.time()
    for i, (kv_format, H, B, L, s_q, mix) in enumerate(cases):
        lengths = mix_lengths(mix, B, L, s_q) if mix else None
        c = decode_case(H, B, L, s_q, args.page, seed=i, kv_format=kv_format, r=args.kv_lora, dr=args.rope,
                        lengths=lengths)
        shape = measure(dict(c, mix=mix), provs, args.page, args.profile)
        rows += shape
        del c
        torch.cuda.empty_cache()
        print(f"[{i + 1}/{len(cases)}] H={H} B={B} L={L} s_q={s_q} kv={kv_format}" + (f" mix={mix}" if mix else "")
              + f" done ({time.time() - t0:.0f} s)", flush=True)
        for r in shape:
            if "kernels" in r:
                print(f"    {r['provider']}: {r['kernels']}", flush=True)
        if args.csv:      # after every case, so that a run cut short keeps what it measured
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
    bad = [r for r in rows if r["provider"] == "mla.ops" and "error" in r]
    if bad:
        print(f"mla bench decode: the dispatched op erred or was wrong on {len(bad)} of {len(cases)} cases",
              file=sys.stderr)
    return 1 if bad else 0
