"""The prefill-path Triton kernels against their references.

On CPU the kernels run under Triton's interpreter, on tiny shapes, in float32 and float16
(the interpreter computes tl.dot on bfloat16 wrongly, so bf16 attention is checked on the
GPU only). Attention tolerance is tied to the arithmetic, as flash-attn's tests do: the
kernel's error against a float64 oracle must stay within twice the error of plain PyTorch
computing the same attention in the input dtype. Copies (gather, the cache rows) must be exact.
"""
from __future__ import annotations

import math

import pytest
import torch

from mla import quant
from mla.ops import gather_latent, merge_attention, prefill_attention, reference, rope_append

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def _cu(lengths, device="cpu"):
    return torch.tensor([0] + list(lengths), device=device).cumsum(0).to(torch.int32)


def _attention(q, k, v, cu_q, cu_k, scale, causal, dtype):
    """Plain PyTorch attention computed entirely in ``dtype`` (the oracle in float64)."""
    Tq, H, _ = q.shape
    out = torch.zeros(Tq, H, v.shape[-1], dtype=dtype, device=q.device)
    lse = torch.full((Tq, H), float("-inf"), dtype=dtype, device=q.device)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        nq, nk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if nq == 0 or nk == 0:
            continue
        qb = q[cq[b]:cq[b + 1]].to(dtype).transpose(0, 1)
        kb = k[ck[b]:ck[b + 1]].to(dtype).transpose(0, 1)
        vb = v[ck[b]:ck[b + 1]].to(dtype).transpose(0, 1)
        s = (qb @ kb.transpose(1, 2)) * scale
        if causal:
            i = torch.arange(nq, device=q.device)[:, None]
            j = torch.arange(nk, device=q.device)[None, :]
            s = s.masked_fill(j > i + nk - nq, float("-inf"))
        l = torch.logsumexp(s, -1)
        seen = torch.isfinite(l)
        p = torch.exp(s - torch.where(seen, l, 0).unsqueeze(-1))
        out[cq[b]:cq[b + 1]] = (p @ vb).transpose(0, 1)
        lse[cq[b]:cq[b + 1]] = l.transpose(0, 1)
    return out, lse


def _check_attention(out, lse, q, k, v, cu_q, cu_k, scale, causal):
    """Kernel error vs float64 <= 2x PyTorch's error in q's dtype (+ a few ulps of slack)."""
    ref_o, ref_l = _attention(q, k, v, cu_q, cu_k, scale, causal, torch.float64)
    pt_o, pt_l = _attention(q, k, v, cu_q, cu_k, scale, causal, q.dtype)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_l)), "queries without keys must match (-inf)"
    empty = torch.isinf(ref_l)
    assert (out[empty] == 0).all()
    eps = torch.finfo(q.dtype).eps
    fin = ~empty
    if fin.any():
        err_o = (out.double() - ref_o).abs().max().item()
        pt_err_o = (pt_o.double() - ref_o).abs().max().item()
        assert err_o <= 2 * pt_err_o + 4 * eps * ref_o.abs().max().item(), (err_o, pt_err_o)
        err_l = (lse.double() - ref_l)[fin].abs().max().item()
        pt_err_l = (pt_l.double() - ref_l)[fin].abs().max().item()
        assert err_l <= 2 * pt_err_l + 4 * eps * ref_l[fin].abs().max().item(), (err_l, pt_err_l)


# (queries per sequence, keys per sequence, dq, dv): zero-length sequences, a cached prefix
# (nk > nq), more queries than keys (the first ones see none), dq = 24 = 16 + 8, dq = 32.
CASES = [
    ([5, 0, 17, 3], [5, 0, 17, 3], 24, 16),
    ([4, 7, 0, 2, 6], [9, 7, 3, 0, 23], 24, 16),
    ([9, 1], [4, 1], 32, 8),
    ([33], [40], 24, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_prefill_attention_cpu(dtype, causal, heads, case):
    lq, lk, dq, dv = CASES[case]
    cu_q, cu_k = _cu(lq), _cu(lk)
    q = torch.randn(sum(lq), heads, dq).to(dtype)
    k = torch.randn(sum(lk), heads, dq).to(dtype)
    v = torch.randn(sum(lk), heads, dv).to(dtype)
    scale = 1.5 / math.sqrt(dq)   # peakier than default: masking errors show
    out, lse = prefill_attention(q, k, v, cu_q, cu_k, scale, causal, backend="triton")
    _check_attention(out, lse, q, k, v, cu_q, cu_k, scale, causal)


class _FakeFlashInfer:
    """Stands in for the flashinfer module: its wrapper's plan fails on the first
    ``fail_plan_until`` calls (a JIT compile without nvcc, say); runs return zeros, and raise
    after ``fail_run_after`` of them."""

    def __init__(self, fail_plan_until=1, fail_run_after=None):
        self.made, self.plans, self.runs = 0, 0, 0
        fake = self

        class Wrapper:
            def __init__(self, *args, **kw):
                fake.made += 1

            def plan(self, *args, **kw):
                fake.plans += 1
                if fake.plans <= fail_plan_until:
                    raise RuntimeError("nvcc: not found")

            def run(self, q, k, v, return_lse):
                fake.runs += 1
                if fail_run_after is not None and fake.runs > fail_run_after:
                    raise RuntimeError("an error after it worked")
                return (q.new_zeros(q.shape[0], q.shape[1], v.shape[-1]),
                        q.new_zeros(q.shape[:2], dtype=torch.float32))

        self.BatchPrefillWithRaggedKVCacheWrapper = Wrapper


def test_flashinfer_first_call_failure_falls_back_cpu(monkeypatch):
    # FlashInfer installed but its first call fails (its JIT compile, e.g. without a CUDA
    # toolkit): one warning, the op's own path gives the answer, and that configuration
    # never tries FlashInfer again; the rule itself is forced on (it needs a Hopper GPU)
    from mla.ops.prefill import FlashInferWorkspace, peers

    fake = _FakeFlashInfer(fail_plan_until=1)
    monkeypatch.setattr(peers, "_flashinfer", lambda: fake)
    monkeypatch.setattr(peers, "use_flashinfer", lambda *a: True)
    ws = FlashInferWorkspace()
    lq, H, dq, dv = [5, 9], 3, 24, 16
    cu, off = _cu(lq), tuple(_cu(lq).tolist())
    q, k, v = torch.randn(sum(lq), H, dq), torch.randn(sum(lq), H, dq), torch.randn(sum(lq), H, dv)
    with pytest.warns(RuntimeWarning, match="FlashInfer failed on its first call"):
        out, lse = prefill_attention(q, k, v, cu, cu, 0.3, True, offsets_q=off, offsets_k=off, backend="triton",
                                     workspace=ws)
    _check_attention(out, lse, q, k, v, cu, cu, 0.3, True)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        again, _ = prefill_attention(q, k, v, cu, cu, 0.3, True, offsets_q=off, offsets_k=off, backend="triton",
                                     workspace=ws)
    assert torch.equal(again, out) and (fake.made, fake.plans, fake.runs) == (1, 1, 0)


def test_flashinfer_later_failure_raises_cpu(monkeypatch):
    # once a configuration has worked, an error is an error: it propagates
    from mla.ops.prefill import FlashInferWorkspace, peers

    fake = _FakeFlashInfer(fail_plan_until=0, fail_run_after=1)
    monkeypatch.setattr(peers, "_flashinfer", lambda: fake)
    monkeypatch.setattr(peers, "use_flashinfer", lambda *a: True)
    ws = FlashInferWorkspace()
    lq, H = [4, 6], 2
    cu, off = _cu(lq), tuple(_cu(lq).tolist())
    q, k, v = torch.randn(10, H, 24), torch.randn(10, H, 24), torch.randn(10, H, 16)
    out, lse = prefill_attention(q, k, v, cu, cu, 0.3, True, offsets_q=off, offsets_k=off, backend="triton",
                                     workspace=ws)
    assert not out.any() and not lse.any()      # the fake's zeros: FlashInfer served
    with pytest.raises(RuntimeError, match="after it worked"):
        prefill_attention(q, k, v, cu, cu, 0.3, True, offsets_q=off, offsets_k=off, backend="triton",
                                     workspace=ws)


def test_prefill_strided_views_cpu():
    """k and v as views of one [Tk, H, dq + dv] buffer (as kv_b_proj's output is split)."""
    lq, lk, H, dq, dv = [6, 11], [6, 20], 3, 24, 16
    kv = torch.randn(sum(lk), H, dq + dv)
    q = torch.randn(sum(lq), H, dq)
    k, v = kv[..., :dq], kv[..., dq:]
    out, lse = prefill_attention(q, k, v, _cu(lq), _cu(lk), 0.3, True, backend="triton")
    _check_attention(out, lse, q, k, v, _cu(lq), _cu(lk), 0.3, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_attention_cpu(dtype):
    rows, H, d = 7, 3, 20
    out_a, out_b = torch.randn(rows, H, d).to(dtype), torch.randn(rows, H, d).to(dtype)
    lse_a, lse_b = torch.randn(rows, H) * 3, torch.randn(rows, H) * 3
    lse_a[0], lse_b[1] = float("-inf"), float("-inf")          # one part empty
    lse_a[2], lse_b[2] = float("-inf"), float("-inf")          # both empty
    lse_a[3, 0], lse_b[3, 0] = 80.0, -80.0                     # far apart: no overflow
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b, backend="triton")
    ref_l = torch.logaddexp(lse_a.double(), lse_b.double())
    safe = torch.where(torch.isfinite(ref_l), ref_l, 0)
    wa = torch.where(torch.isfinite(lse_a), torch.exp(lse_a.double() - safe), 0)
    wb = torch.where(torch.isfinite(lse_b), torch.exp(lse_b.double() - safe), 0)
    ref_o = out_a.double() * wa[..., None] + out_b.double() * wb[..., None]
    assert out.dtype == dtype and not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_l)) and (out[2] == 0).all()
    ref_lo = reference.merge_attention(out_a, lse_a, out_b, lse_b)[0]   # PyTorch in dtype
    eps = torch.finfo(dtype).eps
    err, pt_err = (out.double() - ref_o).abs().max().item(), (ref_lo.double() - ref_o).abs().max().item()
    assert err <= 2 * pt_err + 4 * eps * ref_o.abs().max().item()
    fin = torch.isfinite(ref_l)
    assert (lse.double() - ref_l)[fin].abs().max().item() <= 8 * torch.finfo(torch.float32).eps * 80


def test_merge_splits_prefill_exactly_cpu():
    """Attention over [prefix | new] = merge(prefix part, full mask; new part, causal)."""
    H, dq, dv, lq, lp = 3, 24, 16, [5, 0, 9], [7, 4, 0]
    q = torch.randn(sum(lq), H, dq)
    k_p, v_p = torch.randn(sum(lp), H, dq), torch.randn(sum(lp), H, dv)
    k_n, v_n = torch.randn(sum(lq), H, dq), torch.randn(sum(lq), H, dv)
    cu_q, cu_p = _cu(lq), _cu(lp)
    o_p, l_p = prefill_attention(q, k_p, v_p, cu_q, cu_p, 0.4, False, backend="triton")
    o_n, l_n = prefill_attention(q, k_n, v_n, cu_q, cu_q, 0.4, True, backend="triton")
    out, lse = merge_attention(o_p, l_p, o_n, l_n, backend="triton")
    parts = [(k_p[cu_p[b]:cu_p[b + 1]], k_n[cu_q[b]:cu_q[b + 1]]) for b in range(len(lq))]
    k = torch.cat([torch.cat(p) for p in parts])
    v = torch.cat([torch.cat((v_p[cu_p[b]:cu_p[b + 1]], v_n[cu_q[b]:cu_q[b + 1]])) for b in range(len(lq))])
    _check_attention(out, lse, q, k, v, cu_q, _cu([a + b for a, b in zip(lq, lp)]), 0.4, True)


def _rope_inputs(T, H, dn, dr, r, dtype, device="cpu"):
    q = torch.randn(T, H, dn + dr, device=device).to(dtype)
    kv_a = torch.randn(T, r + dr, device=device).to(dtype)
    ang = torch.rand(T, dr // 2, device=device) * 10
    return q, kv_a, ang.cos(), ang.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])   # the interpreter rounds to bf16 differently
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("heads", [1, 3])
def test_rope_append_cpu(dtype, interleave, heads):
    T, dn, dr, r, nb, bs = 5, 8, 16, 24, 6, 4
    q, kv_a, cos, sin = _rope_inputs(T, heads, dn, dr, r, dtype)
    slots = torch.randperm(nb * bs)[:T]                          # scattered over shuffled blocks
    cache = torch.randn(nb, bs, r + dr).to(dtype)
    q_ref, kv_ref, cache_ref = q.clone(), kv_a.clone(), cache.clone()
    before = cache.clone()
    rope_append(q[..., dn:], kv_a[:, r:], kv_a[:, :r], cos, sin, cache, slots, interleave, backend="triton")
    reference.rope_append(q_ref[..., dn:], kv_ref[:, r:], kv_ref[:, :r], cos, sin, cache_ref, slots, interleave)
    assert torch.equal(q, q_ref) and torch.equal(kv_a, kv_ref)   # q_nope and c_kv untouched too
    assert torch.equal(cache, cache_ref)
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(cache.view(-1, r + dr)[untouched], before.view(-1, r + dr)[untouched])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fmt", ["plain", "fp8", "fp8_tile"])
@pytest.mark.parametrize("heads", [1, 3])
def test_rope_append_into_q_out(backend, fmt, heads):
    """q_out: the rotated queries land there (the decode query buffer's RoPE columns, [H, T, d]
    storage), bit for bit what the in-place call leaves in q_pe; q_pe is only read; the cache
    rows and k_pe are those of the in-place call."""
    T, dn, dr, r, nb, bs = 5, 8, 16, 256, 6, 4
    q, kv_a, cos, sin = _rope_inputs(T, heads, dn, dr, r, torch.float32)
    slots = torch.randperm(nb * bs)[:T]
    slots[1] = -1
    cache = torch.randn(nb, bs, r + dr) if fmt == "plain" else _fp8_cache(nb, bs, r, dr, fmt)
    q_in, kv_in, cache_in, q0 = q.clone(), kv_a.clone(), cache.clone(), q.clone()
    buf = torch.full((heads, T, r + dr), float("nan")).transpose(0, 1)      # [T, H, r + dr] view
    rope_append(q[..., dn:], kv_a[:, r:], kv_a[:, :r], cos, sin, cache, slots, True, q_out=buf[..., r:],
                backend=backend)
    rope_append(q_in[..., dn:], kv_in[:, r:], kv_in[:, :r], cos, sin, cache_in, slots, True, backend=backend)
    assert torch.equal(q, q0)                                                # only read
    assert torch.equal(buf[..., r:], q_in[..., dn:]) and buf[..., :r].isnan().all()
    assert torch.equal(kv_a, kv_in) and torch.equal(cache.view(torch.uint8), cache_in.view(torch.uint8))


def test_rope_append_q_out_leaves_q_pe_and_refuses_overlap():
    T, H, dn, dr, r = 4, 2, 8, 16, 24
    q, kv_a, cos, sin = _rope_inputs(T, H, dn, dr, r, torch.float32)
    q0 = q.clone()
    out = torch.empty(T, H, dr)
    cache = torch.zeros(2, 4, r + dr)
    rope_append(q[..., dn:], kv_a[:, r:], kv_a[:, :r], cos, sin, cache, torch.arange(T), True, q_out=out,
                backend="triton")
    assert torch.equal(q, q0) and not torch.equal(out, q0[..., dn:])
    cache0 = cache.clone()
    for bad, match in ((q[..., dn - 4: dn + dr - 4], "q_out: expected q_pe itself or memory apart"),
                       (torch.empty(T, H, dr, dtype=torch.float64), "q_out: expected"),
                       (torch.empty(T, H + 1, dr), "q_out: expected"), ("q", "q_out: expected"),
                       (torch.empty(T, 1, dr).expand(T, H, dr), "q_out: expected a tensor without overlapping")):
        with pytest.raises(ValueError, match=match):
            rope_append(q[..., dn:], kv_a[:, r:], kv_a[:, :r], cos, sin, cache, torch.arange(T), True, q_out=bad,
                        backend="triton")
    assert torch.equal(cache, cache0) and torch.equal(q, q0)      # a refused call wrote nothing
    # q_out as q_pe itself: the in-place call
    rope_append(q[..., dn:], kv_a[:, r:], kv_a[:, :r], cos, sin, cache, torch.arange(T), True, q_out=q[..., dn:],
                backend="triton")
    assert torch.equal(q[..., dn:], out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("heads", [0, 1, 5])
def test_rope_in_place_on_slices_of_rows(dtype, interleave, heads):
    """ops.rope (the sparse indexer's RoPE): the triton backend rotates the slices exactly as the
    reference does and leaves the rest of each row as it was; no token is a no-op."""
    from mla import ops

    for T in (0, 6):
        q = torch.randn(T, heads, 48).to(dtype)          # RoPE on columns 8 .. 24 of each head's row
        k = torch.randn(T, 40).to(dtype)                 # and on the first 16 of each key
        ang = torch.rand(T, 8) * 10
        q0, k0 = q.clone(), k.clone()
        q_ref, k_ref = q.clone(), k.clone()
        ops.rope(q[..., 8:24], k[:, :16], ang.cos(), ang.sin(), interleave, backend="triton")
        reference.rope(q_ref[..., 8:24], k_ref[:, :16], ang.cos(), ang.sin(), interleave)
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
        assert torch.equal(q[..., :8], q0[..., :8]) and torch.equal(q[..., 24:], q0[..., 24:])
        assert torch.equal(k[:, 16:], k0[:, 16:])
        assert T == 0 or not torch.equal(k[:, :16], k0[:, :16])


def test_rope_refuses_by_name():
    from mla import ops

    q, k, c = torch.randn(3, 2, 16), torch.randn(3, 16), torch.rand(3, 8)
    for args, name in (((q, k[:2], c, c), "k_pe"), ((q[..., :15], k[:, :15], c, c), "q_pe"),
                       ((q, k, c[:, :4], c[:, :4]), "cos, sin"), ((q, k.double(), c, c), "k_pe"),
                       ((q.expand(3, 2, 16)[:, :1].expand(3, 4, 16), k, c, c), "q_pe")):
        with pytest.raises(ValueError, match=name):
            ops.rope(*args, False, backend="torch")
    with pytest.raises(ValueError, match="interleave"):
        ops.rope(q, k, c, c, "no")


def _fp8_cache(nb, bs, r, dr, fmt, device="cpu"):
    """An FP8 cache full of NaN rows (tile rows: all bytes 0xFF, NaN latents and scales)."""
    if fmt == "fp8":
        return torch.full((nb, bs, r + dr), float("nan"), device=device).to(torch.float8_e4m3fn)
    return torch.full((nb, bs, quant.row_width(fmt, r, dr)), 255, dtype=torch.uint8, device=device)


@pytest.mark.parametrize("fmt,kv_scale", [("fp8", 0.5), ("fp8", 3.0), ("fp8_tile", 1.0)])
@pytest.mark.parametrize("interleave", [True, False])
def test_rope_append_fp8_cpu(fmt, kv_scale, interleave):
    """The kernel quantizes rows as mla.quant.quantize_rows does, byte for byte."""
    T, H, dn, dr, r, nb, bs = 6, 3, 8, 16, 256, 5, 4
    q, kv_a, cos, sin = _rope_inputs(T, H, dn, dr, r, torch.float32)
    kv_a[0, :128] *= 1000.0     # a tile that clamps at +-448 under the per-tensor scale
    kv_a[1, 128:r] = 0.0        # an all-zero tile (scale clamped to 1e-12 / 448)
    slots = torch.randperm(nb * bs)[:T]
    slots[2] = -1               # not written
    cache = _fp8_cache(nb, bs, r, dr, fmt)
    q_ref, kv_ref, cache_ref = q.clone(), kv_a.clone(), cache.clone()
    rope_append(q[..., dn:], kv_a[:, r:], kv_a[:, :r], cos, sin, cache, slots, interleave, kv_scale=kv_scale,
                backend="triton")
    reference.rope_append(q_ref[..., dn:], kv_ref[:, r:], kv_ref[:, :r], cos, sin, cache_ref, slots, interleave,
                          kv_scale)
    assert torch.equal(q, q_ref) and torch.equal(kv_a, kv_ref)
    assert torch.equal(cache.view(torch.uint8), cache_ref.view(torch.uint8))


@gpu
@pytest.mark.parametrize("fmt", ["fp8", "fp8_tile"])
def test_rope_append_fp8_gpu(fmt):
    """DeepSeek shapes in bf16: latent bytes and tile scales exact; k_pe (rotated with FMA on
    the GPU, so one bf16 ulp may differ) within one e4m3 step (per-tensor) or one bf16 ulp."""
    T, H, dn, dr, r, bs = 3000, 128, 128, 64, 512, 64
    nb = (T + bs - 1) // bs + 8
    q, kv_a, cos, sin = _rope_inputs(T, H, dn, dr, r, torch.bfloat16, "cuda")
    slots = torch.randperm(nb * bs, device="cuda")[:T]
    cache = _fp8_cache(nb, bs, r, dr, fmt, "cuda")
    q_ref, kv_ref, cache_ref = q.clone(), kv_a.clone(), cache.clone()
    rope_append(q[..., dn:], kv_a[:, r:], kv_a[:, :r], cos, sin, cache, slots, True, kv_scale=0.25)
    reference.rope_append(q_ref[..., dn:], kv_ref[:, r:], kv_ref[:, :r], cos, sin, cache_ref, slots, True, 0.25)
    latent = r if fmt == "fp8" else r + 4 * (r // 128)
    flat = cache.view(torch.uint8).view(-1, cache.shape[-1])
    flat_ref = cache_ref.view(torch.uint8).view(-1, cache.shape[-1])
    assert torch.equal(flat[:, :latent], flat_ref[:, :latent])
    got = quant.dequantize_rows(flat[slots], fmt, r, kv_scale=0.25)[:, r:]
    want = quant.dequantize_rows(flat_ref[slots], fmt, r, kv_scale=0.25)[:, r:]
    step = 2.0 ** -3 if fmt == "fp8" else 2.0 ** -7
    assert ((got - want).abs() <= step * want.abs() + 2.0 ** -9 * 0.25).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gather_latent_cpu(dtype):
    nb, bs, d = 12, 4, 40
    lengths, starts = [5, 0, 9, 3], [2, 0, 0, 6]
    B, max_blocks = len(lengths), 5
    cache = torch.full((nb, bs, d), float("nan")).to(dtype)
    perm = torch.randperm(nb)
    block_table = torch.zeros(B, max_blocks, dtype=torch.int32)
    used = 0
    for b, (n, s) in enumerate(zip(lengths, starts)):
        need = (n + s + bs - 1) // bs
        block_table[b, :need] = perm[used:used + need].to(torch.int32)
        cache[perm[used:used + need]] = torch.randn(need, bs, d).to(dtype)  # only used blocks hold data
        used += need
    cu = _cu(lengths)
    st = torch.tensor(starts, dtype=torch.int32)
    out = gather_latent(cache, block_table, st, cu, sum(lengths), backend="triton")
    ref = reference.gather_latent(cache, block_table, st, cu, sum(lengths))
    assert not out.isnan().any() and torch.equal(out, ref)


# ------------------------------------------------------------------------- GPU, real shapes


def _check_prefill_gpu(heads, lq, lk, causal=True, **kw):
    dq, dv = 192, 128
    cu_q, cu_k = _cu(lq, "cuda"), _cu(lk, "cuda")
    q = torch.randn(sum(lq), heads, dq, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lk), heads, dq, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lk), heads, dv, device="cuda", dtype=torch.bfloat16)
    scale = 1 / math.sqrt(dq)
    out, lse = prefill_attention(q, k, v, cu_q, cu_k, scale, causal, **kw)
    ref_o, ref_l = _attention(q, k, v, cu_q, cu_k, scale, causal, torch.float64)
    pt_o, _ = _attention(q, k, v, cu_q, cu_k, scale, causal, torch.bfloat16)
    err, pt_err = (out.double() - ref_o).abs().max().item(), (pt_o.double() - ref_o).abs().max().item()
    assert out.shape == ref_o.shape and err <= 2 * pt_err, (err, pt_err)
    fin = torch.isfinite(ref_l)
    assert torch.equal(fin, torch.isfinite(lse)) and (lse.double() - ref_l)[fin].abs().max().item() < 1e-2
    return q, k, v, cu_q, cu_k, scale


@gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("lq,lk", [([1000, 0, 2048], [1000, 0, 2048]), ([300, 513], [4096, 513]),
                                   ([1024] * 4, [1024] * 4)])
def test_prefill_attention_gpu(heads, lq, lk):
    _check_prefill_gpu(heads, lq, lk)


def _flashinfer_or_skip():
    from mla.ops.prefill import peers

    if torch.cuda.get_device_capability() != (9, 0) or peers._flashinfer() is None:
        pytest.skip("FlashInfer's fa3 prefill: sm90 with flashinfer installed")
    return peers


@gpu
@pytest.mark.parametrize("heads,lq,lk,causal", [
    (128, [1000, 0, 2048], [1000, 0, 2048], True), (16, [300, 513], [4096, 513], True),
    (7, [1024] * 4, [1024] * 4, True), (16, [300, 0, 77], [4096, 0, 1], False),
    (3, [1, 129, 64], [1, 1000, 64], True)])
def test_prefill_attention_flashinfer_gpu(heads, lq, lk, causal):
    # host offsets given (as the layer gives them): FlashInfer serves where the rule lets it,
    # and plans from the host (a device read would raise under the sync debug mode)
    tp = _flashinfer_or_skip()
    kw = dict(offsets_q=tuple(_cu(lq).tolist()), offsets_k=tuple(_cu(lk).tolist()))
    q, k, v, cu_q, cu_k, scale = _check_prefill_gpu(heads, lq, lk, causal, **kw)
    assert tp.use_flashinfer(q, k, v, causal, kw["offsets_q"], kw["offsets_k"])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        prefill_attention(q, k, v, cu_q, cu_k, scale, causal, **kw, kernel="flashinfer")
    finally:
        torch.cuda.set_sync_debug_mode("default")


@gpu
def test_prefill_attention_flashinfer_strided_views_gpu():
    # q, k, v as views into wider buffers (a fused projection's output): same values as the
    # contiguous copies, through FlashInfer
    tp = _flashinfer_or_skip()
    lq, lk, H = [200, 333], [700, 333], 16
    cu_q, cu_k = _cu(lq, "cuda"), _cu(lk, "cuda")
    q = torch.randn(sum(lq), H, 256, device="cuda", dtype=torch.bfloat16)[..., 32:224]
    kv = torch.randn(sum(lk), H, 384, device="cuda", dtype=torch.bfloat16)
    k, v = kv[..., :192], kv[..., 256:]
    off = dict(offsets_q=tuple(_cu(lq).tolist()), offsets_k=tuple(_cu(lk).tolist()))
    assert tp.use_flashinfer(q, k, v, True, off["offsets_q"], off["offsets_k"])
    out, lse = prefill_attention(q, k, v, cu_q, cu_k, 0.1, True, **off)
    ref_o, ref_l = prefill_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, 0.1, True, **off)
    assert torch.equal(out, ref_o) and torch.equal(lse, ref_l)


@gpu
def test_prefill_attention_flashinfer_refuses_gpu():
    # a causal sequence with fewer keys than queries leaves queries with no key: not
    # FlashInfer's to define, so the Triton kernel serves (out 0, lse -inf for those rows);
    # the same for views TMA cannot read and float16 (not yet checked); kernel= forces a path
    tp = _flashinfer_or_skip()
    lq, lk = [100, 64], [50, 64]
    kw = dict(offsets_q=tuple(_cu(lq).tolist()), offsets_k=tuple(_cu(lk).tolist()))
    q, k, v, *_ = _check_prefill_gpu(16, lq, lk, True, **kw)
    assert not tp.use_flashinfer(q, k, v, True, kw["offsets_q"], kw["offsets_k"])
    assert tp.use_flashinfer(q, k, v, False, kw["offsets_q"], kw["offsets_k"])
    # a view TMA cannot read (start 2 bytes off a 16-byte boundary) stays with the Triton kernel
    assert not tp.use_flashinfer(q.half(), k.half(), v.half(), False, kw["offsets_q"], kw["offsets_k"])
    shifted = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)[1:].view(q.shape).copy_(q)
    assert not tp.use_flashinfer(shifted, k, v, False, kw["offsets_q"], kw["offsets_k"])
    out, _ = prefill_attention(shifted, k, v, _cu(lq, "cuda"), _cu(lk, "cuda"), 0.1, False, **kw)
    assert torch.equal(out, prefill_attention(q, k, v, _cu(lq, "cuda"), _cu(lk, "cuda"), 0.1, False)[0])
    with pytest.raises(ValueError, match="kernel: 'flashinfer' does not serve"):
        prefill_attention(shifted, k, v, _cu(lq, "cuda"), _cu(lk, "cuda"), 0.1, False, **kw, kernel="flashinfer")
    forced, _ = prefill_attention(q, k, v, _cu(lq, "cuda"), _cu(lk, "cuda"), 0.1, False, **kw, kernel="triton")
    assert torch.equal(forced, out)


@gpu
def test_equal_lengths_chosen_without_reading_offsets_gpu():
    # B sequences of n rows with the longest lengths given: the choice reads nothing back
    # (a device read would raise under the sync debug mode); without them it reads once
    from mla.ops.prefill import peers as tp

    if not (torch.cuda.get_device_capability()[0] >= 9
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")):
        pytest.skip("cuDNN attention serves sm90+ only")
    n, B = 1024, 4
    q = torch.randn(B * n, 16, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B * n, 16, 128, device="cuda", dtype=torch.bfloat16)
    cu = _cu([n] * B, "cuda")
    uneven = _cu([n - 1, n + 1] + [n] * (B - 2), "cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert tp.use_cudnn(q, q, v, cu, cu, n, n)
        assert not tp.use_cudnn(q, q, v, uneven, uneven, n + 1, n + 1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tp.use_cudnn(q, q, v, cu, cu) and not tp.use_cudnn(q, q, v, uneven, uneven)


@gpu
def test_rope_append_and_gather_gpu():
    T, H, dn, dr, r, bs = 3000, 128, 128, 64, 512, 64
    nb = (T + bs - 1) // bs + 8
    q, kv_a, cos, sin = _rope_inputs(T, H, dn, dr, r, torch.bfloat16, "cuda")
    slots = torch.randperm(nb * bs, device="cuda")[:T]
    cache = torch.full((nb, bs, r + dr), float("nan"), device="cuda", dtype=torch.bfloat16)
    q_ref, kv_ref, cache_ref = q.clone(), kv_a.clone(), cache.clone()
    rope_append(q[..., dn:], kv_a[:, r:], kv_a[:, :r], cos, sin, cache, slots, True)
    reference.rope_append(q_ref[..., dn:], kv_ref[:, r:], kv_ref[:, :r], cos, sin, cache_ref, slots, True)
    # FMA contraction on the GPU may move a rotated value by one bf16 ulp; copies are exact.
    assert torch.equal(kv_a[:, :r], kv_ref[:, :r]) and torch.equal(q[..., :dn], q_ref[..., :dn])
    torch.testing.assert_close(q, q_ref, rtol=1e-2, atol=1e-2)
    assert torch.equal(cache.isnan(), cache_ref.isnan())
    torch.testing.assert_close(cache.nan_to_num(), cache_ref.nan_to_num(), rtol=1e-2, atol=1e-2)
    lengths, starts = [1000, 0, 3000], [0, 0, 100]
    max_blocks = (3100 + bs - 1) // bs
    cache = torch.randn(3 * max_blocks, bs, r + dr, device="cuda").to(torch.bfloat16)
    block_table = torch.randperm(3 * max_blocks, device="cuda").view(3, max_blocks).to(torch.int32)
    cu, st = _cu(lengths, "cuda"), torch.tensor(starts, dtype=torch.int32, device="cuda")
    out = gather_latent(cache, block_table, st, cu, sum(lengths))
    assert torch.equal(out, reference.gather_latent(cache, block_table, st, cu, sum(lengths)))
