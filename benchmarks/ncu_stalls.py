"""Warp-stall sampling of one decode kernel with Nsight Compute, summarised per SASS instruction.

On the GPU machine (ncu reads the counters there; clocks left alone):

    ncu --clock-control none --section SourceCounters -k regex:_fp8_kernel -c 1 -o $OUT/r \
        python3 benchmarks/ncu_stalls.py run --kernel gluon:fp8reg --shape 16,128,16384 --kv fp8
    ncu -i $OUT/r.ncu-rep --page source --csv --print-source sass > $OUT/sass.csv

Anywhere (the CSV is plain text):

    python3 benchmarks/ncu_stalls.py report sass.csv [--top 40]

``report`` prints the stall reasons summed over the kernel and the instructions with the most
samples, each with its reasons, so a wait can be tied to the instruction that waits.
"""
from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import Counter


def run(kernel: str, shape: str, kv: str) -> None:
    import torch

    from mla import bench

    H, B, L = (int(x) for x in shape.split(","))
    c = bench.decode_case(H, B, L, 1, 64, kv_format=kv)
    call, _ = bench._gluon_provider(kernel)(c)
    call(c["kv"])               # compiled and warm; ncu profiles the next launch of the kernel
    torch.cuda.synchronize()
    call(c["kv"])
    torch.cuda.synchronize()


def report(path: str, top: int) -> None:
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith('"Address"'))
    rows = list(csv.DictReader(lines[start:]))
    reasons = [c for c in rows[0] if c.startswith("stall_") and "(Not Issued)" not in c]

    def num(r, c):
        try:
            return float(str(r.get(c, "0")).replace(",", "") or 0)
        except ValueError:
            return 0.0
    total = sum(num(r, "Warp Stall Sampling (All Samples)") for r in rows)
    sums = Counter({c: sum(num(r, c) for r in rows) for c in reasons})
    excess = sum(num(r, "L1 Wavefronts Shared Excessive") for r in rows)
    waves = sum(num(r, "L1 Wavefronts Shared") for r in rows)
    print(f"{len(rows)} instructions, {total:.0f} samples; shared wavefronts {waves:.3g} ({excess:.3g} excessive)")
    for c, v in sums.most_common(10):
        print(f"  {v / max(total, 1):6.1%}  {c[6:]}")
    print(f"\ntop {top} instructions by samples (index, share, top reasons, shared wavefronts / excessive, SASS):")
    for i, r in sorted(enumerate(rows), key=lambda x: -num(x[1], "Warp Stall Sampling (All Samples)"))[:top]:
        rs = sorted(((num(r, c), c) for c in reasons), reverse=True)[:3]
        why = ", ".join(f"{c[6:][:12]} {v:.0f}" for v, c in rs if v > 0)
        wf = f"{num(r, 'L1 Wavefronts Shared'):.0f}/{num(r, 'L1 Wavefronts Shared Excessive'):.0f}"
        print(f"  {i:5d} {num(r, 'Warp Stall Sampling (All Samples)') / max(total, 1):6.2%}  {why:44s} {wf:>14s} "
              f"{r['Source'][:64]}")
    worst = sorted(enumerate(rows), key=lambda x: -num(x[1], "L1 Wavefronts Shared Excessive"))[:8]
    print("\nmost excessive shared wavefronts:")
    for i, r in worst:
        if num(r, "L1 Wavefronts Shared Excessive"):
            print(f"  {i:5d} {num(r, 'L1 Wavefronts Shared'):.3g} / {num(r, 'L1 Wavefronts Shared Excessive'):.3g}  "
                  f"{r['Source'][:70]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--kernel", default="gluon:fp8reg")
    r.add_argument("--shape", default="16,128,16384", help="H,B,L")
    r.add_argument("--kv", default="fp8")
    s = sub.add_parser("report")
    s.add_argument("csv")
    s.add_argument("--top", type=int, default=40)
    a = p.parse_args(argv)
    if a.cmd == "run":
        run(a.kernel, a.shape, a.kv)
    else:
        report(a.csv, a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
