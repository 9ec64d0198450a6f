"""What a decode step pays besides its key tiles, for the kernel ``mla.ops`` dispatches to (the
seesaw or the narrow Gluon kernel), at the shapes where that is a large part of the time
(batch 1, and 1k-key rows; docs/PERF.md).

    PYTHONPATH=src python3 benchmarks/fixed_cost.py [--shapes 16,32,1024,1 ...]

Variants, timed by ``mla bench decode``'s method (the outputs of all but "shipped" are wrong by
design):
  no_combine      the split kernel alone (the LSE combine of its partials left out)
  no_tiles        no key tiles: launch, query loads, stores and combine
  no_tiles_store  no_tiles, and the output or partial stores masked off
  carveout        shipped, after the combine kernel was asked for the largest shared-memory
                  carveout (the split kernels need it; a combine launched with another one
                  may have to wait for the SMs to switch); timed last, as it cannot be undone
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from seesaw_breakdown import variant_source as seesaw_source  # noqa: E402
from variants import KERNELS, absolute_imports, edit, load_module, parse_shapes, time_launchers  # noqa: E402

from mla import bench  # noqa: E402

SHAPES = ["16,1,1024,1", "16,1,16384,1", "16,32,1024,1", "16,128,1024,1", "128,1,16384,1", "128,1,16384,2",
          "128,32,1024,1"]
_CARVEOUT_ATTR = 9     # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT


def narrow_source(mode: str) -> str:
    src = absolute_imports((KERNELS / "decode_gluon_narrow.py").read_text())
    src = edit(src, "stride_qi, stride_qh, 0, R)\n", "stride_qi, stride_qh, 0, R)\n"
               "    n_tiles = gl.minimum(end - start, 0)\n")
    if mode == "no_tiles_store":
        src = edit(src, "mask=(r < H * S_Q)[None, :] & (d < 512)[:, None]", "mask=(r < 0)[None, :] & (d < 512)[:, None]")
    return src


def set_combine_carveout(percent: int) -> int:
    """The preferred shared-memory carveout of every compiled combine kernel; returns how many."""
    from mla.ops.triton import decode

    cuda = ctypes.CDLL("libcuda.so.1")
    n = 0
    for kernel_cache, *_ in decode._combine_kernel.device_caches.values():
        for k in kernel_cache.values():
            k._init_handles()
            rc = cuda.cuFuncSetAttribute(ctypes.c_void_p(k.function), _CARVEOUT_ATTR, percent)
            if rc != 0:
                raise RuntimeError(f"cuFuncSetAttribute: CUresult {rc}")
            n += 1
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=SHAPES, help="H,B,L,s_q")
    args = p.parse_args(argv)
    shapes = parse_shapes(args.shapes, "H,B,L,s_q")
    if not torch.cuda.is_available():
        sys.exit("fixed_cost: needs a CUDA GPU")
    from mla.ops.triton import decode, decode_gluon, decode_gluon_narrow

    names = ("shipped", "no_combine", "no_tiles", "no_tiles_store")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        mods = {"seesaw": {"shipped": decode_gluon}, "narrow": {"shipped": decode_gluon_narrow}}
        for kern, source, file in (("seesaw", seesaw_source, "decode_gluon.py"),
                                   ("narrow", narrow_source, "decode_gluon_narrow.py")):
            solo = load_module(absolute_imports((KERNELS / file).read_text()), f"{kern}_solo", tmp)
            solo.combine = lambda *a: None
            mods[kern]["no_combine"] = solo
            for m in ("no_tiles", "no_tiles_store"):
                mods[kern][m] = load_module(source(m), f"{kern}_{m}", tmp)
        cases = []
        for H, B, L, s_q in shapes:
            c = bench.decode_case(H, B, L, s_q, 64)
            kern = "narrow" if decode.use_narrow(c["q"], c["kv"]) else "seesaw"
            fn = "launch_narrow" if kern == "narrow" else "launch_gluon"

            def launch(kv, mod, c=c, fn=fn):
                return getattr(mod, fn)(c["q"], kv, c["table"], c["seqlens"], bench.DL, c["scale"], True)[0]
            launchers = {n: (lambda kv, mod=mods[kern][n], launch=launch: launch(kv, mod)) for n in names}
            times, err = time_launchers(c, launchers)
            rows.append([(H, B, L, s_q), kern, times, err])
            cases.append((c, launchers["shipped"]))
        n = set_combine_carveout(100)
        for row, (c, shipped) in zip(rows, cases):
            row[2]["carveout"] = time_launchers(c, {"shipped": shipped}, checked=None)[0]["shipped"]
        print(f"(carveout set on {n} compiled combine kernels)")
    cols = names + ("carveout",)
    print(f"{'H':>4} {'B':>4} {'L':>6} {'s_q':>3} {'kernel':>7} " + " ".join(f"{k:>14}" for k in cols) + "  err")
    for (H, B, L, s_q), kern, times, err in rows:
        print(f"{H:>4} {B:>4} {L:>6} {s_q:>3} {kern:>7} " + " ".join(f"{times[k]:14.1f}" for k in cols) + f"  {err:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
