"""What compute-sanitizer reports on the patterns of the Gluon decode kernels, in kernels of a
few lines whose only defect is the one a mode asks for (docs/RELIABILITY.md reads the results):

- handoff WAIT: one partition of a warp-specialized kernel stores a shared buffer (Triton makes
  the store an ``stmatrix``, as it does the seesaw's P tile), synchronises its 128 threads
  (bar.sync) and arrives on an mbarrier from one thread, as Gluon lowers ``mbarrier.arrive``;
  the other waits on it (WAIT 1) or not (WAIT 0: a race), then loads the buffer.
- loop WAIT: the seesaw's row-statistics hand-off, 8 rounds through one buffer: the producer
  waits for the buffer to be free, stores a row vector (``st.shared``, each row from the 8
  threads that hold it), arrives on "ready"; the consumer waits for "ready", loads it, arrives
  on "free". WAIT 0 leaves both waits out: a race both ways.
- tma: a tile stored to global memory by TMA from shared memory, then read by a torch kernel.

On the H200, from the repository root (COMPUTE_SANITIZER: the binary):

    $COMPUTE_SANITIZER --tool racecheck python3 tools/sanitize_probe.py loop 1      # and 0; handoff 0|1
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 $COMPUTE_SANITIZER --tool initcheck python3 tools/sanitize_probe.py tma

Each prints whether its result is right (a race may still give the right values).
"""
from __future__ import annotations

import sys

import torch

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

ROUNDS = gl.constexpr(8)


@gluon.jit
def _handoff_producer(buf, bar, X, Y, WAIT: gl.constexpr):
    L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    buf.store(gl.load(X + gl.arange(0, 128, layout=L)))
    gl.thread_barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _handoff_consumer(buf, bar, X, Y, WAIT: gl.constexpr):
    L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    if WAIT:
        mbarrier.wait(bar, 0)
    gl.store(Y + gl.arange(0, 128, layout=L), buf.load(L))


@gluon.jit
def _handoff_kernel(X, Y, WAIT: gl.constexpr):
    buf = gl.allocate_shared_memory(gl.float32, [128], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bars = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    fence_async_shared()
    gl.thread_barrier()
    gl.warp_specialize([(_handoff_producer, (buf, bars.index(0), X, Y, WAIT)),
                        (_handoff_consumer, (buf, bars.index(0), X, Y, WAIT))], [4], [96])


@gluon.constexpr_function
def _row_layout():
    """A [64] row vector as the seesaw's softmax holds it: a slice of a [64, 64] tile over 128
    threads, each row on the 8 threads of its column group."""
    return gl.SliceLayout(1, gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))


@gluon.jit
def _loop_producer(buf, ready, free, X, Y, WAIT: gl.constexpr):
    R: gl.constexpr = _row_layout()
    for i in range(ROUNDS):
        if WAIT:
            mbarrier.wait(free, (i & 1) ^ 1)
        buf.store(gl.load(X + i * 64 + gl.arange(0, 64, layout=R)))
        fence_async_shared()
        mbarrier.arrive(ready, count=1)


@gluon.jit
def _loop_consumer(buf, ready, free, X, Y, WAIT: gl.constexpr):
    R: gl.constexpr = _row_layout()
    acc = gl.zeros([64], gl.float32, R)
    for i in range(ROUNDS):
        if WAIT:
            mbarrier.wait(ready, i & 1)
        acc += buf.load(R)
        mbarrier.arrive(free, count=1)
    gl.store(Y + gl.arange(0, 64, layout=R), acc)


@gluon.jit
def _loop_kernel(X, Y, WAIT: gl.constexpr):
    buf = gl.allocate_shared_memory(gl.float32, [64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)
    fence_async_shared()
    gl.thread_barrier()
    gl.warp_specialize([(_loop_producer, (buf, bars.index(0), bars.index(1), X, Y, WAIT)),
                        (_loop_consumer, (buf, bars.index(0), bars.index(1), X, Y, WAIT))], [4], [96])


@gluon.jit
def _tma_kernel(X, y_desc):
    L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, L))
    s = gl.allocate_shared_memory(gl.bfloat16, [64, 64], y_desc.layout)
    s.store(gl.load(X + r[:, None] * 64 + c[None, :]))
    fence_async_shared()
    tma.async_copy_shared_to_global(y_desc, [0, 0], s)
    tma.store_wait(0)


def main(argv: list[str]) -> None:
    mode, flag = (argv + ["", ""])[:2]
    if mode not in ("handoff", "loop", "tma") or (mode != "tma" and flag not in ("0", "1")):
        raise SystemExit("usage: sanitize_probe.py handoff 0|1 | loop 0|1 | tma")
    on = flag == "1"
    if mode == "handoff":
        x = torch.arange(128, dtype=torch.float32, device="cuda")
        y = torch.zeros_like(x)
        _handoff_kernel[(1,)](x, y, WAIT=on, num_warps=4)
        torch.cuda.synchronize()
        print("handoff probe WAIT", flag, "right:", torch.equal(y, x))
    elif mode == "loop":
        x = torch.randint(0, 100, (ROUNDS.value, 64), device="cuda").float()
        y = torch.zeros(64, device="cuda")
        _loop_kernel[(1,)](x, y, WAIT=on, num_warps=4)
        torch.cuda.synchronize()
        print("loop probe WAIT", flag, "right:", torch.equal(y, x.sum(0)))
    else:
        x = torch.randn(64, 64, device="cuda").to(torch.bfloat16)
        y = torch.empty(64, 64, device="cuda", dtype=torch.bfloat16)
        d = TensorDescriptor(y, [64, 64], [64, 1], [64, 64],
                             gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
        _tma_kernel[(1,)](x, d, num_warps=4)
        y.float().sum()      # a torch kernel reads what TMA wrote
        torch.cuda.synchronize()
        print("tma probe right:", torch.equal(y, x))


if __name__ == "__main__":
    main(sys.argv[1:])
