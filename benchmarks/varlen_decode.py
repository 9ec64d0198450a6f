"""Decode over batches of mixed lengths: the dispatched op against FlashInfer's fa3 MLA (whose
plan shares the work out by the actual lengths) in one process, by ``mla bench decode``'s
method (CUDA graphs over cache copies rotated past the L2).

    PYTHONPATH=src python3 benchmarks/varlen_decode.py [--heads 16 128] [--batch 32] [--max-len 16384] [--profile]

Each row is one length mix over a table of max-len keys a sequence: "equal" (all max-len, the
grid's case), "uniform" (lengths uniform in [1, max-len]), "one long" (one sequence max-len, the
others max-len / 16). Prints the times, mla / fa3, the cache bytes read per step over the time,
and the op's relative error against the float32 reference.
"""
from __future__ import annotations

import argparse
import sys

import torch

from mla import bench
from mla.ops import reference


def kernel_times(fn, n: int = 20) -> dict[str, float]:
    """Mean device time in us of each kernel fn launches, over n eager calls (torch.profiler).
    Under a programmatic dependent launch a kernel's time includes its wait for the one before."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return {e.key[:28]: e.device_time_total / n for e in prof.key_averages() if e.device_time_total > 0}


def mixes(B: int, L: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    one_long = torch.full((B,), max(1, L // 16), dtype=torch.int32)
    one_long[B // 2] = L
    return {"equal": torch.full((B,), L, dtype=torch.int32),
            "uniform": torch.randint(1, L + 1, (B,), generator=g, dtype=torch.int32),
            "one long": one_long}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument("--batch", type=int, nargs="+", default=[32])
    p.add_argument("--max-len", type=int, nargs="+", default=[16384])
    p.add_argument("--kv", nargs="+", default=["bf16"], choices=["bf16", "fp8"])
    p.add_argument("--profile", action="store_true",
                   help="also print each kernel's mean device time (CUDA profiler, eager launches) of both ops")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("varlen_decode: needs a CUDA GPU")
    try:        # one workspace for every case; each case plans with its own lengths
        make_fa = bench.flashinfer_provider()
    except Exception as e:      # not installed: the op alone
        print(f"flashinfer: {type(e).__name__}: {e}", file=sys.stderr)
        make_fa = None
    print(f"{'H':>4} {'B':>4} {'max':>6} {'kv':>5} {'mix':>9} {'keys':>8} {'mla us':>8} {'fa3 us':>8} "
          f"{'mla/fa3':>8} {'mla TB/s':>9} {'rel err':>9}")
    for kv_format in args.kv:
        for H in args.heads:
            for B in args.batch:
                for L in args.max_len:
                    base = bench.decode_case(H, B, L, 1, 64, kv_format=kv_format)
                    copies = bench.rotated_copies(base["kv"])
                    for name, lens in mixes(B, L, torch.Generator().manual_seed(B + L)).items():
                        c = dict(base, seqlens=lens.to(base["q"].device))
                        ref = reference.mla_decode(c["q"], c["kv"], c["table"], c["seqlens"], c["r"], c["scale"],
                                                   True)[0].float()
                        op = bench.op_provider()(c).call
                        err = bench.rel_err(op(c["kv"]), ref)
                        t_op = bench.graph_time_us([lambda kv=kv: op(kv) for kv in copies])
                        t_fa = float("nan")
                        if make_fa is not None:
                            fa = make_fa(c).call
                            t_fa = bench.graph_time_us([lambda kv=kv: fa(kv) for kv in copies])
                        keys = int(lens.sum())
                        print(f"{H:>4} {B:>4} {L:>6} {kv_format:>5} {name:>9} {keys:>8} {t_op:8.1f} {t_fa:8.1f} "
                              f"{t_op / t_fa:8.2f} {keys * bench.row_bytes(kv_format) / t_op / 1e6:9.2f} {err:9.2e}",
                              flush=True)
                        if args.profile:    # the split kernel against the combine, e.g. one long's many slots
                            for who, fn in (("mla", op), ("fa3", fa if make_fa is not None else None)):
                                if fn is not None:
                                    ks = kernel_times(lambda fn=fn, c=c: fn(c["kv"]))
                                    print(f"      {who}: " + ", ".join(f"{k} {v:.1f}" for k, v in ks.items()),
                                          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
