"""Every GPU kernel of mla in one call: each checked against its reference, then timed.

    PYTHONPATH=/tmp/site:src python3 benchmarks/gpu.py [--quick]

1. decode (``mla bench decode``): the dispatched op, the portable Triton kernel and the Gluon
   kernels by name (the FP8 one on the FP8 caches), FlashInfer fa3 when installed (see
   docs/PERF.md for how it was brought), naive PyTorch; DeepSeek-V3 shapes, 16 and 128 heads;
   bf16 cache, and the FP8 caches at 16 heads; the mixes (``--mixed``) on the portable kernel's
   three schedules (the split plan, ``p`` persistent, ``f`` flattened) beside the Gluon kernels.
2. prefill (``mla bench prefill``): prefill attention against SDPA, RoPE + append, gather,
   merge, the layer's context phase.
3. FP8 GEMMs (``benchmarks/fp8_gemm.py``): block-scaled FP8 against bf16 and torch's scaled_mm.
4. The FP8 layer (``benchmarks/fp8_layer.py``): FP8 weights and caches in a decode step.
5. FP8 context attention (``benchmarks/fp8_context.py``): against the bf16 prefill, and the
   layer's strategies with and without it.
Multi-GPU runs are separate: ``benchmarks/multi_gpu.py``.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fp8_context  # noqa: E402
import fp8_gemm  # noqa: E402
import fp8_layer  # noqa: E402

from mla.bench import main as bench  # noqa: E402

if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py: needs a CUDA GPU")
    quick = "--quick" in sys.argv[1:]
    batch = ["--batch", "1", "128"] if quick else []
    kernels = ["--variants", "default,gluon:seesaw,gluon:narrow"]
    rc = bench(["decode", "--kv-len", "4096", "16384"] + batch + kernels)
    rc |= bench(["decode", "--heads", "16", "--kv", "fp8", "fp8_tile", "--kv-len", "4096", "16384"] + batch
                + [kernels[0], kernels[1] + ",gluon:fp8reg"])
    rc |= bench(["decode", "--mixed"] + batch + ["--variants", "default,p,f,gluon:seesaw,gluon:narrow"])
    rc |= bench(["prefill"] + (["--quick"] if quick else []))
    rc |= fp8_gemm.main(["--m", "1", "64", "4096"] if quick else [])
    rc |= fp8_layer.main(["--batch", "1", "128"])
    rc |= fp8_context.main(["--quick"] if quick else [])
    rc |= fp8_context.main(["--layer"] + (["--heads", "128"] if quick else []))
    sys.exit(rc)
