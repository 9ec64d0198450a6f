"""The LSE combine: partial attention results over disjoint key sets merged into one, exactly.

For parts s of one query row:  lse = log sum_s exp(lse_s),  out = sum_s exp(lse_s - lse) out_s.
A part with lse = -inf (no keys) weighs 0; a row with no part gets out = 0, lse = -inf, never
NaN. One kernel serves the split-KV decode (``run_splits``: each sequence's slots of the split
plan, ``split_plan.planned_results``) and ``mla.ops.merge_attention`` (two parts, no plan).
Arithmetic in float32 whatever the partials' dtype.
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from .._jit import jit, sm_major
from .split_plan import planned_results

__all__ = ["combine", "combine_tiles", "run_splits"]


@jit
def _combine_step(m, total, acc, l_rows, p_rows, s0, num_splits, r_ok, d, d_ok, stride_ls, stride_ps,
                  BLOCK_S: tl.constexpr):
    """One round of ``_combine_kernel``: splits s0 .. s0 + BLOCK_S - 1 (those below num_splits)
    of l_rows / p_rows ([R] pointers to split 0's rows) into the running (m, total, acc). The
    tile is [R, S, D], splits in the middle: Triton's layout (fastest D, then R, then S) puts
    warps on rows before splits. As [S, R, D] a 16-bit tile (8 values a thread) puts its splits
    on two warps, summed through shared memory, which costs 1.5-2.5x the time."""
    s = s0 + tl.arange(0, BLOCK_S)
    ok = r_ok[:, None] & (s < num_splits)[None, :]
    ls = tl.load(l_rows[:, None] + s[None, :] * stride_ls, mask=ok, other=float("-inf"))
    o = tl.load(p_rows[:, None, None] + s[None, :, None] * stride_ps + d[None, None, :],
                mask=ok[:, :, None] & d_ok[None, None, :], other=0.0)
    m_new = tl.maximum(m, tl.max(ls, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)                          # 0 while nothing was seen
    w = tl.exp(ls - m_safe[:, None])                    # empty split (-inf): weight 0
    return m_new, total * alpha + tl.sum(w, 1), acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 1)


@jit
def _combine_kernel(
    O_PART, LSE_PART, OUT, LSE, INFO,
    stride_ps, stride_pb, stride_pi, stride_ph,
    stride_ls, stride_lb, stride_li,
    stride_ob, stride_oi, stride_oh,
    stride_Lb, stride_Li,
    n_rows, H, DV, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
    PLANNED: tl.constexpr, ROUND_STAGES: tl.constexpr, SKIP_SINGLE: tl.constexpr = False,
):
    """out = sum_s w_s out_s / sum_s w_s with w_s = exp(lse_s - max lse), for BLOCK_R query
    rows (m = i * H + h) and BLOCK_D output columns of one sequence, BLOCK_S splits at a time.
    PDL: launched as a programmatic dependent of the split kernel, so wait for its writes; the
    kernel after it (the next step's split kernel, itself a dependent that waits for this one to
    finish before it reads anything) may be placed from the start, not only once the wait is
    over. SKIP_SINGLE (PLANNED): a sequence with one slot is left as it is (its program wrote
    the output itself)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(1)
    if SKIP_SINGLE:
        if tl.load(INFO + 2 * b + 1) == 1:
            return
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < n_rows
    qi = r // H
    h = r % H
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < DV
    l_rows = LSE_PART + b.to(tl.int64) * stride_lb + qi * stride_li + h                     # [R]
    p_rows = O_PART + b.to(tl.int64) * stride_pb + qi * stride_pi + h * stride_ph          # [R]

    # one pass, the running maximum rescaling what is summed so far (one round of loads when
    # all the splits fit in BLOCK_S, the usual case)
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    total = tl.full([BLOCK_R], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_R, BLOCK_D], 0.0, dtype=tl.float32)
    s_begin = 0
    if PLANNED:
        # sequence b's partials: slots INFO[b, 0] .. + INFO[b, 1] - 1 (planned_results). The
        # first round's loads go out with INFO's, for the slots of equal lengths (num_splits a
        # sequence here, b's from b num_splits), and are summed again from the slots INFO gives
        # where those differ
        s_first = tl.load(INFO + 2 * b).to(tl.int64)
        count = tl.load(INFO + 2 * b + 1)
        guess = b.to(tl.int64) * num_splits
        m, total, acc = _combine_step(m, total, acc, l_rows + guess * stride_ls, p_rows + guess * stride_ps, 0,
                                      num_splits, r_ok, d, d_ok, stride_ls, stride_ps, BLOCK_S)
        s_begin = BLOCK_S
        if (s_first != guess) | (count != num_splits):     # mixed lengths
            m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
            total = tl.full([BLOCK_R], 0.0, dtype=tl.float32)
            acc = tl.full([BLOCK_R, BLOCK_D], 0.0, dtype=tl.float32)
            s_begin = 0
        l_rows += s_first * stride_ls
        p_rows += s_first * stride_ps
        num_splits = count
    # mixed lengths give a long sequence many slots (16 heads B 32, one 16k among 1k ones: 33 in
    # rounds of 4): the rounds' loads pipelined ROUND_STAGES deep (2: cp.async into shared
    # memory), so that each round does not wait out a whole memory latency after the one before.
    # The branch keeps the pipeline's prologue (its predicated copies and waits) out of the
    # programs that have no round left, as all have at equal lengths
    if s_begin < num_splits:
        for s0 in tl.range(s_begin, num_splits, BLOCK_S, num_stages=ROUND_STAGES):
            m, total, acc = _combine_step(m, total, acc, l_rows, p_rows, s0, num_splits, r_ok, d, d_ok, stride_ls,
                                          stride_ps, BLOCK_S)
    lmax = tl.where(m == float("-inf"), 0.0, m)
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    o_rows = OUT + b.to(tl.int64) * stride_ob + qi * stride_oi + h * stride_oh
    tl.store(o_rows[:, None] + d[None, :], out.to(OUT.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
    if tl.program_id(2) == 0:
        lse = tl.where(total == 0.0, float("-inf"), lmax + tl.log(tl.where(total == 0.0, 1.0, total)))
        tl.store(LSE + b.to(tl.int64) * stride_Lb + qi * stride_Li + h, lse, mask=r_ok)


def combine_tiles(num_splits: int, rows: int, dv: int, elt: int = 4) -> tuple[int, int, int, int]:
    """(BLOCK_S, BLOCK_R, BLOCK_D, warps) of the combine: about 4096 partial values a program,
    all the splits at once up to 256, so that each program's loads go out together (one row
    of 128 columns a program, a few splits at a time, is latency-bound: 2-3x the time).

    elt: the partials' bytes a value. Triton lays a tile out 16 bytes a thread along D, then
    threads on R, then S; warps on D, R, and what is left over on S, whose sums then go through
    shared memory. 16-bit partials (8 values a thread) in a [1, 16, 256] tile would put all four
    warps on S. So up to 16 splits a 16-bit tile covers four warps with R x D (1024 values), and
    beyond, the program has only the warps that R x D covers (float32 tiles keep four warps)."""
    bs = min(triton.next_power_of_2(max(num_splits, 1)), 256)
    bd = min(triton.next_power_of_2(dv), max(16, 4096 // bs))
    br = min(triton.next_power_of_2(max(rows, 1)), max(1, 4096 // (bs * bd)))
    if elt != 2:
        return bs, br, bd, 4
    if bs <= 16:
        bd = min(triton.next_power_of_2(dv), 1024)
        br = min(triton.next_power_of_2(max(rows, 1)), max(br, 1024 // bd))
    t_d = min(32, max(1, bd // 8))              # threads on D, then on R
    t_r = min(32 // t_d, br)
    return bs, br, bd, max(1, min(4, (bd // (8 * t_d)) * (br // t_r)))


def combine(o_part, l_part, out, lse, info=None, *, eq_splits: int | None = None, skip_single: bool = False,
            pdl: bool = True):
    """LSE combine of split partials o_part [S, B, s_q, H, dv] (float32 or 16-bit, summed in
    float32) and l_part [S, B, s_q, H] (float32) into out [B, s_q, H, dv] and lse [B, s_q, H].
    info (the split kernels' plan, ``planned_results``): [B, 2] int32, sequence b's partials
    are slots info[b, 0] .. + info[b, 1] - 1 of S = num_splits * B (B more with
    ``planned_results(direct=True)``); eq_splits: the slots a sequence of equal lengths has
    (default S // B); skip_single: a sequence of one slot is left alone (its program wrote out
    and lse). pdl: on Hopper and later, launch as a programmatic dependent of the split kernel
    (its programs are placed as that kernel drains and wait for its writes); else plain stream
    order."""
    S, B, s_q, H, dv = o_part.shape
    if o_part.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("combine: o_part and out need unit stride in their last dim")
    if skip_single and info is None:
        raise ValueError("combine: skip_single needs the plan's info")
    # with info: the slots a sequence of equal lengths has
    per = S if info is None else eq_splits if eq_splits is not None else S // B
    bs, br, bd, warps = combine_tiles(per, H * s_q, dv, o_part.element_size())
    # the rounds' loop pipelines only for a sequence with more slots than the tile holds: more
    # than 256 equal splits, or mixed lengths (a plan over more than one sequence). Else (batch
    # 1: at most one round, when its plan gave fewer slots than the guess) one stage, without
    # the pipeline's shared memory (a float32 [1, 64, 64] tile: 17664 -> 512 bytes) and prologue
    rounds = per > bs or (info is not None and B > 1)
    pdl = pdl and out.is_cuda and sm_major(out.device.index or 0) >= 9
    _combine_kernel[(triton.cdiv(H * s_q, br), B, triton.cdiv(dv, bd))](
        o_part, l_part, out, lse, l_part if info is None else info,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        l_part.stride(0), l_part.stride(1), l_part.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        H * s_q, H, dv, per,
        BLOCK_S=bs, BLOCK_R=br, BLOCK_D=bd, PDL=pdl, PLANNED=info is not None, ROUND_STAGES=2 if rounds else 1,
        SKIP_SINGLE=skip_single, num_warps=warps,
        **({"launch_pdl": True} if pdl else {}),
    )


def run_splits(q: torch.Tensor, head_dim_v: int, max_len: int,
               num_splits: int | tuple[int, int] | Callable[[], int | tuple[int, int]],
               launch: Callable, *, part_dtype: torch.dtype = torch.float32, pdl: bool = True, flat: bool = False,
               direct: bool = False):
    """The frame of every split-KV decode launch: out [B, s_q, H, head_dim_v] in q's dtype and
    lse [B, s_q, H] float32; for a non-empty batch the plan's result slots
    (``planned_results``, partials in part_dtype; flat: the flattened plan's), ``launch(o_part,
    l_part, info, num_splits, eq_splits, direct)`` (the split kernel's launch), and, with more
    than one split, ``combine``. num_splits: the programs a sequence, or (that, the programs a
    sequence at equal lengths: ``split_plan``), or a callable giving either, asked only for a
    non-empty batch (the default counts read the device). max_len: the block table's capacity.
    direct: a sequence's only program writes the output itself (``planned_results``), where
    there is more than one split and part_dtype is q's dtype; out and lse are then views of
    the result slots. Returns (out, lse)."""
    B, s_q, H, _ = q.shape
    out = torch.empty(B, s_q, H, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, s_q, H, dtype=torch.float32, device=q.device)
    if B == 0 or s_q == 0 or H == 0:
        return out, lse
    S = num_splits() if callable(num_splits) else num_splits
    S, eq = S if isinstance(S, tuple) else (S, S)
    if not 1 <= eq <= S:
        raise ValueError(f"num_splits: expected 1 <= splits at equal lengths <= splits, got {eq} of {S}")
    direct = direct and S > 1 and not flat and part_dtype == q.dtype
    o_part, l_part, info = planned_results(out, lse, S, max_len, part_dtype, flat, direct)
    if direct:
        out, lse = o_part[S * B:, 0], l_part[S * B:, 0]
    launch(o_part, l_part, info, S, eq, direct)
    if S > 1:
        combine(o_part, l_part, out, lse, info, eq_splits=eq, skip_single=direct, pdl=pdl)
    return out, lse
