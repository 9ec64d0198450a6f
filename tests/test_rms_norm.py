"""mla.ops.rms_norm: the Triton kernel (interpreted on CPU, compiled on the GPU) against the
reference formula and against float64, and its argument checks."""
import pytest
import torch

from mla import ops
from mla.ops import reference

EPS = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}   # unit roundoff
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def exact(x, w, eps):
    xd = x.double()
    return w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,N", [(0, 7), (1, 1536), (5, 512), (3, 33), (2, 1)])
def test_kernel_matches_reference(device, dtype, T, N):
    g = torch.Generator().manual_seed(T * 1000 + N)
    # a strided view on the device: every other column of a wider buffer, rows at an odd stride
    x = (torch.randn(T, 2 * N + 3, generator=g) * 3).to(dtype).to(device)[:, 3: 3 + 2 * N: 2]
    assert x.stride() == (2 * N + 3, 2)
    w = torch.randn(N, generator=g).to(dtype).to(device)
    got = ops.rms_norm(x, w, 1e-6, backend="triton")
    want = reference.rms_norm(x, w, 1e-6)
    assert got.shape == (T, N) and got.dtype == dtype and got.is_contiguous()
    if T == 0:
        return
    u = EPS[dtype]
    # both round the normalized row to dtype, then the product: each within 2 roundings of the
    # exact value, plus the float32 statistics (a sum of N squares, an rsqrt of 2 ulps: 16
    # float32 units covers it), so within twice that of each other
    ref = exact(x.cpu(), w.cpu(), 1e-6)
    bound = (2.1 * u + 16 * 2.0 ** -24) * ref.abs() + 1e-30
    # Triton 3.6's interpreter narrows float32 to bfloat16 by truncation (each rounding up to
    # 2 units); the GPU rounds to nearest
    truncates = device == "cpu" and dtype == torch.bfloat16
    assert ((got.cpu().double() - ref).abs() <= (2 if truncates else 1) * bound).all()
    assert ((want.cpu().double() - ref).abs() <= bound).all()
    assert ((got.cpu().double() - want.cpu().double()).abs() <= (3 if truncates else 2) * bound).all()
    if dtype == torch.float16:     # no rounding flips in half's range here: the same bits
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_row_stays_in_its_row(device):
    x = torch.randn(3, 64, device=device)
    x[1, 5] = float("nan")
    w = torch.ones(64, device=device)
    got = ops.rms_norm(x, w, 1e-6, backend="triton")
    assert got[1].isnan().all() and torch.isfinite(got[[0, 2]]).all()
    torch.testing.assert_close(got[[0, 2]], reference.rms_norm(x[[0, 2]], w, 1e-6), rtol=2 ** -22, atol=0)


def test_wide_rows_take_the_reference():
    from mla.ops import norm

    x, w = torch.randn(2, norm.MAX_COLUMNS + 1), torch.randn(norm.MAX_COLUMNS + 1)
    assert x.shape[-1] > norm.MAX_COLUMNS
    assert torch.equal(ops.rms_norm(x, w, 1e-6, backend="triton"), reference.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("args,match", [
    ((torch.randn(4), torch.randn(4), 1e-6), "x: expected"),
    ((torch.randn(2, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64), 1e-6), "x: expected"),
    ((torch.randn(2, 0), torch.randn(0), 1e-6), "x: expected at least one column"),
    ((torch.randn(2, 4), torch.randn(5), 1e-6), "weight: expected"),
    ((torch.randn(2, 4), torch.randn(4, dtype=torch.float16), 1e-6), "weight: expected"),
    ((torch.randn(2, 4), None, 1e-6), "weight: expected"),
    ((torch.randn(2, 4), torch.randn(4), -1.0), "eps: expected"),
    ((torch.randn(2, 4), torch.randn(4), float("nan")), "eps: expected"),
    ((torch.randn(2, 4), torch.randn(4), True), "eps: expected"),
    ((torch.randn(2, 4), torch.randn(4), "1e-6"), "eps: expected"),
])
def test_bad_arguments_are_refused_by_name(args, match):
    with pytest.raises(ValueError, match=match):
        ops.rms_norm(*args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,N1,N2", [(0, 7, 3), (1, 1536, 512), (5, 33, 70), (3, 1, 2)])
def test_pair_is_two_norms_in_one_launch(device, dtype, T, N1, N2):
    """rms_norm_pair gives the bits of two rms_norm calls on the same backend, each row with its
    own tensor's weight and eps, from strided inputs (two column slices of one buffer, as the
    layer passes them)."""
    g = torch.Generator().manual_seed(T * 7 + N1 + N2)
    buf = (torch.randn(T, N1 + N2 + 5, generator=g) * 3).to(dtype).to(device)
    x1, x2 = buf[:, 2: 2 + N1], buf[:, 2 + N1: 2 + N1 + N2]
    w1, w2 = (torch.randn(n, generator=g).to(dtype).to(device) for n in (N1, N2))
    for backend in ("torch", "triton"):
        y1, y2 = ops.rms_norm_pair(x1, w1, 1e-6, x2, w2, 3e-2, backend=backend)
        assert y1.shape == (T, N1) and y2.shape == (T, N2) and y1.is_contiguous() and y2.is_contiguous()
        assert torch.equal(y1, ops.rms_norm(x1, w1, 1e-6, backend=backend))
        assert torch.equal(y2, ops.rms_norm(x2, w2, 3e-2, backend=backend))


@pytest.mark.parametrize("device", DEVICES)
def test_pair_nan_row_stays_in_its_row_and_tensor(device):
    x1, x2 = torch.randn(3, 64, device=device), torch.randn(3, 16, device=device)
    x1[1, 5] = float("nan")
    y1, y2 = ops.rms_norm_pair(x1, torch.ones(64, device=device), 1e-6, x2, torch.ones(16, device=device), 1e-6,
                               backend="triton")
    assert y1[1].isnan().all() and torch.isfinite(y1[[0, 2]]).all() and torch.isfinite(y2).all()


@pytest.mark.parametrize("args,match", [
    ((torch.randn(2, 4), torch.randn(4), 1e-6, torch.randn(3, 5), torch.randn(5), 1e-6), "x2: expected 2 rows"),
    ((torch.randn(2, 4), torch.randn(4), 1e-6, torch.randn(2, 5), torch.randn(4), 1e-6), "weight2: expected"),
    ((torch.randn(2, 4), torch.randn(4), 1e-6, torch.randn(2, 5), torch.randn(5), -1.0), "eps2: expected"),
    ((torch.randn(2, 4), torch.randn(3), 1e-6, torch.randn(2, 5), torch.randn(5), 1e-6), "weight1: expected"),
    ((torch.randn(4), torch.randn(4), 1e-6, torch.randn(2, 5), torch.randn(5), 1e-6), "x1: expected"),
    ((torch.randn(2, 4), torch.randn(4), 1e-6, torch.randn(2, 0), torch.randn(0), 1e-6), "x2: expected at least"),
    ((torch.randn(2, 4), torch.randn(4), 1e-6, torch.randn(2, 5, dtype=torch.float64),
      torch.randn(5, dtype=torch.float64), 1e-6), "x2: expected"),
])
def test_pair_bad_arguments_are_refused_by_name(args, match):
    with pytest.raises(ValueError, match=match):
        ops.rms_norm_pair(*args)
