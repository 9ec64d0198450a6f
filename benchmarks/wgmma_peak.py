"""Peak rate of Hopper warpgroup MMAs from Gluon (docs/PERF.md, "Decode: the seesaw at 128
heads"): bf16 operands, float32 accumulators, one CTA per SM looping over tiles resident in
shared memory (no loads), A from shared memory (SS) or registers (RS), N = 64/128/256, one or
two warpgroups of 64 rows, one wait per 64 or per 256 of K.

    PYTHONPATH=src python3 benchmarks/wgmma_peak.py [N ...]     (default 64 128 256)
"""
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait, fence_async_shared

@gluon.jit
def k_mma(OUT, ITERS: gl.constexpr, N: gl.constexpr, KB: gl.constexpr, RS: gl.constexpr, num_warps: gl.constexpr):
    M: gl.constexpr = 64 * (num_warps // 4)
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, N, 16])
    LA: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, 64], gl.bfloat16)
    LB: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, 64], gl.bfloat16)
    a_s = gl.allocate_shared_memory(gl.bfloat16, [M, 64 * KB], LA)
    b_s = gl.allocate_shared_memory(gl.bfloat16, [N, 64 * KB], LB)
    BL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    for c in gl.static_range(KB):
        a_s.slice(c * 64, 64, dim=1).store(gl.full([M, 64], 0.01, gl.bfloat16, BL))
        b_s.slice(c * 64, 64, dim=1).store(gl.full([N, 64], 0.01, gl.bfloat16, BL))
    fence_async_shared()
    gl.thread_barrier()
    acc = gl.zeros([M, N], gl.float32, ACC)
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    if RS:
        a_r = a_s.slice(0, 64, dim=1).load(AL)
    for it in range(ITERS):
        for c in gl.static_range(KB):
            if RS:
                acc = warpgroup_mma(a_r, b_s.slice(c * 64, 64, dim=1).permute((1, 0)), acc, is_async=True)
            else:
                acc = warpgroup_mma(a_s.slice(c * 64, 64, dim=1), b_s.slice(c * 64, 64, dim=1).permute((1, 0)), acc,
                                    is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    rows = gl.arange(0, M, layout=gl.SliceLayout(1, ACC))
    gl.store(OUT + gl.program_id(0) * M + rows, gl.sum(acc, axis=1))

def run(N, KB, RS, warps, iters=2000):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    M = 64 * (warps // 4)
    out = torch.empty(sms * M, device="cuda")
    f = lambda: k_mma[(sms,)](out, iters, N, KB, RS, num_warps=warps)
    f(); torch.cuda.synchronize()
    ms = triton.testing.do_bench(f, warmup=5, rep=50)
    flops = 2 * sms * M * N * 64 * KB * iters
    return flops / ms / 1e9

if not torch.cuda.is_available():
    sys.exit("wgmma_peak: needs a Hopper GPU")
print(f"{'mode':>4} {'warps':>5} {'N':>4} {'K/wait':>6} {'TFLOP/s':>8}")
NS = [int(n) for n in sys.argv[1:]] or [64, 128, 256]     # e.g. `wgmma_peak.py 16 32` for the decode kernels' N
for warps in (4, 8):
    for RS in (False, True):
        for N in NS:
            for KB in (1, 4):
                head = f"{'RS' if RS else 'SS':>4} {warps:>5} {N:>4} {64 * KB:>6}"
                try:
                    print(f"{head} {run(N, KB, RS, warps):8.1f}", flush=True)
                except Exception as e:  # noqa: BLE001 (a shape the compiler refuses: say so, go on)
                    print(f"{head} failed: {str(e)[:100]}", flush=True)
