"""How the split count of the Hopper decode kernels trades parallelism against the float32
partials each split writes and the combine reads back (512 x 4 bytes per query row and split,
about 1.8 keys' worth of cache per row).

    PYTHONPATH=src python3 benchmarks/splits_sweep.py [--shapes 128,1,16384,1 ...]

Per shape (H,B,L,s_q): the kernel ``mla.ops`` dispatches to, timed by ``mla bench decode``'s
method at its default split count and at a quarter, half and double of it (and, with
--block-n, for each seesaw key tile); prints times over the default's (with --block-n, the
default count at the first tile listed), so a better default shows as a ratio below 1.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from variants import parse_shapes, time_launchers  # noqa: E402

from mla import bench  # noqa: E402

SHAPES = ["16,1,4096,1", "16,1,16384,1", "16,32,1024,1", "16,32,4096,1", "128,1,4096,1", "128,1,16384,1",
          "128,1,16384,2", "128,32,1024,1", "128,32,4096,1", "128,32,1024,2"]
FACTORS = (0.25, 0.5, 1, 2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=SHAPES, help="H,B,L,s_q")
    p.add_argument("--block-n", type=int, nargs="+", default=None, choices=[32, 64],
                   help="also sweep the seesaw's key tile (default: its own choice only)")
    args = p.parse_args(argv)
    shapes = parse_shapes(args.shapes, "H,B,L,s_q")
    if not torch.cuda.is_available():
        sys.exit("splits_sweep: needs a CUDA GPU")
    from mla.ops.triton import decode, decode_gluon, decode_gluon_narrow

    print(f"{'H':>4} {'B':>4} {'L':>6} {'s_q':>3} {'kernel':>7} {'BN':>4} {'S':>4} {'us':>8}  "
          + " ".join(f"{'S x' + str(f):>11}" for f in FACTORS) + "  (time / default's)")
    for H, B, L, s_q in shapes:
        c = bench.decode_case(H, B, L, s_q, 64)
        narrow = decode.use_narrow(c["q"], c["kv"])
        fn = decode_gluon_narrow.launch_narrow if narrow else decode_gluon.launch_gluon
        s0 = decode_gluon.default_splits(B, H * s_q, c["table"].shape[1] * c["page"], c["q"].device)
        counts = {f: max(1, min(round(s0 * f), L // 32)) for f in FACTORS}
        tiles = [None] if narrow or not args.block_n else args.block_n

        def launch(kv, S, bn, c=c, fn=fn):
            kw = {} if bn is None else {"block_n": bn}
            return fn(c["q"], kv, c["table"], c["seqlens"], bench.DL, c["scale"], True, num_splits=S, **kw)[0]
        launchers = {(S, bn): (lambda kv, S=S, bn=bn, launch=launch: launch(kv, S, bn))
                     for S in sorted(set(counts.values())) for bn in tiles}
        times, err = time_launchers(c, launchers, checked=(s0, tiles[0]))
        t0 = times[(s0, tiles[0])]     # the default split count (and the first tile asked for)
        for bn in tiles:
            cols = " ".join(f"{times[(counts[f], bn)] / t0:.3f}({counts[f]})".rjust(11) for f in FACTORS)
            print(f"{H:>4} {B:>4} {L:>6} {s_q:>3} {'narrow' if narrow else 'seesaw':>7} {bn or '-':>4} {s0:>4} "
                  f"{times[(s0, bn)]:8.1f}  {cols}  err {err:.1e}", flush=True)
        del c, launchers
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
