"""Where the time of the FP8 register-operand decode kernel (``decode_gluon_fp8``) goes: the
kernel timed against copies of itself with one stage left out (made by editing its source, so
their outputs are wrong by design), and against the widening narrow kernel on the same FP8 rows
and the narrow kernel on bf16 rows of the same values, by ``mla bench decode``'s method.

    PYTHONPATH=src python3 benchmarks/fp8reg_breakdown.py [--shapes 16,128,16384 ...] [--modes ...]

Modes: no_loads (the loader arrives on the barriers instead of copying: compute alone),
no_softmax (P = the masked scores, no row max or sums: the cross-warp reductions left out),
no_pv (no O^T = V^T P^T: its loads, conversions and MMAs left out); the fixed cost:
no_combine (the split kernel alone), no_tiles (no key tiles: launch, query split, partial
stores and combine), no_tiles_store (no_tiles with the partial stores masked off); timeline
(the shipped kernel stamping %globaltimer at each program's entry, after its wait on the previous
kernel, where it computes bt_row (after the ring's barrier inits), after its query split, when
warpgroup 0 has its first tile and is done with its last, and at the end: prints how entries
and ends spread over the kernel and the median of each step); timeline_prologue (the set-up
alone, finer: stamps once the plan is made and the query has landed, after the barrier inits, after
the query split, and at the first tile); timeline_arrival (the end of a program, for a merge of the
splits in the kernel: the last tile, the partial stored, a fence and a release arrival on a
counter per sequence, and the wait until all the sequence's splits have arrived; only where all
programs fit on the SMs at once, e.g. B 32 x 4k or 16k at 4 splits); no_plan (the split of
equal lengths from the program's own length, as before the split plan: what the plan costs the
step; right for equal lengths only); split_first (the query split for sequence p // S before the
plan, done again where the plan differs).
--split-factors also times the shipped kernel at other split counts (the default's times each
factor). --profile also prints each kernel's mean device time (CUDA profiler, eager launches)
for every variant, which tells the time inside the kernels from the gaps between them.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from variants import KERNELS, absolute_imports, edit, load_module, parse_shapes, time_launchers  # noqa: E402

from mla import bench, quant  # noqa: E402
from mla.ops import reference  # noqa: E402

SHAPES = ["16,128,16384", "16,32,16384", "16,128,4096", "16,32,4096", "16,1,16384"]

ARRIVE_LOADER = '''
@gluon.jit
def _arrive_loader(ready, free, n_tiles):
    for j in range(n_tiles):
        buf = j % _NST
        mbarrier.wait(free.index(buf), ((j // _NST) & 1) ^ 1)
        mbarrier.arrive(ready.index(buf), count=1)


@gluon.jit
def _fp8_kernel('''

SOFTMAX = '''        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_safe[None, :])
        alpha = gl.exp2(m_i - m_safe)
        l_t = l_t * alpha[None, :] + p
        m_i = m_new
'''


MODES = ("shipped", "no_loads", "no_softmax", "no_pv", "no_combine", "no_tiles", "no_tiles_store", "timeline",
         "timeline_prologue", "timeline_arrival", "no_plan", "split_first")

PLAN_CALL = """    b, seqlen, start, end, n_tiles, bt_row, blk0, xq = _plan_and_query(SEQLENS, INFO, BT, stride_bt, block_size, B, p,
                                                                       num_splits, BLOCK_B, Q, stride_qb, H, S_Q,
                                                                       stride_qi, stride_qh, r0, _R)
"""
# no_plan: the split of equal lengths straight from the program's length, no plan (what the kernel
# did before 4c8834e; right for equal lengths only, which is what this script times)
FIXED_SPLIT = """    b = p // num_splits
    k = p % num_splits
    xq = _query_chunks(Q, b.to(gl.int64) * stride_qb, H, S_Q, stride_qi, stride_qh, r0, _R,
                       gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
    seqlen = gl.load(SEQLENS + b)
    c = (seqlen + 63) // 64
    start = k * c // num_splits * 64
    end = gl.minimum((k + 1) * c // num_splits * 64, seqlen)
    n_tiles = gl.maximum(end - start + 63, 0) // 64
    gl.store(INFO + 2 * b, p, mask=k == 0)
    gl.store(INFO + 2 * b + 1, num_splits, mask=k == 0)
    bt_row = b.to(gl.int64) * stride_bt
    blk0 = gl.load(BT + bt_row + start // block_size, mask=n_tiles > 0, other=0)
"""
# split_first: the query split of sequence p // S (the plan's at equal lengths) goes before the
# plan, under its loads; done again where the plan gives another sequence
SPLIT_FIRST = """    guess = p // num_splits
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    xq = _query_chunks(Q, guess.to(gl.int64) * stride_qb, H, S_Q, stride_qi, stride_qh, r0, _R, QL)
    _store_q8(xq, q8, qpe, TILE)
    b, seqlen, start, end, n_tiles, bt_row, blk0 = _plan_and_block(SEQLENS, INFO, BT, stride_bt, block_size, B, p,
                                                                   num_splits, 64, BLOCK_B)
    if b != guess:      # mixed lengths
        gl.thread_barrier()
        xq = _query_chunks(Q, b.to(gl.int64) * stride_qb, H, S_Q, stride_qi, stride_qh, r0, _R, QL)
        _store_q8(xq, q8, qpe, TILE)
"""
SPLIT = "stride_qi, stride_qh, r0, _R)\n"      # the end of the plan's call

STAMP = '''
TIMES = {}


def _times(device):
    """The stamp buffer [programs, 8] of the timeline mode (columns: ``fp8reg_breakdown.STAMPS``)."""
    if device not in TIMES:
        TIMES[device] = torch.zeros(1 << 16, 8, dtype=torch.int64, device=device)
    return TIMES[device]


@gluon.jit
def _stamp(TL, prog, k: gl.constexpr):
    t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
    gl.store(TL + prog.to(gl.int64) * 8 + k, t)
    if k == 0:
        sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.store(TL + prog.to(gl.int64) * 8 + 7, sm.to(gl.int64))


@gluon.jit
def _fp8_kernel('''
# the stamps' columns, in program order (column 7 is the SM); the third is taken where the kernel
# computed bt_row: after its tile split until 2774521, after the ring's barrier inits since be4e32a
# (the same place since the plan computes bt_row, _plan_and_block), after the plan once the
# barriers moved ahead of the wait (3a46bdf). "entry" is the kernel's first line.
# One program a split: 16 query rows at most (two row groups would share a row of stamps)
STAMPS = ("entry", "waited", "bt_row", "query split", "first tile", "last tile", "end")
PROG = "gl.program_id(0)"
TIMELINE = [
    ("\n@gluon.jit\ndef _fp8_kernel(", STAMP),
    ("    Q, kv_desc, pe_desc, sc_desc, BT, SEQLENS, O, LSE, INFO,\n",
     "    Q, kv_desc, pe_desc, sc_desc, BT, SEQLENS, O, LSE, INFO, TL,\n"),
    ("    gl.static_assert(num_warps == 4)\n", f"    gl.static_assert(num_warps == 4)\n    _stamp(TL, {PROG}, 1)\n"),
    ("    wait_prerequisites()\n    # program", f"    wait_prerequisites()\n    _stamp(TL, {PROG}, 0)\n    # program"),
    (SPLIT, SPLIT + "    _stamp(TL, p, 2)\n"),
    ("    launch_dependents()\n", "    launch_dependents()\n    _stamp(TL, p, 3)\n"),
    ("            qk_scale, v_scale)\n    gl.warp_specialize",
     "            qk_scale, v_scale, TL, p)\n    gl.warp_specialize"),
    ("stride_li, qk_scale, v_scale) = a\n", "stride_li, qk_scale, v_scale, TL, prog) = a\n"),
    ("        mbarrier.wait(ready.index(st), (j // _NST) & 1)     # the whole tile (see _loader)\n",
     "        mbarrier.wait(ready.index(st), (j // _NST) & 1)     # the whole tile (see _loader)\n"
     "        if WG == 0:\n            if t == 0:\n                _stamp(TL, prog, 4)\n"),
    ("    l_i = gl.sum(l_t, axis=0)\n", "    if WG == 0:\n        _stamp(TL, prog, 5)\n    l_i = gl.sum(l_t, axis=0)\n"),
    ("    ], [4, 1], [232, 24])\n", "    ], [4, 1], [232, 24])\n    _stamp(TL, p, 6)\n"),
    ("        q, kv_desc, pe_desc, sc_desc, block_table, cache_seqlens, o_part, l_part, info,\n",
     "        q, kv_desc, pe_desc, sc_desc, block_table, cache_seqlens, o_part, l_part, info, _times(q.device),\n"),
]
# the set-up alone, finer: a stamp once the plan is made (the lengths in), once the query's last chunk is in
# (behind a branch on the values, so that it cannot be taken before they land; the reduction
# adds a little), after tile 0's copy and after the query split; then the first tile
STAMPS_PROLOGUE = ("entry", "waited", "plan", "query in", "tile 0 sent", "query split", "first tile")
_PROG_S = "p"
TIMELINE_PROLOGUE = TIMELINE[:4] + [
    (SPLIT, SPLIT + f"    if seqlen >= 0:\n        _stamp(TL, {_PROG_S}, 2)\n"
     "    if gl.sum(gl.sum(xq[8].to(gl.float32), axis=1), axis=0) * 0.0 == 0.0:\n"
     f"        _stamp(TL, {_PROG_S}, 3)\n"),
    ("    _store_q8(xq, q8, qpe, TILE)\n", f"    _stamp(TL, {_PROG_S}, 4)\n    _store_q8(xq, q8, qpe, TILE)\n"),
    ("    launch_dependents()\n", f"    launch_dependents()\n    _stamp(TL, {_PROG_S}, 5)\n"),
    TIMELINE[6], TIMELINE[7],
    ("        mbarrier.wait(ready.index(st), (j // _NST) & 1)     # the whole tile (see _loader)\n",
     "        mbarrier.wait(ready.index(st), (j // _NST) & 1)     # the whole tile (see _loader)\n"
     "        if WG == 0:\n            if t == 0:\n                _stamp(TL, prog, 6)\n"),
    TIMELINE[-1],
]


# the end of a program, for a merge of the splits inside the kernel: warpgroup 0's last tile, its
# partial stored, a gpu-scope fence and a release arrival on a counter per sequence (rows 60000 on
# of the stamp buffer, zeroed before every launch), and the spin until all the sequence's splits
# have arrived. Needs all programs on the SMs at once (B 32 x 4 splits: 128): a deadlock else
STAMPS_ARRIVAL = ("entry", "waited", "last tile", "stored", "arrived", "all arrived", "end")
_CNT = "TL + 480000 + b"
TIMELINE_ARRIVAL = TIMELINE[:4] + [
    ("            qk_scale, v_scale)\n    gl.warp_specialize",
     "            qk_scale, v_scale, TL, p, num_splits, b)\n    gl.warp_specialize"),
    ("stride_li, qk_scale, v_scale) = a\n", "stride_li, qk_scale, v_scale, TL, prog, num_splits, b) = a\n"),
    ("    l_i = gl.sum(l_t, axis=0)\n", "    if WG == 0:\n        _stamp(TL, prog, 2)\n    l_i = gl.sum(l_t, axis=0)\n"),
    ("        gl.store(LSE + l_base + (r // H) * stride_li + r % H, lse, mask=r < H * S_Q)\n",
     "        gl.store(LSE + l_base + (r // H) * stride_li + r % H, lse, mask=r < H * S_Q)\n"
     "        _stamp(TL, prog, 3)\n"
     "        gl.inline_asm_elementwise(\"fence.acq_rel.gpu; // $0\", \"=r\", [], dtype=gl.int32, is_pure=False, pack=1)\n"
     "        gl.thread_barrier()\n"
     f"        old = gl.atomic_add({_CNT}, 1, sem=\"release\", scope=\"gpu\")\n"
     "        _stamp(TL, prog, 4)\n"
     "        target = (old // num_splits + 1) * num_splits\n"
     f"        while gl.atomic_add({_CNT}, 0, sem=\"acquire\", scope=\"gpu\") < target:\n"
     "            target = target + 0\n"
     "        _stamp(TL, prog, 5)\n"),
    ("    ], [4, 1], [232, 24])\n", "    ], [4, 1], [232, 24])\n    _stamp(TL, p, 6)\n"),
    ("        q, kv_desc, pe_desc, sc_desc, block_table, cache_seqlens, o_part, l_part, info,\n",
     "        q, kv_desc, pe_desc, sc_desc, block_table, cache_seqlens, o_part, l_part, info,"
     " _counters_zeroed(q.device),\n"),
    ("\n@gluon.jit\ndef _stamp(", "\ndef _counters_zeroed(device):\n    t = _times(device)\n    t[60000:].zero_()\n"
     "    return t\n\n\n@gluon.jit\ndef _stamp("),
]


def timeline(mod, launch, copies, S: int, B: int, names=STAMPS, dump=None) -> str:
    """Lines on the programs' stamps in the last of len(copies) back-to-back launches: when the
    programs enter, pass the wait on the previous kernel and reach the last stamp (min / median
    / max, us from the first entry), the median time between consecutive stamps (names:
    ``STAMPS`` or ``STAMPS_PROLOGUE``), and how the last stamps spread within each sequence's
    splits. dump: a file to save the stamps to (``torch.save``: us from the first entry, SMs)."""
    for kv in copies:
        launch(kv)
    torch.cuda.synchronize()
    t = mod.TIMES[torch.device("cuda", torch.cuda.current_device())][: S * B].double().cpu()
    order = [1, 0, 2, 3, 4, 5, 6]       # the columns in STAMPS' order
    ts = (t[:, order] - t[:, 1].min()) / 1e3

    def q(x):
        return f"{x.min():.1f}/{x.median():.1f}/{x.max():.1f}"
    steps = ", ".join(f"{names[i - 1]}->{names[i]} {(ts[:, i] - ts[:, i - 1]).median():.2f}"
                      for i in range(1, len(names)))
    if dump is not None:
        torch.save({"names": names, "us": ts, "sm": t[:, 7].long(), "S": S, "B": B}, dump)
    # the ends by sequence (programs b S .. b S + S - 1): how far apart a sequence's splits end,
    # and when the last would end if each sequence's keys were shared out so that its splits
    # ended together (the mean of its ends; the prediction for balancing within a sequence)
    ends = ts[:, 6].view(B, S)
    within = ends.max(dim=1).values - ends.min(dim=1).values
    return (f"{S * B} programs on {t[:, 7].unique().numel()} SMs: entry {q(ts[:, 0])}, waited {q(ts[:, 1])}, "
            f"{names[6]} {q(ts[:, 6])} us\n      medians: {steps} us\n"
            f"      a sequence's splits end apart by {q(within)} us; the last sequence's mean end "
            f"{ends.mean(dim=1).max():.1f} us, its last end {ends.max(dim=1).values.max():.1f}")


def variant_source(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} ({', '.join(MODES)})")
    src = absolute_imports((KERNELS / "decode_gluon_fp8.py").read_text())
    if mode == "no_loads":
        src = edit(src, "\n@gluon.jit\ndef _fp8_kernel(", ARRIVE_LOADER)
        src = edit(src, "PRE: gl.constexpr = 0 if TILE else 1", "PRE: gl.constexpr = 0")   # no copy in the prologue either
        src = edit(src, "(_loader, (k8, pe8, sc8, ready, free, start, n_tiles, kv_desc, pe_desc, sc_desc, BT, bt_row, "
                        "block_size,\n                  blk0, KV_FMT, False, gl.minimum(n_tiles, PRE))),",
                   "(_arrive_loader, (ready, free, n_tiles)),")
    elif mode == "no_softmax":
        src = edit(src, SOFTMAX, "        p = s\n        alpha = m_i * 0.0 + 1.0\n        l_t = l_t + 1.0\n")
    elif mode == "no_combine":
        src = edit(src, "    if S > 1:\n        combine(o_part, l_part, out, lse, info)\n", "")
    elif mode in ("no_tiles", "no_tiles_store"):
        src = edit(src, SPLIT, SPLIT + "    n_tiles = gl.minimum(n_tiles, 0)\n")
        if mode == "no_tiles_store":
            src = edit(src, "mask=(ro < H * S_Q)[None, :]", "mask=(ro < 0)[None, :]")
            src = edit(src, "lse, mask=r < H * S_Q)", "lse, mask=r < 0)")
    elif mode.startswith("timeline"):
        for old, new in {"timeline": TIMELINE, "timeline_prologue": TIMELINE_PROLOGUE,
                         "timeline_arrival": TIMELINE_ARRIVAL}[mode]:
            src = edit(src, old, new)
    elif mode in ("no_plan", "split_first"):
        src = edit(src, "_plan_and_query, ", "_plan_and_query, _plan_and_block, _query_chunks, ")
        if mode == "no_plan":
            src = edit(src, PLAN_CALL, FIXED_SPLIT)
        else:
            src = edit(src, PLAN_CALL, "")
            src = edit(src, "        qpe = p_smem   # not used\n", "        qpe = p_smem   # not used\n" + SPLIT_FIRST)
            src = edit(src, "    _store_q8(xq, q8, qpe, TILE)\n    fence_async_shared()",
                       "    fence_async_shared()")
    elif mode == "no_pv":
        start = src.index("        if TILE:\n            a_prev = _v_frag(_v_tile_step(")
        stop_text = "        acc, a_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_prev))\n"
        stop = src.index(stop_text, start) + len(stop_text)
        release = ("        if TILE:   # the stage, which the value steps would have released\n"
                   "            fence_async_shared()\n            gl.thread_barrier()\n"
                   "            mbarrier.arrive(free.index(st), count=1)\n")
        src = src[:start] + release + src[stop:]
    return src


def kernel_times(fn, n: int = 20) -> dict[str, float]:
    """Mean device time in us of each kernel fn launches, over n eager calls (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return {e.key[:28]: e.device_time_total / n for e in prof.key_averages() if e.device_time_total > 0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=SHAPES, help="H,B,L (s_q 1)")
    p.add_argument("--modes", nargs="+", default=["no_loads", "no_softmax", "no_pv"])
    p.add_argument("--split-factors", nargs="*", type=float, default=[],
                   help="also time the shipped kernel at these multiples of its default split count")
    p.add_argument("--profile", action="store_true", help="also print each kernel's device time per variant")
    p.add_argument("--dump", help="a folder to save each timeline's stamps in (torch.save, a file a mode and shape)")
    args = p.parse_args(argv)
    shapes = parse_shapes(args.shapes, "H,B,L")
    if not torch.cuda.is_available():
        sys.exit("fp8reg_breakdown: needs a CUDA GPU")
    from mla.ops.triton import decode_gluon, decode_gluon_narrow

    work = tempfile.mkdtemp()
    mods = {m: load_module(variant_source(m), "fp8reg_" + m.replace("+", "_"), work)
            for m in ["shipped", *args.modes]}
    names = ["bf16 narrow", "fp8 narrow", *mods, *(f"S x{f:g}" for f in args.split_factors)]
    print(f"{'H':>4} {'B':>4} {'L':>6} " + " ".join(f"{n:>12}" for n in names) + "   (us; rel. err of each variant)")
    for H, B, L in shapes:
        c = bench.decode_case(H, B, L, 1, 64, kv_format="fp8")
        bf16 = quant.dequantize_rows(c["kv"].view(-1, c["kv"].shape[-1]), "fp8", bench.DL, torch.bfloat16)
        bf16 = bf16.view(*c["kv"].shape[:2], -1)

        s0 = decode_gluon.default_splits(B, H, c["table"].shape[1] * c["page"], c["q"].device)

        def run(fn, kv, c=c, **kw):
            return fn(c["q"], kv, c["table"], c["seqlens"], bench.DL, c["scale"], True, **kw)[0]
        launchers = {"fp8 narrow": lambda kv: run(decode_gluon_narrow.launch_narrow, kv),
                     **{m: (lambda kv, mod=mod: run(mod.launch_fp8, kv)) for m, mod in mods.items()},
                     **{f"S x{f:g}": (lambda kv, S=max(1, round(s0 * f)): run(mods["shipped"].launch_fp8, kv,
                                                                              num_splits=S))
                        for f in args.split_factors}}
        if "timeline_arrival" in launchers and s0 * B > torch.cuda.get_device_properties(0).multi_processor_count:
            del launchers["timeline_arrival"]     # its programs wait on each other: all must be on the SMs
        times, _ = time_launchers(c, launchers, checked=None)     # errors below, per variant
        ref = reference.mla_decode(c["q"], c["kv"], c["table"], c["seqlens"], bench.DL, c["scale"], True)[0].float()
        errs = {m: bench._rel_err(launchers[m](c["kv"]), ref) for m in mods if m in launchers}
        cb = dict(c, kv=bf16)
        t_bf16, _ = time_launchers(cb, {"bf16 narrow": lambda kv: run(decode_gluon_narrow.launch_narrow, kv)},
                                   checked=None)
        times.update(t_bf16)
        cols = " ".join(f"{times.get(n, float('nan')):12.1f}" for n in names)
        print(f"{H:>4} {B:>4} {L:>6} " + cols + f"   S {s0}: "
              + " ".join(f"{m} {e:.2e}" for m, e in errs.items()), flush=True)
        for m, stamps in (("timeline", STAMPS), ("timeline_prologue", STAMPS_PROLOGUE),
                          ("timeline_arrival", STAMPS_ARRIVAL)):
            if m in launchers:
                dump = args.dump and os.path.join(args.dump, f"{m}_{H}_{B}_{L}.pt")
                line = timeline(mods[m], launchers[m], bench.rotated_copies(c["kv"]), s0, B, stamps, dump)
                print(f"      {m}: {line}", flush=True)
        if args.profile:
            for m, fn in launchers.items():
                ks = kernel_times(lambda fn=fn, c=c: fn(c["kv"]))
                print(f"      {m:>14}: " + ", ".join(f"{k} {v:.1f}" for k, v in ks.items()), flush=True)
        del c, cb, bf16
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
