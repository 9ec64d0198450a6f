"""Does a newer Triton's Gluon run Hopper clusters on this machine? (issue 63's toolchain gate)

    tools/triton_repack.sh 3.9.0 build/triton39                    # here, once: the carried Triton
    tar xJf build/triton39/triton.tar.xz -C /tmp/t39                # on the device
    PYTHONPATH=/tmp/t39 TRITON_BACKENDS_IN_TREE=1 python3 tools/triton_cluster_probe.py [--compile-only]

Three kernels, each run in a child process with a time limit (a cluster barrier that never
completes hangs, it does not fail):

- ``add``: a plain Triton kernel: the wheel's ptxas, driver stub and cubins load here.
- ``own``: two CTAs of a cluster (``num_ctas=2``), each holding the whole vector and a whole copy
  of the shared buffer, store it through ``hopper.async_store`` (``st.async`` completing on an
  mbarrier) and read it back, between cluster barriers.
- ``peer``: the same vector, the shared buffer split half a CTA (``cga_layout=[[1]]``): half of each
  CTA's stores land in the other CTA's shared memory (``mapa`` + ``st.async``); each CTA reads
  back its half. What the two-CTA FP8 decode needs (one CTA widens, both consume).

``--compile-only`` (no GPU): compile ``own`` and ``peer`` for sm_90a and count the cluster
instructions in their PTX. Prints one line per kernel: ok / wrong values / error / timed out.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys

BLOCK = 128


def _kernels():
    import triton
    import triton.language as tl
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    @triton.jit
    def add(x, y, o, n, B: tl.constexpr):
        i = tl.program_id(0) * B + tl.arange(0, B)
        tl.store(o + i, tl.load(x + i, mask=i < n) + tl.load(y + i, mask=i < n), mask=i < n)

    @gluon.jit
    def stores(out, SPLIT: gl.constexpr, BLOCK: gl.constexpr):
        full: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0], cga_layout=[[0]])      # every CTA: all of it
        cga: gl.constexpr = [[1]] if SPLIT else [[0]]
        back: gl.constexpr = gl.BlockedLayout([2 if not SPLIT else 1], [32], [4], [0], cga_layout=cga)
        smem = gl.allocate_shared_memory(gl.int32, [2 * BLOCK], gl.SwizzledSharedLayout(1, 1, 1, order=[0],
                                                                                        cga_layout=cga))
        bar = mbarrier.allocate_mbarrier()
        mbarrier.init(bar, count=1)
        hopper.cluster.barrier()                 # every CTA's barrier is live before any store
        mbarrier.expect(bar, smem.nbytes_per_cta)
        offs = gl.arange(0, 2 * BLOCK, layout=full)
        hopper.async_store(smem, offs * 3 + 1, bar)
        mbarrier.wait(bar, 0, deps=[smem])
        got = smem.load(back)
        mbarrier.invalidate(bar)
        hopper.cluster.barrier()                 # no CTA leaves while a peer may still write to it
        gl.store(out + gl.arange(0, 2 * BLOCK, layout=back), got)

    return add, stores


def _run(name, queue):
    try:
        import torch
        add, stores = _kernels()
        if name == "add":
            x = torch.randn(10000, device="cuda")
            y = torch.randn_like(x)
            o = torch.empty_like(x)
            add[(10,)](x, y, o, 10000, B=1024)
            ok = torch.equal(o, x + y)
        else:
            out = torch.full((2 * BLOCK,), -1, device="cuda", dtype=torch.int32)
            stores[(1,)](out, SPLIT=name == "peer", BLOCK=BLOCK, num_warps=4, num_ctas=2)
            torch.cuda.synchronize()
            ok = torch.equal(out, torch.arange(2 * BLOCK, device="cuda", dtype=torch.int32) * 3 + 1)
        queue.put("ok" if ok else "wrong values")
    except Exception as e:  # noqa: BLE001 - the probe reports every failure by name
        queue.put(f"error: {type(e).__name__}: {str(e)[:300]}")


def compile_only():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    _, stores = _kernels()
    for name in ("own", "peer"):
        src = GluonASTSource(fn=stores, signature={"out": "*i32", "SPLIT": "constexpr", "BLOCK": "constexpr"},
                             constexprs={"SPLIT": name == "peer", "BLOCK": BLOCK})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_ctas=2)).asm["ptx"]
        print(f"{name}: compiled for sm_90a; PTX: st.async {ptx.count('st.async')}, mapa {ptx.count('mapa.')}, "
              f"barrier.cluster {ptx.count('barrier.cluster')}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a kernel (its compile included) may take")
    args = ap.parse_args(argv)
    import triton
    print(f"triton {triton.__version__} from {triton.__file__}")
    if args.compile_only:
        compile_only()
        return 0
    ctx = mp.get_context("spawn")
    bad = 0
    for name in ("add", "own", "peer"):
        q = ctx.Queue()
        p = ctx.Process(target=_run, args=(name, q))
        p.start()
        p.join(args.timeout)
        if p.is_alive():
            p.kill()
            res = "timed out"
        else:
            res = q.get() if not q.empty() else f"died (exit code {p.exitcode})"
        bad += res != "ok"
        print(f"{name}: {res}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
