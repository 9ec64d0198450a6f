"""``mla bench prefill``: the prefill-path ops on the GPU, checked against the references, then timed.

    mla bench prefill [--quick] [--csv FILE]      (or: PYTHONPATH=src python3 benchmarks/prefill.py)

Providers of prefill_attention share one signature (packed varlen q, k, v, cu_seqlens):
our Triton kernel in several tile configs, the library op (``mla.ops.prefill_attention``,
which applies the rule of ``mla.ops.prefill``), PyTorch's cuDNN attention with
log-sum-exp, SDPA's default (no LSE), the memory-efficient and flash kernels through their
aten ops, FlashInfer's fa3 ragged prefill where it imports (a peer, with LSE), and the
float32 PyTorch reference ("naive", up to 4k x 4k per sequence). Each is timed eagerly
(``mla.bench.timing.eager_time_us``) in ROUNDS interleaved rounds (every other one in
reverse order) and its median kept. FLOPs count the visible (query, key) pairs:
2 * H * (dq + dv) per pair.
The memory-bound ops of the prefill path follow (``mla.bench.memory_ops``), then the layer's
context phase (``mla.bench.layer``); all against ``mla.bench.roofline``.
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

from . import layer, memory_ops, report
from .roofline import COPY_BYTES_PER_S, GEMM_FLOPS_PER_S, fraction
from .timing import eager_time_us

DQ, DV = 192, 128
NAIVE_MAX_PAIRS = 4096 * 4096   # the naive provider's float32 scores: H * pairs * 4 bytes
ROUNDS = 4                      # timing rounds per provider (time_attention)


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
            rows.append(dict(check=name, provider=prov,
                             result=f"{'ok' if ok else 'FAIL'} out {err:.1e} lse {lerr:.1e}"))


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
        # GPU's clock drifts under minutes of tensor work, so whoever runs first has an edge
        # (up to 13% between identical calls timed one after the other; with two rounds and
        # the faster kept, identical calls still differ by up to 10%)
        provs = list(_providers().items())
        samples = {}
        for r in range(ROUNDS):
            for prov, fn in (provs if r % 2 == 0 else provs[::-1]):
                vv = vpad if prov == "flash_vpad" else v
                try:
                    if fn(q, k, vv, cq, ck, lq, lk, s) is None:
                        continue
                    samples.setdefault(prov, []).append(eager_time_us(lambda: fn(q, k, vv, cq, ck, lq, lk, s)))
                except Exception as e:  # noqa: BLE001
                    print(f"  {name} {prov}: {type(e).__name__}: {str(e)[:80]}", file=sys.stderr)
        times = {p: statistics.median(ts) for p, ts in samples.items()}
        times = {p: times[p] for p, _ in provs if p in times}
        base = times.get("sdpa")
        for prov, us in times.items():
            rows.append(dict(shape=name, provider=prov, ms=round(us * 1e-3, 3), tflops=round(flops / us * 1e-6, 1),
                             roofline=round(fraction(us, 0, flops), 3), vs_sdpa=round(base / us, 3) if base else ""))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="4k shapes only")
    p.add_argument("--csv", help="write every row to this CSV file")


def validate(args) -> None:
    """Nothing to check beyond argparse's own."""


def run(args) -> int:
    """Checks, memory-bound ops, attention, the layer; what ran is printed even when a step fails."""
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}")
    checks, att, mem, lay = [], [], [], []
    steps = (lambda: check_attention(checks), lambda: memory_ops.bench_memory_ops(mem, checks),
             lambda: time_attention(att, args.quick), lambda: layer.time_layer(lay, args.quick))
    failed = 0
    for step in steps:
        try:
            step()
        except Exception:  # noqa: BLE001 - report what ran, then the failure
            traceback.print_exc()
            failed = 1
    if args.csv:
        report.write_csv(checks + att + mem + lay, args.csv)
    print("\n## checks against the reference")
    report.print_rows(checks, ["check", "provider", "result"])
    print(f"\n## memory-bound ops (ceiling {COPY_BYTES_PER_S / 1e12:.2f} TB/s)")
    report.print_rows(mem, ["shape", "provider", "ms", "gbps", "roofline"])
    print(f"\n## prefill_attention, causal, bf16, q/k {DQ}, v {DV} (roofline {GEMM_FLOPS_PER_S / 1e12:.0f} TFLOP/s)")
    report.print_rows(att, ["shape", "provider", "ms", "tflops", "roofline", "vs_sdpa"])
    layer.print_layer(lay)
    return failed
