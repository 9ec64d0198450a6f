"""Where the seesaw decode kernel's time goes at 128 heads (docs/PERF.md, "Decode: the seesaw
at 128 heads, where the time goes").

    PYTHONPATH=src python3 benchmarks/seesaw_breakdown.py [--modes no_tiles] [--shapes 16,1,16384 ...]

Variants of ``mla/ops/triton/decode_gluon.py`` made by editing its source text (see
variants.py), timed beside the kernel as shipped by the method of ``mla bench decode`` (CUDA
graph over rotated caches), bf16 rows, DeepSeek-V3 dims; the outputs of all but "shipped" are
wrong by design:
  no_load   the loader arrives on each box's barrier instead of copying (tiles hold whatever
            shared memory held): everything but the loads
  no_mma    every warpgroup MMA returns its accumulator: loads, softmax, hand-offs, waits
  no_qk     only S = Q K^T's MMAs left out
  no_pv     only the P V MMAs left out
  no_tiles  no key tiles at all: launch, query loads, the end of the partitions, the stores and
            the combine, i.e. each program's fixed cost (what 1k-key rows pay besides their tiles)
  no_tiles_q      no_tiles, and the query loads masked off
  no_tiles_store  no_tiles, and the output (or partial) stores masked off
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from variants import KERNELS, absolute_imports, edit, load_module, parse_shapes, time_launchers  # noqa: E402

from mla import bench  # noqa: E402

SRC = KERNELS / "decode_gluon.py"
_NOMMA = '''@gluon.jit
def _nomma(a, b, acc, use_acc=True, is_async=True):
    return acc


@gluon.jit
def _qk('''


def variant_source(mode: str) -> str:
    src = absolute_imports(SRC.read_text())
    if mode in ("no_tiles", "no_tiles_q", "no_tiles_store"):
        src = edit(src, "_planned_split(SEQLENS, INFO, B, p, num_splits, BN, BLOCK_B)\n",
                   "_planned_split(SEQLENS, INFO, B, p, num_splits, BN, BLOCK_B)\n    n_tiles = gl.minimum(end - start, 0)\n")
        if mode == "no_tiles_q":       # nor the query loads (all masked off)
            src = edit(src, "qmask = (rows < H * S_Q)", "qmask = (rows < 0)")
            src = edit(src, "mask = (rows < H * S_Q)[:, None] & (cols < 64)", "mask = (rows < 0)[:, None] & (cols < 64)")
        if mode == "no_tiles_store":   # nor the stores of the output or partials (masked off; the
            # TMA output, used with one split since 1c9e025 and for 16-bit partials after it, turned
            # off so that these are the stores)
            src = edit(src, "mask=(mo < H * S_Q)[:, None]", "mask=(mo < 0)[:, None]")
            src = edit(src, "tma_out = rows % _BLOCK_M == 0", "tma_out = False and rows % _BLOCK_M == 0")
        return src
    if mode == "no_load":   # the seesaw's loader path (the tile released in halves)
        for c, dst in (("[row0, c * 64]", "ring.index(buf).slice(c * 64, 64, dim=1))"),
                       ("[row0, 512]", "ring_pe.index(buf))")):
            pad = " " * 20
            head = (f"{pad}mbarrier.expect(bar, kv_desc.block_type.nbytes)\n"
                    f"{pad}tma.async_copy_global_to_shared(kv_desc, {c}, bar,")
            i = src.index(head)
            j = src.index(dst, i) + len(dst)
            src = src[:i] + f"{pad}mbarrier.arrive(bar, count=1)" + src[j:]
        return src
    a, b = src.index("def _qk("), src.index("def _widen_part(")
    c, d = src.index("def _wg0("), src.index("def _loader(")
    if mode == "no_qk":
        src = src[:a] + src[a:b].replace("warpgroup_mma(", "_nomma(") + src[b:]
    elif mode == "no_pv":
        src = src[:c] + src[c:d].replace("warpgroup_mma(", "_nomma(") + src[d:]
    elif mode == "no_mma":
        src = src[:a] + src[a:d].replace("warpgroup_mma(", "_nomma(") + src[d:]
    else:
        raise ValueError(mode)
    return edit(src, "@gluon.jit\ndef _qk(", _NOMMA)


MODES = ("no_load", "no_mma", "no_qk", "no_pv", "no_tiles", "no_tiles_q", "no_tiles_store")
SHAPES = ["128,128,16384", "128,32,4096", "128,128,1024", "128,32,1024"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--shapes", nargs="+", default=SHAPES, help="H,B,L (heads, batch, cache length)")
    args = p.parse_args(argv)
    shapes = parse_shapes(args.shapes, "H,B,L")
    if not torch.cuda.is_available():
        sys.exit("seesaw_breakdown: needs a CUDA GPU")
    from mla.ops.triton import decode_gluon as shipped

    with tempfile.TemporaryDirectory() as tmp:
        kernels = {"shipped": shipped, **{m: load_module(variant_source(m), f"seesaw_{m}", tmp) for m in args.modes}}
        print(f"{'H':>4} {'B':>4} {'L':>6} " + " ".join(f"{k + ' us':>11}" for k in kernels) + "  err (shipped)")
        for H, B, L in shapes:
            c = bench.decode_case(H, B, L, 1, 64)

            def launch(kv, mod, c=c):
                return mod.launch_gluon(c["q"], kv, c["table"], c["seqlens"], bench.DL, c["scale"], True)[0]
            launchers = {name: (lambda kv, mod=mod: launch(kv, mod))
                         for name, mod in kernels.items()}
            times, err = time_launchers(c, launchers)
            cols = " ".join(f"{times[k]:11.1f}" for k in kernels)
            print(f"{H:>4} {B:>4} {L:>6} {cols}  {err:.1e}", flush=True)
            del c, launchers
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
