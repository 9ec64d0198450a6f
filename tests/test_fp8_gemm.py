"""Block-scaled FP8 GEMM: ``mla.ops.quantize_act_1x128``, ``fp8_linear``, ``fp8_bmm``.

Oracles and tolerances, tied to the arithmetic (u = 2^-24, float32's unit roundoff):
- the same quantized math in float64 (x_q * x_scale @ (w_q * w_scale)^T): the float32 reference
  differs only by accumulation, |y - y64| <= (128 + G + 2) u (|x_d| @ |w_d|^T) elementwise
  (<= 128-term sums per group, two scale products, G group additions);
- F.linear(x, dequantized W): the extra error is x's rounding to e4m3 (3 mantissa bits):
  |x - x_q s| <= 2^-4 |x| (+ 2^-10 s in e4m3's subnormal range), so
  |y - y_lin| <= 2^-4 (|x| @ |W|^T) + 2^-10 (s @ |W|^T) + accumulation; about 2.7 % relative
  (Frobenius) for Gaussian data;
- the Triton kernels: quantization equal to the reference's value for value; the GEMM within
  twice the reference's float32 bound (another summation order). On the GPU, Hopper's FP8 MMA
  accumulates with fewer bits inside a 128-column group (the scales promote to float32 after each
  group), so there the per-group term uses u = 2^-14.
On CPU the kernels run under Triton's interpreter (it computes tl.dot on e4m3 operands exactly)
on tiny shapes; on CUDA at DeepSeek-V3's projection shapes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mla
from mla.ops import reference
from mla.ops import fp8_gemm
from mla.weights import dequant_block_fp8, quantize_block_fp8

CUDA = torch.cuda.is_available()
U = 2.0 ** -24


def make(M, N, K, dtype=torch.float32, device="cpu", seed=0, batch=()):
    """x [*batch, M, K]; weight [*batch, N, K] float8_e4m3fn with block scales spread over 2^-8..2^-4."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, M, K, generator=g).to(device, dtype)
    w = torch.randn(*batch, N, K, generator=g) * torch.rand(*batch, N, 1, generator=g) * 0.1
    pairs = [quantize_block_fp8(t) for t in w.reshape(-1, N, K)]
    w_q = torch.stack([p[0] for p in pairs]).view(*batch, N, K)
    w_s = torch.stack([p[1] for p in pairs]).view(*batch, *pairs[0][1].shape)
    return x, w_q.to(device), w_s.to(device)


def dequant64(w, w_scale):
    N, K = w.shape[-2:]
    s = w_scale.double().repeat_interleave(128, -2)[..., :N, :].repeat_interleave(128, -1)[..., :K]
    return w.double() * s


def float64_case(x, w, w_scale):
    """(the quantized math in float64, the elementwise float32 accumulation bound of the reference)."""
    x_q, x_s = reference.quantize_act_1x128(x)
    K = x.shape[-1]
    x_d = x_q.double() * x_s.double().repeat_interleave(128, -1)[..., :K]
    w_d = dequant64(w, w_scale)
    y64 = x_d @ w_d.transpose(-1, -2)
    bound = (128 + x_s.shape[-1] + 2) * U * (x_d.abs() @ w_d.abs().transpose(-1, -2))
    return y64, bound


def assert_within(y, y64, bound, factor=1.0):
    err = (y.double() - y64).abs()
    worst = (err - factor * bound).max().item() if err.numel() else 0.0
    assert worst <= 1e-30, f"error exceeds the bound by {worst:.3e} (max error {err.max().item():.3e})"


SHAPES = [(0, 64, 128), (1, 200, 300), (3, 64, 128), (3, 130, 257), (130, 200, 300)]


# ---------------------------------------------------------------- the reference


def test_quantize_act_rounding_bounds_and_edges():
    x = torch.randn(5, 300) * torch.logspace(-3, 3, 300)
    x[1, :128] = 0                      # a group of zeros
    x[2, 256:] = 1e-20                  # a tiny partial last group
    x_q, x_s = reference.quantize_act_1x128(x)
    assert x_q.dtype == torch.float8_e4m3fn and x_q.shape == (5, 300) and x_s.shape == (5, 3)
    assert x_s.dtype == torch.float32
    s = x_s.repeat_interleave(128, -1)[:, :300]
    err = (x - x_q.float() * s).abs()
    assert (err <= 2.0 ** -4 * x.abs() + 2.0 ** -10 * s).all()
    assert torch.equal(x_q[1, :128].float(), torch.zeros(128)) and x_s[1, 0] == torch.tensor(1e-12) / 448
    q_groups = F.pad(x_q.float(), (0, 84)).view(5, 3, 128).abs().amax(-1)
    x_groups = F.pad(x, (0, 84)).view(5, 3, 128).abs().amax(-1)
    assert torch.isfinite(x_q.float()).all()
    assert torch.equal(q_groups[x_groups > 1e-12], torch.full_like(q_groups[x_groups > 1e-12], 448.0))
    assert torch.equal(x_s, x_groups.clamp_min(1e-12) / 448)


@pytest.mark.parametrize("M,N,K", SHAPES)
def test_reference_is_the_quantized_math(M, N, K):
    x, w, s = make(M, N, K, seed=M + N + K)
    y = mla.ops.fp8_linear(x, w, s, backend="torch")
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert_within(y, *float64_case(x, w, s))


@pytest.mark.parametrize("M,N,K", [(3, 130, 257), (130, 200, 300), (64, 256, 1024)])
def test_reference_vs_linear_on_dequantized_weight(M, N, K):
    x, w, s = make(M, N, K, seed=1)
    y = mla.ops.fp8_linear(x, w, s, backend="torch").double()
    w_d = dequant_block_fp8(w, s).double()
    y_lin = F.linear(x.double(), w_d)
    _, x_s = reference.quantize_act_1x128(x)
    s_full = x_s.double().repeat_interleave(128, -1)[:, :K]
    bound = 2.0 ** -4 * (x.double().abs() @ w_d.abs().T) + 2.0 ** -10 * (s_full @ w_d.abs().T)
    bound += (128 + x_s.shape[1] + 2) * U * (x.double().abs() @ w_d.abs().T) * 1.1
    assert ((y - y_lin).abs() <= bound).all()
    rel = ((y - y_lin).norm() / y_lin.norm()).item()
    assert 0.01 < rel < 0.04, rel      # ~2.7 %: e4m3 rounding of x, averaged


def test_dtypes_and_out_dtype():
    x, w, s = make(3, 130, 257, dtype=torch.bfloat16)
    assert mla.ops.fp8_linear(x, w, s).dtype == torch.bfloat16
    y32 = mla.ops.fp8_linear(x, w, s, out_dtype=torch.float32)
    assert y32.dtype == torch.float32
    assert torch.equal(mla.ops.fp8_linear(x, w, s), y32.to(torch.bfloat16))
    assert_within(y32, *float64_case(x, w, s))


def test_bmm_reference_is_per_head_linear():
    x, w, s = make(3, 130, 257, batch=(4,), seed=5)
    y = mla.ops.fp8_bmm(x, w, s, backend="torch")
    assert y.shape == (4, 3, 130)
    for h in range(4):
        torch.testing.assert_close(y[h], reference.fp8_linear(x[h], w[h], s[h], torch.float32), rtol=0, atol=1e-6)


def test_bad_inputs_raise_before_computing(monkeypatch):
    x, w, s = make(3, 130, 257)
    calls = []
    monkeypatch.setattr(reference, "fp8_linear", lambda *a: calls.append(a))
    bad = [
        ("x", dict(x=x[0])), ("x", dict(x=x.to(torch.int32))),
        ("weight", dict(weight=w.float())), ("weight", dict(weight=w[:, :256])), ("weight", dict(weight=w[None])),
        ("weight_scale_inv", dict(weight_scale_inv=s[:1])), ("weight_scale_inv", dict(weight_scale_inv=s.half())),
        ("weight_scale_inv", dict(weight_scale_inv=None)),
        ("weight", dict(weight=w.to("meta"))), ("out_dtype", dict(out_dtype=torch.int8)),
        ("backend", dict(backend="cuda")),
    ]
    for name, kw in bad:
        args = dict(x=x, weight=w, weight_scale_inv=s, backend="torch") | kw
        with pytest.raises(ValueError, match=name):
            mla.ops.fp8_linear(**args)
    with pytest.raises(ValueError, match="weight"):
        mla.ops.fp8_bmm(x[None].expand(2, -1, -1), w[None], s[None], backend="torch")
    with pytest.raises(ValueError, match="x"):
        mla.ops.quantize_act_1x128(x[None], backend="torch")
    assert not calls


# ---------------------------------------------------------------- CPU: the Triton kernels, interpreted


def test_cpu_act_quant_matches_reference():
    """Ties to even, carries into the exponent, subnormals, zeros: values equal to the reference's
    (zeros may differ in sign). Row 0 holds every e4m3 magnitude and every midpoint, with 448
    as amax (scale 1), so each rounding case is hit exactly."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()   # 0 .. 448
    mids = (grid[:-1] + grid[1:]) / 2
    row = torch.cat((grid, -mids, mids))
    x = torch.randn(9, row.numel()) * torch.logspace(-6, 2, 9)[:, None]
    x[0] = row
    x[1, :128] = 0
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        xt = x.to(dtype)
        q, s = mla.ops.quantize_act_1x128(xt, backend="triton")
        rq, rs = reference.quantize_act_1x128(xt)
        assert torch.equal(q.float(), rq.float()) and torch.equal(s, rs), dtype


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_gemm_matches_reference(M, N, K, dtype):
    x, w, s = make(M, N, K, dtype=dtype, seed=7 * M + K)
    y = mla.ops.fp8_linear(x, w, s, out_dtype=torch.float32, backend="triton")
    assert y.shape == (M, N)
    y64, bound = float64_case(x, w, s)
    assert_within(y, y64, bound, factor=2.0)


def test_cpu_schedules_and_bmm():
    assert fp8_gemm.gemm_config(3, 200, 300, 1, num_sms=4).num_splits > 1      # decode: split-K
    assert fp8_gemm.gemm_config(130, 200, 300, 1, num_sms=4).block_m == 128      # prefill tiles (narrow N)
    x, w, s = make(3, 130, 257, batch=(3,), seed=11)
    y = mla.ops.fp8_bmm(x, w, s, backend="triton")
    assert_within(y, *float64_case(x, w, s), factor=2.0)
    out = mla.ops.fp8_linear(x[0, :, :0], w[0, :, :0], s[0, :, :0], backend="triton")   # K = 0
    assert torch.equal(out, torch.zeros(3, 130))


# ---------------------------------------------------------------- GPU: DeepSeek-V3 shapes

gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@gpu
@pytest.mark.parametrize("N,K", [(24576, 1536), (7168, 16384), (2112, 7168)], ids=["q_b", "o_proj", "kv_a+q_a"])
@pytest.mark.parametrize("M", [1, 64, 499, 4096])
def test_gpu_deepseek_shapes(M, N, K):
    x, w, s = make(M, N, K, dtype=torch.bfloat16, device="cuda", seed=M)
    q, qs = mla.ops.quantize_act_1x128(x)
    rq, rqs = reference.quantize_act_1x128(x)
    assert torch.equal(q.float(), rq.float()) and torch.equal(qs, rqs)
    y = mla.ops.fp8_linear(x, w, s, out_dtype=torch.float32)
    y64, bound32 = float64_case(x, w, s)
    x_d, w_d = (rq.double() * rqs.double().repeat_interleave(128, -1)[:, :K]), dequant64(w, s)
    bound = bound32 * 2 + 128 * 2.0 ** -14 * (x_d.abs() @ w_d.abs().T)
    assert_within(y, y64, bound)
    rel = ((y.double() - y64).norm() / y64.norm()).item()
    assert rel < 1e-3, rel
    yb = mla.ops.fp8_linear(x, w, s)
    assert yb.dtype == torch.bfloat16
    if M <= 64:   # the same kernel, rounded to bf16 at the end
        assert torch.equal(yb, y.to(torch.bfloat16))
    else:         # torch's scaled_mm where it exists: the same bound plus bf16 rounding (2^-9 relative)
        assert_within(yb.float(), y64, bound + 2.0 ** -8 * y64.abs())


@gpu
def test_gpu_bmm_and_cuda_graph():
    x, w, s = make(4, 512, 128, dtype=torch.bfloat16, device="cuda", batch=(16,), seed=3)
    y = mla.ops.fp8_bmm(x, w, s, out_dtype=torch.float32)
    y64, bound = float64_case(x, w, s)
    assert_within(y, y64, bound * 2 + 128 * 2.0 ** -14 * (bound / ((128 + 3) * U)))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = mla.ops.fp8_bmm(x, w, s, out_dtype=torch.float32)
    x.normal_()
    g.replay()
    torch.testing.assert_close(out, mla.ops.fp8_bmm(x, w, s, out_dtype=torch.float32), rtol=0, atol=0)
