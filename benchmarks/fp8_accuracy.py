"""FP8 accuracy on DeepSeek-V3 attention shapes (runs on CPU or GPU).

    PYTHONPATH=src python3 benchmarks/fp8_accuracy.py [--device cuda] [--heads 128] [--context] [--greedy]

One layer with DeepSeek-V3 dimensions and random unit-scale weights serves a prompt and
decode steps; every step's output is compared with the same layer in float32 on a float32
cache. Rows: a bf16 layer on a bf16 cache (the baseline), on the per-tensor FP8 cache and on
the tile-scaled FP8 cache; and the FP8 checkpoint path (128x128 block-quantized weights). "FP8 MMAs" replaces the
decode op by an emulation of what e4m3 tensor-core MMAs would compute over the per-tensor FP8
cache (``fp8_mma_decode``): the route to more than the bf16 kernel's throughput (docs/PERF.md),
whose accuracy is what this row measures.

``--context``: FP8 context attention (``mla.ops.fp8_prefill_attention``, its float32 emulation,
the kernel's rounding) per format and length, one causal sequence of n tokens, against float32
attention of the unrounded inputs; beside it the same inputs in bf16 and e4m3-rounded inputs
attended exactly (what the rounding of K and V alone costs). Data: unit-normal q, k, v, and
FlashAttention-3's outlier test data (``outliers``: 0.1% of the entries N(0, 10)), whose
RMSE the FlashAttention-3 paper reports as 2.4e-2 for per-tensor FP8 attention and 9.1e-3 for
its own FP8 kernel (head dim 128).

``--greedy``: a patched random DeepSeek-V3-shaped model (``mla.hf.patch``) generates greedily on
an FP8 cache with 16-bit and with FP8 context attention; tokens equal between them and against
a 16-bit cache.
"""
from __future__ import annotations

import argparse
from functools import partial

import torch

import mla
from mla import ops, quant
from mla.ops import reference
from mla.testing import random_state_dict, randomize_model
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


def draw_inputs(shape, g: torch.Generator, outliers: bool, device="cpu") -> torch.Tensor:
    """N(0, 1) entries; outliers: FlashAttention-3's error test data, 0.1% of them N(0, 10)."""
    x = torch.randn(shape, generator=g, device=device)
    if outliers:
        spike = torch.rand(shape, generator=g, device=device) < 1e-3
        x = torch.where(spike, 10 * torch.randn(shape, generator=g, device=device), x)
    return x


def context_errors(form: str, n: int, outliers: bool, H: int = 2, seed: int = 0) -> dict[str, tuple[float, float]]:
    """(relative Frobenius error, RMSE) of each arithmetic against float32 attention of the
    unrounded inputs, for one causal sequence of n tokens. form: "expanded" (q/k 192, v 128, K and
    V one scale a (token, head) row, as the layer rounds them), "128" (q, k, v 128: the
    FlashAttention-3 paper's head dim), or the absorbed form over latent rows [n, 576] (values
    their first 512) of an FP8 cache: "fp8" (one scale, attended as stored) or "fp8_tile" (per-128
    scales and bf16 RoPE, rounded again to one scale a row, as ``absorbed.fp8_context`` does)."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, n], dtype=torch.int32)
    if form in ("expanded", "128"):
        dq, dv = (192, 128) if form == "expanded" else (128, 128)
        q, k, v = draw_inputs((n, H, dq), g, outliers), draw_inputs((n, H, dq), g, outliers), draw_inputs((n, H, dv), g, outliers)
        (k8, ks), (v8, vs) = ops.quantize_rows_fp8(k), ops.quantize_rows_fp8(v)
        k_deq, v_deq = k8.float() * ks[..., None], v8.float() * vs[..., None]
    else:
        dq, dv = 576, 512
        q, rows = draw_inputs((n, H, dq), g, outliers), draw_inputs((n, dq), g, outliers)
        k, v = rows[:, None].expand(n, H, dq), rows[:, None, :dv].expand(n, H, dv)
        if form == "fp8":
            k8 = quant.quantize_rows(rows, "fp8", dv)[:, None]
            ks = vs = torch.ones(1)
        else:
            deq = quant.dequantize_rows(quant.quantize_rows(rows, "fp8_tile", dv), "fp8_tile", dv)
            k8, ks = ops.quantize_rows_fp8(deq[:, None])
            vs = ks
        v8 = k8[..., :dv]
        k_deq = (k8.float() * (ks[..., None] if ks.dim() == 2 else ks)).expand(n, H, dq)
        v_deq = k_deq[..., :dv]
    scale = dq ** -0.5

    def exact(q_, k_, v_):
        return reference.prefill_attention(q_.float(), k_.float().contiguous(), v_.float().contiguous(), cu, cu,
                                           scale, True)[0]
    want = exact(q, k, v)
    got = {"bf16": exact(q.bfloat16(), k.bfloat16(), v.bfloat16()),
           "e4m3 K, V": exact(q, k_deq, v_deq),
           "FP8 attention": ops.fp8_prefill_attention(q, k8, v8, ks, vs, cu, cu, scale, True, backend="torch")[0]}
    return {name: (((o - want).norm() / want.norm()).item(), (o - want).pow(2).mean().sqrt().item())
            for name, o in got.items()}


def context_table(lengths=(1024, 4096, 16384)):
    print("FP8 context attention (emulation) against float32, relative error / RMSE, one causal sequence")
    print(f"{'form':<10} {'data':<9} {'n':>6}   " + "   ".join(f"{k:>21}" for k in ("bf16", "e4m3 K, V",
                                                                                    "FP8 attention")))
    for form in ("expanded", "128", "fp8", "fp8_tile"):
        for outliers in (False, True):
            for n in lengths:
                errs = context_errors(form, n, outliers, H=1 if n > 4096 else 2)
                print(f"{form:<10} {'outliers' if outliers else 'normal':<9} {n:>6}   "
                      + "   ".join(f"{e:9.2e} / {r:9.2e}" for e, r in errs.values()), flush=True)


def greedy_agreement(batch: int = 16, prompt: int = 64, new: int = 16, layers: int = 2):
    """Greedy tokens of a patched random DeepSeek-V3-shaped model (MLA dims as DeepSeek-V3's,
    16 heads, hidden 1024) on an FP8 cache, context attention 16-bit and FP8, and on a float32
    cache; float32 weights on CPU. The first token comes from the prompt step alone, the one
    step FP8 context attention changes (the FP8 cache does not: the prompt attends its fresh
    latents); the later ones also follow every earlier difference. Random weights make the top
    two logits close, so a small error flips ties that a trained model's margins would keep."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    hf = DeepseekV3Config(vocab_size=2048, hidden_size=1024, intermediate_size=2048, num_hidden_layers=layers,
                          first_k_dense_replace=layers, num_attention_heads=16, num_key_value_heads=16,
                          q_lora_rank=384, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                          v_head_dim=128, max_position_embeddings=1024)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = randomize_model(DeepseekV3ForCausalLM(hf).eval(), g, gain=1.5)
    ids = torch.randint(0, hf.vocab_size, (batch, prompt), generator=g)
    cfg = mla.hf.patch_config(model)
    tokens = {}
    for name, dtype, fp8 in (("float32 cache", torch.float32, False), ("FP8 cache", quant.FP8, False),
                             ("FP8 cache, FP8 context attention", quant.FP8, True)):
        cache = mla.PagedLatentCache(cfg, num_layers=layers, num_blocks=batch * 3, block_size=64, dtype=dtype)
        with mla.hf.patch(model, cache, fp8_attention=fp8):
            tokens[name] = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                          do_sample=False)[:, prompt:]
    fp8 = tokens["FP8 cache, FP8 context attention"]
    print(f"greedy, {batch} prompts of {prompt} tokens, {new} new, {layers} layers:")
    for other in ("FP8 cache", "float32 cache"):
        t = tokens[other]
        prefix = (fp8 == t).int().cumprod(1).sum(1).float().mean().item()
        print(f"  FP8 context attention vs {other:<14}: tokens equal {(fp8 == t).float().mean().item():.3f}, "
              f"first token equal {(fp8[:, 0] == t[:, 0]).float().mean().item():.2f}, mean equal prefix {prefix:.1f}")
    t, b = tokens["FP8 cache"], tokens["float32 cache"]
    print(f"  FP8 cache (16-bit attention) vs float32 cache: tokens equal {(t == b).float().mean().item():.3f}, "
          f"first token equal {(t[:, 0] == b[:, 0]).float().mean().item():.2f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--context", action="store_true", help="FP8 context attention per format and length only")
    ap.add_argument("--greedy", action="store_true", help="greedy agreement of a patched model only")
    args = ap.parse_args(argv)
    if args.context or args.greedy:
        if args.context:
            context_table()
        if args.greedy:
            greedy_agreement()
        return
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
