"""The portable Triton decode kernel (``mla.ops.decode.portable``), its combine and split plan and
the decode dispatch (``mla.ops.decode``) against a float64 reference.

On CPU the kernel runs under Triton's interpreter: float32 and float16 only (the
3.6 interpreter computes tl.dot on bf16 wrongly) and tiny shapes (d = 64 + 16).
On CUDA: bf16 (and fp16/fp32) at DeepSeek shapes (d = 576, dv = 512).

Every case: fresh random data, shuffled block tables, NaN in every unused block,
in the slots past each sequence's end and behind unused block-table entries.
Tolerance tied to the arithmetic: the kernel's error against float64 must be at
most twice that of PyTorch computing the same thing in the input precision (plus
1e-6 for float32, where both sit at rounding level); lse within 1e-5 relative.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mla.ops import reference
from mla.ops import decode
from mla.ops.decode import combine as dcombine
from mla.ops.decode import portable, split_plan

CUDA = torch.cuda.is_available()


def make_case(lens, s_q, H, dv, dr, block_size, dtype, device, seed, spare_blocks=3):
    """Paged cache holding the given lengths; everything not part of a sequence is NaN."""
    g = torch.Generator().manual_seed(seed)
    B, d = len(lens), dv + dr
    need = [math.ceil(n / block_size) for n in lens]
    max_blocks = max(need + [1]) + 1                      # one spare table column
    num_blocks = sum(need) + spare_blocks
    kv = torch.full((num_blocks, block_size, d), float("nan"), dtype=torch.float32)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.empty(B, max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        blocks = perm[used:used + need[b]]
        used += need[b]
        # unused entries point at NaN blocks (the spares), so a read past the end would show
        table[b] = perm[-1 - torch.randint(spare_blocks, (max_blocks,), generator=g)].int()
        table[b, :need[b]] = blocks.int()
        rows = torch.randn(n, d, generator=g)
        for j in range(need[b]):
            k = min(block_size, n - j * block_size)
            kv[blocks[j], :k] = rows[j * block_size: j * block_size + k]
    q = torch.randn(B, s_q, H, d, generator=g)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    to = dict(device=device)
    return q.to(dtype=dtype, **to), kv.to(dtype=dtype, **to), table.to(**to), seqlens.to(**to)


def attend(q, kv, table, seqlens, dv, scale, causal, dtype):
    """Decode attention in ``dtype`` arithmetic (float64: the oracle; else PyTorch in low precision)."""
    B, s_q, H, _ = q.shape
    out = torch.zeros(B, s_q, H, dv, dtype=torch.float64)
    lse = torch.full((B, s_q, H), float("-inf"), dtype=torch.float64)
    for b, n in enumerate(seqlens.tolist()):
        if n == 0:
            continue
        k = reference.gather_rows(kv, table[b], n).to(dtype)                 # [n, d]
        qb = q[b].to(dtype).transpose(0, 1)                                  # [H, s_q, d]
        scores = (qb @ k.T).double() * scale
        key = torch.arange(n, device=q.device)
        limit = (n - s_q + 1 + torch.arange(s_q, device=q.device)) if causal else torch.full((s_q,), n, device=q.device)
        visible = (key[None, :] < limit[:, None])[None]
        scores = scores.masked_fill(~visible, float("-inf"))
        lse_b = torch.logsumexp(scores, -1)
        p = torch.exp(scores - torch.where(torch.isfinite(lse_b), lse_b, 0.0)[..., None])
        o = (p.to(dtype) @ k[:, :dv]).double()
        out[b] = o.transpose(0, 1).cpu()
        lse[b] = lse_b.transpose(0, 1).cpu()
    return out, lse


def check(lens, s_q, H, dv, dr, block_size, dtype, device, causal=True, seed=0, cfg=None):
    """cfg: the portable kernel's schedule (default: ``portable.default_config``)."""
    q, kv, table, seqlens = make_case(lens, s_q, H, dv, dr, block_size, dtype, device, seed)
    scale = 1.0 / math.sqrt(dv + dr)
    # the portable Triton kernel itself (mla_decode may hand 64-row tiles to the Gluon kernel)
    out, lse = portable.launch(q, kv, table, seqlens, dv, scale, causal,
                             cfg or portable.default_config(q, table.shape[1] * kv.shape[1]))
    assert out.shape == (len(lens), s_q, H, dv) and out.dtype == dtype
    assert lse.shape == (len(lens), s_q, H) and lse.dtype == torch.float32
    ref_out, ref_lse = attend(q, kv, table, seqlens, dv, scale, causal, torch.float64)
    out, lse = out.double().cpu(), lse.double().cpu()

    # NaN / inf positions first: out never NaN, lse -inf exactly where no key is visible
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), "lse = -inf must mark exactly the rows with no visible key"
    assert (out[empty] == 0).all()
    assert (lse[empty] < 0).all()

    low_out, _ = attend(q, kv, table, seqlens, dv, scale, causal, dtype)
    denom = ref_out.norm().clamp_min(1e-30)
    err = ((out - ref_out).norm() / denom).item()
    err_torch = ((low_out - ref_out).norm() / denom).item()
    bound = 2 * err_torch + (1e-6 if dtype == torch.float32 else 0.0)
    assert err <= bound, f"kernel rel err {err:.3e} > 2 x torch {dtype} rel err {err_torch:.3e}"
    fin = ~empty
    if fin.any():
        lse_err = ((lse[fin] - ref_lse[fin]).abs() / ref_lse[fin].abs().clamp_min(1.0)).max().item()
        assert lse_err <= 1e-5, f"lse rel err {lse_err:.3e}"


# ---------------------------------------------------------------- CPU: interpreter, tiny shapes
CPU_DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("H,s_q,block_size", [(1, 1, 16), (3, 4, 16), (7, 2, 5), (16, 3, 64)])
def test_cpu_heads_sq_blocks(dtype, H, s_q, block_size):
    # varlen batch: length == s_q, a few blocks, and a partial last block
    check([s_q, 37, 70], s_q, H, dv=64, dr=16, block_size=block_size, dtype=dtype, device="cpu", seed=H)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_cpu_empty_and_short_rows(dtype):
    # length 0 (every row empty) and length < s_q (the first causal rows see nothing)
    check([0, 2, 19], 4, 3, dv=64, dr=16, block_size=16, dtype=dtype, device="cpu", seed=7)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_cpu_non_causal(dtype):
    check([3, 41], 3, 7, dv=64, dr=16, block_size=16, dtype=dtype, device="cpu", causal=False, seed=11)


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_cpu_plan_shares_programs_by_length(splits, monkeypatch):
    """The split plan (``split_plan.planned_split``): num_splits * B programs shared out by length.
    Each sequence's programs are a run of its own (info: first, count), the runs cover all the
    programs in order, every sequence has one, the long sequence gets the most, and the busiest
    program has the fewest 16-key chunks any T allows (a scan over every T, the oracle of the
    kernel's binary search); the output matches the oracle, with some programs partly empty."""
    lens = [300, 5, 0, 1, 17, 64]
    info = plan_info(lens, splits, monkeypatch)
    if splits > 1:
        first, count = info.long().unbind(1)
        assert (count >= 1).all() and first[0] == 0 and torch.equal(first[1:], (first + count)[:-1])
        assert (first + count)[-1] == splits * len(lens)
        assert count.argmax() == 0 and count[0] > splits
        assert busiest(lens, count.tolist()) == fewest_chunks(lens, splits * len(lens))


def test_cpu_plan_is_the_min_max_split(monkeypatch):
    """On small batches, the plan's busiest program has the fewest chunks of every way to share
    the P programs out (at least one a sequence): enumerated, not searched."""
    import itertools
    g = torch.Generator().manual_seed(12)
    for B, splits in ((2, 3), (3, 2), (4, 2)):
        for _ in range(2):
            lens = torch.randint(1, 200, (B,), generator=g).tolist()
            lens[0] = lens[1] + 1 if lens[0] == lens[1] else lens[0]        # mixed lengths: the search
            P = splits * B
            count = plan_info(lens, splits, monkeypatch)[:, 1].tolist()
            best = min(busiest(lens, n) for n in itertools.product(range(1, P + 1), repeat=B) if sum(n) <= P)
            assert sum(count) == P and busiest(lens, count) == best == fewest_chunks(lens, P), (lens, count)


def busiest(lens, counts, chunk=16):
    """The most chunks any program gets when sequence b's chunks are split into counts[b] runs."""
    return max(_cdiv(_cdiv(n, chunk), k) for n, k in zip(lens, counts))


def fewest_chunks(lens, P, chunk=16):
    """The least T with sum_b max(1, ceil(c_b / T)) <= P, by trying every T."""
    c = [_cdiv(n, chunk) for n in lens]
    return next(t for t in range(1, max(c + [1]) + 1) if sum(max(1, _cdiv(x, t)) for x in c) <= P)


def _cdiv(a, b):
    return -(-a // b)


@pytest.mark.parametrize("lens", [[77] * 5, [0] * 3], ids=["equal", "empty"])
def test_cpu_plan_of_equal_lengths_is_the_fixed_split(lens, monkeypatch):
    """Equal lengths (the plan's short path) and no keys at all: num_splits programs a sequence,
    in order, and the output matches the oracle."""
    first, count = plan_info(lens, 3, monkeypatch).long().unbind(1)
    assert torch.equal(first, torch.arange(len(lens)) * 3) and (count == 3).all()


# a batch where the persistent schedule gives a program the pieces of 3 sequences or more
SEVERAL_A_PROGRAM = [1, 2, 0, 3, 1, 5, 4, 2, 900]


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("schedule", ["flat", "persistent"])
@pytest.mark.parametrize("lens,s_q,splits", [([300, 5, 0, 1, 17, 64], 2, 3), ([130, 20, 20, 20, 2], 1, 2),
                                             ([0, 0, 33], 3, 2), ([64] * 4, 2, 3), ([90], 1, 4),
                                             (SEVERAL_A_PROGRAM, 1, 2)])
def test_cpu_pieces_across_sequences(lens, s_q, splits, schedule, dtype, monkeypatch):
    """The portable kernel on the flattened plan's pieces of the batch's chunks laid end to end,
    merged by the combine: ``flat``, a program a piece (``split_plan.planned_split(FLAT)``), or
    ``persistent``, num_splits x B programs each running the pieces of its window in turn
    (``split_plan.schedule``; several sequences a program at ``SEVERAL_A_PROGRAM``). Empty
    sequences, rows that see nothing (length < s_q), equal lengths and one sequence; the output
    matches the oracle and the plan's info is the host's."""
    seen = {}
    planned = split_plan.planned_results

    def spy(*args):
        o, l_, info = planned(*args)
        seen["info"], seen["slots"] = info, o.shape[0]
        return o, l_, info
    monkeypatch.setattr(dcombine, "planned_results", spy)
    cfg = portable.DecodeConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, num_splits=splits,
                                flat=schedule == "flat", persistent=schedule == "persistent")
    check(lens, s_q, 3, dv=64, dr=16, block_size=16, dtype=dtype, device="cpu", seed=len(lens), cfg=cfg)
    assert seen["info"].tolist() == split_plan.flat_plan(lens, splits, 16)[1]
    assert seen["slots"] == split_plan.flat_programs(splits, len(lens))


def test_several_a_program_is_what_it_says():
    begins = split_plan.persistent_plan(SEVERAL_A_PROGRAM, 2, 16)[0]
    assert max(b - a for a, b in zip(begins, begins[1:])) >= 3


def test_decode_config_takes_one_schedule():
    with pytest.raises(ValueError, match="flat and persistent"):
        portable.DecodeConfig(flat=True, persistent=True)


def plan_info(lens, splits, monkeypatch):
    """``check`` on lens at a fixed split count; returns the plan's info [B, 2] (first, count)."""
    seen = {}
    planned = split_plan.planned_results

    def spy(*args):
        o, l_, info = planned(*args)
        seen["info"] = info
        return o, l_, info
    monkeypatch.setattr(dcombine, "planned_results", spy)
    cfg = portable.DecodeConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, num_splits=splits)
    check(lens, 2, 3, dv=64, dr=16, block_size=16, dtype=torch.float32, device="cpu", seed=splits, cfg=cfg)
    return seen["info"]


def test_plan_range_is_checked():
    out, lse = torch.empty(4, 1, 2, 8), torch.empty(4, 1, 2)
    split_plan.planned_results(out, lse, 33, (2 ** 31 - 1) // 33 * 16)
    with pytest.raises(ValueError, match="block_table"):
        split_plan.planned_results(out, lse, 33, (2 ** 31 - 1) // 33 * 16 + 1)


def test_cpu_odd_dims():
    # head_dim_v and rope dims that are not powers of two, block size 1
    check([9, 4], 2, 3, dv=48, dr=8, block_size=1, dtype=torch.float32, device="cpu", seed=3)


def test_public_op_dispatches_to_kernel():
    import mla.ops

    q, kv, table, seqlens = make_case([5, 33], 2, 3, 64, 16, 16, torch.float32, "cpu", seed=5)
    a = mla.ops.mla_decode(q, kv.unsqueeze(2), table, seqlens, 64, 0.125, backend="triton")
    b = mla.ops.mla_decode(q, kv, table, seqlens, 64, 0.125, backend="torch")
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-5)


def check_combine(S, B, s_q, H, dv, out_dtype, device, seed=0, part_dtype=torch.float32):
    """decode.combine against the float64 LSE merge of S partials (in part_dtype, as
    ``planned_results`` makes them). Partials are as the kernels write them: an empty split has
    out 0 and lse -inf; one row has every split empty."""
    g = torch.Generator().manual_seed(seed)
    o_part = torch.randn(S, B, s_q, H, dv, generator=g).to(part_dtype)
    l_part = torch.randn(S, B, s_q, H, generator=g) * 4
    empty = torch.rand(S, B, s_q, H, generator=g) < 0.3
    empty[:, 0, 0, 0] = True
    l_part[empty] = float("-inf")
    o_part[empty] = 0.0
    o_part = o_part.to(device)
    out = torch.empty(B, s_q, H, dv, dtype=out_dtype, device=device)
    lse = torch.empty(B, s_q, H, dtype=torch.float32, device=device)
    dcombine.combine(o_part, l_part.to(device), out, lse)
    o_part = o_part.double().cpu()
    ref_lse = torch.logsumexp(l_part.double(), 0)
    w = torch.exp(l_part.double() - torch.where(torch.isfinite(ref_lse), ref_lse, 0.0))
    ref = (w[..., None] * o_part.double()).sum(0)
    out, lse = out.double().cpu(), lse.double().cpu()
    none = torch.isinf(ref_lse)
    assert none[0, 0, 0] and torch.equal(torch.isinf(lse), none) and (out[none] == 0).all()
    # float32 sums over S terms (|w| <= 1, |o| ~ 4): S * 2^-24 * max|o| each, plus out's rounding
    tol = 2 * S * 2.0 ** -24 * o_part.abs().max().item()
    rnd = {torch.float32: 0.0, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[out_dtype]   # half an ulp
    assert ((out - ref).abs() <= tol + rnd * ref.abs()).all()
    assert ((lse - ref_lse)[~none].abs() <= 2 * S * 2.0 ** -24 * ref_lse[~none].abs().clamp_min(1.0)).all()


@pytest.mark.parametrize("S", [1, 2, 3, 40, 300])
def test_cpu_combine(S):
    # 300 splits: more than one pass of 256; dv 40 and 3 heads x 2 queries: masked tiles
    check_combine(S, 2, 2, 3, 40, torch.float32, "cpu", seed=S)


def test_cpu_combine_fp16_out_and_wide_rows():
    # float16 here: the 3.6 interpreter casts float32 to bf16 by truncation (the GPU rounds)
    check_combine(5, 3, 1, 7, 64, torch.float16, "cpu")
    check_combine(4, 1, 1, 1, 512, torch.float32, "cpu")
    check_combine(6, 2, 2, 3, 64, torch.float16, "cpu", part_dtype=torch.float16)     # the kernels' fp16 partials
    # 16-bit tiles (combine_tiles): up to 16 splits rows x 512 columns on four warps, beyond one warp
    check_combine(16, 1, 1, 3, 512, torch.float16, "cpu", seed=16, part_dtype=torch.float16)
    check_combine(40, 1, 2, 3, 512, torch.float16, "cpu", seed=40, part_dtype=torch.float16)
    assert dcombine.combine_tiles(16, 3, 512, 2) == (16, 2, 512, 4)
    assert dcombine.combine_tiles(40, 6, 512, 2) == (64, 1, 64, 1)
    assert dcombine.combine_tiles(16, 3, 512, 4) == (16, 1, 256, 4)      # float32: as before


def test_planned_results_partial_dtypes():
    """planned_results: with splits, partial outputs in float32 or out's own 16-bit dtype (lse
    float32), any other dtype refused before anything is allocated; one split writes out and lse
    themselves."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        out, lse = torch.empty(3, 2, 5, 8, dtype=dtype), torch.empty(3, 2, 5)
        for part in {torch.float32, dtype}:
            o, l_, info = split_plan.planned_results(out, lse, 4, 100, part)
            assert o.dtype == part and l_.dtype == torch.float32
            assert o.shape == (12, 3, 2, 5, 8) and l_.shape == (12, 3, 2, 5) and info.shape == (3, 2)
            assert o.stride(1) == 0 and o[:, 0].is_contiguous()      # slot p's rows at p * rows (the TMA boxes)
        o1, l1, _ = split_plan.planned_results(out, lse, 1, 100)
        assert o1.data_ptr() == out.data_ptr() and l1.data_ptr() == lse.data_ptr()
    out = torch.empty(3, 2, 5, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="part_dtype"):
        split_plan.planned_results(out, torch.empty(3, 2, 5), 4, 100, torch.float16)


@pytest.mark.parametrize("counts,P,eq", [([300, 300, 300], 900, None), ([500, 100, 300], 900, None),
                                         ([1, 898, 1], 900, None), ([3], 8, None), ([1, 1, 1], 6, 1),
                                         ([2, 2, 2], 9, 2), ([2, 2, 2], 9, None)],
                         ids=["equal", "mixed", "skewed", "one-short", "idle", "idle-2", "idle-unsaid"])
def test_cpu_planned_combine(counts, P, eq):
    """The combine over the plan's slots (``planned_results``: P slots, sequence b's are info[b,
    0] .. + info[b, 1] - 1): the first round goes out for the slots of equal lengths (300 a
    sequence here, more than one round of 256; eq: told, as a grid wider than equal lengths use
    tells it), and is summed again where info says otherwise. "one-short": batch 1 (the rounds'
    loop in one stage) whose plan used 3 of 8 slots; "idle": equal lengths on fewer slots than
    the grid's; the slots no sequence has are NaN, which must not leak. Against the float64 LSE
    merge of each sequence's own slots."""
    B, s_q, H, dv = len(counts), 1, 2, 16
    g = torch.Generator().manual_seed(len(set(counts)))
    o = torch.randn(P, s_q, H, dv, generator=g)
    ls = torch.randn(P, s_q, H, generator=g) * 4
    ls[torch.rand(P, s_q, H, generator=g) < 0.2] = float("-inf")
    o[torch.isinf(ls)] = 0.0
    o[sum(counts):] = float("nan")
    ls[sum(counts):] = float("nan")
    first = torch.tensor([0, *counts[:-1]]).cumsum(0)
    info = torch.stack([first, torch.tensor(counts)], 1).to(torch.int32)
    out = torch.empty(B, s_q, H, dv)
    lse = torch.empty(B, s_q, H)
    dcombine.combine(o.unsqueeze(1).expand(P, B, s_q, H, dv), ls.unsqueeze(1).expand(P, B, s_q, H), out, lse, info,
                     eq_splits=eq)
    for b in range(B):
        sl = slice(int(first[b]), int(first[b]) + counts[b])
        ref_lse = torch.logsumexp(ls[sl].double(), 0)
        # a row whose slots are all empty (likely with one or two slots): out 0, lse -inf
        none = torch.isinf(ref_lse)
        w = torch.exp(ls[sl].double() - torch.where(none, 0.0, ref_lse))
        ref = (w[..., None] * o[sl].double()).sum(0)
        n = counts[b]
        assert torch.equal(torch.isinf(lse[b]), none) and (out[b][none] == 0).all()
        assert ((out[b].double() - ref).abs() <= 2 * n * 2.0 ** -24 * o[sl].abs().max()).all()
        assert ((lse[b].double() - ref_lse)[~none].abs()
                <= 2 * n * 2.0 ** -24 * ref_lse[~none].abs().clamp_min(1.0)).all()


def test_planned_results_direct():
    """planned_results(direct=True): B slots past the plan's P, slot P + b laid out as out[b]
    (a sequence's only program writes its result there); refused for float32 partials of a
    16-bit output and for the flattened plan, before anything is allocated."""
    out, lse = torch.empty(3, 2, 5, 8, dtype=torch.bfloat16), torch.empty(3, 2, 5)
    o, l_, _ = split_plan.planned_results(out, lse, 2, 100, torch.bfloat16, direct=True)
    assert o.shape == (9, 3, 2, 5, 8) and l_.shape == (9, 3, 2, 5) and o[:, 0].is_contiguous()
    assert o[6:, 0].shape == out.shape and o[6:, 0].is_contiguous() and l_[6:, 0].is_contiguous()
    for kw in ({"part_dtype": torch.float32}, {"part_dtype": torch.bfloat16, "flat": True}):
        with pytest.raises(ValueError, match="direct"):
            split_plan.planned_results(out, lse, 2, 100, direct=True, **kw)


@pytest.mark.parametrize("eq_splits", [None, 1, 2])
def test_cpu_combine_leaves_single_slots(eq_splits):
    """combine(skip_single=True) over the slots of ``planned_results(direct=True)``: a sequence of
    one slot keeps what its program wrote into out (here a sentinel, NaN in its plan slot), the
    others are merged from their slots; eq_splits (the guess of the first round) changes
    nothing but the loads."""
    counts, P, s_q, H, dv = [1, 3, 1, 2, 1], 8, 2, 3, 16
    B = len(counts)
    g = torch.Generator().manual_seed(11)
    o = torch.randn(P + B, s_q, H, dv, generator=g)
    ls = torch.randn(P + B, s_q, H, generator=g) * 4
    first = torch.tensor([0, *counts[:-1]]).cumsum(0)
    for b, n in enumerate(counts):
        if n == 1:      # never written by the kernel: its only program wrote slot P + b
            o[first[b]] = float("nan")
            ls[first[b]] = float("nan")
    out, lse = o[P:], ls[P:]
    sentinel_o, sentinel_l = out.clone(), lse.clone()
    info = torch.stack([first, torch.tensor(counts)], 1).to(torch.int32)
    dcombine.combine(o.unsqueeze(1).expand(P + B, B, s_q, H, dv), ls.unsqueeze(1).expand(P + B, B, s_q, H), out, lse,
                     info, eq_splits=eq_splits, skip_single=True)
    for b, n in enumerate(counts):
        if n == 1:
            assert torch.equal(out[b], sentinel_o[b]) and torch.equal(lse[b], sentinel_l[b])
            continue
        sl = slice(int(first[b]), int(first[b]) + n)
        ref_lse = torch.logsumexp(ls[sl].double(), 0)
        ref = (torch.exp(ls[sl].double() - ref_lse)[..., None] * o[sl].double()).sum(0)
        assert ((out[b].double() - ref).abs() <= 2 * n * 2.0 ** -24 * o[sl].abs().max()).all()
        assert ((lse[b].double() - ref_lse).abs() <= 2 * n * 2.0 ** -24 * ref_lse.abs().clamp_min(1.0)).all()
    with pytest.raises(ValueError, match="skip_single"):
        dcombine.combine(o[:P].unsqueeze(1).expand(P, B, s_q, H, dv), ls[:P].unsqueeze(1).expand(P, B, s_q, H),
                         torch.empty_like(out), torch.empty_like(lse), skip_single=True)


# ---------------------------------------------------------------- GPU: real shapes
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@gpu
@pytest.mark.parametrize("H,s_q", [(1, 1), (3, 2), (16, 1), (16, 4), (63, 2), (128, 1), (128, 2), (128, 8)])
@pytest.mark.parametrize("block_size", [64, 16])
def test_gpu_bf16(H, s_q, block_size):
    lens = [s_q, 1, 700, 4099, 0, 2048][: 6 if H <= 16 else 4]
    lens = [max(n, 0) for n in lens]
    check(lens, s_q, H, dv=512, dr=64, block_size=block_size, dtype=torch.bfloat16, device="cuda", seed=H * 10 + s_q)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_gpu_other_dtypes(dtype):
    check([3, 1500, 257], 2, 16, dv=512, dr=64, block_size=64, dtype=dtype, device="cuda", seed=1)


@gpu
def test_gpu_long_single_sequence_and_non_causal():
    check([131072], 1, 16, dv=512, dr=64, block_size=64, dtype=torch.bfloat16, device="cuda", seed=2)
    check([5000, 7], 3, 128, dv=512, dr=64, block_size=64, dtype=torch.bfloat16, device="cuda", causal=False, seed=3)


@gpu
@pytest.mark.parametrize("S,H,dv", [(2, 128, 512), (8, 16, 512), (132, 16, 512), (300, 3, 40)])
def test_gpu_combine(S, H, dv):
    check_combine(S, 4, 1, H, dv, torch.float32, "cuda", seed=S)
    check_combine(S, 2, 2, H, dv, torch.bfloat16, "cuda", seed=S + 1)
    check_combine(S, 2, 2, H, dv, torch.bfloat16, "cuda", seed=S + 2, part_dtype=torch.bfloat16)  # the kernels'


@gpu
@pytest.mark.parametrize("H,s_q", [(16, 1), (128, 1), (16, 4), (63, 2)])
@pytest.mark.parametrize("lens", [[4096] + [256] * 31, [700, 1, 0, 4099, 2048, 3, 3, 3], [1024] * 8],
                         ids=["one-long", "mixed", "equal"])
def test_gpu_persistent_schedule(H, s_q, lens):
    """The persistent schedule on the GPU's tiles (64-row, 64-key), mixes and equal lengths."""
    q = torch.empty(len(lens), s_q, H, 576, device="cuda", dtype=torch.bfloat16)     # the bf16 schedule
    cfg = dataclasses.replace(portable.default_config(q, 8192), num_splits=4, persistent=True)
    check(lens, s_q, H, dv=512, dr=64, block_size=64, dtype=torch.bfloat16, device="cuda", seed=H + s_q, cfg=cfg)


@gpu
def test_gpu_cuda_graph_capture():
    """No host synchronisation inside the op: it captures, and replays with new lengths."""
    q, kv, table, seqlens = make_case([1000, 3000], 2, 16, 512, 64, 64, torch.bfloat16, "cuda", seed=9)
    scale = 1 / math.sqrt(576)
    decode.mla_decode(q, kv, table, seqlens, 512, scale, True)   # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = decode.mla_decode(q, kv, table, seqlens, 512, scale, True)
    seqlens.copy_(torch.tensor([900, 2500], dtype=torch.int32))
    g.replay()
    torch.cuda.synchronize()
    ref_out, ref_lse = decode.mla_decode(q, kv, table, seqlens, 512, scale, True)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)


@gpu
def test_gpu_combine_dependent_launch(monkeypatch):
    """The combine as a programmatic dependent launch (Hopper) reads the split kernel's
    partials only after they are written: the same bits as in plain stream order, eagerly and
    replayed from a CUDA graph, with splits (B 1, 4k keys: one wave of splits)."""
    q, kv, table, seqlens = make_case([4000], 1, 16, 512, 64, 64, torch.bfloat16, "cuda", seed=11)
    scale = 1 / math.sqrt(576)
    results = {}
    for pdl in (False, True):
        eager = decode.mla_decode(q, kv, table, seqlens, 512, scale, True, pdl=pdl)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            graphed = decode.mla_decode(q, kv, table, seqlens, 512, scale, True, pdl=pdl)
        graphed[0].fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        results[pdl] = (eager, graphed)
    ref_out, ref_lse = results[False][0]
    for out, lse in (results[False][1], *results[True]):
        torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)


def test_cpu_launch_refused_where_the_interpreter_breaks(monkeypatch):
    """With numpy >= 2.4 under Triton 3.6 a CPU launch raises before the interpreter runs
    (a launch failing inside it broke later Gluon compiles in the process) and writes nothing."""
    import mla.ops._jit as mt

    monkeypatch.setattr(mt, "INTERPRETER_BROKEN", True)
    o, lse_p = torch.randn(3, 1, 1, 2, 16), torch.randn(3, 1, 1, 2)
    out, lse = torch.full((1, 1, 2, 16), 7.0), torch.full((1, 1, 2), 7.0)
    with pytest.raises(RuntimeError, match="numpy < 2.4"):
        dcombine.combine(o, lse_p, out, lse)
    assert (out == 7.0).all() and (lse == 7.0).all()


def test_combine_rejects_strided_rows():
    o_part, l_part = torch.zeros(2, 1, 1, 3, 32)[..., ::2], torch.zeros(2, 1, 1, 3)
    out, lse = torch.full((1, 1, 3, 16), 7.0), torch.full((1, 1, 3), 7.0)
    with pytest.raises(ValueError, match="o_part and out need unit stride"):
        dcombine.combine(o_part, l_part, out, lse)
    assert (out == 7.0).all() and (lse == 7.0).all()


def test_gluon_split_rule_on_132_sms(monkeypatch):
    # host-only: about sqrt(b L / (c B rows)) splits per sequence, a count that gives each split
    # of the longest sequence a whole number of 64-key tiles, within one wave of one-per-SM
    # programs (the counts measured best on the H200, or what the caps leave of them)
    from mla.ops.decode.gluon import common as dg

    monkeypatch.setattr(dg, "num_sms", lambda index: 132)
    dev = torch.device("cuda", 0)
    cases = {  # (B, rows, L): splits
        (1, 128, 1024): 16, (1, 128, 2048): 32, (1, 128, 4096): 32, (1, 128, 8192): 43, (1, 128, 16384): 64,
        (1, 256, 2048): 16, (1, 256, 4096): 22, (1, 256, 16384): 32, (1, 64, 16384): 86,
        (1, 16, 1024): 16, (1, 16, 4096): 64, (1, 16, 16384): 128, (32, 16, 1024): 4, (32, 128, 4096): 2,
        (128, 128, 1024): 1, (4, 128, 4096): 16, (1, 128, 131072): 64, (1, 128, 100): 2,
    }
    for (B, rows, L), want in cases.items():
        assert dg.default_splits(B, rows, L, dev) == want, (B, rows, L)


def test_gluon_launch_splits_on_132_sms(monkeypatch):
    # host-only: a default launch's (programs a sequence, programs a sequence at equal lengths):
    # at least 2 from batch 2 with a table of 4096 keys or more, so that a mixed batch shares its
    # long sequences out, where equal lengths want one; a sequence's row groups count as
    # sequences for the equal-length count
    from mla.ops.decode.gluon import common as dg

    monkeypatch.setattr(dg, "num_sms", lambda index: 132)
    dev = torch.device("cuda", 0)
    cases = {(128, 128, 16384, 1): (2, 1), (128, 128, 4096, 1): (2, 1), (128, 128, 4095, 1): (1, 1),
             (32, 128, 4096, 1): (2, 2), (1, 128, 4096, 1): (32, 32), (32, 16, 1024, 1): (4, 4),
             (64, 16, 8192, 2): (2, 1), (64, 16, 4096, 2): (2, 1), (64, 16, 2048, 2): (1, 1),
             (1, 16, 4096, 2): (64, 64)}
    for (B, rows, L, groups), want in cases.items():
        assert dg.launch_splits(B, rows, L, dev, groups) == want, (B, rows, L, groups)
        assert want[1] == dg.default_splits(B * groups, rows, L, dev)


def test_gluon_dependent_launch_rule(monkeypatch):
    # host-only: the Gluon kernels are programmatic dependents with pdl and at most 32 query rows
    # (where it measured faster on the H200), in plain stream order otherwise
    from mla.ops.decode.gluon import common as dg

    assert dg.pdl_launch(16) == dg.pdl_launch(32, True) == {"launch_pdl": True}
    assert dg.pdl_launch(33) == dg.pdl_launch(128) == {}
    assert dg.pdl_launch(16, False) == {}


def test_thread_major_layout_is_a_permutation_by_thread():
    # host-only: common.thread_major puts register k of thread t of a warpgroup layout at
    # word 128 k + t: its offset bases are the lane, warp and register bases in that order, and
    # every element of the tensor gets exactly one word
    from mla.ops.decode.gluon import common as dg
    from mla.ops.decode.gluon import fp8 as df

    ol = df._o_layout()
    sl = dg.thread_major(ol)
    bases = sl.offset_bases
    assert bases == list(ol.lane_bases) + list(ol.warp_bases) + list(ol.reg_bases)
    seen = set()
    for off in range(1 << len(bases)):
        elem = [0, 0]
        for bit, b in enumerate(bases):
            if off >> bit & 1:
                elem = [elem[0] ^ b[0], elem[1] ^ b[1]]
        seen.add(tuple(elem))
    assert len(seen) == 512 * 16 and all(0 <= r < 512 and 0 <= c < 16 for r, c in seen)


def test_dispatch_rule_on_hopper(monkeypatch):
    # host-only: decode.choose_kernel as if a Hopper kernel took every input (use_gluon True):
    # FP8 rows (per-tensor or tile) with <= 32 query rows on the e4m3 kernel, except <= 16 rows
    # with at most FP8_PORTABLE_KEYS keys in the table (portable); bf16 rows: keys-on-M at <= 16
    # rows and batch >= 2; the seesaw for the rest (more rows, batch 1); without a Hopper kernel portable
    monkeypatch.setattr(decode, "use_gluon", lambda q, kv, dv: True)
    fp8 = torch.empty(2, 64, 576, dtype=torch.float8_e4m3fn)
    bf16 = torch.empty(2, 64, 576, dtype=torch.bfloat16)
    tile = torch.empty(2, 64, 656, dtype=torch.uint8)

    def q(B, s_q, H):
        return torch.empty(B, s_q, H, 576, dtype=torch.bfloat16)
    keys = decode.FP8_PORTABLE_KEYS
    assert decode.choose_kernel(q(1, 1, 16), fp8, 512, keys) == "portable"
    assert decode.choose_kernel(q(1, 1, 16), fp8, 512, keys + 64) == "fp8"
    assert decode.choose_kernel(q(4, 2, 8), fp8, 512, keys // 4) == "portable"
    assert decode.choose_kernel(q(4, 2, 8), fp8, 512, 4096) == "fp8"
    assert decode.choose_kernel(q(32, 1, 16), fp8, 512, 1024) == "fp8"
    assert decode.choose_kernel(q(32, 2, 16), fp8, 512, 1024) == "fp8"         # 32 rows
    assert decode.choose_kernel(q(1, 2, 16), fp8, 512, 64) == "fp8"
    assert decode.choose_kernel(q(1, 1, 33), fp8, 512, 1 << 16) == "seesaw"
    assert decode.choose_kernel(q(32, 1, 128), fp8, 512, 1 << 16) == "seesaw"
    assert decode.choose_kernel(q(32, 1, 16), bf16, 512, 1024) == "narrow"
    assert decode.choose_kernel(q(2, 1, 16), bf16, 512, 1024) == "narrow"
    assert decode.choose_kernel(q(2, 2, 16), bf16, 512, 1024) == "seesaw"      # 32 rows
    assert decode.choose_kernel(q(1, 1, 16), bf16, 512, 64) == "seesaw"
    assert decode.choose_kernel(q(32, 1, 16), tile, 512, 1024) == "fp8"
    assert decode.choose_kernel(q(1, 1, 16), tile, 512, keys) == "portable"
    assert decode.choose_kernel(q(1, 1, 16), tile, 512, keys + 64) == "fp8"
    assert decode.choose_kernel(q(4, 2, 16), tile, 512, 64) == "fp8"
    assert decode.choose_kernel(q(4, 2, 64), tile, 512, 4096) == "seesaw"
    assert decode.choose_kernel(q(64, 1, 16), bf16, 512, 1 << 16) == "narrow"
    monkeypatch.setattr(decode, "use_gluon", lambda q, kv, dv: False)
    assert decode.choose_kernel(q(32, 1, 16), fp8, 512, 1 << 20) == "portable"
