"""What compute-sanitizer reports on the two patterns of the Gluon decode kernels, in kernels of
a few lines with no defect of their own (docs/RELIABILITY.md reads the results):

- race: one partition of a warp-specialized kernel stores a shared buffer, synchronises its
  128 threads (bar.sync) and arrives on an mbarrier from one thread, as Gluon lowers
  ``mbarrier.arrive``; the other partition waits on it (WAIT 1) or does not (WAIT 0, a real
  race), then reads the buffer.
- tma: a tile stored to global memory by TMA from shared memory, then read by a torch kernel.

On the H200, from the repository root:

    compute-sanitizer --tool racecheck python3 tools/sanitize_probe.py race 1    # and race 0
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool initcheck python3 tools/sanitize_probe.py tma
"""
from __future__ import annotations

import sys

import torch

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma


@gluon.jit
def _producer(buf, bar, X, Y, WAIT: gl.constexpr):
    L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    buf.store(gl.load(X + gl.arange(0, 128, layout=L)))
    gl.thread_barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _consumer(buf, bar, X, Y, WAIT: gl.constexpr):
    L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    if WAIT:
        mbarrier.wait(bar, 0)
    v = buf.load(L)
    gl.store(Y + 127 - gl.arange(0, 128, layout=L), v)


@gluon.jit
def _race_kernel(X, Y, WAIT: gl.constexpr):
    buf = gl.allocate_shared_memory(gl.float32, [128], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bars = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    fence_async_shared()
    gl.thread_barrier()
    gl.warp_specialize([(_producer, (buf, bars.index(0), X, Y, WAIT)),
                        (_consumer, (buf, bars.index(0), X, Y, WAIT))], [4], [96])


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


if sys.argv[1:] not in (["race", "0"], ["race", "1"], ["tma"]):
    raise SystemExit("usage: sanitize_probe.py race 0|1 | tma")
if sys.argv[1] == "race":
    x = torch.arange(128, dtype=torch.float32, device="cuda")
    y = torch.zeros_like(x)
    _race_kernel[(1,)](x, y, WAIT=int(sys.argv[2]) == 1, num_warps=4)
    torch.cuda.synchronize()
    print("race probe WAIT", sys.argv[2], "right:", torch.equal(y.flip(0), x))
else:
    x = torch.randn(64, 64, device="cuda").to(torch.bfloat16)
    y = torch.empty(64, 64, device="cuda", dtype=torch.bfloat16)
    d = TensorDescriptor(y, [64, 64], [64, 1], [64, 64],
                         gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    _tma_kernel[(1,)](x, d, num_warps=4)
    z = y.float().sum()      # a torch kernel reads what TMA wrote
    torch.cuda.synchronize()
    print("tma probe right:", torch.equal(y, x))
