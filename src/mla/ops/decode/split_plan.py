"""The split plan of the decode kernels: which keys each program reads and where it writes.

A launch has P = num_splits * B programs (num_splits from shapes only, so a decode step can be
captured in a CUDA graph), and every program computes the plan from the B lengths on the
device (no host sync). The plan makes the busiest program's work the least it can be: T, the
fewest chunks a program, is the least with sum_b max(1, ceil(c_b / T)) <= P for the sequences'
chunk counts c_b (a binary search between ceil(total / P) and the smaller of the longest c_b
and ceil(total / (P - B)), as FlashInfer's host plan searches its chunk size; with one split,
P = B, T is the longest). Sequence b gets max(1, ceil(c_b / T)) programs, the programs left
over go one each to the sequences in turn, and program p takes the k-th of its sequence's
nearly equal runs of whole chunks. So a long sequence among short ones is spread over many
SMs, where one program a sequence plus a share of the rest by chunks would leave it about
twice the ideal work. Equal lengths give eq_splits (at most num_splits) programs a sequence, in
order: the grid of a fixed split count, the programs past eq_splits * B idle. So a launch can
take more programs than equal lengths want and still share out a mixed batch; what the idle
programs cost equal lengths: ``mixed_splits``.

Program p writes its results into slot p (``planned_results``); ``combine`` merges each
sequence's slots. The rule is written twice, ``planned_split`` in Triton (the portable kernel)
and ``planned_split_gluon`` in Gluon (the Hopper kernels), because neither language can call
the other's functions; ``plan`` is the same rule on the host, the oracle that tests hold both
to.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .._jit import jit

__all__ = ["planned_split", "planned_split_gluon", "planned_results", "block_b", "plan", "mixed_splits",
           "MIXED_GRID_KEYS", "flat_programs", "flat_plan",
           "persistent_plan", "schedule"]


@jit
def planned_split(SEQLENS, INFO, B, p, num_splits, eq_splits, max_len, BN: tl.constexpr, BLOCK_B: tl.constexpr,
                  FLAT: tl.constexpr = False):
    """Program p's share of the batch's keys in whole BN-key chunks: the plan (module docstring)
    in Triton, for the portable kernel. INFO[b] = (first program, count), for ``combine``.
    Lengths are read clamped to 0 .. max_len (the table's capacity). Returns (b, seqlen, start,
    end); an idle program (equal lengths, p >= eq_splits * B) b 0 and no keys. FLAT: program p's
    piece of the flattened plan instead (the launch has ``flat_programs`` programs; past the
    last piece none: b 0, no keys)."""
    i = tl.arange(0, BLOCK_B)
    ok = i < B
    lens = tl.minimum(tl.maximum(tl.load(SEQLENS + i, mask=ok, other=0), 0), max_len)
    if tl.min(tl.where(ok, lens, 2147483647), 0) == tl.max(lens, 0):
        # equal lengths (the plan below gives the same at eq_splits = num_splits): eq_splits
        # programs a sequence, in order, the rest idle
        live = p < eq_splits * B
        b = tl.where(live, p // eq_splits, 0)
        k = p % eq_splits
        seqlen = tl.where(live, tl.max(lens, 0), 0)
        lead = (k == 0) & live
        c = (seqlen + BN - 1) // BN
        start = tl.where(live, k * c // eq_splits * BN, 0)
        end = tl.minimum((k + 1) * c // eq_splits * BN, seqlen)
        tl.store(INFO + 2 * b, p, mask=lead)
        tl.store(INFO + 2 * b + 1, eq_splits, mask=lead)
    elif FLAT:
        b, seqlen, start, end = _flat_piece(INFO, B, p, num_splits, i, ok, lens, BN)
    else:
        # the least T (lo) with sum_b max(1, ceil(c_b / T)) <= P, a round of sums a step
        chunks = (lens + BN - 1) // BN
        total = tl.sum(chunks, 0)
        P = num_splits * B
        lo = tl.maximum((total + P - 1) // P, 1)
        # T = the longest always fits, and with P > B so does ceil(total / (P - B)) (the sum is
        # at most B + total / T); with P = B that is the answer (no search)
        hi = tl.maximum(tl.max(chunks, 0), lo)
        if num_splits == 1:
            lo = hi
        else:
            hi = tl.minimum(hi, tl.maximum((total + P - B - 1) // (P - B), lo))
        while lo < hi:
            mid = (lo + hi) // 2
            fits = tl.sum(tl.where(ok, tl.maximum((chunks + mid - 1) // mid, 1), 0), 0) <= P
            hi = tl.where(fits, mid, hi)
            lo = tl.where(fits, lo, mid + 1)
        n = tl.where(ok, tl.maximum((chunks + lo - 1) // lo, 1), 0)
        left = P - tl.sum(n, 0)                        # >= 0: one each in turn
        count = (n + tl.where(ok, left // B + (i < left % B).to(tl.int32), 0)).to(tl.int64)
        last = tl.cumsum(count, 0)
        first = last - count
        mine = ok & (first <= p) & (p < last)
        b = tl.sum(tl.where(mine, i, 0), 0)
        seqlen = tl.sum(tl.where(mine, lens, 0), 0)
        f = tl.sum(tl.where(mine, first, 0), 0)
        m = tl.sum(tl.where(mine, count, 0), 0)
        cb = tl.sum(tl.where(mine, chunks, 0), 0).to(tl.int64)
        kb = p - f
        start = (kb * cb // m).to(tl.int32) * BN
        end = tl.minimum(((kb + 1) * cb // m).to(tl.int32) * BN, seqlen)
        tl.store(INFO + 2 * b, f.to(tl.int32), mask=kb == 0)
        tl.store(INFO + 2 * b + 1, m.to(tl.int32), mask=kb == 0)
    return b, seqlen, start, end


@gluon.jit
def _add(a, b):
    return a + b


@gluon.constexpr_function
def _plan_layout(BLOCK_B):
    """The plan's [BLOCK_B] vectors whole in every warp (the 4 warps hold copies), so that its
    sums and prefix sum stay within a warp: shuffles, no shared memory or barrier."""
    return gl.BlockedLayout([max(1, BLOCK_B // 32)], [32], [4], [0])


@gluon.jit
def planned_split_gluon(SEQLENS, INFO, B, p, num_splits, eq_splits, max_len, BN: gl.constexpr,
                        BLOCK_B: gl.constexpr, DIRECT: gl.constexpr = False):
    """Program p's share of the batch's keys: the plan (module docstring) in Gluon, for the
    Hopper kernels, in 64-key chunks; the program's keys [start, end) are n_tiles tiles of BN
    keys. INFO[b] = (first, count), b's slots, for ``combine`` (written by b's first program).

    The plan lies on the path to the first tile's copy, so its shape is chosen for latency:
    equal lengths (one round of reductions to find out) take the fixed split's arithmetic;
    otherwise each lane works out its own sequence's slots (a round of sums for each step of
    the search, then a scan), and one round of sums picks program p's sequence and its
    numbers (a reduction per quantity, or int64 divisions in every lane, cost 1-2 us a
    launch). Counts in int32 (``planned_results`` checks the range), runs in int64. Lengths are
    read clamped to 0 .. max_len (the table's capacity), as in ``planned_split``. Returns
    (b, seqlen, start, end, n_tiles, slot): the result slot the program writes, p; -1 for an
    idle program (it writes nothing); DIRECT (``planned_results(direct=True)``): P + b for a
    sequence's only program (the slot that is the output itself)."""
    i = gl.arange(0, BLOCK_B, layout=_plan_layout(BLOCK_B))
    ok = i < B
    lens = gl.minimum(gl.maximum(gl.load(SEQLENS + i, mask=ok, other=0), 0), max_len)
    if gl.min(gl.where(ok, lens, 2147483647), axis=0) == gl.max(lens, axis=0):
        # equal lengths (the plan below gives the same at eq_splits = num_splits): eq_splits
        # programs a sequence, in order, the rest idle (b 0, no keys)
        live = p < eq_splits * B
        b = gl.where(live, p // eq_splits, 0)
        k = p % eq_splits
        seqlen = gl.where(live, gl.max(lens, axis=0), 0)
        c = (seqlen + 63) // 64
        start = gl.where(live, k * c // eq_splits * 64, 0)
        end = gl.minimum((k + 1) * c // eq_splits * 64, seqlen)
        gl.store(INFO + 2 * b, p, mask=(k == 0) & live)
        gl.store(INFO + 2 * b + 1, eq_splits, mask=(k == 0) & live)
        slot = gl.where(live, p, -1)
        if DIRECT:
            slot = gl.where(live & (eq_splits == 1), num_splits * B + b, slot)
    else:
        # the least T (lo) with sum_b max(1, ceil(c_b / T)) <= P, a round of sums a step
        chunks = (lens + 63) // 64
        total = gl.sum(chunks, axis=0)
        P = num_splits * B
        lo = gl.maximum((total + P - 1) // P, 1)
        # T = the longest always fits, and with P > B so does ceil(total / (P - B)) (the sum is
        # at most B + total / T); with P = B that is the answer (no search)
        hi = gl.maximum(gl.max(chunks, axis=0), lo)
        if num_splits == 1:
            lo = hi
        else:
            hi = gl.minimum(hi, gl.maximum((total + P - B - 1) // (P - B), lo))
        while lo < hi:
            mid = (lo + hi) // 2
            fits = gl.sum(gl.where(ok, gl.maximum((chunks + mid - 1) // mid, 1), 0), axis=0) <= P
            hi = gl.where(fits, mid, hi)
            lo = gl.where(fits, lo, mid + 1)
        n = gl.where(ok, gl.maximum((chunks + lo - 1) // lo, 1), 0)
        left = P - gl.sum(n, axis=0)                       # >= 0
        count = (n + gl.where(ok, left // B + (i < left % B).to(gl.int32), 0)).to(gl.int64)
        last = gl.associative_scan(count, 0, _add)
        first = last - count
        mine = ok & (first <= p) & (p < last)
        # program p's sequence and its (first, count, length, chunks), in one round of sums
        b = gl.sum(gl.where(mine, i, 0), axis=0)
        seqlen = gl.sum(gl.where(mine, lens, 0), axis=0)
        f = gl.sum(gl.where(mine, first, 0), axis=0)
        m = gl.sum(gl.where(mine, count, 0), axis=0)
        cb = gl.sum(gl.where(mine, chunks, 0), axis=0).to(gl.int64)
        kb = p - f
        start = (kb * cb // m).to(gl.int32) * 64
        end = gl.minimum(((kb + 1) * cb // m).to(gl.int32) * 64, seqlen)
        gl.store(INFO + 2 * b, f.to(gl.int32), mask=kb == 0)
        gl.store(INFO + 2 * b + 1, m.to(gl.int32), mask=kb == 0)
        slot = p
        if DIRECT:
            slot = gl.where(m == 1, num_splits * B + b, p).to(gl.int32)
    # through shared memory, each thread reading all five (no cross-lane step after the load):
    # straight from the reductions, start and end made the warpgroups' branches divergent in the
    # SASS (BSSY) and spilled warpgroup 1's loop (sm_90a, 272 bytes of stack against 48)
    V: gl.constexpr = gl.BlockedLayout([8], [32], [4], [0])
    t = gl.arange(0, 8, layout=V)
    buf = gl.allocate_shared_memory(gl.int32, [8], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    buf.store(gl.where(t == 0, b, gl.where(t == 1, seqlen, gl.where(t == 2, start, gl.where(t == 3, end, slot)))))
    gl.thread_barrier()
    v = buf.load(V)
    b = gl.sum(gl.where(t == 0, v, 0), axis=0)
    seqlen = gl.sum(gl.where(t == 1, v, 0), axis=0)
    start = gl.sum(gl.where(t == 2, v, 0), axis=0)
    end = gl.sum(gl.where(t == 3, v, 0), axis=0)
    slot = gl.sum(gl.where(t == 4, v, 0), axis=0)
    return b, seqlen, start, end, gl.maximum(end - start + BN - 1, 0) // BN, slot


def planned_results(out: torch.Tensor, lse: torch.Tensor, num_splits: int, max_len: int,
                    part_dtype: torch.dtype = torch.float32, flat: bool = False, direct: bool = False):
    """Where the split kernels write (the plan:
    P = num_splits * B programs, program p into slot p), as [P, B, ...] views that a kernel
    addresses at (p, b): out and lse themselves when there is one split (slot strides 0:
    program p is sequence p), else partials of P slots (sequence strides 0), the outputs in
    part_dtype, the lse in float32. info [B, 2] int32: each sequence's (first slot, slot count),
    written by the kernel for ``combine``. max_len: the block table's capacity (the plan counts
    chunks and splits equal lengths in int32).

    part_dtype: float32, or the output's own 16-bit dtype where a kernel stores its partials
    well in it (the FP8 kernel's 16-byte stores, the seesaw's TMA boxes), as FlashInfer's MLA
    keeps its partials: half the bytes to write and read back (1 KB a query row and split),
    for one more rounding of each split's normalized output (a relative 2^-9 in bf16).
    flat: the flattened plan's slots (``flat_programs``: P + B - 1) with more than one split.
    direct (more than one split, part_dtype out's dtype): B slots more, slot P + b the result of
    a sequence that has one program, written there by it and left alone by ``combine``
    (``o_part[P:, 0]`` and ``l_part[P:, 0]`` are then the output: ``run_splits``).
    Returns (o_part, l_part, info)."""
    if part_dtype not in (torch.float32, out.dtype):
        raise ValueError(f"part_dtype: expected float32 or the output's dtype {out.dtype}, got {part_dtype}")
    B = out.shape[0]
    P = num_splits * B
    if max(num_splits, B) * -(-max_len // 16) >= 2 ** 31:
        raise ValueError(f"block_table: {max_len} keys a sequence in {num_splits} splits of a batch of {B} is past "
                         f"the split plan's int32 arithmetic (max(splits, batch) x keys / 16 < 2^31)")
    info = torch.empty(B, 2, dtype=torch.int32, device=out.device)
    if num_splits == 1:
        return out.unsqueeze(0).expand(P, *out.shape), lse.unsqueeze(0).expand(P, *lse.shape), info
    if direct and (flat or part_dtype != out.dtype):
        raise ValueError("direct: takes the plan's slots (not flat) in the output's dtype")
    slots = flat_programs(num_splits, B) if flat else P + B if direct else P
    o = torch.empty(slots, *out.shape[1:], dtype=part_dtype, device=out.device)
    l_ = torch.empty(slots, *lse.shape[1:], dtype=torch.float32, device=out.device)
    return o.unsqueeze(1).expand(slots, *out.shape), l_.unsqueeze(1).expand(slots, *lse.shape), info


def block_b(B: int) -> int:
    """The plan's vector width (``planned_split``) for a batch of B: B rounded up to a power of
    two, at least 16 (a compile-time constant: a new power of two compiles the kernel again)."""
    return max(16, triton.next_power_of_2(B))


# the table capacity from which a batch's launch takes at least 2 programs a sequence
# (``mixed_splits``)
MIXED_GRID_KEYS = 4096


def mixed_splits(B: int, eq_splits: int, max_len: int) -> int:
    """The programs a sequence of a launch (its grid: this times B) whose equal lengths want
    eq_splits: at least 2 from batch 2 where the table holds ``MIXED_GRID_KEYS`` keys or more,
    so that a mixed batch can share its long sequences out (the plan idles the programs equal
    lengths leave over, and a sequence's only program writes the output itself). On the H100
    at B 128, 2 programs a sequence (1 used at equal lengths) took, against 1, at 128 / 16
    heads: 4k keys 1.02 / 1.02x at equal lengths, 0.93 / 0.99x on uniform lengths, 0.77 /
    0.46x on one long among short; 16k 1.05 / 1.01x, 0.79 / 0.92x, 0.36 / 0.27x. 4, 6 and 8
    were slower than 2 or within 2% of it."""
    return eq_splits if B < 2 or max_len < MIXED_GRID_KEYS else max(eq_splits, 2)


def plan(lens: list[int], num_splits: int, chunk: int, eq_splits: int | None = None) -> list[tuple[int, int, int]]:
    """The plan on the host: for each program p of P = num_splits * len(lens), its (b, start,
    end) in keys, with chunks of ``chunk`` keys (the kernels' BN, 64 for the Hopper kernels);
    eq_splits (default num_splits): the programs a sequence at equal lengths, the rest idle
    ((0, 0, 0))."""
    B, P = len(lens), num_splits * len(lens)
    eq = num_splits if eq_splits is None else eq_splits
    if not 1 <= eq <= num_splits:
        raise ValueError(f"eq_splits: expected 1 .. num_splits ({num_splits}), got {eq_splits}")
    if B == 0:
        return []
    if min(lens) == max(lens):
        c = -(-lens[0] // chunk)
        return [(p // eq, p % eq * c // eq * chunk, min((p % eq + 1) * c // eq * chunk, lens[0])) if p < eq * B
                else (0, 0, 0) for p in range(P)]
    chunks = [-(-n // chunk) for n in lens]
    total = sum(chunks)
    lo = max(-(-total // P), 1)
    hi = max(max(chunks), lo)
    if num_splits == 1:
        lo = hi
    else:
        hi = min(hi, max(-(-total // (P - B)), lo))
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(max(-(-c // mid), 1) for c in chunks) <= P:
            hi = mid
        else:
            lo = mid + 1
    n = [max(-(-c // lo), 1) for c in chunks]
    left = P - sum(n)
    count = [n[b] + left // B + (b < left % B) for b in range(B)]
    out = []
    for b in range(B):
        for k in range(count[b]):
            out.append((b, k * chunks[b] // count[b] * chunk, min((k + 1) * chunks[b] // count[b] * chunk, lens[b])))
    return out


# ---------------------------------------------------------------- the flattened plan
#
# The plan above gives every program one run of one sequence, so its busiest program holds T
# chunks, the least that fits: at mixed lengths more than total / P (B 32, one 4k sequence among
# 31 of 256 keys, 66 programs: T = 4 chunks, total / P = 2.85). The flattened plan lays the
# batch's chunks end to end in sequence order and cuts them at every multiple of W = ceil(total
# / P) and at every sequence's start: the pieces, at most P + B - 1, none longer than W. A
# launch has P + B - 1 programs, program k takes piece k (those past the last piece: nothing)
# and writes into slot k, so a sequence's pieces are consecutive slots, merged by ``combine``
# as runs are. The GPU's block scheduler then shares the pieces out over the SMs as they free
# up. Piece numbers: sequence b (first chunk s_b, c_b chunks) starts at piece ceil(s_b / W) +
# (the non-empty sequences before it that start off a multiple of W) and has (s_b + c_b - 1) //
# W - s_b // W + 1 pieces. Equal lengths take the fixed split, as in the plan above (programs
# P .. P + B - 2 idle).


def flat_programs(num_splits: int, B: int) -> int:
    """The programs (and result slots) of a launch on the flattened plan: P + B - 1."""
    return num_splits * B + B - 1


def flat_plan(lens: list[int], num_splits: int, chunk: int) -> tuple[list[tuple[int, int, int]], list[list[int]]]:
    """The flattened plan on the host (the oracle of ``planned_split(FLAT)``): for each program k of
    ``flat_programs``, its piece (b, start, end) in keys ((0, 0, 0): none), and info [B] =
    [first slot, count] (an empty sequence: count 0 at the slot where it would start)."""
    B = len(lens)
    P, n = num_splits * B, flat_programs(num_splits, B)
    if B and min(lens) == max(lens):
        c = -(-lens[0] // chunk)
        runs = [(p // num_splits, p % num_splits * c // num_splits * chunk,
                 min((p % num_splits + 1) * c // num_splits * chunk, lens[0])) for p in range(P)]
        return runs + [(0, 0, 0)] * (n - P), [[b * num_splits, num_splits] for b in range(B)]
    chunks = [-(-x // chunk) for x in lens]
    starts = [sum(chunks[:b]) for b in range(B)]
    W = max(1, -(-sum(chunks) // P))
    pieces, info = [], []
    for b in range(B):
        info.append([min(len(pieces), n - 1), 0])     # clamped: an empty sequence past the last
        pos, end = starts[b], starts[b] + chunks[b]
        while pos < end:
            e = min((pos // W + 1) * W, end)
            pieces.append((b, (pos - starts[b]) * chunk, min((e - starts[b]) * chunk, lens[b])))
            info[b][1] += 1
            pos = e
    return pieces + [(0, 0, 0)] * (n - len(pieces)), info


@jit
def _flat_pieces(lens, ok, P, BN: tl.constexpr):
    """The flattened plan's sequences side by side (lanes ok): their chunks, first chunks in the
    batch's order, the piece width W, whether each starts off a multiple of W (a cut of its own),
    and each one's first piece and piece count."""
    chunks = tl.where(ok, (lens + BN - 1) // BN, 0)
    starts = tl.cumsum(chunks, 0) - chunks
    W = tl.maximum((tl.sum(chunks, 0) + P - 1) // P, 1)
    cuts = (ok & (chunks > 0) & (starts % W != 0)).to(tl.int32)
    first = (starts + W - 1) // W + tl.cumsum(cuts, 0) - cuts
    count = tl.where(chunks > 0, (starts + chunks - 1) // W - starts // W + 1, 0)
    return chunks, starts, W, cuts, first, count


@jit
def _flat_piece(INFO, B, k, num_splits, i, ok, lens, BN: tl.constexpr):
    """``planned_split(FLAT)``'s mixed lengths: program k's piece (b, seqlen, start, end),
    (0, 0, 0, 0) past the last one, and INFO[b] = (first slot, count) for the sequences whose
    first slot is k (an empty sequence: where it would start, the last program's past the end)."""
    P = num_splits * B
    chunks, starts, W, cuts, first, count = _flat_pieces(lens, ok, P, BN)
    mine = (chunks > 0) & (first <= k) & (k < first + count)
    b = tl.sum(tl.where(mine, i, 0), 0)
    seqlen = tl.sum(tl.where(mine, lens, 0), 0)
    s0 = tl.sum(tl.where(mine, starts, 0), 0)
    j = k - tl.sum(tl.where(mine, first, 0), 0)
    lo = tl.where(j == 0, s0, (s0 // W + j) * W)
    hi = tl.minimum((s0 // W + j + 1) * W, s0 + tl.sum(tl.where(mine, chunks, 0), 0))
    start = tl.where(seqlen > 0, (lo - s0) * BN, 0)     # a piece has keys; past the last: none
    end = tl.minimum((hi - s0) * BN, seqlen)
    n = P + B - 1
    at = ok & (tl.minimum(first, n - 1) == k)
    tl.store(INFO + 2 * i, tl.minimum(first, n - 1), mask=at)
    tl.store(INFO + 2 * i + 1, count, mask=at)
    return b, seqlen, start, end


# ---------------------------------------------------------------- the persistent schedule
#
# The flattened plan's pieces, but P = num_splits * B programs instead of P + B - 1: program p
# takes, in order, the pieces whose first chunk lies in its window [p W, (p + 1) W) of the
# batch's chunks laid end to end (W = ceil(total / P), as above), so that every program holds
# at most W chunks however the lengths mix, and the launch is one wave wherever the fixed split's
# is. Piece k still writes slot k, so ``combine`` merges a sequence's consecutive slots as it
# does the flattened plan's. Program p's first piece is p (the multiples of W below p W, while
# they lie inside the batch) plus the non-empty sequences that start off a multiple of W before
# p W. Equal lengths take the fixed split, one piece a program. The schedule is computed once,
# on the device, by ``schedule`` (a small kernel, no host read, so a step can be captured in a
# CUDA graph), and every program of the attention kernel reads its piece range and each piece's
# (b, start, end) from it instead of running the plan itself.


def persistent_plan(lens: list[int], num_splits: int, chunk: int) -> tuple[list[int], list[tuple[int, int, int]],
                                                                            list[list[int]]]:
    """The persistent schedule on the host (the oracle of ``schedule``): (begins [P + 1], pieces,
    info) with program p's pieces begins[p] .. begins[p + 1] - 1, pieces and info as
    ``flat_plan``'s (pieces past begins[P]: (0, 0, 0), never run)."""
    pieces, info = flat_plan(lens, num_splits, chunk)
    B = len(lens)
    P = num_splits * B
    if B and min(lens) == max(lens):
        return list(range(P + 1)), pieces, info
    chunks = [-(-x // chunk) for x in lens]
    W = max(1, -(-sum(chunks) // P))
    firsts, pos = [], 0             # each real piece's first chunk, in the batch's order
    for c in chunks:
        firsts += [pos] + list(range((pos // W + 1) * W, pos + c, W)) if c else []
        pos += c
    return [sum(f < p * W for f in firsts) for p in range(P + 1)], pieces, info


@jit
def _schedule_kernel(SEQLENS, SCHED, INFO, B, num_splits, max_len, BN: tl.constexpr, BLOCK_B: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """``persistent_plan`` on the device: SCHED = [begins (P + 1) | pieces (P + B - 1) x (b,
    start, end)], INFO [B, 2]; program j writes pieces and begins j BLOCK_K .. + BLOCK_K - 1
    (the first also INFO). Lengths read clamped to 0 .. max_len, as ``planned_split`` does."""
    i = tl.arange(0, BLOCK_B)
    ok = i < B
    lens = tl.minimum(tl.maximum(tl.load(SEQLENS + i, mask=ok, other=0), 0), max_len)
    equal = tl.min(tl.where(ok, lens, 2147483647), 0) == tl.max(lens, 0)
    P = num_splits * B
    n = P + B - 1
    chunks, starts, W, cuts, first, count = _flat_pieces(lens, ok, P, BN)
    total = tl.sum(chunks, 0)
    first = tl.where(equal, i * num_splits, first)
    count = tl.where(equal & ok, num_splits, count)

    k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    mine = (count > 0)[None, :] & (first[None, :] <= k[:, None]) & (k[:, None] < (first + count)[None, :])
    b = tl.sum(tl.where(mine, i[None, :], 0), 1)
    seqlen = tl.sum(tl.where(mine, lens[None, :], 0), 1)
    s0 = tl.sum(tl.where(mine, starts[None, :], 0), 1)
    cb = tl.sum(tl.where(mine, chunks[None, :], 0), 1)
    j = k - tl.sum(tl.where(mine, first[None, :], 0), 1)
    if equal:       # the fixed split: run j of num_splits
        start = (j * cb // num_splits) * BN
        end = tl.minimum((j + 1) * cb // num_splits * BN, seqlen)
    else:
        lo = tl.where(j == 0, s0, (s0 // W + j) * W)
        hi = tl.minimum((s0 // W + j + 1) * W, s0 + cb)
        start = (lo - s0) * BN
        end = tl.minimum((hi - s0) * BN, seqlen)
    real = tl.sum(mine.to(tl.int32), 1) > 0
    piece = SCHED + (P + 1) + 3 * k
    k_ok = k < n
    tl.store(piece, tl.where(real, b, 0), mask=k_ok)
    tl.store(piece + 1, tl.where(real, start, 0), mask=k_ok)
    tl.store(piece + 2, tl.where(real, end, 0), mask=k_ok)

    # begins: program p = k's first piece (the multiples of W inside the batch below p W, and
    # the off-multiple sequence starts below it)
    offs = tl.sum(tl.where((cuts[None, :] != 0) & (starts[None, :] < (k.to(tl.int64) * W)[:, None]), 1, 0), 1)
    begin = tl.where(equal, k, tl.minimum(k, (total + W - 1) // W) + offs)
    tl.store(SCHED + k, begin, mask=k <= P)
    if tl.program_id(0) == 0:
        tl.store(INFO + 2 * i, tl.minimum(first, n - 1), mask=ok)
        tl.store(INFO + 2 * i + 1, count, mask=ok)


SCHEDULE_BLOCK = 64     # pieces a program of ``schedule``


def schedule(cache_seqlens: torch.Tensor, num_splits: int, max_len: int, chunk: int,
             info: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The persistent schedule of a batch (``persistent_plan``, computed on cache_seqlens' device,
    no host read): (sched, info), sched int32 [P + 1 + 3 (P + B - 1)] (program p's pieces
    sched[p] .. sched[p + 1] - 1; piece k's (b, start, end) at P + 1 + 3 k), info [B, 2] int32
    for ``combine`` (written into info where given). chunk: the attention kernel's key tile."""
    B = cache_seqlens.shape[0]
    if B == 0:
        raise ValueError("cache_seqlens: the schedule of an empty batch has no programs")
    if num_splits < 1:
        raise ValueError(f"num_splits: expected at least 1, got {num_splits}")
    P = num_splits * B
    if max(num_splits, B) * -(-max_len // chunk) >= 2 ** 31:
        raise ValueError(f"max_len: {max_len} keys in {num_splits} splits of a batch of {B} is past the "
                         f"schedule's int32 arithmetic")
    dev = cache_seqlens.device
    sched = torch.empty(P + 1 + 3 * (P + B - 1), dtype=torch.int32, device=dev)
    if info is None:
        info = torch.empty(B, 2, dtype=torch.int32, device=dev)
    _schedule_kernel[(triton.cdiv(max(P + 1, P + B - 1), SCHEDULE_BLOCK),)](
        cache_seqlens.contiguous(), sched, info, B, num_splits, max_len, BN=chunk, BLOCK_B=block_b(B),
        BLOCK_K=SCHEDULE_BLOCK, num_warps=4)
    return sched, info
