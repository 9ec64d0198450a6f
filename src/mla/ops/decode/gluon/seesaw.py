"""The seesaw: the Hopper (sm90) absorbed MLA decode for many query rows, in Gluon.

Same contract as ``mla.ops.reference.mla_decode`` for the shapes ``supports`` accepts:
CUDA tensors on a compute-capability-9.x device, bf16/fp16 queries over a cache of rows in
their dtype, of FP8 rows (float8_e4m3fn, per-tensor kv_scale) or of FP8 tile rows (uint8,
``mla.quant``); d = 576 with head_dim_v = 512, block_size a multiple of 64 and cache rows laid
out as one 2-D matrix (unit column stride): ``common.supports``. Anything else runs the portable
kernel. ``narrow`` and ``fp8`` are the other Hopper kernels (few query rows; FP8 rows with few
query rows); ``mla.ops.decode.choose_kernel`` chooses. ``sparse`` runs the two warpgroups below
over gathered rows (their ``sp`` argument).

Grid (ceil(H * s_q / 64), splits * B): 64 query rows m = i * H + h (zero-padded) against one
share of one sequence's keys. The split count comes from shapes only (no host sync, so a decode
step can be captured in a CUDA graph); each program finds its sequence and keys from the lengths
(``split_plan``: a long sequence among short ones gets most of the programs); partial
(out, lse) per program -> ``combine``.

Warp-specialized: the two warpgroups take alternate key tiles (a "seesaw", the schedule
FlashMLA describes; our own code), so each reads Q from shared memory once per tile it owns
and one warpgroup's softmax overlaps the other's MMAs (two warpgroups splitting each tile's
columns would read all of Q for half the work each and serialise GEMMs, softmax and loads).

    partitions: WG0 (default, 4 warps), WG1 (4 warps), a loader (1 warp; FP8 rows: the
                producer, 4 warps, below)
    shared:     Q latent part [64, 512] (its RoPE part lives in registers), K ring of two
                64-key tiles (or four of 32 keys; even tiles for WG0, odd for WG1), P0, P1,
                row statistics (m, rescale, l) for the exchange
    the loader: TMA, 9 boxes of 64 columns per tile, one mbarrier per box, so a QK^T can
                start on the first 64 columns while the rest arrive; a buffer is refilled
                half by half: columns 0..255 once WG0's P V is done with them, 256..511 once
                WG1's is (bf16/fp16 rows; FP8 staging tiles: once widened)
    query rows: loaded by the two warpgroups, half each, after the partitions start, so the
                loader's first TMA does not wait for them
    per pair of tiles (2i in K0, 2i+1 in K1); WG0 owns output columns 0..255, WG1 256..511:
      WG0: S0 = Q K0^T; m0 = max(m, rowmax S0); P0 -> shared; O_L = O_L a0 + P0 V0_L
      WG1: S1 = Q K1^T (alongside WG0's); P1' = exp(S1 - max(m, rowmax S1)) meanwhile;
           waits P0; m1 = max(m0, rowmax S1); P1 = P1' rescaled to m1 -> shared
           O_R = (O_R a0 + P0 V0_R) a1 + P1 V1_R
      WG0: waits P1; O_L = O_L a1 + P1 V1_L; m = m1
    so the two QK^T GEMMs and one warpgroup's softmax overlap the other's MMAs, and every
    GEMM has N >= 64 (each warpgroup reads Q once per 64 keys, not twice).
    l: each warpgroup sums its own P with the same rescales; the two halves add at the end.
    output: one split with whole 64-row tiles per sequence: staged in Q's shared memory and
    written by TMA; else (partials for the combine) stored from the MMA's registers.

Masking: tail rows zeroed in shared memory by the tile's owner before
its QK^T (NaN there would survive 0 * NaN in P V), causal limits per query row, applied only
on tiles some row of the tile does not see in full.

FP8 rows: a fourth warpgroup, the producer (``_producer``), copies 32-key FP8 tiles by TMA into
two staging stages and widens each (``widen_by_parts``: e4m3 -> fp16 exactly, kv_scale folded
into the softmax scale and the output; tile rows: times each row's scale per 128 values, the
product in fp16) into a ring of three K slots, zeroing tail rows; the two warpgroups
only wait for a slot, and the rest is the same. Widening in the warpgroups themselves, before
each QK^T, took 1.25-1.39x this time on the H200 at 128 heads (B 4-128, 4k-16k): it spilled,
and it stood between every tile's release and the next QK^T.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.language.nvidia.hopper.tma import tensor_descriptor

from ..._jit import kv_fmt
from ..combine import run_splits
from ..split_plan import block_b
from .common import (BLOCK_M, D_QK, D_V, LN2, LOG2E, MAXNREG, TILE_LD_L, IntArg, aggregate, constant,
                     copy_fp8_tile, descriptors, key_mask, launch_dependents, launch_splits, loader, pdl_launch,
                     plan_and_block, sink_start, supports, wait_gathered, wait_prerequisites, widen_by_parts,
                     zero_tail)

__all__ = ["launch", "default_block_n", "SeesawSmem", "SeesawWork", "seesaw_buffers"]

# a warpgroup's layouts: S [64, BN] and its half of O [64, 256] as wgmma accumulators
_ACC_L = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])

# an idle program's first output row: past the last row of any output TMA stores to (checked in
# ``launch``), so that its boxes lie wholly outside the tensor
IDLE_ROW = gl.constexpr(1 << 30)

# Registers (``common.MAXNREG``): warp_specialize resizes the worker partitions to these counts,
# WG1's first, then the loader's or the producer's, and WG0, the default partition, takes what
# they free. The TMA loader only issues copies and waits: 24, and WG1 holds
# S, P and its half of O in 240. The FP8 producer widens e4m3 tiles in registers: 40 keep it out of
# spills (32 took 1.04-1.26x the time on the H200), and WG1 gets 232.
REGS_WITH_LOADER = gl.constexpr([240, 24])      # WG1, the loader
REGS_WITH_PRODUCER = gl.constexpr([232, 40])    # WG1, the producer (FP8 rows)


@aggregate
class SeesawSmem:
    """What the two warpgroups share in shared memory (``seesaw_buffers`` sets it up)."""
    q_smem: gl.shared_memory_descriptor      # the query rows' latent part [64, 512]
    k_smem: gl.shared_memory_descriptor      # the K ring [NBUF, BN, 512]: the latent part of NBUF key tiles
    kpe_smem: gl.shared_memory_descriptor    # their RoPE part [NBUF, BN, 64]
    p_smem: gl.shared_memory_descriptor      # P0 and P1 [2, 64, BN]
    stats: gl.tuple                          # six [64] float32 rows: m0, a0, m1, a1, l0, l1
    ready: gl.shared_memory_descriptor       # "tile (or box) landed", the loader's or the producer's
    empty: gl.shared_memory_descriptor       # [2 NBUF]: a K slot's columns 0..255 / 256..511 released
    p_ready: gl.shared_memory_descriptor     # [2]: P0 / P1 and their statistics stored
    p_free: gl.shared_memory_descriptor      # [2]: P0 / P1 read by the other warpgroup
    l_bar: gl.shared_memory_descriptor       # both l halves stored
    q_bar: gl.shared_memory_descriptor       # both halves of Q stored

    @gluon.constexpr_function
    def __init__(self, q_smem, k_smem, kpe_smem, p_smem, stats, ready, empty, p_ready, p_free, l_bar, q_bar):
        self.q_smem, self.k_smem, self.kpe_smem, self.p_smem, self.stats = q_smem, k_smem, kpe_smem, p_smem, stats
        self.ready, self.empty, self.p_ready, self.p_free = ready, empty, p_ready, p_free
        self.l_bar, self.q_bar = l_bar, q_bar


@aggregate
class SeesawWork:
    """One program's share: 64 query rows, one split's keys, and where its result goes. Row
    m = i H + h of the program's 64 (from ml) is query token i, head h: at Q + q_base +
    i stride_qi + h stride_qh, its output at O + o_base + i stride_oi + h stride_oh and its lse at
    LSE + l_base + i stride_li + h (O, LSE: out and lse with one split, else the split's
    partials). Its keys: start .. end of the sequence's seqlen, in n_tiles tiles."""
    Q: gl.tensor
    O: gl.tensor
    LSE: gl.tensor
    q_base: gl.tensor
    o_base: gl.tensor
    l_base: gl.tensor
    ml: gl.tensor
    seqlen: IntArg
    start: gl.tensor
    end: gl.tensor
    n_tiles: gl.tensor
    H: IntArg
    S_Q: IntArg
    stride_qi: IntArg
    stride_qh: IntArg
    stride_oi: IntArg
    stride_oh: IntArg
    stride_li: IntArg
    qk_scale: gl.tensor         # softmax scale x log2(e) (x kv_scale for FP8 rows): scores in base 2
    v_scale: IntArg             # kv_scale for FP8 rows (the output's), else 1
    o_desc: tensor_descriptor   # out's TMA descriptor (TMA_OUT), and the program's first row there
    o_row0: gl.tensor           # (IDLE_ROW: an idle program, which stores nothing)

    @gluon.constexpr_function
    def __init__(self, Q, O, LSE, q_base, o_base, l_base, ml, seqlen, start, end, n_tiles, H, S_Q, stride_qi,
                 stride_qh, stride_oi, stride_oh, stride_li, qk_scale, v_scale, o_desc, o_row0):
        self.Q, self.O, self.LSE, self.q_base, self.o_base, self.l_base = Q, O, LSE, q_base, o_base, l_base
        self.ml, self.seqlen, self.start, self.end, self.n_tiles = ml, constant(seqlen), start, end, n_tiles
        self.H, self.S_Q, self.stride_qi, self.stride_qh = constant(H), constant(S_Q), constant(stride_qi), \
            constant(stride_qh)
        self.stride_oi, self.stride_oh, self.stride_li = constant(stride_oi), constant(stride_oh), constant(stride_li)
        self.qk_scale, self.v_scale, self.o_desc, self.o_row0 = qk_scale, constant(v_scale), o_desc, o_row0


@gluon.constexpr_function
def _s_layout(BN):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])


@gluon.jit
def _qk(q_smem, qpe, k_buf, kpe_buf, ready, buf, phase, n0, end,
        BN: gl.constexpr, S_L: gl.constexpr, WIDENED: gl.constexpr):
    """S = Q K^T for one BN-key tile, box by box as the loads land; zero the tail rows first.
    WIDENED: the tile is complete, tail rows already zero (written by ``widen``, or gathered:
    ``common.gather_loader``)."""
    if not WIDENED and n0 + BN > end:   # tail tile: wait for everything, zero rows >= end
        for c in gl.static_range(9):
            mbarrier.wait(ready.index(buf * 9 + c), phase)
        zero_tail(k_buf, kpe_buf, n0, end)
        fence_async_shared()
        gl.thread_barrier()
    s = gl.zeros([64, BN], gl.float32, S_L)
    for c in gl.static_range(8):
        if not WIDENED:
            mbarrier.wait(ready.index(buf * 9 + c), phase)
        s = warpgroup_mma(q_smem.slice(c * 64, 64, dim=1), k_buf.slice(c * 64, 64, dim=1).permute((1, 0)), s,
                          use_acc=c > 0, is_async=True)
    if not WIDENED:
        mbarrier.wait(ready.index(buf * 9 + 8), phase)
    s = warpgroup_mma(qpe, kpe_buf.permute((1, 0)), s, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(s, ))


@gluon.jit
def _scaled(s, n0, end, limit, full_to, qk_scale, BN: gl.constexpr, S_L: gl.constexpr, ok=None):
    """Scores in base 2, -inf where a row does not see the key. Keys below full_to are seen by
    every row of the tile: a tile below it skips the mask (all but the last tile or two of a
    split; the mask is a compare and a select per score on the softmax's critical path).
    ok: gathered keys (``mla.ops.decode.gluon.sparse``), [BN] which of the tile's keys exist;
    it replaces the positional mask."""
    if ok is not None:
        return gl.where(ok[None, :], s * qk_scale, float("-inf"))
    if n0 + BN <= full_to:
        return s * qk_scale
    n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, S_L))
    visible = (n < end)[None, :] & (n[None, :] < limit[:, None])
    return gl.where(visible, s * qk_scale, float("-inf"))


@gluon.jit
def _probs(s, n0, end, limit, full_to, m_ref, qk_scale, BN: gl.constexpr, S_L: gl.constexpr, ok=None):
    """Masked scores in base 2 -> (P, new max, rescale of the old max, row sums of P)."""
    p, m_new, rs = _probs_own(s, n0, end, limit, full_to, m_ref, qk_scale, BN, S_L, ok)
    return p, m_new, gl.exp2(m_ref - gl.where(m_new == float("-inf"), 0.0, m_new)), rs


@gluon.jit
def _probs_own(s, n0, end, limit, full_to, m_prev, qk_scale, BN: gl.constexpr, S_L: gl.constexpr, ok=None):
    """WG1's exponentials before WG0's row max is known: against its own reference
    m_own = max(m_prev, rowmax S) -> (P', m_own, row sums of P'); ``_rebase`` later moves them
    to the shared reference."""
    s = _scaled(s, n0, end, limit, full_to, qk_scale, BN, S_L, ok)
    m_own = gl.maximum(m_prev, gl.max(s, axis=1))
    p = gl.exp2(s - gl.where(m_own == float("-inf"), 0.0, m_own)[:, None])
    return p, m_own, gl.sum(p, axis=1)


@gluon.jit
def _rebase(m_own, m0):
    """The shared reference m1 = max(m0, m_own) (= max(m0, rowmax S1), as m0 >= m_prev), the
    factor c that takes P' from m_own to it (0 where nothing is visible yet: P' is 0 there),
    and a1 = 2^(m0 - m1), WG0's rescale."""
    m1 = gl.maximum(m0, m_own)
    m1_safe = gl.where(m1 == float("-inf"), 0.0, m1)
    c = gl.where(m_own == float("-inf"), 0.0, gl.exp2(m_own - m1_safe))
    return m1, c, gl.exp2(m0 - m1_safe)


@gluon.jit
def _load_qpe(wk, S_L: gl.constexpr, dtype: gl.constexpr):
    """The RoPE part of the query rows, straight into the QK^T A-operand registers."""
    QPE_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=2)
    rows = wk.ml + gl.arange(0, 64, layout=gl.SliceLayout(1, QPE_L))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, QPE_L))
    ptr = wk.Q + wk.q_base + (rows // wk.H) * wk.stride_qi + (rows % wk.H) * wk.stride_qh
    mask = ((rows < wk.H * wk.S_Q) & (wk.n_tiles > 0))[:, None] & (cols < 64)[None, :]
    return gl.load(ptr[:, None] + (512 + cols)[None, :], mask=mask, other=0.0).to(dtype)


@gluon.jit
def _load_q_half(wk, q_smem, q_bar, HALF: gl.constexpr, S_L: gl.constexpr):
    """This warpgroup's half of the query rows' latent part (256 columns) -> shared memory,
    then wait for the other half: inside the partitions, so the loader's first TMA does not
    wait behind the query loads. Returns the RoPE part (``_load_qpe``). All the loads go out
    before the first store: one memory latency, where storing each chunk as it came (and the
    RoPE part after the wait) took three in a row (sm_90a SASS)."""
    LD_L: gl.constexpr = TILE_LD_L
    rows = wk.ml + gl.arange(0, 64, layout=gl.SliceLayout(1, LD_L))
    cl = gl.arange(0, 64, layout=gl.SliceLayout(0, LD_L))
    qrow = wk.Q + wk.q_base + (rows // wk.H) * wk.stride_qi + (rows % wk.H) * wk.stride_qh
    # a program without keys (an idle one, an empty sequence) reads no query: its result is 0
    qmask = ((rows < wk.H * wk.S_Q) & (wk.n_tiles > 0))[:, None] & (cl < 64)[None, :]
    ptr = qrow[:, None] + (HALF * 256 + cl)[None, :]
    xs = (gl.load(ptr, mask=qmask, other=0.0), gl.load(ptr + 64, mask=qmask, other=0.0),
          gl.load(ptr + 128, mask=qmask, other=0.0), gl.load(ptr + 192, mask=qmask, other=0.0))
    qpe = _load_qpe(wk, S_L, q_smem.dtype)
    for c in gl.static_range(4):
        q_smem.slice(HALF * 256 + c * 64, 64, dim=1).store(xs[c].to(q_smem.dtype))
    fence_async_shared()
    mbarrier.arrive(q_bar.index(0), count=1)
    mbarrier.wait(q_bar.index(0), 0)
    return qpe


@gluon.jit
def _limits(wk, CAUSAL: gl.constexpr, S_L: gl.constexpr):
    """(per query row: keys < limit are visible; keys < full_to are in the split and visible to
    every row of the tile)."""
    ms = wk.ml + gl.arange(0, 64, layout=gl.SliceLayout(1, S_L))
    if CAUSAL:                                     # query i sees keys < limit; row ml the fewest
        return (wk.seqlen - wk.S_Q + ms // wk.H + 1,
                gl.minimum(wk.end, wk.seqlen - wk.S_Q + wk.ml // wk.H + 1))
    return gl.full([64], 0, gl.int32, gl.SliceLayout(1, S_L)) + wk.seqlen, wk.end


@gluon.jit
def _store_out(wk, q_smem, acc, m_i, l_tot, col0, WRITE_LSE: gl.constexpr, TMA_OUT: gl.constexpr,
               S_L: gl.constexpr, ACC_L: gl.constexpr):
    """This warpgroup's 256 output columns (or the split's partial), and the LSE if WRITE_LSE.
    TMA_OUT (whole 64-row tiles of one sequence, out's dtype; the output with one split, else
    the split's slot of 16-bit partials, at row o_row0): staged in the query's shared memory,
    free once both warpgroups passed ``_add_other_l`` (their MMAs all waited), and written by
    TMA in 64-column boxes; the stores from the MMA's register layout wrote 16 bytes per row
    and instruction (about an eighth of a 128-head step at batch 128)."""
    empty = l_tot == 0.0
    inv = wk.v_scale / gl.where(empty, 1.0, l_tot)
    out = acc * gl.convert_layout(inv, gl.SliceLayout(1, ACC_L))[:, None]
    # an idle program's rows start at IDLE_ROW, past the end of any output, where TMA stores
    # nothing (a branch around the copies spilled the warpgroups' loops, 112 -> 272 bytes of
    # stack; rows before the tensor, a negative coordinate, stopped the H100 on an illegal
    # instruction)
    live = wk.o_row0 < IDLE_ROW
    if TMA_OUT:
        q_smem.slice(col0, 256, dim=1).store(out.to(q_smem.dtype))
        fence_async_shared()
        for c in gl.static_range(4):
            tma.async_copy_shared_to_global(wk.o_desc, [wk.o_row0, col0 + c * 64],
                                            q_smem.slice(col0 + c * 64, 64, dim=1))
        tma.store_wait(0)
    else:
        mo = wk.ml + gl.arange(0, 64, layout=gl.SliceLayout(1, ACC_L))
        do = gl.arange(0, 256, layout=gl.SliceLayout(0, ACC_L))
        o_row = wk.O + wk.o_base + (mo // wk.H) * wk.stride_oi + (mo % wk.H) * wk.stride_oh + col0
        gl.store(o_row[:, None] + do[None, :], out.to(wk.O.dtype.element_ty),
                 mask=((mo < wk.H * wk.S_Q) & live)[:, None] & (do < 256)[None, :])
    if WRITE_LSE:
        ms = wk.ml + gl.arange(0, 64, layout=gl.SliceLayout(1, S_L))
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_tot))) * LN2)
        gl.store(wk.LSE + wk.l_base + (ms // wk.H) * wk.stride_li + ms % wk.H, lse,
                 mask=(ms < wk.H * wk.S_Q) & live)


@gluon.jit
def _add_other_l(l_i, mine, theirs, l_bar, ROW_L: gl.constexpr):
    """l = l0 + l1: each warpgroup summed its own P with the same rescales (same reference max)."""
    mine.store(l_i)
    fence_async_shared()
    mbarrier.arrive(l_bar.index(0), count=1)
    mbarrier.wait(l_bar.index(0), 0)
    return l_i + theirs.load(ROW_L)


@gluon.jit
def _wg0(sm, wk, CAUSAL: gl.constexpr, KV_FMT: gl.constexpr, TMA_OUT: gl.constexpr, sp=None):
    """Even tiles: S0, softmax, P0 -> shared, O_L += P0 V0_L, then O_L += P1 V1_L.
    sp: gathered keys (``mla.ops.decode.gluon.sparse``: the loader's one barrier a tile, keys
    masked by their index, the softmax started from the attention sink); None: paged keys."""
    BN: gl.constexpr = sm.k_smem.shape[1]
    NBUF: gl.constexpr = sm.k_smem.shape[0]
    S_L: gl.constexpr = _s_layout(BN)
    ACC_L: gl.constexpr = _ACC_L
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_L, k_width=2)
    ROW_L: gl.constexpr = gl.SliceLayout(1, S_L)
    dtype: gl.constexpr = sm.q_smem.dtype
    qpe = _load_q_half(wk, sm.q_smem, sm.q_bar, 0, S_L)
    limit, full_to = _limits(wk, CAUSAL, S_L)
    if sp is not None:
        m_i = sink_start(sp, wk.ml, wk.H, ROW_L)
        l_i = gl.where(m_i == float("-inf"), 0.0, 1.0)      # the sink: one key of weight 2^(sink - m)
    else:
        m_i = gl.full([64], float("-inf"), gl.float32, ROW_L)
        l_i = gl.full([64], 0.0, gl.float32, ROW_L)
    acc = gl.zeros([64, 256], gl.float32, ACC_L)
    for i in range((wk.n_tiles + 1) // 2):
        ph = i & 1                                # p_ready / p_free phase
        kph = (2 * i // NBUF) & 1                 # K ring phase of tile 2i
        b0 = (2 * i) % NBUF
        b1 = (2 * i + 1) % NBUF                   # (a ring of three FP8 slots: not b0 + 1)
        n0 = wk.start + 2 * i * BN
        has1 = 2 * i + 1 < wk.n_tiles
        if sp is not None:
            ok = key_mask(sp, n0, wk.end, gl.SliceLayout(0, S_L), BN)
            if KV_FMT == 0:
                wait_gathered(sm.ready, b0, kph)
        else:
            ok = None
        if KV_FMT != 0:   # the producer widened tile 2i into slot b0
            mbarrier.wait(sm.ready.index(b0), kph)
        s = _qk(sm.q_smem, qpe, sm.k_smem.index(b0), sm.kpe_smem.index(b0), sm.ready, b0, kph, n0, wk.end, BN, S_L,
                KV_FMT != 0 or sp is not None)
        p, m0, a0, rs = _probs(s, n0, wk.end, limit, full_to, m_i, wk.qk_scale, BN, S_L, ok)
        l_i = l_i * a0 + rs
        p16 = p.to(dtype)
        # hand P0, m0, a0 to WG1 once it has consumed the previous ones
        mbarrier.wait(sm.p_free.index(0), ph ^ 1)
        sm.p_smem.index(0).store(p16)
        sm.stats[0].store(m0)
        sm.stats[1].store(a0)
        fence_async_shared()
        mbarrier.arrive(sm.p_ready.index(0), count=1)
        acc = acc * gl.convert_layout(a0, gl.SliceLayout(1, ACC_L))[:, None]
        acc = warpgroup_mma(gl.convert_layout(p16, P_L), sm.k_smem.index(b0).slice(0, 256, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(sm.empty.index(2 * b0), count=1)
        # P1 from WG1: rescale to its max and add P1 V1_L
        mbarrier.wait(sm.p_ready.index(1), ph)
        m_i = sm.stats[2].load(ROW_L)
        a1 = sm.stats[3].load(ROW_L)
        l_i = l_i * a1
        acc = acc * gl.convert_layout(a1, gl.SliceLayout(1, ACC_L))[:, None]
        if has1:
            acc = warpgroup_mma(sm.p_smem.index(1), sm.k_smem.index(b1).slice(0, 256, dim=1), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(sm.empty.index(2 * b1), count=1)
        mbarrier.arrive(sm.p_free.index(1), count=1)
    l_tot = _add_other_l(l_i, sm.stats[4], sm.stats[5], sm.l_bar, ROW_L)
    _store_out(wk, sm.q_smem, acc, m_i, l_tot, 0, True, TMA_OUT, S_L, ACC_L)


@gluon.jit
def _wg1(sm, wk, CAUSAL: gl.constexpr, KV_FMT: gl.constexpr, TMA_OUT: gl.constexpr, sp=None):
    """Odd tiles: S1 alongside WG0's S0, O_R += P0 V0_R, softmax against m0, O_R += P1 V1_R.
    sp: as ``_wg0``'s."""
    BN: gl.constexpr = sm.k_smem.shape[1]
    NBUF: gl.constexpr = sm.k_smem.shape[0]
    S_L: gl.constexpr = _s_layout(BN)
    ACC_L: gl.constexpr = _ACC_L
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_L, k_width=2)
    ROW_L: gl.constexpr = gl.SliceLayout(1, S_L)
    dtype: gl.constexpr = sm.q_smem.dtype
    qpe = _load_q_half(wk, sm.q_smem, sm.q_bar, 1, S_L)
    limit, full_to = _limits(wk, CAUSAL, S_L)
    l_i = gl.full([64], 0.0, gl.float32, ROW_L)
    if sp is not None:     # WG0 counts the sink's weight; both start from its reference
        m_prev = sink_start(sp, wk.ml, wk.H, ROW_L)
    else:
        m_prev = gl.full([64], float("-inf"), gl.float32, ROW_L)     # the shared reference of the last pair
    acc = gl.zeros([64, 256], gl.float32, ACC_L)
    for i in range((wk.n_tiles + 1) // 2):
        ph = i & 1
        kph = ((2 * i + 1) // NBUF) & 1           # K ring phase of tile 2i + 1
        b0 = (2 * i) % NBUF
        b1 = (2 * i + 1) % NBUF
        n1 = wk.start + (2 * i + 1) * BN
        has1 = 2 * i + 1 < wk.n_tiles
        if sp is not None:
            ok = key_mask(sp, n1, wk.end, gl.SliceLayout(0, S_L), BN)      # none past end
        else:
            ok = None
        if has1:
            if sp is not None and KV_FMT == 0:
                wait_gathered(sm.ready, b1, kph)
            if KV_FMT != 0:
                mbarrier.wait(sm.ready.index(b1), kph)
            s = _qk(sm.q_smem, qpe, sm.k_smem.index(b1), sm.kpe_smem.index(b1), sm.ready, b1, kph, n1, wk.end, BN, S_L,
                    KV_FMT != 0 or sp is not None)
        else:
            s = gl.full([64, BN], float("-inf"), gl.float32, S_L)
        # the exponentials against this warpgroup's own reference, alongside WG0's softmax
        p, m_own, rs = _probs_own(s, n1, wk.end, limit, full_to, m_prev, wk.qk_scale, BN, S_L, ok)
        mbarrier.wait(sm.p_ready.index(0), ph)
        m0 = sm.stats[0].load(ROW_L)
        a0 = sm.stats[1].load(ROW_L)
        acc = acc * gl.convert_layout(a0, gl.SliceLayout(1, ACC_L))[:, None]
        acc = warpgroup_mma(sm.p_smem.index(0), sm.k_smem.index(b0).slice(256, 256, dim=1), acc, is_async=True)
        m1, c, a1 = _rebase(m_own, m0)
        l_i = l_i * a0 * a1 + rs * c
        p16 = (p * c[:, None]).to(dtype)
        mbarrier.wait(sm.p_free.index(1), ph ^ 1)
        sm.p_smem.index(1).store(p16)
        sm.stats[2].store(m1)
        sm.stats[3].store(a1)
        fence_async_shared()
        mbarrier.arrive(sm.p_ready.index(1), count=1)
        m_prev = m1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(sm.p_free.index(0), count=1)
        mbarrier.arrive(sm.empty.index(2 * b0 + 1), count=1)
        acc = acc * gl.convert_layout(a1, gl.SliceLayout(1, ACC_L))[:, None]
        if has1:
            acc = warpgroup_mma(gl.convert_layout(p16, P_L), sm.k_smem.index(b1).slice(256, 256, dim=1), acc,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(sm.empty.index(2 * b1 + 1), count=1)
    l_tot = _add_other_l(l_i, sm.stats[5], sm.stats[4], sm.l_bar, ROW_L)
    m_i = gl.full([64], 0.0, gl.float32, ROW_L)     # unused: WG0 writes the LSE
    _store_out(wk, sm.q_smem, acc, m_i, l_tot, 256, False, TMA_OUT, S_L, ACC_L)


@gluon.jit
def _producer(st8, k_smem, kpe_smem, kready, empty, start, end, n_tiles, kv_desc, pe_desc, sc_desc, BT, bt_row,
              block_size, blk0, KV_FMT: gl.constexpr):
    """FP8 rows: the fourth warpgroup loads and widens, so the two that compute only wait.
    Tile j: TMA copies into staging stage j % NST (NST tiles ahead: the stages are this
    partition's own, freed in program order), then, once both warpgroups released K slot
    j % NBUF (``empty``: columns 0..255 by WG0's P V, 256..511 by WG1's), widened into it
    (``widen_by_parts``), fenced for the MMAs' proxy, and signalled on kready[j % NBUF]. The
    block of tile j + NST is loaded before the widening of tile j, so its latency passes under
    it."""
    k8, pe8, sc8, ready8 = st8
    BN: gl.constexpr = k_smem.shape[1]
    NBUF: gl.constexpr = k_smem.shape[0]
    NST: gl.constexpr = k8.shape[0]
    for j in range(0, gl.minimum(n_tiles, NST)):
        n0 = start + j * BN
        blk = gl.load(BT + bt_row + n0 // block_size, mask=j > 0, other=blk0)
        copy_fp8_tile(k8, pe8, sc8, ready8, j, blk * block_size + n0 % block_size, kv_desc, pe_desc, sc_desc, KV_FMT)
    for j in range(n_tiles):
        st = j % NST
        b = j % NBUF
        kph = (j // NBUF) & 1
        nn = start + (j + NST) * BN
        refill = j + NST < n_tiles
        blk = gl.load(BT + bt_row + nn // block_size, mask=refill, other=0)
        mbarrier.wait(empty.index(2 * b), kph ^ 1)
        mbarrier.wait(empty.index(2 * b + 1), kph ^ 1)
        mbarrier.wait(ready8.index(st), (j // NST) & 1)
        widen_by_parts(k8, pe8, sc8, st, k_smem.index(b), kpe_smem.index(b), start + j * BN, end, KV_FMT)
        fence_async_shared()
        gl.thread_barrier()           # every thread's part written (and the stage read)
        mbarrier.arrive(kready.index(b), count=1)
        if refill:
            copy_fp8_tile(k8, pe8, sc8, ready8, st, blk * block_size + nn % block_size, kv_desc, pe_desc, sc_desc,
                          KV_FMT)


@gluon.jit
def seesaw_buffers(dtype: gl.constexpr, NBUF: gl.constexpr, BN: gl.constexpr, SM_L: gl.constexpr,
                   P_SM: gl.constexpr, N_READY: gl.constexpr, READY_COUNT: gl.constexpr):
    """The two warpgroups' ``SeesawSmem``, set up: the query's latent part, the K ring of NBUF
    BN-key tiles, P0 / P1, the row statistics handed between them (m0, a0, m1, a1, l0, l1), a K
    tile's two halves' "released" barriers (columns 0..255: WG0's P V; 256..511: WG1's), P's
    ready / free, the l exchange and "both halves of Q stored", and N_READY "tile landed"
    barriers of READY_COUNT arrivals each (their number and count depend on the loader)."""
    ST_L: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    Q_SM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=dtype.primitive_bitwidth,
                                              rank=2)
    q_smem = gl.allocate_shared_memory(dtype, [64, 512], Q_SM)
    k_smem = gl.allocate_shared_memory(dtype, [NBUF, BN, 512], SM_L)
    kpe_smem = gl.allocate_shared_memory(dtype, [NBUF, BN, 64], SM_L)
    p_smem = gl.allocate_shared_memory(dtype, [2, 64, BN], P_SM)
    stats = (gl.allocate_shared_memory(gl.float32, [64], ST_L), gl.allocate_shared_memory(gl.float32, [64], ST_L),
             gl.allocate_shared_memory(gl.float32, [64], ST_L), gl.allocate_shared_memory(gl.float32, [64], ST_L),
             gl.allocate_shared_memory(gl.float32, [64], ST_L), gl.allocate_shared_memory(gl.float32, [64], ST_L))
    empty = gl.allocate_shared_memory(gl.int64, [2 * NBUF, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    l_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * NBUF):
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(p_free.index(i), count=1)
    mbarrier.init(l_bar.index(0), count=2)
    mbarrier.init(q_bar.index(0), count=2)
    ready = gl.allocate_shared_memory(gl.int64, [N_READY, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(N_READY):
        mbarrier.init(ready.index(i), count=READY_COUNT)
    return SeesawSmem(q_smem, k_smem, kpe_smem, p_smem, stats, ready, empty, p_ready, p_free, l_bar, q_bar)


@gluon.jit
def _seesaw_kernel(
    Q, kv_desc, pe_desc, sc_desc, o_desc, BT, SEQLENS, O, LSE, INFO,
    stride_qb, stride_qi, stride_qh,
    stride_bt, bt_width,
    stride_os, stride_ob, stride_oi, stride_oh,
    stride_ls, stride_lb, stride_li,
    H, S_Q, B, block_size, num_splits, eq_splits, qk_scale, v_scale,
    CAUSAL: gl.constexpr, KV_FMT: gl.constexpr, dtype: gl.constexpr, SM_L: gl.constexpr, P_SM: gl.constexpr,
    TMA_OUT: gl.constexpr, BLOCK_B: gl.constexpr, num_warps: gl.constexpr, DIRECT: gl.constexpr = False,
):
    gl.static_assert(num_warps == 4)
    BN: gl.constexpr = kv_desc.block_type.shape[0]     # keys per tile: 64, or 32 (a ring of 4)
    pid_m = gl.program_id(0)
    p = gl.program_id(1)           # the plan's program (``split_plan``)

    # K tiles in the compute dtype: the loader's ring (bf16/fp16 cache: 2 x 64 or 4 x 32 keys), or,
    # for FP8 rows, one 32-key tile per warpgroup that it widens from the FP8 staging ring into
    if KV_FMT == 0:
        NBUF: gl.constexpr = 128 // BN
        NLOAD: gl.constexpr = NBUF
    else:
        # FP8 rows: three K slots that the producer widens into, two FP8 staging stages (smem: 227 KB
        # in all). On the H200 two slots and four stages took 1.3-1.6x the time: the producer could
        # not widen a tile before both warpgroups were done with the one two back in its slot
        NBUF: gl.constexpr = 3
        NLOAD: gl.constexpr = 2
    # ready: the loader's, one a 64-column box; FP8 rows: the producer's "K slot widened"
    sm = seesaw_buffers(dtype, NBUF, BN, SM_L, P_SM, NLOAD * 9 if KV_FMT == 0 else NBUF, 1)
    if KV_FMT != 0:   # the FP8 staging ring: latent, k_pe, scales (tile rows), one TMA barrier a stage
        k8 = gl.allocate_shared_memory(kv_desc.dtype, [NLOAD, BN, 512], kv_desc.layout)
        if KV_FMT == 1:
            pe8 = gl.allocate_shared_memory(kv_desc.dtype, [NLOAD, BN, 64], kv_desc.layout)
            sc8 = sm.stats[0]                            # not used
        else:
            pe8 = gl.allocate_shared_memory(pe_desc.dtype, [NLOAD, BN, 64], pe_desc.layout)
            sc8 = gl.allocate_shared_memory(sc_desc.dtype, [NLOAD, BN, 4], sc_desc.layout)
        ready8 = gl.allocate_shared_memory(gl.int64, [NLOAD, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NLOAD):
            mbarrier.init(ready8.index(i), count=1)
        st8 = (k8, pe8, sc8, ready8)

    # the barriers above read no memory: under a dependent launch they are set up while the
    # kernel before drains
    wait_prerequisites()
    b, seqlen, start, end, n_tiles, bt_row, blk0, slot = plan_and_block(
        SEQLENS, INFO, BT, stride_bt, bt_width, block_size, B, p, num_splits, eq_splits, BN, BLOCK_B, DIRECT)
    # an idle program (slot -1) goes through the partitions with no keys and no query, and
    # stores nothing (``_store_out``): returning here instead spilled the warpgroups' loops
    # (sm_90a, 112 -> 288 bytes of stack)

    ml = pid_m * 64
    q_base = b.to(gl.int64) * stride_qb
    fence_async_shared()      # the barriers' init, before the partitions use them
    gl.thread_barrier()
    launch_dependents()

    # the program writes the plan's slot: p, or the output (one split: p is b; DIRECT and alone)
    o_base = slot.to(gl.int64) * stride_os + b.to(gl.int64) * stride_ob
    l_base = slot.to(gl.int64) * stride_ls + b.to(gl.int64) * stride_lb
    wk = SeesawWork(Q, O, LSE, q_base, o_base, l_base, ml, seqlen, start, end, n_tiles, H, S_Q, stride_qi, stride_qh,
                    stride_oi, stride_oh, stride_li, qk_scale, v_scale, o_desc,
                    gl.where(slot < 0, IDLE_ROW, slot * (H * S_Q) + ml))
    if KV_FMT == 0:
        gl.warp_specialize([
            (_wg0, (sm, wk, CAUSAL, KV_FMT, TMA_OUT)),
            (_wg1, (sm, wk, CAUSAL, KV_FMT, TMA_OUT)),
            (loader, (sm.k_smem, sm.kpe_smem, sm.stats[0], sm.ready, sm.empty, start, n_tiles, kv_desc, pe_desc,
                      sc_desc, BT, bt_row, block_size, blk0, KV_FMT, True)),
        ], [4, 1], REGS_WITH_LOADER)
    else:
        gl.warp_specialize([
            (_wg0, (sm, wk, CAUSAL, KV_FMT, TMA_OUT)),
            (_wg1, (sm, wk, CAUSAL, KV_FMT, TMA_OUT)),
            (_producer, (st8, sm.k_smem, sm.kpe_smem, sm.ready, sm.empty, start, end, n_tiles, kv_desc, pe_desc,
                         sc_desc, BT, bt_row, block_size, blk0, KV_FMT)),
        ], [4, 4], REGS_WITH_PRODUCER)


def default_block_n(B: int, rows: int) -> int:
    """Tiles of 32 keys (a ring of four) when there are few CTAs per split (<= 32): more loads
    in flight per SM; 64 otherwise (half the Q traffic from shared memory per key).
    On the H200 32 is 2-9% faster at batch 1 and at 16 heads batch 32, 64 is 6-18% faster at
    128 heads batch >= 32."""
    return 32 if B * triton.cdiv(rows, BLOCK_M) <= 32 else 64


def launch(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal=True,
           num_splits: int | tuple[int, int] | None = None, block_n: int | None = None, kv_scale: float = 1.0, *,
           pdl: bool = True):
    """Absorbed MLA decode (contract of ``mla.ops.reference.mla_decode``) on the seesaw, for inputs
    ``common.supports`` takes, with an optional explicit split count and tile (``block_n`` keys:
    64 = a ring of two tiles, 32 = a ring of four; default by ``default_block_n``; FP8 rows: 32
    only). No host synchronisation: splits from ``block_table.shape[1] * block_size``.
    num_splits: programs a sequence, or (that, programs a sequence at equal lengths: the plan idles the
    rest, ``split_plan``); default ``common.launch_splits``."""
    if block_n not in (None, 32, 64):
        raise ValueError(f"block_n: expected 32 or 64, got {block_n!r}")
    if kv_cache.dim() == 4:
        kv_cache = kv_cache.squeeze(2)
    B, s_q, H, d = q.shape
    # the kernel takes the table's row stride only, and reads lengths at unit stride
    block_table, cache_seqlens = block_table.contiguous(), cache_seqlens.contiguous()
    num_blocks, block_size, _ = kv_cache.shape
    if head_dim_v != D_V or d != D_QK or not supports(q, kv_cache, block_size):
        raise ValueError("seesaw.launch: unsupported shapes/dtypes/layout (see common.supports())")
    fmt = kv_fmt(kv_cache)
    if fmt != 0 and block_n not in (None, 32):
        raise ValueError(f"block_n: FP8 rows are read in tiles of 32 keys, got {block_n}")
    rows = H * s_q
    max_len = block_table.shape[1] * block_size
    if block_n is None:
        block_n = default_block_n(B, rows) if fmt == 0 else 32
    # the MMAs' dtype: q's; FP8 rows widen to fp16, exactly in one instruction a pair (bf16: three),
    # tile rows times their scales in one more (into bf16 through float32: six a pair)
    gdt = gl.float16 if q.dtype == torch.float16 or fmt != 0 else gl.bfloat16
    # whole 64-row tiles per sequence and the output in the MMAs' dtype: each split's result is
    # staged in the query's shared memory and goes out by TMA, into out itself (one split) or
    # into partials in out's dtype (slot p's rows p * rows ..); else (fp16 MMAs for a bf16
    # output, rows not whole tiles) float32 partials, stored from registers (16-bit partials
    # stored from registers go out 16 bytes a row and instruction, slower than float32 ones).
    # o_desc is a stand-in when unused
    tma_out = rows % BLOCK_M == 0 and gdt == (gl.float16 if q.dtype == torch.float16 else gl.bfloat16)
    v_scale = float(kv_scale) if fmt == 1 else 1.0

    def split_kernel(o_part, l_part, info, S, eq, direct):
        kv_desc, pe_desc, sc_desc = descriptors(kv_cache, fmt, block_n, gdt)
        o_desc = kv_desc
        if tma_out:
            o_rows = (o_part[0] if S == 1 else o_part[:, 0]).view(-1, D_V)    # [slots * rows, DV]: slot k's at k * rows
            assert o_rows.shape[0] + BLOCK_M <= IDLE_ROW, "the output's rows reach IDLE_ROW"
            o_desc = TensorDescriptor(o_rows, list(o_rows.shape), [D_V, 1], [BLOCK_M, 64],
                                      gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
        _seesaw_kernel[(triton.cdiv(rows, BLOCK_M), S * B)](
            q, kv_desc, pe_desc, sc_desc, o_desc, block_table, cache_seqlens, o_part, l_part, info,
            q.stride(0), q.stride(1), q.stride(2),
            block_table.stride(0), block_table.shape[1],
            o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
            l_part.stride(0), l_part.stride(1), l_part.stride(2),
            H, s_q, B, block_size, S, eq, softmax_scale * LOG2E * v_scale, v_scale,
            CAUSAL=bool(causal), KV_FMT=fmt, dtype=gdt, SM_L=gl.NVMMASharedLayout.get_default_for([block_n, 64], gdt),
            P_SM=gl.NVMMASharedLayout.get_default_for([64, block_n], gdt), TMA_OUT=tma_out, BLOCK_B=block_b(B),
            DIRECT=direct,
            num_warps=4, maxnreg=MAXNREG, **pdl_launch(rows, pdl),
        )
    splits = num_splits if num_splits is not None else (lambda: launch_splits(B, rows, max_len, q.device))
    return run_splits(q, D_V, max_len, splits, split_kernel, part_dtype=q.dtype if tma_out else torch.float32, pdl=pdl,
                      direct=True)
