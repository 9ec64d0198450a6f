"""The memory-bound ops of the prefill path on the GPU (part of ``mla bench prefill``):
rope_append, gather_latent and merge_attention, each checked against its reference, then
timed in a CUDA graph over rotated inputs and reported in GB/s of the fewest bytes it must
move, against the copy ceiling of ``mla.bench.roofline``.
"""
from __future__ import annotations

import torch

from .roofline import fraction
from .timing import copies_past_l2, eager_time_us, graph_time_us

__all__ = ["bench_memory_ops"]

DV = 128            # value width of the merged partials (DeepSeek-V3's v_head_dim)
MEMORY_COPIES = 8   # input sets a graph rotates through, at most


def _cu(lengths):
    return torch.tensor([0] + list(lengths), device="cuda").cumsum(0).to(torch.int32)


def _memory_rows(rows, shape, nbytes, calls, reference_fn):
    """Our kernel timed in a CUDA graph over rotated inputs (``mla bench decode``'s method: per
    call, without launch gaps or an L2 flush in between; eager do_bench times of these
    25-100 us kernels vary up to 2x between runs); the PyTorch reference eagerly (it reads
    the host, so it cannot be captured)."""
    for prov, us in (("triton", graph_time_us(calls)), ("torch", eager_time_us(reference_fn))):
        rows.append(dict(shape=shape, provider=prov, ms=round(us * 1e-3, 4), gbps=round(nbytes / us * 1e-3),
                         roofline=round(fraction(us, nbytes), 3)))


def bench_memory_ops(rows: list[dict], checks: list[dict]) -> None:
    """DeepSeek-V3 dims (dn 128, dr 64, r 512, page 64): a check row per shape to checks, a
    timing row per (shape, provider) to rows."""
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
        n_sets = copies_past_l2(nbytes, MEMORY_COPIES)
        sets = [(q, kv_a, cache)] + [(q.clone(), kv_a.clone(), cache.clone()) for _ in range(n_sets - 1)]
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
        caches = [cache] + [cache.clone() for _ in range(copies_past_l2(nbytes, MEMORY_COPIES) - 1)]
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
        sets = [(oa, ob)] + [(oa.clone(), ob.clone()) for _ in range(copies_past_l2(nbytes, MEMORY_COPIES) - 1)]
        _memory_rows(rows, f"merge T{T} H{H}", nbytes,
                     [lambda a=a, b=b: merge_attention(a, la, b, lb) for a, b in sets],
                     lambda: reference.merge_attention(oa, la, ob, lb))
