"""Hostile inputs on the GPU: strided index tensors give the contiguous call's bits on every decode
kernel, prefill, append and gather; NaN in an FP8 cache reaches the queries that see it; bad
values the wrappers cannot check on CUDA (gather block ids and offsets, append slots, decode
block ids and lengths) never read or write out of bounds. Run it plain, then under compute-sanitizer:

    PYTHONPATH=src python3 tools/hostile_gpu.py
    PYTHONPATH=src compute-sanitizer --tool memcheck python3 tools/hostile_gpu.py --unchecked
"""
from __future__ import annotations

import sys

import torch

from mla import ops
from mla.ops import decode

dev = "cuda"


def i32(x):
    return torch.tensor(x, dtype=torch.int32, device=dev)


def column_major(t):
    return t.t().contiguous().t()


def spread(t):
    buf = torch.full((2 * t.shape[0],), 7, dtype=t.dtype, device=t.device)
    buf[::2] = t
    return buf[::2]


def same(a, b, what):
    for x, y in zip(a, b):
        assert torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num()), what
    print("ok", what)


def strided():
    g = torch.Generator(device=dev).manual_seed(0)
    for B, s_q, H, kv_dtype in [(4, 1, 16, torch.bfloat16), (1, 1, 128, torch.bfloat16), (4, 2, 16, torch.bfloat16),
                                (4, 1, 16, torch.float8_e4m3fn), (64, 1, 16, torch.float8_e4m3fn)]:
        q = torch.randn(B, s_q, H, 576, device=dev, generator=g, dtype=torch.bfloat16)
        blocks = 4 * B + 3
        kv = torch.randn(blocks, 64, 576, device=dev, generator=g).to(kv_dtype)
        table = torch.randperm(blocks, device=dev, generator=g)[:4 * B].view(B, 4).int()
        lens = torch.randint(1, 257, (B,), device=dev, generator=g, dtype=torch.int32)
        kernel = decode.choose_kernel(q, kv, 512, 256)
        want = ops.mla_decode(q, kv, table, lens, 512, 0.1, kv_scale=0.5)
        same(ops.mla_decode(q, kv, column_major(table), spread(lens), 512, 0.1, kv_scale=0.5), want,
             f"decode {kernel} B{B} s_q{s_q} H{H} {kv_dtype}: column-major table, strided lengths")
    lq, lk = [300, 0, 129], [300, 40, 500]
    cu_q, cu_k = (torch.tensor([0] + l, device=dev).cumsum(0).int() for l in (lq, lk))
    q = torch.randn(sum(lq), 16, 192, device=dev, dtype=torch.bfloat16)
    k = torch.randn(sum(lk), 16, 192, device=dev, dtype=torch.bfloat16)
    v = torch.randn(sum(lk), 16, 128, device=dev, dtype=torch.bfloat16)
    same(ops.prefill_attention(q, k, v, spread(cu_q), spread(cu_k), 0.1, kernel="triton"),
         ops.prefill_attention(q, k, v, cu_q, cu_k, 0.1, kernel="triton"), "prefill triton: strided cu_seqlens")
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        outs = []
        for strided_ in (False, True):
            T = 37
            gg = torch.Generator(device=dev).manual_seed(1)
            q_pe, k_pe = torch.randn(T, 16, 64, device=dev, generator=gg), torch.randn(T, 64, device=dev, generator=gg)
            c_kv, ang = torch.randn(T, 512, device=dev, generator=gg), torch.rand(T, 32, device=dev, generator=gg)
            cos, sin, slots = ang.cos(), ang.sin(), torch.randperm(128, device=dev, generator=gg)[:T]
            if strided_:
                cos, sin, slots = column_major(cos), column_major(sin), spread(slots)
            cache = torch.zeros(2, 64, 576, device=dev, dtype=kv_dtype)
            ops.rope_append(q_pe, k_pe, c_kv, cos, sin, cache, slots, True, kv_scale=0.5)
            outs.append((q_pe, k_pe, cache.float()))
        same(outs[1], outs[0], f"rope_append {kv_dtype}: column-major cos/sin, strided slots")
    kv = torch.randn(9, 64, 576, device=dev, dtype=torch.bfloat16)
    table, starts, cu = i32([[3, 1, 4], [2, 8, 0]]), i32([5, 64]), i32([0, 120, 200])
    same((ops.gather_latent(kv, column_major(table), spread(starts), spread(cu), 200),),
         (ops.gather_latent(kv, table, starts, cu, 200),), "gather: strided table, starts, offsets")


def nan_rows():
    """A NaN token in an FP8 cache: every decode kernel gives NaN for the queries that see it."""
    for B, H, scaling in [(1, 16, "tensor"), (64, 16, "tensor"), (4, 128, "tensor"), (4, 16, "tile")]:
        T = 200
        gg = torch.Generator(device=dev).manual_seed(2)
        c_kv = torch.randn(B * T, 512, device=dev, generator=gg)
        c_kv[T - 1, 7] = float("nan")          # sequence 0's last token
        k_pe, q_pe = torch.randn(B * T, 64, device=dev, generator=gg), torch.zeros(B * T, 1, 64, device=dev)
        width = 576 if scaling == "tensor" else 656
        cache = torch.zeros(B * 4, 64, width, device=dev, dtype=torch.float8_e4m3fn if scaling == "tensor" else torch.uint8)
        table = torch.arange(B * 4, device=dev, dtype=torch.int32).view(B, 4)
        slots = (torch.arange(B, device=dev)[:, None] * 256 + torch.arange(T, device=dev)[None]).flatten()
        ops.rope_append(q_pe, k_pe, c_kv, torch.ones(B * T, 32, device=dev), torch.zeros(B * T, 32, device=dev),
                        cache, slots, True, kv_scale=0.5)
        q = torch.randn(B, 2, H, 576, device=dev, dtype=torch.bfloat16, generator=gg)
        lens = torch.full((B,), T, device=dev, dtype=torch.int32)
        for s_q in (1, 2):
            kernel = decode.choose_kernel(q[:, :s_q], cache, 512, 256)
            out, lse = ops.mla_decode(q[:, :s_q].contiguous(), cache, table, lens, 512, 0.1, kv_scale=0.5)
            assert out[0, -1].isnan().all() and lse[0, -1].isnan().all(), kernel
            if s_q == 2:
                assert torch.isfinite(lse[0, 0]).all(), kernel       # the earlier query does not see it
            if B > 1:
                assert torch.isfinite(out[1:]).all() and torch.isfinite(lse[1:]).all(), kernel
            print("ok NaN row", kernel, f"B{B} H{H} s_q{s_q} {scaling}")


def unchecked():
    """Values only the CPU path checks: must not read or write out of bounds (compute-sanitizer)."""
    kv = torch.randn(3, 64, 576, device=dev, dtype=torch.bfloat16)
    out = ops.gather_latent(kv, i32([[1, 2**30], [-2**30, 0]]), i32([-50, 10**6]), i32([0, 100, 150]), 300)
    torch.cuda.synchronize()
    assert (out[150:] == 0).all()
    cache = torch.zeros(2, 64, 576, device=dev, dtype=torch.float8_e4m3fn)
    T = 4
    ops.rope_append(torch.zeros(T, 1, 64, device=dev), torch.zeros(T, 64, device=dev), torch.ones(T, 512, device=dev),
                    torch.ones(T, 32, device=dev), torch.zeros(T, 32, device=dev), cache,
                    torch.tensor([128, 2**40, -1, 5], device=dev), True)
    torch.cuda.synchronize()
    assert cache.float().flatten(0, 1).abs().sum(-1).nonzero().flatten().tolist() == [5]
    print("ok unchecked gather / append values stay in bounds")
    # decode: block ids past the pool and negative, lengths negative and past the table, on every
    # kernel; sequence 0's values are sound, and its answer is the one a batch of it alone gives
    g = torch.Generator(device=dev).manual_seed(3)
    table = i32([[0, 1, 2, 3], [2**30, -5, 1, 0], [3, 2**31 - 1, -(2**31), 1]])
    failed = []
    lens = i32([200, 10**6, -3])
    for H, s_q, kv_dtype in [(16, 1, torch.bfloat16), (128, 1, torch.bfloat16), (16, 2, torch.bfloat16),
                             (16, 1, torch.float8_e4m3fn), (128, 1, torch.float8_e4m3fn)]:
        q = torch.randn(3, s_q, H, 576, device=dev, generator=g, dtype=torch.bfloat16)
        kv = torch.randn(4, 64, 576, device=dev, generator=g).to(kv_dtype)
        for kernel in ("portable", decode.choose_kernel(q, kv, 512, 256)):
            if kernel == "portable":
                call = lambda q, t, n: decode.portable.launch(q, kv, t, n, 512, 0.1, True,      # noqa: E731
                                                              decode.portable.default_config(q, 256))
            else:
                call = lambda q, t, n: ops.mla_decode(q, kv, t, n, 512, 0.1)                  # noqa: E731
            out, lse = call(q, table, lens)
            clean_out, clean_lse = call(q[:1], table[:1], lens[:1])
            torch.cuda.synchronize()
            what = f"unchecked decode values: {kernel} H{H} s_q{s_q} {kv_dtype}"
            try:
                # the batch's split plan differs from the clean one's: the same sums in another order
                torch.testing.assert_close(out[:1].float(), clean_out.float(), rtol=8e-3, atol=1e-3)   # 2 bf16 ulps
                torch.testing.assert_close(lse[:1], clean_lse, rtol=1e-5, atol=1e-5)
                assert torch.isfinite(out).all() and not lse[1:].isnan().any(), "non-finite rows"
            except AssertionError as e:
                failed.append(what)
                print("FAIL", what, str(e).splitlines()[0])
                continue
            print("ok", what)
    if failed:
        raise SystemExit(f"{len(failed)} failed: {failed}")


if __name__ == "__main__":
    if "--unchecked" in sys.argv:
        unchecked()
    else:
        strided()
        nan_rows()
        unchecked()
