"""Prefill-path ops on the GPU: correctness against the references, then timings.

    mla bench prefill [--quick] [--csv FILE]      (or: PYTHONPATH=src python3 benchmarks/prefill.py)

Providers of prefill_attention share one signature (packed varlen q, k, v, cu_seqlens):
our Triton kernel in several tile configs, the library op (``mla.ops.prefill_attention``,
which applies the rule of ``mla.ops.prefill``), PyTorch's cuDNN attention with
log-sum-exp, SDPA's default (no LSE), the memory-efficient and flash kernels through their
aten ops, FlashInfer's fa3 ragged prefill where it imports (a peer, with LSE), and the
float32 PyTorch reference ("naive", up to 4k x 4k per sequence). Each is timed in ROUNDS
interleaved rounds (every other one in reverse order) and its median kept. FLOPs count the
visible (query, key) pairs: 2 * H * (dq + dv) per pair.
rope_append, gather_latent and merge_attention (our kernels timed in CUDA graphs over
rotated inputs) are reported in GB/s of the fewest bytes they must move, against the
4.28 TB/s device copy ceiling.
"""
from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import traceback

import torch
import torch.nn.functional as F

PEAK_FLOPS = 790e12      # bf16 dense GEMM measured on the H200 (DESIGN.md section 5)
PEAK_BYTES = 4.28e12     # device-to-device copy, read + write
DQ, DV = 192, 128
NAIVE_MAX_PAIRS = 4096 * 4096   # the naive provider's float32 scores: H * pairs * 4 bytes
ROUNDS = 4                      # timing rounds per provider (time_attention)


def _bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=25, return_mode="median") * 1e-3


def _offsets(lengths):
    return tuple(itertools.accumulate(lengths, initial=0))


def _cu(lengths):
    return torch.tensor([0] + list(lengths), device="cuda").cumsum(0).to(torch.int32)


def _pairs(lq, lk, causal=True):
    if not causal:
        return sum(a * b for a, b in zip(lq, lk))
    return sum(sum(min(nk, i + 1 + nk - nq) for i in range(nq) if i + 1 + nk - nq > 0) for nq, nk in zip(lq, lk))


# ------------------------------------------------------------------------- attention providers

def _providers():
    from mla.ops import prefill_attention, reference
    from mla.ops.prefill import peers
    from mla.ops.prefill import triton as tp

    def triton_cfg(cfg):
        return lambda q, k, v, cq, ck, lq, lk, s: tp.launch(q, k, v, cq, ck, s, True, cfg)

    def cudnn_lse(q, k, v, cq, ck, lq, lk, s):
        if not (lq == lk and len(set(lq)) == 1):
            return None
        return peers.cudnn_prefill(q, k, v, len(lq), s, True)

    def cudnn_raw(q, k, v, cq, ck, lq, lk, s):    # the same call without converting out/lse back
        if not (lq == lk and len(set(lq)) == 1):
            return None
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(_bhnd(q, lq), _bhnd(k, lq), _bhnd(v, lq), None, True,
                                                               0.0, True, False, scale=s)
        return r[0], None

    def _bhnd(t, lq):
        return t.view(len(lq), lq[0], t.shape[1], t.shape[2]).transpose(1, 2)

    def sdpa(q, k, v, cq, ck, lq, lk, s):   # SDPA's default choice, no LSE
        if not (lq == lk and len(set(lq)) == 1):
            return None
        return F.scaled_dot_product_attention(_bhnd(q, lq), _bhnd(k, lq), _bhnd(v, lq), is_causal=True, scale=s), None

    def cudnn_varlen(q, k, v, cq, ck, lq, lk, s):   # ragged cuDNN: top-left causal, nq == nk only
        if lq != lk:
            return None
        r = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cq, ck, max(lq), max(lk), True, 0.0, True, False,
                                                    scale=s)
        return r[0], None

    def eff_varlen(q, k, v, cq, ck, lq, lk, s):     # mask type 2: causal from the bottom right (our rule)
        r = torch.ops.aten._efficient_attention_forward(q[None], k[None], v[None], None, cq, ck, max(lq), max(lk),
                                                        0.0, 2, True, scale=s)
        return r[0][0], None

    def flash_vpad(q, k, v, cq, ck, lq, lk, s):     # flash needs dv == dq: v padded (not counted)
        r = torch.ops.aten._flash_attention_forward(q, k, v, cq, ck, max(lq), max(lk), 0.0, True, False, scale=s)
        return r[0][..., :DV], None

    def op(q, k, v, cq, ck, lq, lk, s):     # with the offsets on the host, as the layer passes them
        return prefill_attention(q, k, v, cq, ck, s, True, offsets_q=_offsets(lq), offsets_k=_offsets(lk))

    fi_plans, fi_workspace = {}, []

    def flashinfer_fa3(q, k, v, cq, ck, lq, lk, s):    # FlashInfer's ragged prefill (a peer), with LSE
        import flashinfer

        key = (tuple(lq), tuple(lk), q.shape[1], s)
        if key not in fi_plans:   # plan once per shape, outside the timed call
            if not fi_workspace:  # scratch shared by the wrappers (each keeps its own plan)
                fi_workspace.append(torch.empty(256 << 20, dtype=torch.uint8, device=q.device))
            w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(fi_workspace[0], "NHD", backend="fa3")
            w.plan(cq, ck, q.shape[1], k.shape[1], DQ, head_dim_vo=DV, causal=True, sm_scale=s,
                   q_data_type=q.dtype, kv_data_type=k.dtype)
            fi_plans[key] = w
        o, lse = fi_plans[key].run(q, k, v, return_lse=True)
        return o, lse * math.log(2)   # FlashInfer's LSE is in base 2

    def naive(q, k, v, cq, ck, lq, lk, s):  # the float32 PyTorch reference: [H, n, n] scores per sequence
        if max(lq) * max(lk) > NAIVE_MAX_PAIRS:
            return None
        return reference.prefill_attention(q, k, v, cq, ck, s, True)

    return {
        "op": op,
        "triton": triton_cfg(tp.PrefillConfig(128, 128, 8, 2)),      # the default
        "triton_n64": triton_cfg(tp.PrefillConfig(128, 64, 8, 3)),
        "triton_m64": triton_cfg(tp.PrefillConfig(64, 64, 4, 3)),
        "cudnn_lse": cudnn_lse,
        "cudnn_raw": cudnn_raw,
        "sdpa": sdpa,
        "cudnn_varlen": cudnn_varlen,   # ~50 ms a call on torch 2.11: a graph built per call?
        "eff_varlen": eff_varlen,
        "flash_vpad": flash_vpad,
        "flashinfer_fa3": flashinfer_fa3,
        "naive": naive,
    }


def _inputs(H, lq, lk, pad_v=False):
    q = torch.randn(sum(lq), H, DQ, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lk), H, DQ, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lk), H, DQ if pad_v else DV, device="cuda", dtype=torch.bfloat16)
    return q, k, v


def check_attention(rows):
    from mla.ops import reference

    cases = [("H16 eq 4x1024", 16, [1024] * 4, [1024] * 4), ("H16 var", 16, [1000, 0, 2048], [1000, 0, 2048]),
             ("H16 prefix", 16, [300, 513], [4096, 513]), ("H128 1x2048", 128, [2048], [2048])]
    for name, H, lq, lk in cases:
        q, k, v = _inputs(H, lq, lk)
        cq, ck, s = _cu(lq), _cu(lk), 1 / math.sqrt(DQ)
        ro, rl = reference.prefill_attention(q, k, v, cq, ck, s, True)
        for prov, fn in _providers().items():
            vv = torch.nn.functional.pad(v, (0, DQ - DV)) if prov == "flash_vpad" else v
            try:
                res = fn(q, k, vv, cq, ck, lq, lk, s)
            except Exception as e:  # noqa: BLE001 - a library path may be absent on this build
                rows.append(dict(check=name, provider=prov, result=f"error {type(e).__name__}: {str(e)[:60]}"))
                continue
            if res is None:
                continue
            o, l = res
            if o.dim() == 4:   # SDPA's [B, H, n, dv]
                o = o.transpose(1, 2).reshape(-1, H, DV)
            err = (o.float() - ro.float()).abs().max().item()
            fin = torch.isfinite(rl)
            lerr = float("nan") if l is None else (l.float() - rl).abs()[fin].max().item()
            lse_ok = l is None or torch.equal(torch.isfinite(l), fin)
            ok = err < 2e-2 and lse_ok and (l is None or lerr < 1e-2)
            rows.append(dict(check=name, provider=prov, result=f"{'ok' if ok else 'FAIL'} out {err:.1e} lse {lerr:.1e}"))


def time_attention(rows, quick):
    shapes = [(128, 1, 4096), (128, 4, 4096), (16, 1, 4096), (16, 4, 4096)]
    if not quick:
        shapes += [(128, 1, 1024), (128, 1, 16384), (16, 1, 16384), (128, 1, 32768), (16, 1, 32768)]
    cases = [(H, [n] * B, [n] * B, f"H{H} B{B} n{n}") for H, B, n in shapes]
    cases += [(128, [512, 1024, 2048, 4096], [512, 1024, 2048, 4096], "H128 var 512..4096"),
              (128, [1024, 1024], [4096, 4096], "H128 2x1024 over 4096")]
    for H, lq, lk, name in cases:
        q, k, v = _inputs(H, lq, lk)
        vpad = torch.nn.functional.pad(v, (0, DQ - DV))
        cq, ck, s = _cu(lq), _cu(lk), 1 / math.sqrt(DQ)
        flops = 2 * H * (DQ + DV) * _pairs(lq, lk)
        # ROUNDS rounds, every other one in reverse order, each provider's median kept: the
        # GPU's clock drifts under minutes of tensor work, and whoever ran first had an edge
        # (one run had the op 13% ahead of the identical cuDNN call timed after it; with two
        # rounds and the faster kept, identical calls still differed by up to 10%)
        provs = list(_providers().items())
        samples = {}
        for r in range(ROUNDS):
            for prov, fn in (provs if r % 2 == 0 else provs[::-1]):
                vv = vpad if prov == "flash_vpad" else v
                try:
                    if fn(q, k, vv, cq, ck, lq, lk, s) is None:
                        continue
                    samples.setdefault(prov, []).append(_bench(lambda: fn(q, k, vv, cq, ck, lq, lk, s)))
                except Exception as e:  # noqa: BLE001
                    print(f"  {name} {prov}: {type(e).__name__}: {str(e)[:80]}", file=sys.stderr)
        times = {p: statistics.median(ts) for p, ts in samples.items()}
        times = {p: times[p] for p, _ in provs if p in times}
        base = times.get("sdpa")
        for prov, t in times.items():
            tf = flops / t / 1e12
            rows.append(dict(shape=name, provider=prov, ms=round(t * 1e3, 3), tflops=round(tf, 1),
                             roofline=round(tf * 1e12 / PEAK_FLOPS, 3),
                             vs_sdpa=round(base / t, 3) if base else ""))


# ------------------------------------------------------------------------- memory-bound ops

def _copies(nbytes: int) -> int:
    """Input sets to rotate through so that a graph's calls do not find their data in the L2."""
    from mla.bench import L2_ROTATE_BYTES

    return max(1, min(8, math.ceil(L2_ROTATE_BYTES / nbytes)))


def _memory_rows(rows, shape, nbytes, calls, reference_fn):
    """Our kernel timed in a CUDA graph over rotated inputs (`mla bench decode`'s method: per
    call, without launch gaps or an L2 flush in between; eager `do_bench` times of these
    25-100 us kernels varied up to 2x between runs); the PyTorch reference eagerly (it reads
    the host, so it cannot be captured)."""
    from mla.bench import graph_time_us

    for prov, t in (("triton", graph_time_us(calls) * 1e-6), ("torch", _bench(reference_fn))):
        rows.append(dict(shape=shape, provider=prov, ms=round(t * 1e3, 4), gbps=round(nbytes / t / 1e9),
                         roofline=round(nbytes / t / PEAK_BYTES, 3)))


def bench_memory_ops(rows, checks):
    from mla.ops import gather_latent, merge_attention, reference, rope_append

    dn, dr, r, bs = 128, 64, 512, 64
    for H, T in ((128, 4096), (16, 16384), (128, 16384)):
        q = torch.randn(T, H, dn + dr, device="cuda", dtype=torch.bfloat16)
        kv_a = torch.randn(T, r + dr, device="cuda", dtype=torch.bfloat16)
        ang = torch.rand(T, dr // 2, device="cuda") * 100
        cos, sin = ang.cos(), ang.sin()
        nb = T // bs + 16
        cache = torch.randn(nb, bs, r + dr, device="cuda", dtype=torch.bfloat16)
        slots = torch.randperm(nb * bs, device="cuda")[:T]
        q2, kv2, c2 = q.clone(), kv_a.clone(), cache.clone()
        rope_append(q[..., dn:], kv_a[:, r:], kv_a[:, :r], cos, sin, cache, slots, True)
        reference.rope_append(q2[..., dn:], kv2[:, r:], kv2[:, :r], cos, sin, c2, slots, True)
        diff = max((q.float() - q2.float()).abs().max().item(), (cache.float() - c2.float()).abs().max().item())
        checks.append(dict(check=f"rope_append H{H} T{T}", provider="triton", result=f"max diff {diff:.1e}"))
        nbytes = T * (H * dr * 2 * 2 + dr * 2 * 2 + r * 2 + (r + dr) * 2 + dr * 4)
        sets = [(q, kv_a, cache)] + [(q.clone(), kv_a.clone(), cache.clone()) for _ in range(_copies(nbytes) - 1)]
        calls = [lambda q=q, kv_a=kv_a, cache=cache: rope_append(q[..., dn:], kv_a[:, r:], kv_a[:, :r], cos, sin,
                                                                 cache, slots, True) for q, kv_a, cache in sets]
        _memory_rows(rows, f"rope_append H{H} T{T}", nbytes, calls,
                     lambda: reference.rope_append(q[..., dn:], kv_a[:, r:], kv_a[:, :r], cos, sin, cache, slots, True))

    for B, n in ((4, 4096), (32, 2048), (1, 65536)):
        max_blocks = (n + 100 + bs - 1) // bs
        cache = torch.randn(B * max_blocks, bs, r + dr, device="cuda", dtype=torch.bfloat16)
        bt = torch.randperm(B * max_blocks, device="cuda").view(B, max_blocks).to(torch.int32)
        st = torch.full((B,), 100, dtype=torch.int32, device="cuda")
        cu, N = _cu([n] * B), B * n
        out = gather_latent(cache, bt, st, cu, N)
        same = torch.equal(out, reference.gather_latent(cache, bt, st, cu, N))
        checks.append(dict(check=f"gather B{B} n{n}", provider="triton", result="ok" if same else "FAIL"))
        nbytes = 2 * N * (r + dr) * 2
        caches = [cache] + [cache.clone() for _ in range(_copies(nbytes) - 1)]
        _memory_rows(rows, f"gather_latent B{B} n{n}", nbytes,
                     [lambda c=c: gather_latent(c, bt, st, cu, N) for c in caches],
                     lambda: reference.gather_latent(cache, bt, st, cu, N))

    for T, H in ((4096, 128), (16384, 16)):
        oa, ob = (torch.randn(T, H, DV, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        la, lb = (torch.randn(T, H, device="cuda") * 4 for _ in range(2))
        la[::7] = float("-inf")
        o, l = merge_attention(oa, la, ob, lb)
        ro, rl = reference.merge_attention(oa, la, ob, lb)
        err = (o.float() - ro.float()).abs().max().item()
        checks.append(dict(check=f"merge T{T} H{H}", provider="triton",
                           result=f"{'ok' if err < 2e-2 and not o.isnan().any() else 'FAIL'} {err:.1e}"))
        nbytes = T * H * (3 * DV * 2 + 3 * 4)
        sets = [(oa, ob)] + [(oa.clone(), ob.clone()) for _ in range(_copies(nbytes) - 1)]
        _memory_rows(rows, f"merge T{T} H{H}", nbytes,
                     [lambda a=a, b=b: merge_attention(a, la, b, lb) for a, b in sets],
                     lambda: reference.merge_attention(oa, la, ob, lb))


def time_layer(rows, quick):
    """The whole layer's context phase: DeepSeek-V3 dimensions, random weights, bf16, 16 and
    128 heads; prompts with no prefix and prompts over a cached prefix. Tokens/s of new tokens."""
    import mla
    from mla.testing import random_state_dict

    cases = [(4096, 0), (4096, 4096)] if quick else [(1024, 0), (4096, 0), (16384, 0), (32768, 0), (4096, 4096),
                                                       (4096, 28672)]
    for H in (16, 128):
        cfg = mla.MLAConfig.preset("deepseek-v3").replace(num_heads=H)
        layer = mla.MLA(cfg, dtype=torch.bfloat16, device="cuda")
        layer.load_hf_state_dict(random_state_dict(cfg, torch.Generator().manual_seed(0)))
        for n, c in cases:
            cache = mla.PagedLatentCache(cfg, num_blocks=(n + c) // 64 + 4, block_size=64, dtype=torch.bfloat16,
                                         device="cuda")
            if c:
                layer(torch.randn(c, cfg.hidden_size, device="cuda", dtype=torch.bfloat16), cache.prepare([("s", c)]))
            batch = cache.prepare([("s", n)])
            x = torch.randn(n, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
            layer(x, batch)   # plan and compile; later calls rewrite the same slots
            t = _bench(lambda: layer(x, batch))
            plan = layer.plan(batch)
            rows.append(dict(shape=f"V3 layer H{H} new {n} prefix {c}", provider=plan.strategy[0],
                             ms=round(t * 1e3, 3), tokens_per_s=round(n / t)))
            del cache
            torch.cuda.empty_cache()


def _print(rows, cols):
    widths = {c: max([len(c)] + [len(str(r.get(c, ""))) for r in rows]) for c in cols}
    print(" | ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mla bench prefill", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4k shapes only")
    ap.add_argument("--csv", help="write every row to this CSV file")
    ap.add_argument("--layer-only", action="store_true", help="time only the layer's context phase")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("mla bench prefill: needs a CUDA GPU")
        return 1
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}")
    checks, att, mem, lay = [], [], [], []
    steps = (lambda: check_attention(checks), lambda: bench_memory_ops(mem, checks),
             lambda: time_attention(att, args.quick), lambda: time_layer(lay, args.quick))
    if args.layer_only:
        steps = steps[-1:]
    for step in steps:
        try:
            step()
        except Exception:  # noqa: BLE001 - report what ran, then the failure
            traceback.print_exc()
    if args.csv:
        from .bench import write_csv
        write_csv(checks + att + mem + lay, args.csv)
    print("\n## checks against the reference")
    _print(checks, ["check", "provider", "result"])
    print("\n## memory-bound ops (ceiling 4.28 TB/s)")
    _print(mem, ["shape", "provider", "ms", "gbps", "roofline"])
    print("\n## prefill_attention, causal, bf16, q/k 192, v 128 (roofline 790 TFLOP/s)")
    _print(att, ["shape", "provider", "ms", "tflops", "roofline", "vs_sdpa"])
    print("\n## the layer's context phase (strategy as provider)")
    _print(lay, ["shape", "provider", "ms", "tokens_per_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
