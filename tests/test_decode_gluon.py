"""The Hopper (sm90) decode kernels ``mla.ops.decode.gluon`` against a float64 reference.

GPU-only: skipped without CUDA or without a compute-capability-9.x device. DeepSeek shapes
(d = 576, dv = 512), bf16/fp16, page 64 and 128; fresh random data, shuffled block tables,
NaN in every unused block, in the slots past each sequence's end and behind unused
block-table entries. Tolerance: the kernel's error against float64 at most twice that of
PyTorch doing the same in the input precision; lse within 1e-5 relative (the FP8 kernel's e4m3
MMAs: within the bound of their accumulation, ``fp8_mma_lse_bound``).
"""
from __future__ import annotations

import math

import pytest
import torch

from mla import quant
from test_decode_kernel import attend as _attend
from test_decode_kernel import make_case as _make_case

CUDA = torch.cuda.is_available()
SM90 = CUDA and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not SM90, reason="needs an sm90 (Hopper) GPU")

if SM90:
    from mla.ops.decode import split_plan
    from mla.ops.decode.gluon import common
    from mla.ops.decode.gluon import fp8 as df
    from mla.ops.decode.gluon import narrow as dn
    from mla.ops.decode.gluon import seesaw as dg

TILES = [64, 32]     # keys per tile: a ring of two or of four

DV, DR = 512, 64


def make_case(lens, s_q, H, block_size, dtype, seed):
    return _make_case(lens, s_q, H, DV, DR, block_size, dtype, "cuda", seed)


def attend(q, kv, table, seqlens, scale, causal, dtype):
    """The decode tests' oracle at dv = 512 (float64: the oracle; else PyTorch in ``dtype``)."""
    return _attend(q, kv, table, seqlens, DV, scale, causal, dtype)


def widened_tile_rows(stored, r, fp16, dtype):
    """Tile rows as the widening kernels write them into shared memory: into fp16, each value
    times its scale rounded to fp16 (one rounding: the product of two fp16 values is exact in
    float32); else the float32 product rounded to dtype (``quant.dequantize_rows``)."""
    if not fp16:
        return quant.dequantize_rows(stored, "fp8_tile", r, dtype)
    n, g = stored.shape[0], r // 128
    values = stored[:, :r].contiguous().view(torch.float8_e4m3fn).half().view(n, g, 128)
    scales = stored[:, r: r + 4 * g].contiguous().view(torch.float32).half()
    k_pe = stored[:, r + 4 * g:].contiguous().view(torch.bfloat16).half()
    return torch.cat(((values * scales[..., None]).view(n, r), k_pe), -1)


def check(lens, s_q, H, block_size=64, dtype=torch.bfloat16, causal=True, seed=0, kv_fmt="plain", kv_scale=1.0,
          **kw):
    """kv_fmt "fp8" / "fp8_tile": the kernel reads FP8 rows of the case's cache; the oracles see
    those rows dequantized as the kernel widens them (in q's dtype: exact for fp8 with a
    power-of-two kv_scale; tile rows: ``widened_tile_rows``)."""
    e4m3_mma = kw.get("kernel") == "fp8reg"
    q, kv, table, seqlens = make_case(lens, s_q, H, block_size, dtype, seed)
    stored = kv
    if kv_fmt != "plain":    # NaN rows stay NaN (tile rows: NaN scales)
        stored = quant.quantize_rows(kv.view(-1, DV + DR).float(), kv_fmt, DV, kv_scale)
        if kv_fmt == "fp8_tile" and not e4m3_mma:
            # the seesaw widens tile rows into fp16 whatever q's dtype; narrow into q's dtype
            fp16 = dtype == torch.float16 or kw.get("kernel", "seesaw") == "seesaw"
            kv = widened_tile_rows(stored, DV, fp16, dtype).view(kv.shape)
        else:
            # the e4m3 kernel scales tile rows in float32 (keys) and fp16 (values): its oracle is
            # the float32 dequantization
            deq = torch.float32 if kv_fmt == "fp8_tile" else dtype
            kv = quant.dequantize_rows(stored, kv_fmt, DV, deq, kv_scale).view(kv.shape)
        stored = stored.view(*kv.shape[:2], -1)
    assert common.supports(q, stored, block_size)
    scale = 1.0 / math.sqrt(DV + DR)
    launch = {"seesaw": dg.launch, "narrow": dn.launch, "fp8reg": df.launch}[kw.pop("kernel", "seesaw")]
    out, lse = launch(q, stored, table, seqlens, DV, scale, causal, kv_scale=kv_scale, **kw)
    assert out.shape == (len(lens), s_q, H, DV) and out.dtype == dtype
    assert lse.shape == (len(lens), s_q, H) and lse.dtype == torch.float32
    ref_out, ref_lse = attend(q, kv, table, seqlens, scale, causal, torch.float64)
    out, lse = out.double().cpu(), lse.double().cpu()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty)
    assert (out[empty] == 0).all() and (lse[empty] < 0).all()
    low_out, _ = attend(q, kv, table, seqlens, scale, causal, dtype)
    denom = ref_out.norm().clamp_min(1e-30)
    err = ((out - ref_out).norm() / denom).item()
    err_torch = ((low_out - ref_out).norm() / denom).item()
    assert err <= 2 * err_torch, f"kernel rel err {err:.3e} > 2 x torch {dtype} rel err {err_torch:.3e}"
    fin = ~empty
    if fin.any():
        lse_err = ((lse[fin] - ref_lse[fin]).abs() / ref_lse[fin].abs().clamp_min(1.0)).max().item()
        if e4m3_mma:
            # S^T from e4m3 tensor-core MMAs: see fp8_mma_lse_bound
            bound = fp8_mma_lse_bound(q, kv, table, seqlens, scale)
            lse_diff = (lse - ref_lse)[fin].abs()
            assert (lse_diff <= bound[fin] + 1e-5 * ref_lse[fin].abs()).all(), \
                f"lse err {lse_diff.max().item():.3e} above the e4m3 MMA bound (max {bound[fin].max().item():.3e})"
        else:
            assert lse_err <= 1e-5, f"lse rel err {lse_err:.3e}"
    return err


def fp8_mma_lse_bound(q, kv, table, seqlens, scale, bits=13, steps=18):
    """Per query row, a bound on the lse error of scores summed by e4m3 tensor-core MMAs: their
    sums keep about 13 fraction bits relative to the largest magnitude in them (DeepSeek-V3's
    report: about 14; measured here 0.5-1.2e-4 relative at K = 32-128), once per k32 MMA of a
    chained accumulation (576 columns: 18), so |error of s_j| <= steps 2^-bits sum_d |q_d k_jd|
    and |error of lse| <= max_j of that (the exact query split makes the operands exact)."""
    from mla.ops import reference

    B, s_q, H, _ = q.shape
    bound = torch.zeros(B, s_q, H, dtype=torch.float64)
    for b, n in enumerate(seqlens.tolist()):
        if n:
            k = reference.gather_rows(kv, table[b], n).double().abs()
            bound[b] = (q[b].double().abs() @ k.T).amax(-1).cpu()
    return bound * scale * steps * 2.0 ** -bits


# every head count and query count on the ring of two 64-key tiles; on the ring of four 32-key
# tiles the cases that differ for it (a single row, several queries, odd heads, 128 x 3 rows)
@pytest.mark.parametrize("H,s_q,block_n", [(16, 1, 64), (16, 4, 64), (64, 2, 64), (128, 1, 64), (128, 3, 64),
                                           (3, 2, 64), (63, 4, 64), (16, 1, 32), (128, 3, 32), (3, 2, 32),
                                           (63, 4, 32)])
def test_heads_sq(H, s_q, block_n):
    # length 0, == s_q, 1, a partial tail, several pages
    check([0, s_q, 1, 700, 4099, 2048], s_q, H, seed=H * 10 + s_q, block_n=block_n)


@pytest.mark.parametrize("block_n", TILES)
def test_varlen_1_to_20000(block_n):
    g = torch.Generator().manual_seed(5)
    lens = [1, 2, 63, 64, 65, 20000] + torch.randint(1, 20001, (10,), generator=g).tolist()
    check(lens, 2, 16, seed=5, block_n=block_n)
    check(lens[:8], 1, 128, seed=6, block_n=block_n)


@pytest.mark.parametrize("splits,block_n", [(1, 64), (3, 64), (40, 64), (1, 32), (40, 32)])
def test_explicit_splits_and_empty_splits(splits, block_n):
    # 40 splits of short sequences: many splits are empty (lse -inf, weight 0 in the combine)
    check([5, 130, 1000], 2, 16, seed=splits, num_splits=splits, block_n=block_n)


@pytest.mark.parametrize("block_n", TILES)
@pytest.mark.parametrize("H,s_q,dtype,kv_fmt", [(128, 1, torch.bfloat16, "plain"), (64, 2, torch.float16, "plain"),
                                               (32, 4, torch.bfloat16, "fp8_tile"), (128, 1, torch.bfloat16, "fp8"),
                                               (64, 1, torch.float16, "fp8")])
def test_one_split_whole_row_tiles(H, s_q, dtype, kv_fmt, block_n):
    # one split and rows a multiple of 64: the output is staged in shared memory and written by
    # TMA (fp8 rows with a bf16 output: fp16 MMAs, so stores from registers; with an fp16
    # output, TMA again); empty sequences too
    if kv_fmt != "plain" and block_n == 64:
        pytest.skip("FP8 rows are read in tiles of 32 keys")
    check([0, s_q, 700, 4099, 64], s_q, H, dtype=dtype, seed=H + s_q, kv_fmt=kv_fmt, num_splits=1, block_n=block_n)


@pytest.mark.parametrize("block_n", TILES)
@pytest.mark.parametrize("H,s_q,dtype,kv_fmt,part", [
    (128, 1, torch.bfloat16, "plain", torch.bfloat16), (64, 2, torch.float16, "plain", torch.float16),
    (16, 4, torch.bfloat16, "plain", torch.bfloat16), (64, 1, torch.float16, "fp8", torch.float16),
    (128, 1, torch.bfloat16, "fp8", torch.float32), (63, 4, torch.bfloat16, "plain", torch.float32)])
def test_split_partials_dtype(H, s_q, dtype, kv_fmt, part, block_n, monkeypatch):
    # with splits, whole 64-row tiles in the MMAs' dtype: 16-bit partials that TMA writes at
    # the program's slot (mixed lengths: slot p is not sequence p); else (fp16 MMAs for a bf16
    # output, rows not whole tiles) float32 partials from registers
    if kv_fmt != "plain" and block_n == 64:
        pytest.skip("FP8 rows are read in tiles of 32 keys")
    seen, planned = [], split_plan.planned_results

    def spy(*args):
        seen.append(planned(*args))
        return seen[-1]
    from mla.ops.decode import combine
    monkeypatch.setattr(combine, "planned_results", spy)
    check([0, s_q, 700, 4099, 64], s_q, H, dtype=dtype, seed=H + s_q + 1, kv_fmt=kv_fmt, num_splits=5,
          block_n=block_n)
    assert [o.dtype for o, _, _ in seen] == [part]


@pytest.mark.parametrize("block_n", TILES)
def test_fp16_page128_non_causal(block_n):
    check([3, 1500, 257], 2, 16, block_size=128, dtype=torch.float16, seed=1, block_n=block_n)
    check([5000, 7], 3, 128, causal=False, seed=3, block_n=block_n)


@pytest.mark.parametrize("kv_fmt,kv_scale", [("fp8", 0.5), ("fp8", 1.0), ("fp8_tile", 1.0)])
@pytest.mark.parametrize("H,s_q", [(16, 1), (128, 2), (3, 4)])
def test_fp8_rows(kv_fmt, kv_scale, H, s_q):
    """FP8 rows widened in the kernel: lengths 0, s_q, 1, partial tails, several pages; a kv_scale
    applied twice or not at all would miss the oracle by far more than the bound."""
    check([0, s_q, 1, 700, 4099, 2048], s_q, H, seed=H + s_q, kv_fmt=kv_fmt, kv_scale=kv_scale)


@pytest.mark.parametrize("kv_fmt", ["fp8", "fp8_tile"])
def test_fp8_producer_every_tile_count(kv_fmt):
    """FP8 rows through the seesaw's producer (three K slots, two staging stages): programs of 1
    to 8 tiles of 32 keys, full and partial last tiles, so that the slots and the stages wrap at
    every offset and either warpgroup may own the last tile; one split and three."""
    lens = [31, 32, 33, 64, 95, 96, 97, 160, 191, 224, 255]
    check(lens, 1, 64, seed=21, kv_fmt=kv_fmt, num_splits=1)
    check(lens, 2, 128, seed=22, kv_fmt=kv_fmt, num_splits=3)


@pytest.mark.parametrize("kv_fmt", ["fp8", "fp8_tile"])
def test_fp8_rows_splits_fp16_page128(kv_fmt):
    check([5, 130, 1000, 20000], 2, 16, seed=7, kv_fmt=kv_fmt, kv_scale=2.0, num_splits=40)
    check([3, 1500, 257], 2, 16, block_size=128, dtype=torch.float16, seed=1, kv_fmt=kv_fmt, causal=False)


_NARROW_SHAPES = [(16, 1), (16, 2), (1, 1), (3, 4), (7, 2), (5, 3)]    # 16, 32, 1 and odd row counts


@pytest.mark.parametrize("kv_fmt,H,s_q", [("plain", H, s_q) for H, s_q in _NARROW_SHAPES]
                         + [(fmt, H, s_q) for fmt in ("fp8", "fp8_tile") for H, s_q in _NARROW_SHAPES[:4]])
def test_narrow(kv_fmt, H, s_q):
    """The swap-AB kernel for H * s_q <= 32 rows (32 rows over tile rows: not taken): every row
    count on bf16 rows; on FP8 rows 16, 32, 1 and one odd count (the widening is per key, not
    per row)."""
    q = torch.empty(1, s_q, H, DV + DR, device="cuda")
    if not dn.narrow_rows(q, torch.empty(1, 1, 1, dtype=quant.storage_dtype(kv_fmt, torch.bfloat16))):
        assert kv_fmt == "fp8_tile" and H * s_q > 16
        return
    check([0, s_q, 1, 700, 4099, 2048, 31, 33, 65], s_q, H, seed=H * 7 + s_q, kv_fmt=kv_fmt,
          kv_scale=0.5 if kv_fmt == "fp8" else 1.0, kernel="narrow")


@pytest.mark.parametrize("kv_fmt", ["plain", "fp8", "fp8_tile"])
def test_narrow_splits_fp16_page128_non_causal(kv_fmt):
    check([5, 130, 1000, 20000], 1, 16, seed=8, kv_fmt=kv_fmt, num_splits=40, kernel="narrow")
    check([3, 1500, 257], 2, 8, block_size=128, dtype=torch.float16, seed=2, kv_fmt=kv_fmt, causal=False,
          kernel="narrow")


# one row group of 16 and of 1, odd rows with several queries, two row groups (32 and 17 rows)
@pytest.mark.parametrize("H,s_q", [(16, 1), (1, 1), (3, 4), (7, 2), (16, 2), (17, 1)])
def test_fp8_register_operands(H, s_q):
    """FP8 rows as the MMAs' register operands, <= 32 query rows (two row groups above 16):
    lengths 0, s_q, 1, partial tails (NaN past each end), several pages; kv_scale 0.5 (applied
    twice or not at all would miss the oracle by far more than the bound)."""
    check([0, s_q, 1, 700, 4099, 2048, 31, 33, 65, 64, 128], s_q, H, seed=H * 11 + s_q, kv_fmt="fp8", kv_scale=0.5,
          kernel="fp8reg")


def test_fp8_register_operands_splits_fp16_page128_non_causal():
    check([5, 130, 1000, 20000], 1, 16, seed=8, kv_fmt="fp8", kv_scale=2.0, num_splits=40, kernel="fp8reg")
    check([3, 1500, 257], 2, 8, block_size=128, dtype=torch.float16, seed=2, kv_fmt="fp8", causal=False,
          kernel="fp8reg")
    check([64 * 300] * 3, 1, 16, seed=3, kv_fmt="fp8", num_splits=1, kernel="fp8reg")
    # two row groups (32 rows: 16 heads x 2 queries, causal among them), with splits and without
    check([5, 130, 1000, 20000], 2, 16, seed=10, kv_fmt="fp8", num_splits=7, kernel="fp8reg")
    check([3, 1500, 257], 2, 16, block_size=128, dtype=torch.float16, seed=11, kv_fmt="fp8", causal=False,
          num_splits=1, kernel="fp8reg")


@pytest.mark.parametrize("kernel,H,s_q,kv_fmt", [("seesaw", 128, 1, "plain"), ("seesaw", 64, 2, "fp8"),
                                                 ("narrow", 16, 1, "plain"), ("narrow", 7, 2, "plain"),
                                                 ("fp8reg", 16, 1, "fp8"), ("fp8reg", 16, 2, "fp8"),
                                                 ("fp8reg", 3, 1, "fp8_tile")])
def test_planned_split_skewed_lengths(kernel, H, s_q, kv_fmt):
    """The split plan (``split_plan.planned_split_gluon``) at the default split count, where it
    shares a long sequence out over most of the programs: one long sequence among short ones,
    empty ones and ones of a single key, and a batch whose lengths are all shorter than a split."""
    check([20000] + [700] * 13 + [0, s_q, 1, 65], s_q, H, seed=H + s_q, kv_fmt=kv_fmt, kernel=kernel)
    check([3, 20000, 5, 17000, 64], s_q, H, seed=H * 3 + s_q, kv_fmt=kv_fmt, kernel=kernel, num_splits=24)
    check([1, s_q, 2, 0], s_q, H, seed=H * 5 + s_q, kv_fmt=kv_fmt, kernel=kernel, num_splits=9)


@pytest.mark.parametrize("kernel,H,s_q,kv_fmt", [("seesaw", 128, 1, "plain"), ("seesaw", 64, 2, "fp8_tile"),
                                                 ("seesaw", 7, 2, "fp8"), ("narrow", 16, 1, "plain"),
                                                 ("fp8reg", 16, 1, "fp8"), ("fp8reg", 32, 1, "fp8_tile")])
def test_programs_idle_past_equal_splits(kernel, H, s_q, kv_fmt):
    """A launch of more programs than equal lengths use (num_splits=(S, eq), ``split_plan``): at
    equal lengths eq programs a sequence, the rest idle, their slots never merged; mixed lengths
    take all S; and the default grid of a large batch with a table past ``MIXED_GRID_KEYS``
    (``launch_splits``: at 128 heads on 132 SMs 2 a sequence, 1 used at equal lengths)."""
    check([700] * 5, s_q, H, seed=H + s_q, kv_fmt=kv_fmt, kernel=kernel, num_splits=(3, 1))
    check([4099] * 3, s_q, H, seed=H * 2 + s_q, kv_fmt=kv_fmt, kernel=kernel, num_splits=(4, 2))
    check([0] * 4, s_q, H, seed=H * 3 + s_q, kv_fmt=kv_fmt, kernel=kernel, num_splits=(2, 1))
    check([1500, 700, s_q, 0, 65], s_q, H, seed=H * 4 + s_q, kv_fmt=kv_fmt, kernel=kernel, num_splits=(3, 1))
    check([8500] * 40, s_q, H, seed=H * 5 + s_q, kv_fmt=kv_fmt, kernel=kernel)


def test_one_used_split_is_the_single_split():
    """Equal lengths on one program a sequence of a grid of two write through the partials and
    the merge of one slot: bit for bit what one split writes straight into out."""
    q, kv, table, seqlens = make_case([900] * 6, 1, 128, 64, torch.bfloat16, 3)
    one = dg.launch(q, kv, table, seqlens, DV, 0.07, True, num_splits=1)
    idle = dg.launch(q, kv, table, seqlens, DV, 0.07, True, num_splits=(2, 1))
    assert torch.equal(one[0], idle[0]) and torch.equal(one[1], idle[1])


@pytest.mark.parametrize("H,s_q", [(16, 1), (8, 2), (3, 4), (7, 2)])
def test_fp8_tile_rows_e4m3(H, s_q):
    """FP8 tile rows (a float32 scale per key and 128 values, bf16 k_pe) through the e4m3
    kernel: lengths 0, s_q, 1, partial tails (NaN rows with NaN scales past each end), splits."""
    check([0, s_q, 1, 700, 4099, 2048, 31, 33, 65, 64, 128], s_q, H, seed=H * 13 + s_q, kv_fmt="fp8_tile",
          kernel="fp8reg")
    check([5, 130, 1000, 20000], s_q, H, seed=H + s_q, kv_fmt="fp8_tile", num_splits=40, kernel="fp8reg")
    check([3, 1500, 257], s_q, H, block_size=128, dtype=torch.float16, seed=2, kv_fmt="fp8_tile", causal=False,
          kernel="fp8reg")
    check([5, 1000, 20000], 2, 16, seed=H * 7 + s_q, kv_fmt="fp8_tile", num_splits=5, kernel="fp8reg")  # 2 groups


def test_fp8_register_operands_refuses():
    q = torch.randn(1, 1, 33, 576, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(4, 64, 576, device="cuda").to(torch.float8_e4m3fn)
    table, lens = torch.zeros(1, 1, dtype=torch.int32, device="cuda"), torch.ones(1, dtype=torch.int32, device="cuda")
    assert not df.takes(q, kv) and df.takes(q[:, :, :32], kv) and df.takes(q[:, :, :16], kv)
    assert not df.takes(q[:, :, :16], kv.to(torch.bfloat16))
    tile = torch.zeros(4, 64, 656, device="cuda", dtype=torch.uint8)
    assert df.takes(q[:, :, :32], tile) and not df.takes(q, tile)
    with pytest.raises(ValueError, match="H \\* s_q <= 32"):
        df.launch(q, kv, table, lens, DV, 0.1)


@pytest.mark.parametrize("batch", [2, 32])
def test_dispatch_picks_narrow_for_16_rows_from_batch_2(batch):
    import mla
    from mla.ops.decode import use_narrow
    g = torch.Generator().manual_seed(4)
    lens = torch.randint(1, 3000, (batch,), generator=g).tolist()
    q, kv, table, seqlens = make_case(lens, 1, 16, 64, torch.bfloat16, seed=4)
    assert use_narrow(q, kv) and not use_narrow(q[:1], kv) and not use_narrow(q.expand(batch, 2, 16, DV + DR), kv)
    out, lse = mla.ops.mla_decode(q, kv, table, seqlens, DV, 0.1)
    ref_out, ref_lse = dn.launch(q, kv, table, seqlens, DV, 0.1)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("batch,max_len,kernel,launch", [(32, 3000, "fp8", False), (4, 4096, "fp8", True),
                                                         (1, 16384, "fp8", False), (2, 3000, "portable", True),
                                                         (1, 1000, "portable", False)])
def test_dispatch_of_fp8_rows(batch, max_len, kernel, launch):
    """FP8 rows with at most 16 query rows: the e4m3 kernel at any batch above
    ``FP8_PORTABLE_KEYS`` keys (the table's capacity), the portable kernel up to it; 32 rows the
    e4m3 kernel (the rule at five batches and capacities); the op gives the chosen kernel's bits,
    for per-tensor and tile rows (launch: once for each kernel)."""
    import mla
    from mla.ops import decode
    g = torch.Generator().manual_seed(6 + batch)
    lens = torch.randint(1, max_len + 1, (batch,), generator=g).tolist()
    lens[0] = max_len
    q, kv, table, seqlens = make_case(lens, 1, 16, 64, torch.bfloat16, seed=6)
    kv8 = quant.quantize_rows(kv.view(-1, DV + DR).float(), "fp8", DV, 1.0).view(*kv.shape[:2], -1)
    cap = table.shape[1] * 64
    assert decode.choose_kernel(q, kv8, DV, cap) == kernel
    edge = decode.FP8_PORTABLE_KEYS // batch
    assert decode.choose_kernel(q, kv8, DV, edge) == "portable" and decode.choose_kernel(q, kv8, DV, edge + 64) == "fp8"
    assert decode.choose_kernel(q.expand(batch, 2, 16, DV + DR), kv8, DV, cap) == "fp8"     # 32 rows
    assert decode.choose_kernel(q, kv, DV, cap) == ("narrow" if batch >= 2 else "seesaw")    # bf16 rows
    kvt = quant.quantize_rows(kv.view(-1, DV + DR).float(), "fp8_tile", DV).view(*kv.shape[:2], -1)
    for cache in (kv8, kvt):
        assert decode.choose_kernel(q, cache, DV, cap) == kernel
        if not launch:
            continue
        out, lse = mla.ops.mla_decode(q, cache, table, seqlens, DV, 0.1)
        if kernel == "fp8":
            ref_out, ref_lse = df.launch(q, cache, table, seqlens, DV, 0.1)
        else:
            ref_out, ref_lse = decode.portable.launch(q, cache, table, seqlens, DV, 0.1, True,
                                                      decode.portable.default_config(q, cap))
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("kernel", ["seesaw", "narrow", "fp8reg"])
def test_dependent_launch_same_bits(kernel, monkeypatch):
    """Launched as programmatic dependents (pdl, at most 32 rows) the kernels wait for
    the kernels before them: the same bits as in plain stream order, eagerly and replayed from a
    CUDA graph right after a kernel that rewrites the query, with one split and with several."""
    q, kv, table, seqlens = make_case([5, 4000, 700, 64 * 20], 1, 16, 64, torch.bfloat16, seed=12)
    if kernel == "fp8reg":
        kv = quant.quantize_rows(kv.view(-1, DV + DR).float(), "fp8", DV, 1.0).view(*kv.shape[:2], -1)
    launch = {"seesaw": dg.launch, "narrow": dn.launch, "fp8reg": df.launch}[kernel]
    q0 = q.clone()
    results = {}
    for pdl in (False, True):
        for S in (1, 5):
            q.fill_(float("nan"))
            q.copy_(q0)          # the write the kernel must wait for
            eager = launch(q, kv, table, seqlens, DV, 0.1, num_splits=S, pdl=pdl)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                q.copy_(q0)
                graphed = launch(q, kv, table, seqlens, DV, 0.1, num_splits=S, pdl=pdl)
            q.fill_(float("nan"))
            graphed[0].fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            results[pdl, S] = (eager, graphed)
    for S in (1, 5):
        ref_out, ref_lse = results[False, S][0]
        assert not torch.isnan(ref_out).any()
        for out, lse in (results[False, S][1], *results[True, S]):
            assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_entry_point_and_graph_capture():
    q, kv, table, seqlens = make_case([1000, 3000], 2, 16, 64, torch.bfloat16, seed=9)
    scale = 1 / math.sqrt(576)
    dg.launch(q, kv.unsqueeze(2), table, seqlens, DV, scale, True)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = dg.launch(q, kv, table, seqlens, DV, scale, True)
    seqlens.copy_(torch.tensor([900, 2500], dtype=torch.int32))
    g.replay()
    torch.cuda.synchronize()
    ref_out, ref_lse = dg.launch(q, kv, table, seqlens, DV, scale, True)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)


def test_supports_rejects():
    q = torch.randn(1, 1, 16, 576, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(4, 64, 576, device="cuda", dtype=torch.bfloat16)
    assert common.supports(q, kv, 64)
    assert not common.supports(q, kv[:, :32], 32)                      # block_size not a multiple of 64
    assert not common.supports(q.float(), kv.float(), 64)              # fp32
    assert not common.supports(q[..., :320], kv[..., :320], 64)        # other head dims
    assert not common.supports(q.cpu(), kv.cpu(), 64)
    assert not common.supports(q, kv[::2], 64)                         # blocks not one row matrix
    assert common.supports(q, kv.to(torch.float8_e4m3fn), 64)
    assert common.supports(q, torch.zeros(4, 64, 656, dtype=torch.uint8, device="cuda"), 64)
    assert not common.supports(q, torch.zeros(4, 64, 576, dtype=torch.uint8, device="cuda"), 64)   # tile rows are 656 B
    with pytest.raises(ValueError, match="block_n"):
        dg.launch(q, kv.to(torch.float8_e4m3fn), torch.zeros(1, 1, dtype=torch.int32, device="cuda"),
                        torch.ones(1, dtype=torch.int32, device="cuda"), DV, 0.1, block_n=64)
