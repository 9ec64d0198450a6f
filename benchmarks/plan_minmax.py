"""The split plan for mixed lengths with the fewest chunks a program (min-max) against the plan
as shipped, on the batches of ``varlen_decode.py``, in one process.

    PYTHONPATH=src python3 benchmarks/plan_minmax.py [--heads 16 128] [--batch 32] [--max-len 16384]
    PYTHONPATH=src python3 benchmarks/plan_minmax.py --model      # the chunk counts alone, no GPU

As shipped (``decode_gluon._planned_split``), sequence i of c_i 64-key chunks gets 1 +
floor((P - B) c_i / total) of the P programs, the remainder one each to the first sequences. With
P = 2 B (128 heads at B 32) that leaves a long sequence twice the keys a program of the ideal
split: uniform lengths in 1..16k, 128 chunks in the busiest program where total / P is 65. The
variant takes the least T with sum_i max(1, ceil(c_i / T)) <= P (a binary search between
ceil(total / P) and the longest c_i, each step one round of sums), gives sequence i max(1,
ceil(c_i / T)) programs and the programs left one each in turn: 87 chunks there. FlashInfer's
plan searches its chunk size the same way (on the host).

Variants of ``decode_gluon.py`` (the seesaw, and through it the narrow kernel, which imports its
plan) made by editing the source text (variants.py); equal lengths keep the short path, so only
the mixed rows move. Prints both kernels' times, the busiest program's chunks under each rule
(the model: a step's time about the fixed cost plus that many chunks' time), and each output's
relative error against the float32 reference.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from variants import KERNELS, absolute_imports, edit, load_module  # noqa: E402

from mla import bench  # noqa: E402

# the shipped mixed path's share of programs: from its first line through its last
SHIPPED_FROM = "        n = gl.where(ok, (P - B) * chunks // gl.maximum(total, 1), 0)\n"
SHIPPED_TO = "        first = last - count\n"
MINMAX_MIXED = """        c32 = chunks.to(gl.int32)
        lo = gl.maximum((total.to(gl.int32) + P - 1) // P, 1)
        hi = gl.maximum(gl.max(c32, axis=0), lo)           # one program a sequence always fits
        while lo < hi:
            t = (lo + hi) // 2
            need = gl.sum(gl.where(ok, gl.maximum((c32 + t - 1) // t, 1), 0), axis=0)
            hi = gl.where(need <= P, t, hi)
            lo = gl.where(need <= P, lo, t + 1)
        n = gl.where(ok, gl.maximum((c32 + lo - 1) // lo, 1), 0)
        left = P - gl.sum(n, axis=0)                       # >= 0, one each in turn
        count = (n + gl.where(ok, left // B + (i < left % B).to(gl.int32), 0)).to(gl.int64)
        last = gl.associative_scan(count, 0, _add)
        first = last - count
"""


def variant_modules(workdir: str) -> dict:
    """{"shipped" | "minmax": (decode_gluon module, decode_gluon_narrow module)}; the narrow copy
    imports its plan from the decode_gluon copy beside it."""
    out = {}
    for name in ("shipped", "minmax"):
        src = absolute_imports((KERNELS / "decode_gluon.py").read_text())
        if name == "minmax":
            a = src.index(SHIPPED_FROM)
            z = src.index(SHIPPED_TO, a) + len(SHIPPED_TO)
            src = edit(src, src[a:z], MINMAX_MIXED)
        gmod = load_module(src, f"plan_{name}_gluon", workdir)
        sys.modules[gmod.__name__] = gmod
        nsrc = absolute_imports((KERNELS / "decode_gluon_narrow.py").read_text())
        nsrc = edit(nsrc, "from mla.ops.triton.decode_gluon import", f"from {gmod.__name__} import")
        out[name] = (gmod, load_module(nsrc, f"plan_{name}_narrow", workdir))
    return out


def busiest(lens: torch.Tensor, P: int, rule: str) -> int:
    """The most 64-key chunks any program gets under a rule (the model of the step's time)."""
    c = [(int(x) + 63) // 64 for x in lens]
    B = len(c)
    if rule == "shipped":
        total = max(sum(c), 1)
        n = [1 + (P - B) * x // total for x in c]
        left = P - sum(n)
        n = [v + left // B + (i < left % B) for i, v in enumerate(n)]
    else:
        lo, hi = max(1, -(-sum(c) // P)), max(max(c), 1)
        while lo < hi:
            t = (lo + hi) // 2
            if sum(max(1, -(-x // t)) for x in c) <= P:
                hi = t
            else:
                lo = t + 1
        n = [max(1, -(-x // lo)) for x in c]
    return max(-(-x // k) for x, k in zip(c, n))


def main(argv=None) -> int:
    from varlen_decode import mixes

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument("--batch", type=int, nargs="+", default=[32])
    p.add_argument("--max-len", type=int, nargs="+", default=[16384])
    p.add_argument("--model", action="store_true", help="only the busiest program's chunks (no GPU)")
    args = p.parse_args(argv)
    if not args.model and not torch.cuda.is_available():
        sys.exit("plan_minmax: needs a CUDA GPU (or --model)")
    from mla.ops.triton import decode_gluon
    if args.model:      # the split count as on the H200 (132 SMs), without one
        decode_gluon._num_sms = lambda index: 132
    mods = None if args.model else variant_modules(tempfile.mkdtemp())
    print(f"{'H':>4} {'B':>4} {'max':>6} {'mix':>9} {'P':>5} {'chunks':>13} {'shipped us':>11} {'minmax us':>10} "
          f"{'ratio':>6} {'errors':>19}")
    for H in args.heads:
        for B in args.batch:
            for L in args.max_len:
                base = None if args.model else bench.decode_case(H, B, L, 1, 64)
                copies = None if args.model else bench.rotated_copies(base["kv"])
                for name, lens in mixes(B, L, torch.Generator().manual_seed(B + L)).items():
                    P = B * decode_gluon.default_splits(B, H, L, torch.device("cuda", 0))
                    chunks = f"{busiest(lens, P, 'shipped')} -> {busiest(lens, P, 'minmax')}"
                    times, errs = {}, {}
                    if not args.model:
                        from mla.ops import reference
                        from mla.ops.triton.decode import use_narrow
                        c = dict(base, seqlens=lens.to(base["q"].device))
                        ref = reference.mla_decode(c["q"], c["kv"], c["table"], c["seqlens"], bench.DL, c["scale"],
                                                   True)[0].float()
                        narrow = use_narrow(c["q"], c["kv"])      # the dispatch's choice between the two
                        for rule, (g, n) in mods.items():
                            fn = n.launch_narrow if narrow else g.launch_gluon

                            def op(kv, fn=fn, c=c):
                                return fn(c["q"], kv, c["table"], c["seqlens"], bench.DL, c["scale"], True)[0]
                            errs[rule] = bench._rel_err(op(c["kv"]), ref)
                            times[rule] = bench.graph_time_us([lambda kv=kv, op=op: op(kv) for kv in copies])
                    t0, t1 = times.get("shipped", float("nan")), times.get("minmax", float("nan"))
                    err = " ".join(f"{errs[r]:.2e}" for r in errs) if errs else "-"
                    print(f"{H:>4} {B:>4} {L:>6} {name:>9} {P:>5} {chunks:>13} {t0:11.1f} {t1:10.1f} "
                          f"{t1 / t0:6.3f} {err:>19}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
