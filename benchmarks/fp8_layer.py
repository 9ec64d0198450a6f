"""The whole layer with FP8: an FP8 checkpoint (weights kept FP8 or dequantized) and the FP8
latent caches, against the bf16 layer, on the GPU.

    PYTHONPATH=src python3 benchmarks/fp8_layer.py [--heads 128] [--batch 1 32 128] [--ctx 4096]

DeepSeek-V3 shapes, random weights block-quantized to FP8 (128 x 128, float32 scales). Each row:
one decode step of the layer (projections, RoPE + append, attention, output projection) for
``batch`` sequences of ``ctx`` cached tokens, captured in a CUDA graph and replayed; and a
prompt of ``--prompt`` tokens (eager). The error column is the decode output's relative error
against the same layer in float32 on dequantized weights and a float32 cache.
"""
from __future__ import annotations

import argparse

import torch

import mla
from mla.bench.timing import eager_time_us, graph_time_us
from mla.testing import random_state_dict
from mla.weights import quantize_checkpoint_fp8


def _step_time(fn) -> float:
    """Microseconds per call: replayed from a CUDA graph; eager (and why) when capture fails."""
    try:
        torch.cuda.set_sync_debug_mode("error")     # a host sync would break the capture: name it
        fn()
    except Exception as e:
        import traceback
        print("host sync in the step:", "".join(traceback.format_exception(e)[-6:]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    try:
        return graph_time_us([fn])
    except Exception as e:
        print(f"capture failed ({type(e).__name__}: {str(e).splitlines()[0]}); eager time")
        torch.cuda.synchronize()
        return eager_time_us(fn)


def _cache(cfg, batch, ctx, dtype, scaling):
    blocks = batch * (-(-(ctx + 8) // 64)) + 8
    return mla.PagedLatentCache(cfg, num_blocks=blocks, block_size=64, dtype=dtype, device="cuda", fp8_scaling=scaling)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=4096)
    args = ap.parse_args(argv)
    cfg = mla.MLAConfig.preset("deepseek-v3").replace(num_heads=args.heads)
    sd = random_state_dict(cfg, torch.Generator().manual_seed(0))
    sd8 = quantize_checkpoint_fp8(sd)
    layers = {}
    for name, fp8w in (("bf16 weights", "never"), ("fp8 weights", "auto")):
        layers[name] = mla.MLA(cfg, dtype=torch.bfloat16, device="cuda", fp8_weights=fp8w)
        layers[name].load_hf_state_dict(sd8)
    x_prompt = torch.randn(args.prompt, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    x_prompt = x_prompt.to("cuda", torch.bfloat16)
    ref_layer = mla.MLA(cfg, dtype=torch.float32, device="cuda")
    ref_layer.load_hf_state_dict(sd8)
    caches = (("bf16", torch.bfloat16, "tensor"), ("fp8", torch.float8_e4m3fn, "tensor"),
              ("fp8_tile", torch.float8_e4m3fn, "tile"))
    print(f"DeepSeek-V3 layer, {args.heads} heads, decode with {args.ctx} cached tokens (CUDA graph), "
          f"prompt {args.prompt} tokens (eager)")
    print(f"{'weights':<13} {'cache':<9} {'batch':>5} {'step us':>9} {'vs bf16':>8} {'rel err':>9}")
    base = {}
    for B in args.batch:
        g = torch.Generator().manual_seed(1)
        latents = torch.randn(B * args.ctx, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=g) * 0.5
        x = torch.randn(B, cfg.hidden_size, generator=g).cuda()
        ref_cache = _cache(cfg, B, args.ctx, torch.float32, "tensor")
        ref_cache.prepare([(s, args.ctx) for s in range(B)])
        _fill(ref_cache, B, args.ctx, latents)
        ref = ref_layer(x, ref_cache.prepare([(s, 1) for s in range(B)]))
        for lname, layer in layers.items():
            for cname, dtype, scaling in caches:
                cache = _cache(cfg, B, args.ctx, dtype, scaling)
                cache.prepare([(s, args.ctx) for s in range(B)])
                _fill(cache, B, args.ctx, latents)
                batch = cache.prepare([(s, 1) for s in range(B)])
                xb = x.to(torch.bfloat16)
                out = layer(xb, batch)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                us = _step_time(lambda: layer(xb, batch))
                base.setdefault(B, us)
                print(f"{lname:<13} {cname:<9} {B:>5} {us:9.1f} {base[B] / us:7.2f}x {err:9.2e}", flush=True)
                del cache
    print(f"\n{'weights':<13} {'prompt ms':>9} {'vs bf16':>8}")
    t0 = None
    for lname, layer in layers.items():
        cache = _cache(cfg, 1, args.prompt, torch.bfloat16, "tensor")

        def step():
            cache.release("p") if "p" in cache else None
            return layer(x_prompt, cache.prepare([("p", args.prompt)]))
        ms = eager_time_us(step) * 1e-3
        t0 = t0 or ms
        print(f"{lname:<13} {ms:9.3f} {t0 / ms:7.2f}x", flush=True)
        del cache
    return 0


def _fill(cache, B, ctx, latents):
    """Write the same latent rows into every format (quantized on the way in)."""
    from mla import quant
    rows = quant.quantize_rows(latents, cache.format, cache.cfg.kv_lora_rank, cache.kv_scale) \
        if cache.format != "plain" else latents
    rows = rows.to(cache.kv.device)
    for s in range(B):
        blocks = cache.blocks(s)
        for j, blk in enumerate(blocks):
            n = min(64, ctx - j * 64)
            if n <= 0:
                break
            cache.kv[0, blk, :n] = rows[s * ctx + j * 64: s * ctx + j * 64 + n].to(cache.kv.dtype)


if __name__ == "__main__":
    raise SystemExit(main())
