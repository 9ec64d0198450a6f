"""Wall-clock timing shared by the benchmark scripts (kernels are timed by ``mla bench``)."""
from __future__ import annotations

import time

import torch


def time_per_call(fn, sync: bool = True, iters: int = 20) -> float:
    """Seconds per call of fn after 3 warm-up calls; ``sync``: wait for the GPU around the loop."""
    for _ in range(3):
        fn()
    if sync:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if sync:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def graph_time_per_call(fn, iters: int = 20) -> float:
    """Seconds per replay of one call of fn captured in a CUDA graph (warmed up on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return time_per_call(g.replay, True, iters)
