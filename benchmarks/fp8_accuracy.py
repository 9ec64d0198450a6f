"""FP8 accuracy on DeepSeek-V3 attention shapes (runs on CPU or GPU).

    PYTHONPATH=src python3 benchmarks/fp8_accuracy.py [--device cuda] [--heads 128]

One layer with DeepSeek-V3 dimensions and random unit-scale weights serves a prompt and
decode steps; every step's output is compared with the same layer in float32 on a float32
cache. Rows: a bf16 layer on a bf16 cache (the baseline), on the per-tensor FP8 cache and on
the tile-scaled FP8 cache; and the FP8 checkpoint path (128x128 block-quantized weights). "FP8 MMAs" replaces the
decode op by an emulation of what e4m3 tensor-core MMAs would compute over the per-tensor FP8
cache (``fp8_mma_decode``): the route to more than the bf16 kernel's throughput (docs/PERF.md),
whose accuracy is what this row measures.
"""
from __future__ import annotations

import argparse
from functools import partial

import torch

import mla
from mla import ops
from mla.testing import random_state_dict
from mla.ops.reference import decode_visible, gather_rows
from mla.weights import quantize_checkpoint_fp8

E4M3_MAX = 448.0


def _e4m3(x: torch.Tensor, split: bool, bound: float | None = None) -> torch.Tensor:
    """x as the MMA would see it: e4m3 with a scale per row (amax / 448; bound / 448 when every
    value is known to be <= bound, as P <= 1 is: one scale for all tiles), or, split, as the
    sum of two e4m3 terms under that same scale (the second carries the first's rounding error:
    two FP8 MMAs into one accumulator instead of one MMA, about bf16's precision)."""
    s = (x.abs().amax(-1, keepdim=True).clamp_min(1e-30) if bound is None else bound) / E4M3_MAX
    hi = (x / s).to(torch.float8_e4m3fn).float()
    if split:
        hi = hi + (x / s - hi).to(torch.float8_e4m3fn).float()
    return hi * s


def fp8_mma_decode(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal=True, *, kv_scale=1.0,
                   backend=None, e4m3_q=True, e4m3_p=True, split=False):
    """``mla.ops.mla_decode`` over a per-tensor FP8 cache as e4m3 MMAs would compute it, in
    float32: query rows quantized to e4m3 with a scale per row (amax / 448), S = q8 k8^T summed
    exactly, P = exp(S - lse) (<= 1) quantized to e4m3 with scale 1 / 448, O = P8 v8; the row
    sums stay float32. The keys and values are the cache's e4m3 values as stored. e4m3_q /
    e4m3_p False: that operand stays float32 (to see which quantization costs what); split: each
    quantized operand is the sum of two e4m3 terms (``_e4m3``)."""
    if kv_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"kv_cache: expected the per-tensor float8_e4m3fn cache, got {kv_cache.dtype}")
    B, s_q, H, _ = q.shape
    out = torch.zeros(B, s_q, H, head_dim_v, dtype=torch.float32, device=q.device)
    lse = torch.full((B, s_q, H), float("-inf"), dtype=torch.float32, device=q.device)
    for b, n in enumerate(cache_seqlens.tolist()):
        if n <= 0 or s_q == 0:
            continue
        kv = gather_rows(kv_cache, block_table[b], n).float()                # e4m3 values
        qb = q[b].float().transpose(0, 1)                                     # [H, s_q, d]
        q8 = _e4m3(qb, split) if e4m3_q else qb
        scores = (q8 @ kv.T) * (kv_scale * softmax_scale)
        scores = scores.masked_fill(~decode_visible(n, s_q, causal, q.device), float("-inf"))
        l = torch.logsumexp(scores, dim=-1)
        p = torch.exp(scores - l.unsqueeze(-1))
        p8 = _e4m3(p, split, bound=1.0) if e4m3_p else p
        out[b] = ((p8 @ kv[:, :head_dim_v]) * kv_scale).transpose(0, 1)
        lse[b] = l.transpose(0, 1)
    return out.to(q.dtype), lse


def run(cfg, sd, dtype, cache_dtype, device, steps, scaling="tensor", decode_op=None):
    if decode_op is not None:
        shipped, ops.mla_decode = ops.mla_decode, decode_op
        try:
            return run(cfg, sd, dtype, cache_dtype, device, steps, scaling)
        finally:
            ops.mla_decode = shipped
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
            ("bf16 layer, fp8 cache, FP8 MMAs", run(cfg, sd, torch.bfloat16, torch.float8_e4m3fn, args.device, steps,
                                                   decode_op=fp8_mma_decode)),
            ("  the same, e4m3 queries only", run(cfg, sd, torch.bfloat16, torch.float8_e4m3fn, args.device, steps,
                                                decode_op=partial(fp8_mma_decode, e4m3_p=False))),
            ("  the same, e4m3 P only", run(cfg, sd, torch.bfloat16, torch.float8_e4m3fn, args.device, steps,
                                          decode_op=partial(fp8_mma_decode, e4m3_q=False))),
            ("  queries and P as two e4m3 terms", run(cfg, sd, torch.bfloat16, torch.float8_e4m3fn, args.device,
                                                     steps, decode_op=partial(fp8_mma_decode, split=True))),
            ("fp32 layer on FP8 block weights", run(cfg, sd8, torch.float32, torch.float32, args.device, steps))]
    print(f"DeepSeek-V3 attention, {args.heads} heads, steps {steps} (prompt, decodes, 1+3 drafts), "
          f"relative error vs float32 per step")
    print(f"{'configuration':<36} " + " ".join(f"{'step ' + str(i):>9}" for i in range(len(steps))))
    for name, outs in rows:
        errs = [((o - r).norm() / r.norm()).item() for o, r in zip(outs, ref)]
        print(f"{name:<36} " + " ".join(f"{e:9.2e}" for e in errs))


if __name__ == "__main__":
    main()
