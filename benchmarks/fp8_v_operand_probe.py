"""Compile-only probe (no GPU needed): can Gluon feed V^T to an FP8 warpgroup MMA from registers
loaded with 16-byte shared-memory loads? (docs/PERF.md, "FP8 accuracy": the design for issue 6.)

O^T [dv, N] += V^T [dv, 64 keys] P^T [64 keys, N], V an FP8 tile [64 keys, dv] in shared memory,
P^T FP8 [N, 64] (K-major) in shared memory, compiled for sm_90a; prints the shared-memory and
MMA instructions of each form:

  bytes   V^T loaded straight into the MMA's A layout: each lane needs 4 consecutive keys of
          one column per register, so the loads are single bytes
  chunks  value columns permuted so that each lane group owns 16 adjacent columns (the
          accumulator rows are then value columns in that order; a store undoes it): one
          16-byte load per key and lane, the tensor reshaped/permuted into the MMA's row
          order, then converted to the A layout in registers

    PYTHONPATH=src python3 benchmarks/fp8_v_operand_probe.py [--dv 512] [--n 32]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma


@gluon.jit
def _pv(V, P, O, CHUNKS: gl.constexpr, DV: gl.constexpr, N: gl.constexpr, L1: gl.constexpr):
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 32])
    ld: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    v = gl.allocate_shared_memory(gl.float8e4nv, [64, DV], gl.NVMMASharedLayout.get_default_for([64, DV], gl.float8e4nv))
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, ld))
    c = gl.arange(0, DV, layout=gl.SliceLayout(0, ld))
    v.store(gl.load(V + r[:, None] * DV + c[None, :]))
    pt = gl.allocate_shared_memory(gl.float8e4nv, [N, 64], gl.NVMMASharedLayout.get_default_for([N, 64], gl.float8e4nv))
    rp = gl.arange(0, N, layout=gl.SliceLayout(1, ld))
    cp = gl.arange(0, 64, layout=gl.SliceLayout(0, ld))
    pt.store(gl.load(P + rp[:, None] * 64 + cp[None, :]))
    fence_async_shared()
    gl.thread_barrier()
    a_l: gl.constexpr = gl.DotOperandLayout(0, acc_l, 4)
    if CHUNKS:
        x = v.permute((1, 0)).load(L1)
        # columns (w 4, g 8, t DV / 64, h 2) -> the MMA's row order (t, w, h, g)
        x = x.reshape([4, 8, DV // 64, 2, 64]).permute((2, 0, 3, 1, 4)).reshape([DV, 64])
        a = gl.convert_layout(x, a_l)
    else:
        a = v.permute((1, 0)).load(a_l)
    acc = warpgroup_mma(a, pt.permute((1, 0)), gl.zeros([DV, N], gl.float32, acc_l))
    ro = gl.arange(0, DV, layout=gl.SliceLayout(1, acc_l))
    co = gl.arange(0, N, layout=gl.SliceLayout(0, acc_l))
    gl.store(O + ro[:, None] * N + co[None, :], acc)


def chunk_layout(dv: int) -> gl.DistributedLinearLayout:
    """[dv columns, 64 keys] for 4 warps: lane group (w, g) owns columns 16 (8 w + g) .. + 15
    (the register bits, columns fastest: one 16-byte load a key); lane bits q pick the key
    quads 4q .. 4q + 3, and the registers also hold keys + 16, + 32, + 48, as the MMA's A
    fragment does."""
    assert dv == 512, "the warp bits below cover 512 columns"
    reg = [[1, 0], [2, 0], [4, 0], [8, 0], [0, 1], [0, 2], [0, 16], [0, 32]]
    lane = [[0, 4], [0, 8], [16, 0], [32, 0], [64, 0]]
    warp = [[128, 0], [256, 0]]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [dv, 64])


def compile_form(chunks: bool, dv: int, n: int) -> dict:
    sig = {"V": "*fp8e4nv", "P": "*fp8e4nv", "O": "*fp32", "CHUNKS": "constexpr", "DV": "constexpr",
           "N": "constexpr", "L1": "constexpr"}
    src = GluonASTSource(_pv, sig, constexprs={(3,): chunks, (4,): dv, (5,): n, (6,): chunk_layout(dv)})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin], capture_output=True,
                              text=True, check=True).stdout
    ops = Counter(m.group(1) for m in re.finditer(r"^\s+/\*[0-9a-f]+\*/\s+([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)",
                                                  sass, re.M))
    keep = ("LDS", "STS", "PRMT", "SHFL", "QGMMA", "HGMMA", "LDL", "STL")
    return {op: c for op, c in sorted(ops.items()) if op.split(".")[0] in keep}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dv", type=int, default=512)
    p.add_argument("--n", type=int, default=32)
    a = p.parse_args()
    for chunks in (False, True):
        print("chunks" if chunks else "bytes ", compile_form(chunks, a.dv, a.n))


if __name__ == "__main__":
    main()
