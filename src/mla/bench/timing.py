"""The one timer of the benchmarks: every figure ``mla bench`` and ``benchmarks/`` report comes from here.

Two methods, both in microseconds per call, and a breakdown by kernel:

- ``graph_time_us(calls)``: one CUDA graph holding every call, replayed; the median replay time
  over the number of calls. For kernels of microseconds, whose launch gaps and host overhead
  would otherwise be timed: each call reads its own copy of the inputs (``rotated_copies``),
  the copies together past the L2, so no call finds its data left in the L2 by the one before.
- ``eager_time_us(fn)``: eager calls under ``triton.testing.do_bench``, which flushes the L2
  before each call; the median. For calls that cannot be captured (they read the host) or run
  long enough that a launch gap does not matter.
- ``kernel_times_us(fn)``: the mean device time of each kernel one eager call of fn launches
  (torch.profiler): where a call's time goes, e.g. a split-KV kernel against its combine.

Both timers take ``iters``: a fixed number of calls (3 warm-up calls, then the mean of ``iters``)
instead of do_bench's count, which do_bench picks from each process's own estimate. A
multi-process benchmark needs the fixed count: every rank must make the same number of calls,
or the collectives inside them hang.
"""
from __future__ import annotations

import math
import time

import torch

__all__ = ["L2_ROTATE_BYTES", "copies_past_l2", "rotated_copies", "graph_time_us", "eager_time_us",
           "kernel_times_us"]

# 4x the H200's 60 MB L2: rotating through this many bytes leaves nothing of a call's inputs there
L2_ROTATE_BYTES = 240 << 20
WARMUP = 3


def copies_past_l2(nbytes: int, most: int = 64) -> int:
    """How many input sets of ``nbytes`` each a graph rotates through so that, together, they
    pass ``L2_ROTATE_BYTES`` (at least 1, at most ``most``)."""
    return max(1, min(most, math.ceil(L2_ROTATE_BYTES / max(1, nbytes))))


def rotated_copies(kv: torch.Tensor, most: int = 64) -> list[torch.Tensor]:
    """kv and copies of it with its blocks (dim 0) permuted: the same rows in other memory (any
    dtype), together past the L2, for timing calls that rotate through them."""
    n = copies_past_l2(kv.numel() * kv.element_size(), most)
    return [kv] + [kv[torch.randperm(kv.shape[0], device=kv.device)] for _ in range(n - 1)]


def _fixed_us(fn, iters: int, sync: bool) -> float:
    for _ in range(WARMUP):
        fn()
    if sync:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if sync:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def graph_time_us(calls, iters: int | None = None) -> float:
    """Microseconds per call of the callables ``calls``, captured together in one CUDA graph:
    the median replay time (do_bench) over ``len(calls)``, or with ``iters`` the mean of that
    many replays after 3 warm-up replays.

    Each call runs once eagerly on a side stream first (lazy initialisation and compilation
    cannot happen inside a capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(g):
            for c in calls:
                c()
    except Exception:
        torch.cuda.set_stream(stream)   # a capture that fails inside leaves its side stream current
        raise
    torch.cuda.synchronize()
    if iters is None:
        from triton.testing import do_bench

        us = do_bench(g.replay, warmup=5, rep=40, return_mode="median") * 1e3
    else:
        us = _fixed_us(g.replay, iters, True)
    del g
    return us / len(calls)


def eager_time_us(fn, iters: int | None = None, sync: bool = True) -> float:
    """Microseconds per eager call of fn: do_bench's median with the L2 flushed before each
    call, or with ``iters`` the mean of that many calls after 3 warm-up calls (no flush;
    ``sync=False`` for CPU processes, which have no stream to wait for)."""
    if iters is not None:
        return _fixed_us(fn, iters, sync)
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=25, return_mode="median") * 1e3


def kernel_times_us(fn, calls: int = 20) -> dict[str, float]:
    """The mean device time in microseconds of each kernel fn launches, by kernel name (cut to
    40 characters), over ``calls`` eager calls after one warm-up call. A kernel launched as a
    programmatic dependent counts its wait for the kernel before it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    # the device's own activities only: a host-side event (a launch) carries its kernels' time too
    return {e.key[:40]: e.device_time_total / calls for e in prof.key_averages()
            if e.device_type == DeviceType.CUDA and e.device_time_total > 0}
