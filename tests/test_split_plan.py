"""The split plan (``mla.ops.decode.split_plan``): the Triton and Gluon versions against the host
rule ``plan``, which is written once in Python; the Gluon one on an sm90 GPU only."""
from __future__ import annotations

import pytest
import torch

from mla.ops.decode import split_plan

CASES = [([300, 5, 0, 1, 17, 64], 1), ([300, 5, 0, 1, 17, 64], 3), ([300, 5, 0, 1, 17, 64], 8), ([64] * 5, 4),
         ([0, 0], 2), ([20000] + [700] * 13 + [0, 1, 1, 65], 6), ([3, 20000, 5, 17000, 64], 24), ([1], 7)]
# lengths the device cannot check (negative, past the table): the plan reads them clamped to 0 .. max_len
CLAMPED = [([-5, 300, 2**31 - 1, 64], 3, 256), ([-(2**31), -1], 2, 64), ([999, 999], 4, 128)]


def _triton_plan(lens, num_splits, chunk, device, max_len=2**30, flat=False, eq_splits=None):
    """Every program's (b, start, end) from ``planned_split`` (flat: its flattened plan, over
    ``flat_programs``), and the info it wrote."""
    import triton.language as tl

    from mla.ops._jit import jit

    @jit
    def probe(SEQLENS, INFO, OUT, B, num_splits, eq_splits, max_len, BN: tl.constexpr, BLOCK_B: tl.constexpr,
              FLAT: tl.constexpr):
        p = tl.program_id(0)
        b, seqlen, start, end = split_plan.planned_split(SEQLENS, INFO, B, p, num_splits, eq_splits, max_len, BN,
                                                         BLOCK_B, FLAT)
        tl.store(OUT + 3 * p, b)
        tl.store(OUT + 3 * p + 1, start)
        tl.store(OUT + 3 * p + 2, end)

    B = len(lens)
    n = split_plan.flat_programs(num_splits, B) if flat else num_splits * B
    out = torch.full((n, 3), -1, dtype=torch.int32, device=device)
    info = torch.full((B, 2), -7, dtype=torch.int32, device=device)
    probe[(n,)](torch.tensor(lens, dtype=torch.int32, device=device), info, out, B, num_splits,
                num_splits if eq_splits is None else eq_splits, max_len, BN=chunk, BLOCK_B=split_plan.block_b(B),
                FLAT=flat)
    return [tuple(r) for r in out.tolist()], info


def _check_info(plan, info, B, live=None):
    """info against the plan's first `live` programs (default all: the rest idle)."""
    plan = plan[:live]
    first = {}
    for p, (b, _, _) in enumerate(plan):
        first.setdefault(b, p)
    count = [sum(1 for b_, _, _ in plan if b_ == b) for b in range(B)]
    assert info.tolist() == [[first[b], count[b]] for b in range(B)]


# (lengths, num_splits, eq_splits): programs past eq_splits * B idle at equal lengths; mixed
# lengths use all num_splits * B (eq_splits does not enter)
EQ_CASES = [([64] * 5, 4, 1), ([300] * 3, 3, 2), ([0, 0], 2, 1), ([1], 7, 3), ([4096] * 40, 2, 1),
            ([300, 5, 0, 1, 17, 64], 3, 1), ([4096] + [256] * 31, 2, 1)]


def _live(lens, num_splits, eq_splits):
    return eq_splits * len(lens) if min(lens) == max(lens) else num_splits * len(lens)


@pytest.mark.parametrize("lens,num_splits", CASES)
def test_triton_plan_is_the_host_plan_cpu(lens, num_splits):
    got, info = _triton_plan(lens, num_splits, 16, "cpu")
    want = split_plan.plan(lens, num_splits, 16)
    assert got == want
    _check_info(want, info, len(lens))


@pytest.mark.parametrize("lens,num_splits,max_len", CLAMPED)
def test_triton_plan_clamps_lengths_cpu(lens, num_splits, max_len):
    got, info = _triton_plan(lens, num_splits, 16, "cpu", max_len)
    want = split_plan.plan([min(max(n, 0), max_len) for n in lens], num_splits, 16)
    assert got == want and all(0 <= s <= e <= max_len for _, s, e in got)
    _check_info(want, info, len(lens))


@pytest.mark.parametrize("lens,num_splits,eq_splits", EQ_CASES)
def test_triton_plan_idles_past_equal_splits_cpu(lens, num_splits, eq_splits):
    got, info = _triton_plan(lens, num_splits, 16, "cpu", eq_splits=eq_splits)
    want = split_plan.plan(lens, num_splits, 16, eq_splits)
    live = _live(lens, num_splits, eq_splits)
    assert got == want and set(want[live:]) <= {(0, 0, 0)} and len(want) == num_splits * len(lens)
    if min(lens) == max(lens):
        assert want[:live] == split_plan.plan(lens, eq_splits, 16)
    else:
        assert want == split_plan.plan(lens, num_splits, 16)
    _check_info(want, info, len(lens), live)


def test_plan_refuses_more_equal_splits_than_splits():
    for eq in (0, 4):
        with pytest.raises(ValueError, match="eq_splits"):
            split_plan.plan([5, 5], 3, 16, eq)


def test_mixed_splits():
    # at least 2 programs a sequence from batch 2 at MIXED_GRID_KEYS keys (a mixed batch's long
    # sequences shared out), what equal lengths want where that is more; batch 1 and shorter
    # tables as equal lengths want
    L = split_plan.MIXED_GRID_KEYS
    cases = [(1, 1, L), (1, 5, L), (2, 1, L), (128, 1, 2 * L), (32, 2, L), (8, 9, L), (128, 1, L - 1), (2, 3, 64)]
    assert [split_plan.mixed_splits(B, eq, n) for B, eq, n in cases] == [1, 5, 2, 2, 2, 9, 1, 3]


def test_host_plan_covers_every_key():
    # every sequence's keys are the union of its programs' runs, in order, in whole chunks
    for lens, S, eq in [(n, s, s) for n, s in CASES] + EQ_CASES:
        runs = split_plan.plan(lens, S, 64, eq)[:_live(lens, S, eq)]
        for b, n in enumerate(lens):
            mine = [(s, e) for b_, s, e in runs if b_ == b]
            assert mine and mine[0][0] == 0 and all(e0 >= s1 for (_, e0), (s1, _) in zip(mine, mine[1:]))
            assert max(e for _, e in mine) == n and all(s % 64 == 0 for s, _ in mine)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("lens,num_splits,max_len,eq_splits",
                         [(n, s, 2**30, s) for n, s in CASES] + [(*c, c[1]) for c in CLAMPED]
                         + [(n, s, 2**30, e) for n, s, e in EQ_CASES])
def test_gluon_plan_is_the_host_plan(lens, num_splits, max_len, eq_splits):
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def probe(SEQLENS, INFO, OUT, SLOT, B, num_splits, eq_splits, max_len, BLOCK_B: gl.constexpr,
              DIRECT: gl.constexpr):
        p = gl.program_id(0)
        b, seqlen, start, end, n_tiles, slot = split_plan.planned_split_gluon(SEQLENS, INFO, B, p, num_splits,
                                                                              eq_splits, max_len, 64, BLOCK_B, DIRECT)
        gl.store(OUT + 3 * p, b)
        gl.store(OUT + 3 * p + 1, start)
        gl.store(OUT + 3 * p + 2, end)
        gl.store(SLOT + p, slot)

    B = len(lens)
    clamped = [min(max(n, 0), max_len) for n in lens]
    want = split_plan.plan(clamped, num_splits, 64, eq_splits)
    live = _live(clamped, num_splits, eq_splits)
    count = [sum(1 for b_, _, _ in want[:live] if b_ == b) for b in range(B)]
    for direct in (False, True):
        out = torch.zeros(num_splits * B, 3, dtype=torch.int32, device="cuda")
        slots = torch.zeros(num_splits * B, dtype=torch.int32, device="cuda")
        info = torch.zeros(B, 2, dtype=torch.int32, device="cuda")
        probe[(num_splits * B,)](torch.tensor(lens, dtype=torch.int32, device="cuda"), info, out, slots, B,
                                 num_splits, eq_splits, max_len, BLOCK_B=split_plan.block_b(B), DIRECT=direct,
                                 num_warps=4)
        assert [tuple(r) for r in out.tolist()] == want
        _check_info(want, info, B, live)
        # the slot each program writes: its own, none when idle, the output's (P + b) when it is its
        # sequence's only program and the launch is direct
        assert slots.tolist() == [-1 if p >= live else num_splits * B + b if direct and count[b] == 1 else p
                                  for p, (b, _, _) in enumerate(want)]
    triton_got, _ = _triton_plan(lens, num_splits, 64, "cuda", max_len, eq_splits=eq_splits)
    assert triton_got == want


# ---------------------------------------------------------------- the flattened plan
FLAT_CASES = CASES + [([4096] + [256] * 31, 2), ([1] * 9, 2), ([200, 0, 0, 1], 3), ([0, 0, 5], 2),
                      (torch.randint(0, 3000, (40,), generator=torch.Generator().manual_seed(5)).tolist(), 3)]


def test_host_flat_plan_cuts_the_batch_evenly():
    """``flat_plan``: at mixed lengths no piece holds more than W = ceil(total chunks / P)
    chunks, every key of every sequence lies in exactly one piece, a sequence's pieces are
    consecutive programs in key order (info: first, count; an empty sequence count 0), and the
    programs past the last piece hold nothing. Equal lengths: the fixed split."""
    for lens, S in FLAT_CASES:
        pieces, info = split_plan.flat_plan(lens, S, 16)
        B, P = len(lens), S * len(lens)
        assert len(pieces) == split_plan.flat_programs(S, B) == P + B - 1
        if min(lens) == max(lens):
            assert pieces[:P] == split_plan.plan(lens, S, 16) and set(pieces[P:]) <= {(0, 0, 0)}
            continue
        W = max(1, -(-sum(-(-n // 16) for n in lens) // P))
        assert all(-(-(e - s) // 16) <= W for _, s, e in pieces)
        used = 0
        for b, n in enumerate(lens):
            first, count = info[b]
            assert count == (0 if n == 0 else len([1 for b_, s, e in pieces if b_ == b and e > s]))
            if n == 0:
                continue
            mine = pieces[first:first + count]
            assert all(b_ == b for b_, _, _ in mine) and first == used
            assert mine[0][1] == 0 and mine[-1][2] == n and all(e == s for (_, _, e), (_, s, _) in zip(mine, mine[1:]))
            assert all(s % 16 == 0 and s < e for _, s, e in mine)
            used += count
        assert set(pieces[used:]) <= {(0, 0, 0)}


def _triton_flat_plan(lens, num_splits, chunk, max_len=2**30):
    got, info = _triton_plan(lens, num_splits, chunk, "cpu", max_len, flat=True)
    return got, info.tolist()


@pytest.mark.parametrize("lens,num_splits", FLAT_CASES)
def test_triton_flat_plan_is_the_host_flat_plan_cpu(lens, num_splits):
    assert _triton_flat_plan(lens, num_splits, 16) == split_plan.flat_plan(lens, num_splits, 16)


@pytest.mark.parametrize("lens,num_splits,max_len", CLAMPED)
def test_triton_flat_plan_clamps_lengths_cpu(lens, num_splits, max_len):
    got = _triton_flat_plan(lens, num_splits, 16, max_len)
    assert got == split_plan.flat_plan([min(max(n, 0), max_len) for n in lens], num_splits, 16)


# ---------------------------------------------------------------- the persistent schedule

_LONG_BATCH = torch.randint(0, 300, (130,), generator=torch.Generator().manual_seed(6)).tolist()
PERSISTENT_CASES = FLAT_CASES + [([1] * 3 + [0] * 5 + [2], 2), ([0, 0, 0], 3), (_LONG_BATCH, 2)]


def test_host_persistent_plan_gives_every_program_a_window():
    """``persistent_plan``: its pieces are the flattened plan's; program p's pieces are
    consecutive, together they are every real piece once, in order, and at mixed lengths they
    lie in the window [p W, (p + 1) W) of the batch's chunks (W = ceil(total / P)), so that no
    program holds more than W chunks; equal lengths: one piece a program."""
    for lens, S in PERSISTENT_CASES:
        begins, pieces, info = split_plan.persistent_plan(lens, S, 16)
        B, P = len(lens), S * len(lens)
        assert (pieces, info) == split_plan.flat_plan(lens, S, 16)
        assert len(begins) == P + 1 and begins[0] == 0 and begins == sorted(begins)
        if min(lens) == max(lens):
            assert begins == list(range(P + 1))
            continue
        real = sum(count for _, count in info)
        assert begins[-1] == real and set(pieces[real:]) <= {(0, 0, 0)}
        chunks = [-(-n // 16) for n in lens]
        starts = [sum(chunks[:b]) for b in range(B)]
        W = max(1, -(-sum(chunks) // P))
        for p in range(P):
            mine = pieces[begins[p]:begins[p + 1]]
            pos = [(starts[b] + s // 16, starts[b] + -(-e // 16)) for b, s, e in mine]
            assert all(p * W <= lo < hi <= (p + 1) * W for lo, hi in pos), (lens, S, p, mine)
            assert sum(hi - lo for lo, hi in pos) <= W


def _schedule(lens, num_splits, chunk, max_len=2**20):
    sched, info = split_plan.schedule(torch.tensor(lens, dtype=torch.int32), num_splits, max_len, chunk)
    P = num_splits * len(lens)
    return sched[:P + 1].tolist(), [tuple(x) for x in sched[P + 1:].view(-1, 3).tolist()], info.tolist()


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("lens,num_splits", PERSISTENT_CASES)
def test_schedule_is_the_host_persistent_plan_cpu(lens, num_splits, chunk):
    """The schedule kernel (several programs of ``SCHEDULE_BLOCK`` pieces at B 130) against its
    host oracle, begins, pieces and info alike."""
    assert _schedule(lens, num_splits, chunk) == split_plan.persistent_plan(lens, num_splits, chunk)


@pytest.mark.parametrize("lens,num_splits,max_len", CLAMPED)
def test_schedule_clamps_lengths_cpu(lens, num_splits, max_len):
    got = _schedule(lens, num_splits, 16, max_len)
    assert got == split_plan.persistent_plan([min(max(n, 0), max_len) for n in lens], num_splits, 16)


def test_schedule_refuses_what_it_cannot_plan():
    lens = torch.tensor([5, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_seqlens"):
        split_plan.schedule(lens[:0], 2, 64, 16)
    with pytest.raises(ValueError, match="num_splits"):
        split_plan.schedule(lens, 0, 64, 16)
    with pytest.raises(ValueError, match="max_len"):
        split_plan.schedule(lens, 2, 2**40, 16)
