"""FP8 accuracy on DeepSeek-V3 attention shapes (runs on CPU or GPU).

    PYTHONPATH=src python3 benchmarks/fp8_accuracy.py [--device cuda] [--heads 128]

One layer with DeepSeek-V3 dimensions and random unit-scale weights serves a prompt and
decode steps; every step's output is compared with the same layer in float32 on a float32
cache. Rows: a bf16 layer on a bf16 cache (the baseline), on the per-tensor FP8 cache and on
the tile-scaled FP8 cache; and the FP8 checkpoint path (128x128 block-quantized weights).
"""
from __future__ import annotations

import argparse

import torch

import mla
from mla.demo import random_state_dict
from mla.weights import quantize_checkpoint_fp8


def run(cfg, sd, dtype, cache_dtype, device, steps, scaling="tensor"):
    layer = mla.MLA(cfg, dtype=dtype, device=device)
    layer.load_hf_state_dict(sd)
    cache = mla.PagedLatentCache(cfg, num_blocks=64, block_size=64, dtype=cache_dtype, device=device,
                                 fp8_scaling=scaling)
    g = torch.Generator().manual_seed(1)
    outs = []
    for n in steps:
        x = torch.randn(n, cfg.hidden_size, generator=g)
        outs.append(layer(x.to(device, dtype), cache.prepare([("s", n)])).double().cpu())
    return outs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--heads", type=int, default=128)
    args = ap.parse_args(argv)
    cfg = mla.MLAConfig.preset("deepseek-v3").replace(num_heads=args.heads)
    sd = random_state_dict(cfg, torch.Generator().manual_seed(0))
    steps = [256, 1, 1, 4, 1]
    ref = run(cfg, sd, torch.float32, torch.float32, args.device, steps)
    sd8 = quantize_checkpoint_fp8(sd)
    rows = [("bf16 layer, bf16 cache", run(cfg, sd, torch.bfloat16, torch.bfloat16, args.device, steps)),
            ("bf16 layer, fp8 cache (per-tensor)", run(cfg, sd, torch.bfloat16, torch.float8_e4m3fn, args.device, steps)),
            ("bf16 layer, fp8 cache (tile)", run(cfg, sd, torch.bfloat16, torch.float8_e4m3fn, args.device, steps, "tile")),
            ("fp32 layer on FP8 block weights", run(cfg, sd8, torch.float32, torch.float32, args.device, steps))]
    print(f"DeepSeek-V3 attention, {args.heads} heads, steps {steps} (prompt, decodes, 1+3 drafts), "
          f"relative error vs float32 per step")
    print(f"{'configuration':<36} " + " ".join(f"{'step ' + str(i):>9}" for i in range(len(steps))))
    for name, outs in rows:
        errs = [((o - r).norm() / r.norm()).item() for o, r in zip(outs, ref)]
        print(f"{name:<36} " + " ".join(f"{e:9.2e}" for e in errs))


if __name__ == "__main__":
    main()
