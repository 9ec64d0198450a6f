"""Block-scaled FP8 GEMM (``mla.ops.fp8_linear``) against bf16 F.linear on DeepSeek-V3's projections.

    PYTHONPATH=src python3 benchmarks/fp8_gemm.py [--m 1 8 64 512 4096]

Shapes (N, K): q_b_proj 24576 x 1536, o_proj 7168 x 16384, kv_a_proj_with_mqa + q_a_proj
2112 x 7168. x is bf16 [M, K], the output bf16; weights random, 128 x 128 block-quantized.
Providers, each checked against mla.ops.reference.fp8_linear (float32 output) before it is timed:
  fp8        the Triton kernels: activation quantization + block-scaled GEMM (mla.ops.fp8_linear
             takes them at M <= 64 and scaled_mm above)
  bf16       F.linear(x, W dequantized to bf16)
  scaled_mm  our activation quantization + torch.nn.functional.scaled_mm (cuBLAS, BlockWise1x128
             x BlockWise128x128), where this torch and GPU have it
Then the absorbed path's per-head W_UK / W_UV matmuls: ``fp8_bmm`` against torch.bmm in bf16.
Timing: one CUDA graph holding one call per rotated copy of the weight (together > 256 MB, past
the L2), median replay time / number of calls (triton.testing.do_bench, L2 flushed per replay).
  bytes = N*K (fp8 weight) + 2*M*K + 2*M*N;  FLOPs = 2*M*N*K
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from mla.bench.timing import graph_time_us
from mla.ops import reference
from mla.ops import fp8_gemm
from mla.weights import dequant_block_fp8, quantize_block_fp8

SHAPES = [("q_b_proj", 24576, 1536), ("o_proj", 7168, 16384), ("kv_a+q_a", 2112, 7168)]
# the absorbed path's per-head matmuls (kv_b_proj split into W_UK and W_UV, DeepSeek-V3):
# q_nope [H, M, 128] -> [H, M, 512] through W_UK (w = W_UK[h]^T: N 512, K 128), and the
# attention's latent output [H, M, 512] -> [H, M, 128] through W_UV (w = W_UV[h]: N 128, K 512)
ABSORBED = [("W_UK", 512, 128), ("W_UV", 128, 512)]


def scaled_mm_provider():
    """fn(x, w, w_scale) -> y via torch's block-scaled scaled_mm, or None without one."""
    return fp8_gemm.scaled_mm_blockwise if fp8_gemm._SCALED_MM is not None else None


def rel_err(y, ref):
    return ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    smm = scaled_mm_provider()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; times in us per call, "
          f"err = max |y - ref| / max |ref| against the float32 reference (fp8: float32 output, "
          f"smm: bf16 output, so ~2^-9 from rounding alone)")
    print(f"{'shape':<9} {'N':>6} {'K':>6} {'M':>5} {'fp8 us':>8} {'bf16 us':>8} {'speedup':>8} "
          f"{'TB/s':>6} {'TFLOP/s':>8} {'fp8 err':>8} {'smm us':>8} {'smm err':>8}")
    for name, N, K in SHAPES:
        w, w_scale = quantize_block_fp8(torch.randn(N, K, device=dev, generator=g) * 0.02)
        copies = max(1, min(16, math.ceil(256e6 / (N * K))))
        ws = [(w.clone(), w_scale.clone()) for _ in range(copies)]
        wb = [dequant_block_fp8(a, s).to(torch.bfloat16) for a, s in ws]
        for M in args.m:
            x = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
            ref = reference.fp8_linear(x, w, w_scale, torch.float32)
            err = rel_err(fp8_gemm.fp8_linear_triton(x, w, w_scale, torch.float32), ref)
            t8 = graph_time_us([lambda a=a, s=s: fp8_gemm.fp8_linear_triton(x, a, s, x.dtype) for a, s in ws])
            t16 = graph_time_us([lambda b=b: F.linear(x, b) for b in wb])
            t_smm, e_smm = float("nan"), float("nan")
            if smm is not None:
                try:
                    e_smm = rel_err(smm(x, w, w_scale), ref)
                    if e_smm < 1e-2:
                        t_smm = graph_time_us([lambda a=a, s=s: smm(x, a, s) for a, s in ws])
                except Exception:   # not supported for this shape, GPU or torch: left blank
                    pass
            tb = (N * K + 2 * M * K + 2 * M * N) / t8 / 1e6
            tf = 2 * M * N * K / t8 / 1e6
            print(f"{name:<9} {N:>6} {K:>6} {M:>5} {t8:>8.1f} {t16:>8.1f} {t16 / t8:>7.2f}x "
                  f"{tb:>6.2f} {tf:>8.0f} {err:>8.1e} {t_smm:>8.1f} {e_smm:>8.1e}")
    absorbed(args.m, g)
    return 0


def absorbed(ms, g, heads=(16, 128)):
    """fp8_bmm (block-scaled FP8 weights, per-head batch) against torch.bmm on bf16 weights."""
    dev = g.device
    print(f"\nabsorbed bmm, per head x [M, K] @ w^T, w [N, K]: fp8 = mla fp8_bmm (activation "
          f"quantization + block-scaled GEMM), bf16 = torch.bmm on the dequantized weights")
    print(f"{'shape':<6} {'H':>4} {'N':>4} {'K':>4} {'M':>5} {'fp8 us':>8} {'bf16 us':>8} {'speedup':>8} "
          f"{'fp8 err':>8}")
    for name, N, K in ABSORBED:
        for H in heads:
            w, w_scale = quantize_block_fp8(torch.randn(H * N, K, device=dev, generator=g) * 0.02)
            w, w_scale = w.view(H, N, K), w_scale.view(H, -1, w_scale.shape[-1])
            copies = max(1, min(16, math.ceil(256e6 / (H * N * K))))
            ws = [(w.clone(), w_scale.clone()) for _ in range(copies)]
            wb = [torch.stack([dequant_block_fp8(a[h], s[h]) for h in range(H)]).to(torch.bfloat16) for a, s in ws]
            for M in ms:
                x = torch.randn(H, M, K, device=dev, generator=g).to(torch.bfloat16)
                ref = torch.stack([reference.fp8_linear(x[h], w[h], w_scale[h], torch.float32) for h in range(H)])
                err = rel_err(fp8_gemm.fp8_bmm(x, w, w_scale, torch.float32), ref)
                t8 = graph_time_us([lambda a=a, s=s: fp8_gemm.fp8_bmm(x, a, s, x.dtype) for a, s in ws])
                t16 = graph_time_us([lambda b=b: torch.bmm(x, b.mT) for b in wb])
                print(f"{name:<6} {H:>4} {N:>4} {K:>4} {M:>5} {t8:>8.1f} {t16:>8.1f} {t16 / t8:>7.2f}x {err:>8.1e}")


if __name__ == "__main__":
    raise SystemExit(main())
