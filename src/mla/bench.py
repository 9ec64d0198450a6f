"""``mla bench``: kernel benchmarks on one GPU, side by side with the peers present.

    mla bench decode [--heads 16 128] [--batch 1 32 128] [--kv-len 1024 4096 16384]
                     [--s-q 1] [--page 64] [--variants default,...] [--csv F] [--json F] [--png F]

Decode (DeepSeek-V3 shapes: latent 512 + rope 64, bf16, scale 1/sqrt(192)):
  bytes = B * L * 576 * 2  (every cache row read once)  + B * s_q * H * (576 + 512) * 2  (q in, out)
  FLOPs = 2 * B * s_q * H * L * (576 + 512)            (QK^T over 576, PV over 512; causal s_q > 1
                                                          counted as if every query saw every key)
  roofline time = max(bytes / 4.3e12, FLOPs / 790e12)  (copy and bf16 GEMM ceilings measured on an H200)
Timing: one CUDA graph holding one call per rotated copy of the KV cache (together larger than
the 60 MB L2), median replay time / number of calls (triton.testing.do_bench).
Peers: FlashInfer ``BatchMLAPagedAttentionWrapper`` (backend fa3) when importable, and a naive
PyTorch decode (gather pages, bmm, softmax, bmm). Each provider is checked against
``mla.ops.reference.mla_decode`` on every shape before it is timed.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from dataclasses import replace

import torch

PEAK_BYTES_PER_S = 4.3e12
PEAK_FLOPS = 790e12
L2_ROTATE_BYTES = 240 << 20
DL, DR = 512, 64


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["prefill"]:   # its own options: mla/bench_prefill.py
        from .bench_prefill import main as prefill_main
        return prefill_main(argv[1:])
    parser = argparse.ArgumentParser(prog="mla bench", description="Kernel benchmarks on one GPU.")
    sub = parser.add_subparsers(dest="op", required=True)
    add_decode_args(sub.add_parser("decode", help="absorbed MLA decode over a paged latent cache"))
    sub.add_parser("prefill", help="prefill attention, RoPE + append, gather, merge, and the layer's context phase")
    args = parser.parse_args(argv)
    if args.op == "decode":
        return run_decode(args)
    return 2


# ---------------------------------------------------------------- decode
def decode_variant(name: str, cfg):
    """A Triton schedule derived from the default one (mla.ops.decode.portable.default_config).

    ``default``, or dash-separated changes: ``w8`` warps, ``n32`` keys per tile, ``m32`` query
    rows per program, ``s3`` pipeline stages, ``x2`` / ``h2`` splits times / divided by 2,
    ``g`` gather every row's page (no one-page tile).
    """
    if name == "default":
        return cfg
    for part in name.split("-"):
        k, v = part[0], part[1:]
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
        else:
            raise ValueError(f"--variants: unknown part {part!r} in {name!r}")
    return cfg


def add_decode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heads", type=int, nargs="+", default=None, help="head counts (default 16 128)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--kv-len", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--s-q", type=int, nargs="+", default=None,
                   help="query tokens per sequence (default: 1, and also 2 for 128 heads)")
    p.add_argument("--page", type=int, default=64, help="block size of the paged cache")
    p.add_argument("--kv", nargs="+", default=["bf16"], choices=["bf16", "fp8", "fp8_tile"],
                   help="cache formats: bf16 rows (1152 B), fp8 per-tensor (576 B), fp8 tile rows (656 B)")
    p.add_argument("--variants", default="default",
                   help="comma list of Triton schedules to time: default, or e.g. w4-n32-s3-x2 (see decode_variant); "
                        "gluon:seesaw, gluon:narrow and gluon:fp8reg time those Hopper kernels by name")
    p.add_argument("--no-peers", action="store_true", help="time only the Triton kernel")
    p.add_argument("--csv", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)


def decode_grid(args) -> list[tuple[int, int, int, int]]:
    """(heads, batch, kv_len, s_q) of every shape to run."""
    heads = args.heads or [16, 128]
    shapes = []
    for H in heads:
        sqs = args.s_q or ([1, 2] if H == 128 else [1])
        for s_q in sqs:
            for B in args.batch:
                for L in args.kv_len:
                    shapes.append((H, B, L, s_q))
    return shapes


ROW_BYTES = {"bf16": (DL + DR) * 2, "fp8": DL + DR, "fp8_tile": DL + 4 * DL // 128 + 2 * DR}


def decode_metrics(H, B, L, s_q, us, kv="bf16"):
    nbytes = B * L * ROW_BYTES[kv] + B * s_q * H * (DL + DR + DL) * 2
    flops = 2 * B * s_q * H * L * (DL + DR + DL)
    roof_us = max(nbytes / PEAK_BYTES_PER_S, flops / PEAK_FLOPS) * 1e6
    return dict(us=us, TBps=nbytes / us / 1e6, TFLOPs=flops / us / 1e6, roof=roof_us / us)


def decode_case(H, B, L, s_q, page, seed=0, kv_format="bf16"):
    from mla import quant

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed + 7919 * H + 131 * B + L + 17 * s_q)
    pages_per_seq = math.ceil(L / page)
    kv = torch.randn(B * pages_per_seq, page, DL + DR, device=dev, dtype=torch.bfloat16, generator=g)
    if kv_format != "bf16":   # FP8 rows of the same values (kv_scale 1)
        kv = quant.quantize_rows(kv.view(-1, DL + DR), kv_format, DL).view(B * pages_per_seq, page, -1)
    q = torch.randn(B, s_q, H, DL + DR, device=dev, dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(B * pages_per_seq, device=dev, generator=g).to(torch.int32)
    return dict(H=H, B=B, L=L, s_q=s_q, page=page, q=q, kv=kv, kv_format=kv_format,
                table=perm.view(B, pages_per_seq),
                seqlens=torch.full((B,), L, dtype=torch.int32, device=dev), scale=1 / math.sqrt(192))


def _triton_provider(variant):
    from mla.ops.decode import portable

    def make(c):
        cfg = decode_variant(variant, portable.default_config(c["q"], c["table"].shape[1] * c["page"]))

        def call(kv):
            return portable.launch(c["q"], kv, c["table"], c["seqlens"], DL, c["scale"], True, cfg)[0]
        return call, cfg
    return make


GLUON_KERNELS = ("gluon:seesaw", "gluon:narrow", "gluon:fp8reg")


def _gluon_provider(name):
    """One Hopper kernel by name, whatever the dispatch would pick: gluon:seesaw (query rows
    on M, ``mla.ops.decode.gluon.seesaw``), gluon:narrow (keys on M, ``gluon.narrow``) or
    gluon:fp8reg (FP8 rows, e4m3 MMAs for S, ``gluon.fp8``)."""
    from mla.ops.decode.gluon import fp8, narrow, seesaw

    launch = {"gluon:seesaw": seesaw.launch, "gluon:narrow": narrow.launch, "gluon:fp8reg": fp8.launch}[name]

    def make(c):
        def call(kv):
            return launch(c["q"], kv, c["table"], c["seqlens"], DL, c["scale"], True)[0]
        return call, name
    return make


def _op_provider():
    """The public op as the library dispatches it (Gluon or Triton kernel, mla.ops.decode.choose_kernel)."""
    from mla.ops import mla_decode

    def make(c):
        def call(kv):
            return mla_decode(c["q"], kv, c["table"], c["seqlens"], DL, c["scale"], True)[0]
        return call, "dispatch"
    return make


def _flashinfer_provider():
    import flashinfer  # the one place the benchmark imports FlashInfer

    ws = torch.empty(256 << 20, dtype=torch.int8, device="cuda")

    def make(c):
        if c["kv_format"] == "fp8_tile":   # its per-128 scales come with an FP8 rope part; ours is bf16
            raise ValueError("FlashInfer has no MLA cache with bf16 rope beside scaled e4m3 latents")
        B, s_q, H, P = c["B"], c["s_q"], c["H"], c["table"].shape[1]
        dev = c["q"].device
        w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend="fa3")
        w.plan(qo_indptr=torch.arange(B + 1, device=dev, dtype=torch.int32) * s_q,
               kv_indptr=torch.arange(B + 1, device=dev, dtype=torch.int32) * P,
               kv_indices=c["table"].reshape(-1).contiguous(), kv_len_arr=c["seqlens"], num_heads=H,
               head_dim_ckv=DL, head_dim_kpe=DR, page_size=c["page"], causal=s_q > 1, sm_scale=c["scale"],
               q_data_type=torch.bfloat16, kv_data_type=c["kv"].dtype)
        # FP8 rows (one e4m3 scale for all 576 values, 1.0 here): FlashInfer takes it per part
        scales = dict(ckv_scale=1.0, kpe_scale=1.0) if c["kv_format"] == "fp8" else {}
        q = c["q"].reshape(B * s_q, H, DL + DR)
        out = torch.empty(B * s_q, H, DL, dtype=torch.bfloat16, device=dev)

        def call(kv):
            w.run(q_nope=q[..., :DL], q_pe=q[..., DL:], ckv_cache=kv[..., :DL], kpe_cache=kv[..., DL:], out=out,
                  **scales)
            return out.view(B, s_q, H, DL)
        return call, "fa3"
    return make


def _naive_provider():
    def make(c):
        B, s_q, H, L = c["B"], c["s_q"], c["H"], c["L"]
        q = c["q"].reshape(B, s_q * H, DL + DR)
        key = torch.arange(c["table"].shape[1] * c["page"], device=q.device)
        limit = L - s_q + 1 + torch.arange(s_q, device=q.device).repeat_interleave(H)
        bias = torch.where(key[None, :] < limit[:, None], 0.0, float("-inf")).to(torch.bfloat16)

        def call(kv):
            if c["kv_format"] != "bf16":   # the naive way: a dequantized copy of the whole cache
                from mla import quant
                kv = quant.dequantize_rows(kv.view(-1, kv.shape[-1]), c["kv_format"], DL, torch.bfloat16).view(
                    kv.shape[0], kv.shape[1], DL + DR)
            k = kv[c["table"].long()].reshape(B, -1, DL + DR)
            s = torch.bmm(q, k.transpose(1, 2)) * c["scale"] + bias
            return torch.bmm(torch.softmax(s, -1), k[..., :DL]).view(B, s_q, H, DL)
        return call, "naive"
    return make


def rotated_copies(kv: torch.Tensor) -> list[torch.Tensor]:
    """kv and copies of it with its blocks permuted (the same rows in other memory, any dtype),
    together past the L2, for timing calls that rotate through them."""
    n = max(1, min(64, math.ceil(L2_ROTATE_BYTES / (kv.numel() * kv.element_size()))))
    return [kv] + [kv[torch.randperm(kv.shape[0], device=kv.device)] for _ in range(n - 1)]


def graph_time_us(calls) -> float:
    """Median replay time of one CUDA graph holding every call, divided by the number of calls."""
    from triton.testing import do_bench

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    torch.cuda.synchronize()
    ms = do_bench(g.replay, warmup=5, rep=40, return_mode="median")
    del g
    return ms * 1e3 / len(calls)


def _rel_err(out, ref):
    out = out.float()
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out - ref).norm() / ref.norm()).item()


def run_decode(args) -> int:
    if not torch.cuda.is_available():
        print("mla bench decode: needs a CUDA GPU", file=sys.stderr)
        return 1
    from mla.ops import reference

    variants = [v for v in args.variants.split(",") if v and not v.startswith("gluon:")]
    kernels = [v for v in args.variants.split(",") if v.startswith("gluon:")]
    from mla.ops.decode.portable import DecodeConfig

    for v in variants:
        decode_variant(v, DecodeConfig())  # unknown parts fail here, before any GPU work
    for v in kernels:
        if v not in GLUON_KERNELS:
            raise ValueError(f"--variants: unknown kernel {v!r} ({', '.join(GLUON_KERNELS)})")
    providers = {"mla.ops": _op_provider(), **{f"triton:{v}": _triton_provider(v) for v in variants},
                 **{v: _gluon_provider(v) for v in kernels}}
    if not args.no_peers:
        try:
            providers["flashinfer-fa3"] = _flashinfer_provider()
        except Exception as e:  # not installed / no GPU build: the run goes on without it
            print(f"flashinfer not available: {type(e).__name__}: {e}")
        providers["naive-torch"] = _naive_provider()

    shapes = [(H, B, L, s_q, kv) for kv in args.kv for (H, B, L, s_q) in decode_grid(args)]
    rows = []
    t0 = time.time()
    for i, (H, B, L, s_q, kv_format) in enumerate(shapes):
        c = decode_case(H, B, L, s_q, args.page, seed=i, kv_format=kv_format)
        ref = reference.mla_decode(c["q"], c["kv"], c["table"], c["seqlens"], DL, c["scale"], True)[0].float()
        copies = rotated_copies(c["kv"])
        for name, make in providers.items():
            row = dict(H=H, B=B, L=L, s_q=s_q, kv=kv_format, page=args.page, provider=name)
            try:
                call, info = make(c)
                row["config"] = str(info)
                row["rel_err"] = _rel_err(call(c["kv"]), ref)
                row.update(decode_metrics(H, B, L, s_q, graph_time_us([lambda kv=kv: call(kv) for kv in copies]),
                                          kv_format))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            rows.append(row)
        del c, ref, copies
        torch.cuda.empty_cache()
        print(f"[{i + 1}/{len(shapes)}] H={H} B={B} L={L} s_q={s_q} kv={kv_format} done "
              f"({time.time() - t0:.0f} s)", flush=True)
        if args.csv:      # after every shape, so that a run cut short keeps what it measured
            write_csv(rows, args.csv)

    _add_ratios(rows)
    print(decode_table(rows))
    print()
    print(decode_summary(rows))
    if args.csv:
        write_csv(rows, args.csv)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
    if args.png:
        decode_plot(rows, args.png)
    return 0


def _key(r):
    return r["H"], r["B"], r["L"], r["s_q"], r.get("kv", "bf16")


def write_csv(rows, path):
    """Every row (dicts with any keys) to a CSV file, columns sorted by name."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        w.writeheader()
        w.writerows(rows)


def _add_ratios(rows):
    peer = {_key(r): r.get("us") for r in rows if r["provider"] == "flashinfer-fa3"}
    for r in rows:
        p = peer.get(_key(r))
        if p and r.get("us"):
            r["ratio_fa3"] = r["us"] / p


def decode_table(rows) -> str:
    head = f"{'H':>4} {'B':>4} {'L':>6} {'s_q':>3} {'kv':>8}  {'provider':<16} {'us':>9} {'TB/s':>6} {'TF/s':>6} {'roof':>5} {'/fa3':>6} {'err':>8}  config"
    out = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            out.append(f"{r['H']:>4} {r['B']:>4} {r['L']:>6} {r['s_q']:>3} {r['kv']:>8}  {r['provider']:<16} "
                       f"ERROR {r['error']}")
            continue
        ratio = f"{r['ratio_fa3']:6.2f}" if "ratio_fa3" in r else f"{'-':>6}"
        out.append(f"{r['H']:>4} {r['B']:>4} {r['L']:>6} {r['s_q']:>3} {r['kv']:>8}  {r['provider']:<16} {r['us']:9.1f} "
                   f"{r['TBps']:6.2f} {r['TFLOPs']:6.0f} {r['roof']:5.0%} {ratio} {r['rel_err']:8.1e}  {r['config']}")
    return "\n".join(out)


def decode_summary(rows) -> str:
    """One line per shape: the public op as dispatched, the fastest kernel timed by name, the peers;
    TB/s, TFLOP/s and roofline fraction of the op (of the fastest named kernel without it)."""
    head = (f"{'H':>4} {'B':>4} {'L':>6} {'s_q':>3} {'kv':>8} {'mla.ops':>8} {'best':>8} {'variant':<15} {'fa3':>8} "
            f"{'naive':>8} {'op/fa3':>7} {'best/fa3':>8} {'TB/s':>5} {'TF/s':>5} {'roof':>5}")
    out = [head]
    keys = []
    for r in rows:
        k = _key(r)
        if k not in keys:
            keys.append(k)
    for k in keys:
        rs = [r for r in rows if _key(r) == k and "us" in r]
        by = {r["provider"]: r for r in rs}
        tri = [r for r in rs if r["provider"].startswith(("triton:", "gluon:"))]
        best = min(tri, key=lambda r: r["us"]) if tri else None
        d, f, n = by.get("mla.ops"), by.get("flashinfer-fa3"), by.get("naive-torch")
        fmt = lambda r: f"{r['us']:8.1f}" if r else f"{'-':>8}"  # noqa: E731
        rat = lambda r: f"{r['us'] / f['us']:.2f}" if r and f else "-"  # noqa: E731
        out.append(f"{k[0]:>4} {k[1]:>4} {k[2]:>6} {k[3]:>3} {k[4]:>8} {fmt(d)} {fmt(best)} "
                   f"{(best['provider'] if best else '-'):<15} {fmt(f)} {fmt(n)} {rat(d):>7} {rat(best):>8} "
                   + (f"{m['TBps']:5.2f} {m['TFLOPs']:5.0f} {m['roof']:5.0%}" if (m := d or best) else ""))
    return "\n".join(out)


def decode_plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--png: matplotlib is not installed")
        return
    shapes = sorted({(r["H"], r["s_q"], r["B"], r["L"]) for r in rows})
    labels = [f"H{h} sq{s}\nB{b} L{l // 1024}k" for h, s, b, l in shapes]
    fig, ax = plt.subplots(figsize=(max(8, len(shapes) * 0.6), 4))
    provs = sorted({r["provider"] for r in rows})
    width = 0.8 / len(provs)
    for j, p in enumerate(provs):
        by = {(r["H"], r["s_q"], r["B"], r["L"]): r.get("roof", 0) for r in rows if r["provider"] == p}
        ax.bar([i + j * width for i in range(len(shapes))], [100 * by.get(s, 0) for s in shapes], width, label=p)
    ax.set_xticks([i + 0.4 for i in range(len(shapes))], labels, fontsize=6)
    ax.set_ylabel("% of roofline")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
