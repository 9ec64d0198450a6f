"""Thread barriers that Triton 3.6 adds between accesses to different slots of one shared
allocation, and kernel variants without them.

Triton 3.6's barrier analysis (membar) does not tell the slots of one allocation apart: two
stores into q8.index(0) and q8.index(1), two mbarrier inits or two mbarrier waits on
ready.index(i) and ready.index(i + 1) each get a CTA (or warpgroup) barrier between them, where
separate allocations get none (a 4-slot allocation: 7 barriers for 4 inits and 4 waits; 4
allocations: 1). Found in the sm_90a PTX (``--sass``), where:
  - the FP8 kernel's prologue stores each query chunk's two e4m3 halves one after another into
    the [9, 32, 64] q8 buffer: 17 barriers (of its 28 before the first tile);
  - the bf16 narrow kernel and the seesaw wait on the 9 boxes of a tile (one mbarrier each, so
    that S^T starts on the first columns) in one allocation: 8 barriers a tile and warpgroup.
Variants, built by editing the kernels' source text (``variants.py``):
  fp8 q8_split      q8 as 9 allocations of [32, 64], each chunk's halves joined in registers
                    and stored at once: 80 -> 63 bar.sync in the PTX (prologue only)
  narrow box_bars   bf16 rows: each of the 18 box mbarriers (2 tiles x 9 boxes) its own
                    allocation, waited on by constant index; the loader picks its tile's set
                    with a branch: 115 -> 66 bar.sync (8 fewer a tile and warpgroup)
  narrow q_split    the query's 8 latent chunks as 8 allocations (was one [R, 512]): 8 stores
                    without barriers between them: 115 -> 108 bar.sync (prologue only)
  seesaw box_bars   the same as narrow box_bars for the seesaw's ring of two 64-key tiles
                    (bf16 rows, block_n 64): 121 -> 72 bar.sync
Registers and MMA counts are unchanged, and the stack but for the FP8 variant's (24 -> 32
bytes) (``--sass``). Compiled only: none of the four has run on a GPU.

    PYTHONPATH=src python3 benchmarks/barrier_allocs.py [--shapes 16,32,4096 ...]   # on the GPU
    PYTHONPATH=src python3 benchmarks/barrier_allocs.py --sass                      # offline

On the GPU: each variant beside the shipped kernel on its own shapes (``RUNS``; FP8 rows for
fp8, bf16 rows for the others), ``mla bench decode``'s timing, and both outputs' relative error
against the float64 reference (the variants must match the shipped kernels' error).
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

_Q8_ALLOC = "    q8 = gl.allocate_shared_memory(gl.float8e4nv, [9, 2 * _R, 64], Q8_SM)\n"


def fp8_q8_split(src: str) -> str:
    src = edit(src, "        q8.index(c).slice(0, _R, dim=0).store(hi.to(gl.float8e4nv))          # exact\n"
                    "        q8.index(c).slice(_R, _R, dim=0).store((x - hi).to(gl.float8e4nv))\n",
               "        both = gl.join(hi, x - hi).permute((2, 0, 1)).reshape([2 * _R, 64])   # [hi; lo]\n"
               "        q8[c].store(both.to(gl.float8e4nv))\n")
    for old in ("q8.index(0)", "q8.index(8)", "q8.index(2 * g)", "q8.index(2 * g + 1)"):
        src = edit(src, old, old.replace(".index(", "[").replace(")", "]"))
    src = edit(src, "q8.index(c).permute", "q8[c].permute")
    alloc = "gl.allocate_shared_memory(gl.float8e4nv, [2 * _R, 64], Q8_SM)"
    return edit(src, _Q8_ALLOC, "    q8 = (" + ", ".join([alloc] * 9) + ")\n")


# shared by both box_bars variants: a box's copy on its own mbarrier, and the box mbarriers
_BOXES = '''
@gluon.jit
def _copy_box(kv_desc, row0, bar, dst, col: gl.constexpr):
    mbarrier.expect(bar, kv_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(kv_desc, [row0, col], bar, dst)


@gluon.jit
def _one_barrier():
    b = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(b, count=1)
    return b


@gluon.jit
def _box_set():
    return (_one_barrier(), _one_barrier(), _one_barrier(), _one_barrier(), _one_barrier(), _one_barrier(),
            _one_barrier(), _one_barrier(), _one_barrier())
'''

_BOX_LOADER = _BOXES + '''

@gluon.jit
def _issue_boxes(kv_desc, row0, bars, dst, dst_pe):
    for c in gl.static_range(8):
        _copy_box(kv_desc, row0, bars[c], dst.slice(c * 64, 64, dim=1), c * 64)
    _copy_box(kv_desc, row0, bars[8], dst_pe, 512)


@gluon.jit
def _loader_boxes(ring, ring_pe, ready, free, start, n_tiles, BT, bt_row, block_size, blk0, kv_desc):
    \"\"\"_loader for bf16 rows and a ring of two tiles, the boxes' mbarriers in ready[slot][c].\"\"\"
    BN: gl.constexpr = ring.shape[1]
    for j in range(n_tiles):
        buf = j % 2
        n0 = start + j * BN
        blk = gl.load(BT + bt_row + n0 // block_size, mask=j > 0, other=blk0)
        row0 = blk * block_size + n0 % block_size
        mbarrier.wait(free.index(buf), ((j // 2) & 1) ^ 1)
        if buf == 0:
            _issue_boxes(kv_desc, row0, ready[0], ring.index(0), ring_pe.index(0))
        else:
            _issue_boxes(kv_desc, row0, ready[1], ring.index(1), ring_pe.index(1))


@gluon.jit
def _box_barriers():
    \"\"\"ready[slot][c]: 2 x 9 mbarriers, each its own allocation; free: one allocation of 2.\"\"\"
    ready0 = _box_set()
    ready1 = _box_set()
    free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(free.index(i), count=1)
    return ready0, ready1, free


@gluon.jit
def _narrow_wg('''


def narrow_box_bars(src: str) -> str:
    """bf16 rows only (the FP8 branches keep ``ready`` as it was and are not compiled here)."""
    src = edit(src, "    fence_async_shared,\n    mbarrier,\n", "    fence_async_shared,\n    mbarrier,\n    tma,\n")
    src = edit(src, "\n@gluon.jit\ndef _narrow_wg(", _BOX_LOADER)
    src = edit(src, "                    mbarrier.wait(ready.index(WG * 9 + c), ph)\n",
               "                    mbarrier.wait(ready[WG][c], ph)\n")
    src = edit(src, "                mbarrier.wait(ready.index(WG * 9 + c), ph)\n",
               "                mbarrier.wait(ready[WG][c], ph)\n")
    src = edit(src, "            mbarrier.wait(ready.index(WG * 9 + 8), ph)\n", "            mbarrier.wait(ready[WG][8], ph)\n")
    src = edit(src, "        ready, free = _ring_barriers(2)\n",
               "        ready0, ready1, free = _box_barriers()\n        ready = (ready0, ready1)\n")
    return edit(src, "        (_loader, (ring, ring_pe, ring_sc, ready, free, start, n_loads, kv_desc, pe_desc, sc_desc, BT, bt_row,\n"
                     "                   block_size, blk0, KV_FMT)),\n",
                "        (_loader_boxes, (ring, ring_pe, ready, free, start, n_loads, BT, bt_row, block_size, blk0, kv_desc)),\n")


_SEESAW_LOADER = '''
@gluon.jit
def _issue_halves(kv_desc, row0, bars, dst, dst_pe, free, BUF: gl.constexpr, fph):
    for h in gl.static_range(2):
        mbarrier.wait(free.index(2 * BUF + h), fph)
        for c in gl.static_range(4 * h, 4 * h + 4):
            _copy_box(kv_desc, row0, bars[c], dst.slice(c * 64, 64, dim=1), c * 64)
        if BUF == h:     # k_pe with the half of the tile's owner (tile j -> slot j % 2)
            _copy_box(kv_desc, row0, bars[8], dst_pe, 512)


@gluon.jit
def _loader_halves_boxes(ring, ring_pe, ready, free, start, n_tiles, BT, bt_row, block_size, blk0, kv_desc):
    """_loader with HALVES for bf16 rows and two 64-key tiles, the boxes' mbarriers in ready[slot][c]."""
    BN: gl.constexpr = ring.shape[1]
    for j in range(n_tiles):
        n0 = start + j * BN
        blk = gl.load(BT + bt_row + n0 // block_size, mask=j > 0, other=blk0)
        row0 = blk * block_size + n0 % block_size
        fph = ((j // 2) & 1) ^ 1
        if j % 2 == 0:
            _issue_halves(kv_desc, row0, ready[0], ring.index(0), ring_pe.index(0), free, 0, fph)
        else:
            _issue_halves(kv_desc, row0, ready[1], ring.index(1), ring_pe.index(1), free, 1, fph)
'''


def seesaw_box_bars(src: str) -> str:
    """bf16 rows, 64-key tiles (a ring of two: tile 2i in slot 0, 2i + 1 in slot 1) only."""
    src = edit(src, "\n@gluon.jit\ndef _qk(", _BOXES + "\n" + _SEESAW_LOADER + "\n\n@gluon.jit\ndef _qk(")
    # _qk's waits: ready is now the tile's box set
    i = src.index("@gluon.jit\ndef _qk(")
    j = src.index("@gluon.jit", i + 1)
    qk = src[i:j]
    assert qk.count("ready.index(buf * 9 + c)") == 2 and qk.count("ready.index(buf * 9 + 8)") == 1
    src = src[:i] + qk.replace("ready.index(buf * 9 + c)", "ready[c]").replace("ready.index(buf * 9 + 8)", "ready[8]") \
        + src[j:]
    src = edit(src, "kpe_smem.index(b0), ready, b0, kph,", "kpe_smem.index(0), ready[0], 0, kph,")
    src = edit(src, "kpe_smem.index(b1), ready, b1, kph,", "kpe_smem.index(1), ready[1], 1, kph,")
    src = edit(src, "    ready = gl.allocate_shared_memory(gl.int64, [NLOAD * 9, 1], mbarrier.MBarrierLayout())\n",
               "    ready = (_box_set(), _box_set())\n")
    src = edit(src, "    for i in gl.static_range(NLOAD * 9):\n        mbarrier.init(ready.index(i), count=1)\n", "")
    return edit(src, "        (_loader, (ring, ring_pe, ring_sc, ready, free, start, n_tiles, kv_desc, pe_desc, sc_desc, BT, bt_row,\n"
                     "                   block_size, blk0, KV_FMT, KV_FMT == 0)),\n",
                "        (_loader_halves_boxes, (ring, ring_pe, ready, free, start, n_tiles, BT, bt_row, block_size, blk0,\n"
                "                                kv_desc)),\n")


def narrow_q_split(src: str) -> str:
    """The query's 8 latent chunks as 8 allocations of [R, 64] (was one [R, 512])."""
    src = edit(src, "    R: gl.constexpr = q_smem.shape[0]\n", "    R: gl.constexpr = q_smem[0].shape[0]\n")
    src = edit(src, "    dtype: gl.constexpr = q_smem.dtype\n", "    dtype: gl.constexpr = q_smem[0].dtype\n")
    src = edit(src, "q_smem.slice(c * 64, 64, dim=1).permute((1, 0))", "q_smem[c].permute((1, 0))")
    src = edit(src, "        q_smem.slice(c * 64, 64, dim=1).store(xq[c].to(dtype))\n", "        q_smem[c].store(xq[c].to(dtype))\n")
    alloc = "gl.allocate_shared_memory(dtype, [R, 64], SM_L)"
    return edit(src, "    q_smem = gl.allocate_shared_memory(dtype, [R, 512], SM_L)\n",
                "    q_smem = (" + ", ".join([alloc] * 8) + ")\n")


VARIANTS = {"fp8 q8_split": ("decode_gluon_fp8.py", fp8_q8_split),
            "narrow box_bars": ("decode_gluon_narrow.py", narrow_box_bars),
            "narrow q_split": ("decode_gluon_narrow.py", narrow_q_split),
            "seesaw box_bars": ("decode_gluon.py", seesaw_box_bars)}


def variant_source(name: str) -> str:
    path, fn = VARIANTS[name]
    return fn(absolute_imports((KERNELS / path).read_text()))


def sass_report() -> None:
    """Barriers in the sm_90a PTX of each shipped kernel and its variant (no GPU needed)."""
    import compile_sm90 as c

    work = tempfile.mkdtemp()
    for name in VARIANTS:
        mod = load_module(variant_source(name), name.replace(" ", "_"), work)
        for label, m in (("shipped", None), ("variant", mod)):
            k = {"fp8": c.fp8_kernel, "narrow": c.narrow_kernel, "seesaw": c.seesaw_kernel}[name.split()[0]](m)
            ptx = k.asm["ptx"]
            usage, ops = c.sass_counts(k)
            print(f"{name:>16} {label:>8}: {ptx.count('bar.sync')} bar.sync in the PTX, BAR {ops['BAR']}, "
                  f"HGMMA {ops['HGMMA']}, QGMMA {ops['QGMMA']}, {usage}")


# (variant, cache format, launcher name, default shapes H,B,L)
RUNS = (("fp8 q8_split", "fp8", "launch_fp8", ["16,32,1024", "16,32,4096", "16,32,16384", "16,128,4096", "16,8,4096"]),
        ("narrow box_bars", "bf16", "launch_narrow", ["16,32,1024", "16,32,4096", "16,128,4096", "16,128,16384",
                                                       "16,8,4096"]),
        ("narrow q_split", "bf16", "launch_narrow", ["16,32,1024", "16,32,4096", "16,128,1024", "16,8,4096"]),
        ("seesaw box_bars", "bf16", "launch_gluon", ["128,32,1024", "128,32,4096", "128,128,1024", "128,128,4096"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=None, help="H,B,L (s_q 1), for every variant (default: each its own)")
    p.add_argument("--sass", action="store_true", help="only count the barriers of each build (offline)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="NAME",
                   help=f"which to time (default all: {', '.join(repr(v) for v in VARIANTS)})")
    args = p.parse_args(argv)
    if args.sass:
        sass_report()
        return 0
    if not torch.cuda.is_available():
        sys.exit("barrier_allocs: needs a CUDA GPU (or --sass)")
    from mla.ops import reference
    from mla.ops.triton import decode_gluon, decode_gluon_fp8, decode_gluon_narrow

    shipped = {"fp8": decode_gluon_fp8, "narrow": decode_gluon_narrow, "seesaw": decode_gluon}
    work = tempfile.mkdtemp()
    print(f"{'variant':>16} {'H':>4} {'B':>4} {'L':>6} {'shipped':>8} {'variant':>8} {'ratio':>6}   rel. errors")
    for name, kv_format, launcher, default_shapes in RUNS:
        if name not in args.variants:
            continue
        mod = load_module(variant_source(name), name.replace(" ", "_"), work)
        fns = {"shipped": getattr(shipped[name.split()[0]], launcher), "variant": getattr(mod, launcher)}
        kw = {"block_n": 64} if name.startswith("seesaw") else {}     # the variant's ring of two tiles
        for H, B, L in parse_shapes(args.shapes or default_shapes, "H,B,L"):
            c = bench.decode_case(H, B, L, 1, 64, kv_format=kv_format)

            def run(fn, kv, c=c):
                return fn(c["q"], kv, c["table"], c["seqlens"], bench.DL, c["scale"], True, **kw)[0]
            launchers = {k: (lambda kv, f=f: run(f, kv)) for k, f in fns.items()}
            times, _ = time_launchers(c, launchers, checked=None)
            ref = reference.mla_decode(c["q"], c["kv"], c["table"], c["seqlens"], bench.DL, c["scale"], True)[0]
            errs = " ".join(f"{k} {bench._rel_err(fn(c['kv']), ref.float()):.2e}" for k, fn in launchers.items())
            print(f"{name:>16} {H:>4} {B:>4} {L:>6} {times['shipped']:8.1f} {times['variant']:8.1f} "
                  f"{times['variant'] / times['shipped']:6.3f}   {errs}", flush=True)
            del c
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
