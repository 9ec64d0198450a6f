"""FP8 context attention (``mla.ops.fp8_prefill_attention``) against mla's bf16 prefill, on the GPU.

    PYTHONPATH=src python3 benchmarks/fp8_context.py [--quick] [--heads 128 16] [--csv FILE] [--layer]

One sequence of n new tokens over c cached ones (causal, ends aligned), DeepSeek-V3's shapes:

- expanded: q [n, H, 192], k [c + n, H, 192], v [c + n, H, 128] (what the layer's prefill,
  cached and chunked paths attend over). Providers: ``bf16_op`` (``mla.ops.prefill_attention``
  with host offsets, the layer's call: FlashInfer where installed, cuDNN for equal lengths
  without a prefix, else the Triton kernel), ``bf16_triton`` (the Triton kernel), ``fp8``
  (the FP8 kernel on K and V already in e4m3, one scale a token and head), ``fp8_quant`` (the
  same plus the per-row quantization of K and V the layer runs before it), ``fp8_pv`` (the FP8
  kernel with P V on e4m3 MMAs too, V key-major: not yet the op's), ``flashinfer_fp8``
  (FlashInfer's fa3 ragged prefill on e4m3 q, k, v with per-tensor scales, where it imports).
- absorbed: q [n, H, 576] over latent rows [c + n, 1, 576] (values: their first 512
  columns), the FP8 cache's rows as they are stored (one scale): ``fp8`` and ``bf16_triton``
  (the same kernel on bf16 rows).

``--layer`` (instead of the op grid): the whole layer (DeepSeek-V3 dimensions, random bf16
weights, a per-tensor FP8 cache) on n new tokens over c cached ones, the strategy pinned to
the expanded path ("cached": gather, expand, attend) or the absorbed one, with 16-bit and with
FP8 context attention, beside the 16-bit rule's own choice: where the absorbed FP8 path stops
beating the expanded one is the crossover the strategy rule needs.

Every provider is timed eagerly with the L2 flushed (``mla.bench.timing.eager_time_us``) in 2
interleaved rounds, median kept. TFLOP/s counts the visible (query, key) pairs:
2 * H * (dq + dv) a pair. The accuracy lines give each provider's error against float32
attention of the same (dequantized) inputs on one shape per form.
"""
from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys

import torch

from mla import ops
from mla.ops import reference
from mla.bench.timing import eager_time_us

FP8 = torch.float8_e4m3fn
ROUNDS = 2


def _cu(*lengths):
    return torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)


def pairs(n: int, c: int) -> int:
    """Visible (query, key) pairs of n causal queries over c + n keys."""
    return n * c + n * (n + 1) // 2


def inputs(form: str, H: int, n: int, c: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if form == "expanded":
        q = torch.randn(n, H, 192, device="cuda", generator=g).bfloat16()
        k = torch.randn(c + n, H, 192, device="cuda", generator=g).bfloat16()
        v = torch.randn(c + n, H, 128, device="cuda", generator=g).bfloat16()
        return q, k, v
    q = torch.randn(n, H, 576, device="cuda", generator=g).bfloat16()
    rows = (torch.randn(c + n, 1, 576, device="cuda", generator=g) * 0.5).bfloat16()
    return q, rows, rows[..., :512]


def providers(form: str, q, k, v, n: int, c: int, scale: float):
    from mla.ops.prefill import triton as tp

    cq, ck = _cu(n), _cu(c + n)
    out = {}
    if form == "expanded":
        out["bf16_op"] = lambda: ops.prefill_attention(q, k, v, cq, ck, scale, True, offsets_q=[0, n],
                                                       offsets_k=[0, c + n])
        out["bf16_triton"] = lambda: tp.launch(q, k, v, cq, ck, scale, True, tp.default_config(q, v.shape[-1]))
        (k8, ks), (v8, vs) = ops.quantize_rows_fp8(k), ops.quantize_rows_fp8(v)
        out["fp8"] = lambda: ops.fp8_prefill_attention(q, k8, v8, ks, vs, cq, ck, scale, True)
        vt = tp.key_major(v8)
        cfg = tp.fp8_config(q, 192, 128)
        out["fp8_pv"] = lambda: tp.launch(q, k8, vt, cq, ck, scale, True, cfg, ks, vs, fp8_pv=True)

        def quantized():
            (k8, ks), (v8, vs) = ops.quantize_rows_fp8(k), ops.quantize_rows_fp8(v)
            return ops.fp8_prefill_attention(q, k8, v8, ks, vs, cq, ck, scale, True)
        out["fp8_quant"] = quantized
        fi = _flashinfer_fp8(q, k, v, cq, ck, scale)
        if fi is not None:
            out["flashinfer_fp8"] = fi
    else:
        one = torch.tensor([1.0], device="cuda")
        rows8 = k.float().clamp(-448, 448).to(FP8)          # an FP8 cache's rows, kv_scale 1
        out["fp8"] = lambda: ops.fp8_prefill_attention(q, rows8, rows8[..., :512], one, one, cq, ck, scale, True)
        cfg = tp.PrefillConfig(64, 32, 8, 1)                  # bf16 rows: 576-wide keys, 512-wide values
        out["bf16_triton"] = lambda: tp.launch(q, k, v, cq, ck, scale, True, cfg)
    return out


def _flashinfer_fp8(q, k, v, cq, ck, scale):
    """FlashInfer's fa3 ragged prefill on e4m3 q, k, v with per-tensor scales, or None."""
    try:
        import flashinfer
    except ImportError:
        return None
    try:
        H = q.shape[1]
        sq, sk, sv = (t.float().abs().amax() / 448 for t in (q, k, v))
        q8, k8, v8 = (q.float() / sq).to(FP8), (k.float() / sk).to(FP8), (v.float() / sv).to(FP8)
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3")
        w.plan(cq, ck, H, H, 192, head_dim_vo=128, causal=True, sm_scale=scale, q_data_type=FP8, kv_data_type=FP8,
               o_data_type=torch.bfloat16)
        w.run(q8, k8, v8, scale_q=sq.reshape(1), scale_k=sk.reshape(1), scale_v=sv.reshape(1))
        return lambda: w.run(q8, k8, v8, scale_q=sq.reshape(1), scale_k=sk.reshape(1), scale_v=sv.reshape(1))
    except Exception as e:  # noqa: BLE001 - a peer's missing configuration is reported, not fatal
        print(f"flashinfer fp8: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        return None


def accuracy(form: str, H: int, n: int):
    """Each provider's relative error (Frobenius) against float32 attention of its own inputs."""
    q, k, v = inputs(form, H, n, 0, seed=1)
    scale = 192 ** -0.5 if form == "expanded" else 576 ** -0.5
    cq = _cu(n)
    res = {}
    for name, fn in providers(form, q, k, v, n, 0, scale).items():
        o = fn()
        o = o[0] if isinstance(o, tuple) else o
        if form == "expanded":
            kk, vv = k, v
            if name.startswith("fp8"):      # the inputs it attends: K, V dequantized from their rows
                (k8, ks), (v8, vs) = ops.quantize_rows_fp8(k), ops.quantize_rows_fp8(v)
                kk, vv = k8.float() * ks[..., None], v8.float() * vs[..., None]
        else:
            rows = k.float().clamp(-448, 448).to(FP8).float() if name == "fp8" else k.float()
            kk, vv = rows.expand(-1, H, -1), rows[..., :512].expand(-1, H, -1)
        want, _ = reference.prefill_attention(q.float(), kk.float().contiguous(), vv.float().contiguous(), cq, cq,
                                              scale, True)
        res[name] = ((o.float() - want).norm() / want.norm()).item()
    return res


def fa3_accuracy(n: int = 4096, H: int = 16, d: int = 128, seed: int = 2):
    """RMSE against float32 attention on FlashAttention-3's error test data: q, k, v entries
    N(0, 1) with 0.1% of them N(0, 10) (outliers), non-causal, one sequence. The paper reports
    2.4e-2 for per-tensor FP8 attention and 9.1e-3 for its own FP8 kernel (block quantization and
    incoherent processing)."""
    from fp8_accuracy import draw_inputs
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (draw_inputs((n, H, d), g, outliers=True, device="cuda") for _ in range(3))
    cq, scale = _cu(n), d ** -0.5
    want, _ = reference.prefill_attention(q, k, v, cq, cq, scale, False)
    (k8, ks), (v8, vs) = ops.quantize_rows_fp8(k), ops.quantize_rows_fp8(v)
    got = {"bf16_op": ops.prefill_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cq, cq, scale, False)[0],
           "fp8": ops.fp8_prefill_attention(q, k8, v8, ks, vs, cq, cq, scale, False)[0]}
    return {name: (o.float() - want).pow(2).mean().sqrt().item() for name, o in got.items()}


def layer_rows(heads, news=(16, 64, 256, 1024, 4096), prefixes=(4096, 32768), device="cuda",
               timer=eager_time_us):
    """The layer's context call per (heads, n new, c cached) and (strategy, FP8 attention)."""
    import mla
    from mla.bench.layer_step import v3_config
    from mla.testing import random_state_dict

    rows = []
    for H in heads:
        cfg = v3_config(H)
        sd = random_state_dict(cfg, torch.Generator().manual_seed(0))
        layers = {}
        for name, strategy, fp8 in (("bf16 rule", None, False), ("bf16 expanded", "cached", False),
                                    ("bf16 absorbed", "absorbed", False), ("fp8 expanded", "cached", True),
                                    ("fp8 absorbed", "absorbed", True)):
            layers[name] = mla.MLA(cfg, dtype=torch.bfloat16, device=device, strategy=strategy, fp8_attention=fp8)
            layers[name].load_hf_state_dict(sd)
        for c in prefixes:
            for n in news:
                cache = mla.PagedLatentCache(cfg, num_blocks=(n + c) // 64 + 4, block_size=64,
                                             dtype=torch.float8_e4m3fn, device=device)
                layers["bf16 rule"](torch.randn(c, cfg.hidden_size, device=device, dtype=torch.bfloat16),
                                    cache.prepare([("s", c)]))
                batch = cache.prepare([("s", n)])
                x = torch.randn(n, cfg.hidden_size, device=device, dtype=torch.bfloat16)
                outs, times = {}, {}
                for name, layer in layers.items():
                    outs[name] = layer(x, batch).float()    # plan and compile; later calls rewrite the same slots
                for r in range(ROUNDS):
                    for name, layer in list(layers.items())[:: 1 if r % 2 == 0 else -1]:
                        times.setdefault(name, []).append(timer(lambda: layer(x, batch)))
                ref = outs["bf16 expanded"]
                rule = layers["bf16 rule"].plan(batch).strategy[0]
                for name in layers:
                    us = statistics.median(times[name])
                    err = ((outs[name] - ref).norm() / ref.norm()).item()
                    rows.append(dict(form="layer", heads=H, new=n, cached=c, provider=name, us=round(us, 1),
                                     tokens_per_s=round(n / us * 1e6), err_vs_bf16_expanded=f"{err:.2e}",
                                     rule=rule))
                    print(f"layer H{H:<3d} n{n:<5d} c{c:<6d} {name:14s} {us:10.1f} us {n / us * 1e6:10.0f} tok/s  "
                          f"err {err:.2e}" + (f"  (rule: {rule})" if name == "bf16 rule" else ""), flush=True)
                del cache
                torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="n 4096 only")
    ap.add_argument("--heads", type=int, nargs="+", default=[128, 16])
    ap.add_argument("--csv", help="write the rows here too")
    ap.add_argument("--layer", action="store_true", help="the layer's strategies with and without FP8 attention")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if args.layer:
        _write(args.csv, layer_rows(args.heads))
        return 0
    for form in ("expanded", "absorbed"):
        print(f"accuracy {form} H16 n2048:", {k: f"{v:.2e}" for k, v in accuracy(form, 16, 2048).items()})
    print("RMSE on FlashAttention-3's outlier data, H16 d128 n4096:",
          {k: f"{v:.2e}" for k, v in fa3_accuracy().items()})
    rows = []
    lengths = [4096] if args.quick else [4096, 16384, 32768]
    for form in ("expanded", "absorbed"):
        for H in args.heads:
            for n in lengths if form == "expanded" else [4096]:
                for c in (0, 32768):
                    q, k, v = inputs(form, H, n, c)
                    scale = 192 ** -0.5 if form == "expanded" else 576 ** -0.5
                    provs = list(providers(form, q, k, v, n, c, scale).items())
                    times = {}
                    for r in range(ROUNDS):
                        for name, fn in provs if r % 2 == 0 else provs[::-1]:
                            times.setdefault(name, []).append(eager_time_us(fn))
                    dq, dv = q.shape[-1], v.shape[-1]
                    flops = 2 * H * (dq + dv) * pairs(n, c)
                    med = {k: statistics.median(t) for k, t in times.items()}
                    base = med.get("bf16_op", med["bf16_triton"])
                    for name, us in med.items():
                        rows.append(dict(form=form, heads=H, new=n, cached=c, provider=name, us=round(us, 1),
                                         tflops=round(flops / us / 1e6, 1), vs_bf16=round(base / us, 3)))
                        print(f"{form:8s} H{H:<3d} n{n:<6d} c{c:<6d} {name:15s} {us:10.1f} us "
                              f"{flops / us / 1e6:7.1f} TFLOP/s  {base / us:5.2f}x bf16")
                    del q, k, v
                    torch.cuda.empty_cache()
    _write(args.csv, rows)
    return 0


def _write(path, rows):
    if path and rows:
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
