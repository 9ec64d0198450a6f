"""Where the time of the FP8 register-operand decode kernel (``decode_gluon_fp8``) goes: the
kernel timed against copies of itself with one stage left out (made by editing its source, so
their outputs are wrong by design), and against the widening narrow kernel on the same FP8 rows
and the narrow kernel on bf16 rows of the same values, by ``mla bench decode``'s method.

    PYTHONPATH=src python3 benchmarks/fp8reg_breakdown.py [--shapes 16,128,16384 ...] [--modes ...]

Modes: no_loads (the loader arrives on the barriers instead of copying: compute alone),
no_softmax (P = the masked scores, no row max or sums: the cross-warp reductions left out),
no_pv (no O^T = V^T P^T: its loads, conversions and MMAs left out), candidates not yet
run: v_banks (value loads without bank conflicts, see V_BANKS), q_in_wg (the query split inside
warpgroup 0, off the loader's path, see Q_IN_WG), v_banks+q_in_wg.
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
        mbarrier.arrive(ready.index(buf * 9), count=1)


@gluon.jit
def _fp8_kernel('''

SOFTMAX = '''        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_safe[None, :])
        alpha = gl.exp2(m_i - m_safe)
        l_t = l_t * alpha[None, :] + p
        m_i = m_new
'''


MODES = ("shipped", "no_loads", "no_softmax", "no_pv", "v_banks", "q_in_wg", "v_banks+q_in_wg")

# v_banks: the value loads' lanes take keys +1 and +4 (registers +2 and +8), so that a warp's
# 16-byte loads reach rows of both parities of the 64-byte swizzle (4 wavefronts a load instead
# of 8 by the bank model; ncu counted 2x excess wavefronts on these loads); the O^T MMA's key
# order is relabelled to match in V^T and in P^T (sm_90a SASS counts unchanged but for 2 PRMT)
PI = '''@gluon.jit
def _pi(x, GROUPS: gl.constexpr):
    C: gl.constexpr = x.shape[1]
    return x.reshape([GROUPS, 2, 2, 2, 2, C]).permute((0, 1, 2, 4, 3, 5)).reshape([16 * GROUPS, C])


@gluon.jit
def _v_frag(x):'''
V_BANKS = [
    ("    reg = [[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [8, 0]]\n    lane = [[2, 0], [4, 0], [0, 16], [0, 32], [0, 64]]",
     "    reg = [[0, 1], [0, 2], [0, 4], [0, 8], [2, 0], [8, 0]]\n    lane = [[1, 0], [4, 0], [0, 16], [0, 32], [0, 64]]"),
    ("@gluon.jit\ndef _v_frag(x):", PI),
    ("    y = x.to(gl.float16).permute((1, 0))", "    y = _pi(x.to(gl.float16), 1).permute((1, 0))"),
    ("        p_buf.store(p.to(gl.float16))", "        p_buf.store(_pi(p.to(gl.float16), 4))"),
]

# q_in_wg: the query split (global loads, e4m3 rounding, stores) moves from the prologue into
# warpgroup 0, which signals an mbarrier that warpgroup 1 waits on before its first S^T, so the
# loader's first TMA no longer waits for the query (the seesaw gained 0-5% from the same move)
Q_IN_WG = [
    ("    (q8, Q, q_off,", "    (q8, qbar, Q, q_off,"),
    ("    l_base += WG * stride_ls\n",
     "    l_base += WG * stride_ls\n"
     "    if WG == 0:\n"
     "        _store_q8(Q, q_off, H, S_Q, stride_qi, stride_qh, q8, gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))\n"
     "        fence_async_shared()\n"
     "        gl.thread_barrier()\n"
     "        mbarrier.arrive(qbar, count=1)\n"
     "    else:\n"
     "        mbarrier.wait(qbar, 0)\n"),
    ("    ready, free = _ring_barriers(_NST)\n",
     "    ready, free = _ring_barriers(_NST)\n"
     "    qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())\n"
     "    mbarrier.init(qbar, count=1)\n"),
    ("    _store_q8(Q, b.to(gl.int64) * stride_qb, H, S_Q, stride_qi, stride_qh, q8, QL)\n", ""),
    ("    args = (q8, Q,", "    args = (q8, qbar, Q,"),
]


def variant_source(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} ({', '.join(MODES)})")
    src = absolute_imports((KERNELS / "decode_gluon_fp8.py").read_text())
    if mode == "no_loads":
        src = edit(src, "\n@gluon.jit\ndef _fp8_kernel(", ARRIVE_LOADER)
        src = edit(src, "(_loader, (k8, pe8, k8, ready, free, start, n_tiles, kv_desc, kv_desc, kv_desc, BT, bt_row, "
                        "block_size, 1)),", "(_arrive_loader, (ready, free, n_tiles)),")
    elif mode == "no_softmax":
        src = edit(src, SOFTMAX, "        p = s\n        alpha = m_i * 0.0 + 1.0\n        l_t = l_t + 1.0\n")
    elif mode == "no_pv":
        start = src.index("        a_prev = _v_frag(v0)\n")
        stop_text = "        acc, a_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_prev))\n"
        stop = src.index(stop_text, start) + len(stop_text)
        src = src[:start] + src[stop:]
    else:
        for part, edits in (("v_banks", V_BANKS), ("q_in_wg", Q_IN_WG)):
            if part in mode.split("+"):
                for old, new in edits:
                    src = edit(src, old, new)
    return src


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=SHAPES, help="H,B,L (s_q 1)")
    p.add_argument("--modes", nargs="+", default=["no_loads", "no_softmax", "no_pv"])
    args = p.parse_args(argv)
    shapes = parse_shapes(args.shapes, "H,B,L")
    if not torch.cuda.is_available():
        sys.exit("fp8reg_breakdown: needs a CUDA GPU")
    from mla.ops.triton import decode_gluon_narrow

    work = tempfile.mkdtemp()
    mods = {m: load_module(variant_source(m), "fp8reg_" + m.replace("+", "_"), work)
            for m in ["shipped", *args.modes]}
    names = ["bf16 narrow", "fp8 narrow", *mods]
    print(f"{'H':>4} {'B':>4} {'L':>6} " + " ".join(f"{n:>12}" for n in names) + "   (us; rel. err of each variant)")
    for H, B, L in shapes:
        c = bench.decode_case(H, B, L, 1, 64, kv_format="fp8")
        bf16 = quant.dequantize_rows(c["kv"].view(-1, c["kv"].shape[-1]), "fp8", bench.DL, torch.bfloat16)
        bf16 = bf16.view(*c["kv"].shape[:2], -1)

        def run(fn, kv, c=c):
            return fn(c["q"], kv, c["table"], c["seqlens"], bench.DL, c["scale"], True)[0]
        launchers = {"fp8 narrow": lambda kv: run(decode_gluon_narrow.launch_narrow, kv),
                     **{m: (lambda kv, mod=mod: run(mod.launch_fp8, kv)) for m, mod in mods.items()}}
        times, _ = time_launchers(c, launchers)
        ref = reference.mla_decode(c["q"], c["kv"], c["table"], c["seqlens"], bench.DL, c["scale"], True)[0].float()
        errs = {m: bench._rel_err(launchers[m](c["kv"]), ref) for m in mods}
        cb = dict(c, kv=bf16)
        t_bf16, _ = time_launchers(cb, {"bf16 narrow": lambda kv: run(decode_gluon_narrow.launch_narrow, kv)},
                                   checked="bf16 narrow")
        times.update(t_bf16)
        print(f"{H:>4} {B:>4} {L:>6} " + " ".join(f"{times[n]:12.1f}" for n in names) + "   "
              + " ".join(f"{m} {e:.2e}" for m, e in errs.items()), flush=True)
        del c, cb, bf16
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
