"""Gluon (sm90) decode hot path vs the portable Triton kernel vs FlashInfer fa3, in one run.

    PYTHONPATH=/tmp/site:src python3 benchmarks/decode_gluon.py [--heads 16 128] [--batch 1 32 128]
        [--kv-len 1024 4096 16384] [--s-q 1 2] [--gluon 64,32,default] [--no-triton] [--csv F]

Grid of issue 4 by default (s_q 2 only at 128 heads). Method of ``mla bench decode``
(src/mla/bench.py): every provider checked against ``mla.ops.reference.mla_decode`` on the
shape, then timed in one CUDA graph over rotated KV copies (> 240 MB together).
Gluon variants: keys per tile (``64``, ``32``) or ``default`` (the launcher's rule), suffix
``-x2`` / ``-h2`` for twice / half the default splits.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from mla import bench
from mla.ops import reference


def _gluon_provider(variant):
    """variant: "default", or the keys per tile ("64", "32"), with "-x2" / "-h2" for twice / half the splits."""
    from mla.ops.triton import decode_gluon as dg

    def make(c):
        parts = variant.split("-")
        block_n = None if parts[0] == "default" else int(parts[0])
        B, s_q, H = c["B"], c["s_q"], c["H"]
        S = dg.default_splits(B, H * s_q, c["table"].shape[1] * c["page"], c["q"].device)
        for p in parts[1:]:
            S = S * int(p[1:]) if p[0] == "x" else max(1, S // int(p[1:]))
        block_n = block_n or dg.default_block_n(B, H * s_q)

        def call(kv):
            return dg.launch_gluon(c["q"], kv, c["table"], c["seqlens"], bench.DL, c["scale"], True,
                                   num_splits=S, block_n=block_n)[0]
        return call, f"block_n={block_n} splits={S}"
    return make


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--kv-len", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--s-q", type=int, nargs="+", default=None)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--gluon", default="64,32")
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--no-fa3", action="store_true")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)

    providers = {f"gluon:{v}": _gluon_provider(v) for v in args.gluon.split(",") if v}
    if not args.no_triton:
        providers["triton"] = bench._triton_provider("default")
    if not args.no_fa3:
        try:
            providers["fa3"] = bench._flashinfer_provider()
        except Exception as e:
            print(f"flashinfer not available: {type(e).__name__}: {e}")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)

    shapes = []
    for H in args.heads:
        for s_q in (args.s_q or ([1, 2] if H == 128 else [1])):
            for B in args.batch:
                for L in args.kv_len:
                    shapes.append((H, B, L, s_q))
    rows, t0 = [], time.time()
    for i, (H, B, L, s_q) in enumerate(shapes):
        c = bench.decode_case(H, B, L, s_q, args.page, seed=i)
        ref = reference.mla_decode(c["q"], c["kv"], c["table"], c["seqlens"], bench.DL, c["scale"], True)[0].float()
        kv_bytes = c["kv"].numel() * 2
        n_copies = max(1, min(64, math.ceil(bench.L2_ROTATE_BYTES / kv_bytes)))
        copies = [c["kv"]] + [torch.randn_like(c["kv"]) for _ in range(n_copies - 1)]
        for name, make in providers.items():
            row = dict(H=H, B=B, L=L, s_q=s_q, provider=name)
            try:
                call, info = make(c)
                row["config"] = str(info)
                row["rel_err"] = bench._rel_err(call(c["kv"]), ref)
                row.update(bench.decode_metrics(H, B, L, s_q, bench.graph_time_us([lambda kv=kv: call(kv) for kv in copies])))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            rows.append(row)
        del c, ref, copies
        torch.cuda.empty_cache()
        print(f"[{i + 1}/{len(shapes)}] H={H} B={B} L={L} s_q={s_q} ({time.time() - t0:.0f} s)", flush=True)

    for r in rows:
        if "error" in r:
            print("ERROR", r)
    key = lambda r: (r["H"], r["B"], r["L"], r["s_q"])
    fa3 = {key(r): r["us"] for r in rows if r["provider"] == "fa3" and "us" in r}
    names = list(providers)
    print("\n| H | B | L | s_q | " + " | ".join(f"{n} us" for n in names) + " | best gluon TB/s | TFLOP/s | "
          + " | ".join(f"{n}/fa3" for n in names if n != "fa3") + " | gluon err |")
    print("|" + "---|" * (5 + len(names) + 2 + len(names) - (1 if "fa3" in names else 0)))
    ratios = {n: [] for n in names}
    for sh in dict.fromkeys(key(r) for r in rows):
        rs = {r["provider"]: r for r in rows if key(r) == sh}
        us = {n: rs[n].get("us") for n in names if n in rs}
        gl_rows = [rs[n] for n in names if n.startswith("gluon") and "us" in rs.get(n, {})]
        best = min(gl_rows, key=lambda r: r["us"]) if gl_rows else {}
        cells = [f"{us[n]:.1f}" if us.get(n) else "err" for n in names]
        rat = []
        for n in names:
            if n == "fa3":
                continue
            if us.get(n) and sh in fa3:
                ratios[n].append(us[n] / fa3[sh])
                rat.append(f"{us[n] / fa3[sh]:.2f}")
            else:
                rat.append("-")
        err = max((r["rel_err"] for r in gl_rows), default=float("nan"))
        print(f"| {sh[0]} | {sh[1]} | {sh[2]} | {sh[3]} | " + " | ".join(cells)
              + f" | {best.get('TBps', 0):.2f} | {best.get('TFLOPs', 0):.0f} | " + " | ".join(rat) + f" | {err:.1e} |")
    print()
    for n, rs in ratios.items():
        if rs:
            gm = math.exp(sum(math.log(x) for x in rs) / len(rs))
            print(f"{n}: geomean time/fa3 {gm:.2f} over {len(rs)} shapes, <= 1.0 on {sum(x <= 1.0 for x in rs)}")
    if args.csv:
        bench.write_csv(rows, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
