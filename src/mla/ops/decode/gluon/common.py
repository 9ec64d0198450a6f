"""The shared toolkit of the Hopper (sm90) decode kernels in Gluon: what ``seesaw``, ``narrow``
and ``fp8`` have in common.

- input checks and schedule: ``supports`` (the inputs every Hopper kernel takes), the split
  counts ``default_splits`` and ``launch_splits``, TMA ``descriptors`` over the cache rows;
- the prologue: ``plan_and_block`` / ``plan_and_query`` (the split plan of ``split_plan`` and
  the first loads issued under its latency), ``ring_barriers``;
- the loader partition: ``loader`` (TMA copies of key tiles into a ring, one mbarrier a 64-column
  box for 16-bit rows, one a tile for FP8 rows), ``copy_tile``, ``copy_fp8_tile``; for gathered
  keys (sparse attention) ``gather_loader`` and the consumers' ``wait_gathered``, ``key_mask``,
  ``sink_start``;
- key tiles in shared memory: ``zero_tail`` (rows past a sequence's end may hold NaN, and
  0 * NaN in P V would leak), ``widen`` (FP8 staging tile -> the MMAs' 16-bit dtype) and
  ``widen_by_parts`` (the same in a few registers, for a partition of its own);
- the two warpgroups' merge at the end of a split: ``merge_buffers``, ``send_state``,
  ``merge_weights``, ``thread_major``;
- programmatic dependent launch: ``pdl_launch``, ``wait_prerequisites``, ``launch_dependents``.

Row layout constants: d = ``D_QK`` (576) = ``D_V`` (512, the latent and value) + 64 (k_pe);
query rows come in tiles of ``BLOCK_M`` and keys in chunks of ``BLOCK_N`` (64).
"""
import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from ..._jit import KERNEL_LOG2E, LN2, LOG2E, kv_fmt, num_sms
from ..split_plan import mixed_splits, planned_split_gluon

try:
    from triton.experimental.gluon.language import aggregate
except ImportError:   # Triton 3.6 has Gluon's aggregate (a class of named fields jit functions pass as one value) here
    from triton.language.core import _aggregate as aggregate
# an aggregate's number field: a run-time value, or a constant (a literal the kernel passes, or an
# int argument of 1, which Triton specialises to one)
IntArg = gl.tensor | gl.constexpr


@gluon.constexpr_function
def constant(x):
    """x as an ``IntArg`` field holds it: an aggregate's constructor receives constants as plain
    Python numbers."""
    return gl.constexpr(x) if isinstance(x, (int, float)) else x

D_QK, D_V, BLOCK_M, BLOCK_N = 576, 512, 64, 64
# The Hopper kernels launch at MAXNREG registers a thread: their three warpgroups (two that compute,
# one that loads) fill the 64K register file (3 x 128 threads x 168); each kernel's warp_specialize
# then resizes its worker partitions (setmaxnreg) and the default partition takes what they free.
MAXNREG = 168
# rows of 64 columns for plain loads and stores of a tile (one warpgroup)
TILE_LD_L = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])


@gluon.jit
def zero_tail(k_buf, kpe_buf, n0, end):
    """Rows >= end of a loaded key tile -> 0 (they may hold NaN; 0 * NaN in P V would leak)."""
    BN: gl.constexpr = k_buf.shape[0]
    rl = gl.arange(0, BN, layout=gl.SliceLayout(1, TILE_LD_L))
    keep = (n0 + rl < end)[:, None]
    for c in gl.static_range(8):
        part = k_buf.slice(c * 64, 64, dim=1)
        x = part.load(TILE_LD_L)
        part.store(gl.where(keep, x, gl.zeros_like(x)))
    x = kpe_buf.load(TILE_LD_L)
    kpe_buf.store(gl.where(keep, x, gl.zeros_like(x)))


@gluon.jit
def _mul_f16x2(a, b):
    """a * b of fp16 tensors, two values an instruction (a plain product is one a value)."""
    return gl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.float16, is_pure=True,
                                     pack=2)


@gluon.jit
def _widen_part(x, dst, keep, full, sc, g: gl.constexpr, KV_FMT: gl.constexpr):
    """Columns of FP8 values (registers; within one group g of 128) -> dst in its dtype, times
    their scales (tile rows); rows not kept -> 0 unless the tile is full (a select per value
    costs more than the conversion)."""
    if KV_FMT == 2:
        col = gl.sum(gl.where(gl.arange(0, 4, layout=gl.SliceLayout(0, x.type.layout))[None, :] == g, sc, 0.0),
                     axis=1)
        if dst.dtype == gl.float16:
            # e4m3 -> fp16 is exact and one instruction a pair, the product one more (HMUL2);
            # through float32 into bf16 it took six a pair (two widenings, two multiplies, a pack)
            s16, x16 = gl.broadcast(col.to(gl.float16)[:, None], x.to(gl.float16))
            y = _mul_f16x2(x16, s16)
        else:
            y = (x.to(gl.float32) * col[:, None]).to(dst.dtype)
    else:
        y = x.to(dst.dtype)
    if full:
        dst.store(y)
    else:
        dst.store(gl.where(keep, y, gl.zeros_like(y)))


@gluon.jit
def widen(st8, ready, j, k_buf, kpe_buf, n0, end, KV_FMT: gl.constexpr):
    """FP8 tile j (staging stage j % NST) -> the compute dtype in k_buf / kpe_buf (free: the
    caller waited), rows >= end zeroed (unused slots may hold NaN); the stage goes back to the
    loader.
    KV_FMT 1: e4m3 rows (kv_scale is applied outside: in qk_scale and on the output), widened
    exactly; 2: e4m3 latent times its row's float32 scale per 128 values (into fp16: the scale
    rounded to fp16, one rounding of the product; into bf16: the float32 product rounded),
    k_pe converted from bf16.
    All of the tile is read into registers before anything is written: the compiler puts a
    barrier between shared-memory reads and writes it cannot tell apart, and one per 64
    columns (read, barrier, write, barrier, ...) made the widening 2-3x slower than the loads."""
    k8, pe8, sc8, free8 = st8
    BN: gl.constexpr = k_buf.shape[0]
    NST: gl.constexpr = k8.shape[0]
    WL: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])     # 16 bytes of FP8 a thread
    st = j % NST
    ph = (j // NST) & 1
    mbarrier.wait(ready.index(st * 9), ph)              # the whole tile (see loader)
    src = k8.index(st)
    x0 = src.slice(0, 128, dim=1).load(WL)
    x1 = src.slice(128, 128, dim=1).load(WL)
    x2 = src.slice(256, 128, dim=1).load(WL)
    x3 = src.slice(384, 128, dim=1).load(WL)
    pe = pe8.index(st).load(WL)
    if KV_FMT == 2:
        sc = sc8.index(st).load(WL)                     # [BN, 4]: per row, one scale per 128 values
    else:
        sc = 0.0
    keep = (n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, WL)) < end)[:, None]
    full = n0 + BN <= end
    _widen_part(x0, k_buf.slice(0, 128, dim=1), keep, full, sc, 0, KV_FMT)
    _widen_part(x1, k_buf.slice(128, 128, dim=1), keep, full, sc, 1, KV_FMT)
    _widen_part(x2, k_buf.slice(256, 128, dim=1), keep, full, sc, 2, KV_FMT)
    _widen_part(x3, k_buf.slice(384, 128, dim=1), keep, full, sc, 3, KV_FMT)
    ype = pe.to(kpe_buf.dtype)
    kpe_buf.store(gl.where(keep, ype, gl.zeros_like(ype)))
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(free8.index(st), count=1)


@gluon.jit
def widen_by_parts(k8, pe8, sc8, st, k_buf, kpe_buf, n0, end, KV_FMT: gl.constexpr, TAIL_PASS: gl.constexpr = True):
    """``widen``'s arithmetic for a partition of few registers (the seesaw's producer): FP8
    staging stage st -> k_buf / kpe_buf 128 columns a round, each round's two 64-column parts
    read before either is written (a thread holds 32 FP8 values, not the tile's 144), rows >=
    end zeroed. The compiler puts a barrier between a round's writes and the next round's reads
    (it cannot tell a partition's shared buffers apart): the producer's own four warps, off the
    MMAs' path; on the H200 rounds of 256 columns were no faster. The caller waited for the
    stage and the buffer, and fences and signals after.

    TAIL_PASS: rows past end zeroed in a pass of their own (``zero_tail``, a split's last tile
    only); else by a select per value in the widening, which keeps every converted pair as two
    16-bit halves (two byte permutes a pair in every tile, sm_90a SASS). The sparse kernel
    keeps the select: with the pass, ptxas spilled in one of its computing warpgroups' loops
    (2 -> 25 spill instructions), though their code is the same."""
    BN: gl.constexpr = k_buf.shape[0]
    WL: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])     # [32, 64]: 16 bytes of FP8 a thread
    src = k8.index(st)
    if KV_FMT == 2:
        sc = sc8.index(st).load(WL)                     # [BN, 4]: per row, one scale per 128 values
    else:
        sc = 0.0
    keep = (n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, WL)) < end)[:, None]
    full = TAIL_PASS or n0 + BN <= end
    for g in gl.static_range(4):      # 128 columns (one scale of a tile row) a round: two loads in flight
        x0 = src.slice(g * 128, 64, dim=1).load(WL)
        x1 = src.slice(g * 128 + 64, 64, dim=1).load(WL)
        _widen_part(x0, k_buf.slice(g * 128, 64, dim=1), keep, full, sc, g, KV_FMT)
        _widen_part(x1, k_buf.slice(g * 128 + 64, 64, dim=1), keep, full, sc, g, KV_FMT)
    ype = pe8.index(st).load(WL).to(kpe_buf.dtype)
    if TAIL_PASS:
        kpe_buf.store(ype)
        if n0 + BN > end:
            zero_tail(k_buf, kpe_buf, n0, end)
    else:
        kpe_buf.store(gl.where(keep, ype, gl.zeros_like(ype)))


@gluon.jit
def plan_and_block(SEQLENS, INFO, BT, stride_bt, bt_width, block_size, B, p, num_splits, eq_splits, BN: gl.constexpr,
                    BLOCK_B: gl.constexpr, DIRECT: gl.constexpr = False):
    """``planned_split_gluon`` and the cache block of the split's first key (0 when it has no keys),
    which the prologue loads for ``loader`` so that the first tile's copy does not wait on a
    load of its own. bt_width: the block table's columns (lengths past bt_width * block_size
    are read as that, so no read leaves the table). Returns (b, seqlen, start, end, n_tiles,
    bt_row, blk0, slot) (slot: ``planned_split_gluon``'s, -1 for an idle program).

    Not loaded ahead for the split of equal lengths: that needs sequence p // eq_splits's
    length first, and ptxas then waited for it before it sent the lengths' own load (sm_90a
    SASS), which put a second memory latency in front of the plan."""
    b, seqlen, start, end, n_tiles, slot = planned_split_gluon(SEQLENS, INFO, B, p, num_splits, eq_splits,
                                                               bt_width * block_size, BN, BLOCK_B, DIRECT)
    bt_row = b.to(gl.int64) * stride_bt
    blk0 = gl.load(BT + bt_row + start // block_size, mask=n_tiles > 0, other=0)
    return b, seqlen, start, end, n_tiles, bt_row, blk0, slot


@gluon.jit
def ring_barriers(NBUF: gl.constexpr, PER_SLOT: gl.constexpr = 9):
    """The mbarriers of a ring that ``loader`` fills: ready[PER_SLOT slot + c] (one per 64-column
    box; FP8 rows use ready[PER_SLOT slot] for the whole tile, so a kernel that reads only FP8
    rows asks for one a slot: every init costs the prologue a thread barrier) and free[slot], all
    with one arrival."""
    ready = gl.allocate_shared_memory(gl.int64, [NBUF * PER_SLOT, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF * PER_SLOT):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(NBUF):
        mbarrier.init(free.index(i), count=1)
    return ready, free


@gluon.jit
def _query_chunks(Q, q_off, H, S_Q, stride_qi, stride_qh, r0, R: gl.constexpr, QL: gl.constexpr):
    """Query rows r0 .. r0 + R - 1's nine 64-column chunks ([R, 64] in QL, zero past H * s_q) as a
    tuple, all loads in flight on return: a prologue issues them first and sets up under their
    latency."""
    rows = r0 + gl.arange(0, R, layout=gl.SliceLayout(1, QL))
    cl = gl.arange(0, 64, layout=gl.SliceLayout(0, QL))
    ptr = (Q + q_off + (rows // H) * stride_qi + (rows % H) * stride_qh)[:, None] + cl[None, :]
    mask = (rows < H * S_Q)[:, None] & (cl < 64)[None, :]
    return (gl.load(ptr, mask=mask, other=0.0), gl.load(ptr + 64, mask=mask, other=0.0),
            gl.load(ptr + 128, mask=mask, other=0.0), gl.load(ptr + 192, mask=mask, other=0.0),
            gl.load(ptr + 256, mask=mask, other=0.0), gl.load(ptr + 320, mask=mask, other=0.0),
            gl.load(ptr + 384, mask=mask, other=0.0), gl.load(ptr + 448, mask=mask, other=0.0),
            gl.load(ptr + 512, mask=mask, other=0.0))


@gluon.jit
def plan_and_query(SEQLENS, INFO, BT, stride_bt, bt_width, block_size, B, p, num_splits, eq_splits,
                   BLOCK_B: gl.constexpr, Q, stride_qb, H, S_Q, stride_qi, stride_qh, r0, R: gl.constexpr,
                   DIRECT: gl.constexpr = False):
    """``plan_and_block`` (64-key tiles) and the query rows r0 .. r0 + R - 1 of the program's
    sequence (``_query_chunks``, [R, 64] chunks in the prologue's layout). The query's loads go
    out first, for sequence p // eq_splits (the plan's when the lengths are equal; the last one
    for an idle program), so that they land under the plan's latency as they did under the
    length's before; where the plan gives another sequence they go out again. Returns (b,
    seqlen, start, end, n_tiles, bt_row, blk0, xq, slot)."""
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    guess = gl.minimum(p // eq_splits, B - 1)
    xq = _query_chunks(Q, guess.to(gl.int64) * stride_qb, H, S_Q, stride_qi, stride_qh, r0, R, QL)
    # a barrier, so that the query's loads go out before the plan: without it ptxas put them after
    # the plan's first use of the lengths, behind the lengths' latency (sm_90a SASS)
    gl.thread_barrier()
    b, seqlen, start, end, n_tiles, bt_row, blk0, slot = plan_and_block(
        SEQLENS, INFO, BT, stride_bt, bt_width, block_size, B, p, num_splits, eq_splits, 64, BLOCK_B, DIRECT)
    if b != guess:      # mixed lengths
        xq = _query_chunks(Q, b.to(gl.int64) * stride_qb, H, S_Q, stride_qi, stride_qh, r0, R, QL)
    return b, seqlen, start, end, n_tiles, bt_row, blk0, xq, slot


@gluon.jit
def loader(ring, ring_pe, ring_sc, ready, free, start, n_tiles, kv_desc, pe_desc, sc_desc, BT, bt_row, block_size,
            blk0, KV_FMT: gl.constexpr, HALVES: gl.constexpr = False, j0=0):
    """TMA loads of n_tiles tiles of keys from ``start`` into a ring (tile j -> slot j % ring size,
    once ``free`` says the slot's last tile was consumed), 9 boxes of 64 columns. Rows in q's
    dtype: one mbarrier per box (ready[9 slot + c]), so S can start on the first columns. FP8
    rows: one mbarrier for the whole tile (ready[PER_SLOT slot], ``ring_barriers``), as the
    widening reads all of it (every wait costs the warpgroup a barrier); tile rows: 8 latent
    boxes, k_pe and the scales.
    HALVES (rows in q's dtype): the slot is released in two halves, free[2 slot] for columns
    0..255 and free[2 slot + 1] for 256..511, k_pe going with the half of the tile's owner (even
    tiles: the first); each half is refilled as soon as it is released. blk0: tile 0's block
    (``plan_and_block``). j0: the first tile to copy (the prologue copied those before it, each into
    its own slot)."""
    BN: gl.constexpr = ring.shape[1]
    NBUF: gl.constexpr = ring.shape[0]
    for j in range(j0, n_tiles):
        buf = j % NBUF
        n0 = start + j * BN
        blk = gl.load(BT + bt_row + n0 // block_size, mask=j > 0, other=blk0)
        row0 = blk * block_size + n0 % block_size
        if HALVES:
            fph = ((j // NBUF) & 1) ^ 1
            for h in gl.static_range(2):
                mbarrier.wait(free.index(2 * buf + h), fph)
                for c in gl.static_range(4 * h, 4 * h + 4):
                    bar = ready.index(buf * 9 + c)
                    mbarrier.expect(bar, kv_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(kv_desc, [row0, c * 64], bar,
                                                    ring.index(buf).slice(c * 64, 64, dim=1))
                if j % 2 == h:
                    bar = ready.index(buf * 9 + 8)
                    mbarrier.expect(bar, kv_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(kv_desc, [row0, 512], bar, ring_pe.index(buf))
        elif KV_FMT == 0:
            mbarrier.wait(free.index(buf), ((j // NBUF) & 1) ^ 1)
            copy_tile(ring, ring_pe, ready, buf, row0, kv_desc)
        else:
            mbarrier.wait(free.index(buf), ((j // NBUF) & 1) ^ 1)
            copy_fp8_tile(ring, ring_pe, ring_sc, ready, buf, row0, kv_desc, pe_desc, sc_desc, KV_FMT)


@aggregate
class SplitShare:
    """A program's split of one sequence's keys and where its result goes, in the narrow and FP8
    kernels (two warpgroups over alternate tiles, merged by warpgroup 0): query row r = i H + h
    writes O + o_base + i stride_oi + h stride_oh and LSE + l_base + i stride_li + h (O, LSE: out
    and lse with one split, else the split's partials); its keys are start .. end of seqlen, in
    n_tiles tiles; scores are scaled by qk_scale (to base 2) and the output by v_scale."""
    O: gl.tensor
    LSE: gl.tensor
    o_base: gl.tensor
    l_base: gl.tensor
    seqlen: IntArg
    start: gl.tensor
    end: gl.tensor
    n_tiles: gl.tensor
    H: IntArg
    S_Q: IntArg
    stride_oi: IntArg
    stride_oh: IntArg
    stride_li: IntArg
    qk_scale: gl.tensor
    v_scale: IntArg

    @gluon.constexpr_function
    def __init__(self, O, LSE, o_base, l_base, seqlen, start, end, n_tiles, H, S_Q, stride_oi, stride_oh, stride_li,
                 qk_scale, v_scale):
        self.O, self.LSE, self.o_base, self.l_base = O, LSE, o_base, l_base
        self.seqlen, self.start, self.end, self.n_tiles = constant(seqlen), start, end, n_tiles
        self.H, self.S_Q = constant(H), constant(S_Q)
        self.stride_oi, self.stride_oh, self.stride_li = constant(stride_oi), constant(stride_oh), constant(stride_li)
        self.qk_scale, self.v_scale = qk_scale, constant(v_scale)


@aggregate
class Gathered:
    """Gathered keys (sparse attention): a program's index list and the attention sink."""
    idx_row: gl.tensor      # the token's indices (flat cache slots, -1 = none)
    num_slots: IntArg       # the pool's rows: an index outside [0, num_slots) names no key
    SINK: gl.tensor         # [H] float32 sink logits (a stand-in when sink_on is 0)
    sink_on: gl.tensor      # 1 where this program starts from the sink (split 0 of a launch with one)

    @gluon.constexpr_function
    def __init__(self, idx_row, num_slots, SINK, sink_on):
        self.idx_row, self.num_slots, self.SINK, self.sink_on = idx_row, num_slots, SINK, sink_on


@gluon.jit
def gather_loader(ring, ring_pe, ready, free, KV, stride_row, sp, start, end, n_tiles):
    """The loader of gathered keys (``sparse``): tile j holds the rows that index positions
    start + j BN .. of the program's index list name (a row of 576 values a key, wherever it is
    in the cache), copied by this warpgroup's cp.async, 16 bytes a thread and instruction, into
    ring slot j % ring size once both warpgroups released it (free[2 slot], free[2 slot + 1]).
    An index outside [0, num_slots) or past end is never read: its row is zero-filled (and
    ``key_mask`` hides it from the softmax). ready[slot] completes when all 128 threads'
    copies have landed (cp.async.mbarrier.arrive.noinc; the barrier counts 128).
    On the H200 a finer schedule (``loader``'s for TMA: a barrier a 64-column box, each half of a
    slot refilled once released) took 1.1-1.4x this one's time: spills, nine arrivals a tile."""
    BN: gl.constexpr = ring.shape[1]
    NBUF: gl.constexpr = ring.shape[0]
    r = gl.arange(0, BN, layout=gl.SliceLayout(1, TILE_LD_L))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, TILE_LD_L))
    for j in range(n_tiles):
        buf = j % NBUF
        n = start + j * BN + r
        slot = gl.load(sp.idx_row + n, mask=n < end, other=-1)
        ok = (slot >= 0) & (slot < sp.num_slots)
        ptr = (KV + gl.where(ok, slot, 0).to(gl.int64) * stride_row)[:, None] + cols[None, :]
        mask = ok[:, None] & (cols < 64)[None, :]
        fph = ((j // NBUF) & 1) ^ 1
        mbarrier.wait(free.index(2 * buf), fph)
        mbarrier.wait(free.index(2 * buf + 1), fph)
        for c in gl.static_range(8):
            async_copy.async_copy_global_to_shared(ring.index(buf).slice(c * 64, 64, dim=1), ptr + c * 64, mask=mask)
        async_copy.async_copy_global_to_shared(ring_pe.index(buf), ptr + 512, mask=mask)
        async_copy.mbarrier_arrive(ready.index(buf), increment_count=False)


@gluon.jit
def wait_gathered(ready, buf, phase):
    """Wait for ``gather_loader``'s tile in slot buf; then a proxy fence, as the cp.async
    copies wrote through the generic proxy and the MMAs read through the async one."""
    mbarrier.wait(ready.index(buf), phase)
    fence_async_shared()


@gluon.jit
def key_mask(sp, n0, end, layout: gl.constexpr, BN: gl.constexpr):
    """[BN] in ``layout``: which keys of the gathered tile at index position n0 exist (an index
    in [0, num_slots) before end; -1 and out-of-pool indices do not)."""
    n = n0 + gl.arange(0, BN, layout=layout)
    slot = gl.load(sp.idx_row + n, mask=n < end, other=-1)
    return (slot >= 0) & (slot < sp.num_slots)


@gluon.jit
def sink_start(sp, ml, H, ROW_L: gl.constexpr):
    """The running max a gathered split starts from, per query row (head) ml ..: the attention
    sink in base 2 where sink_on (split 0 of a launch with a sink), else -inf."""
    h = ml + gl.arange(0, 64, layout=ROW_L)
    sink = gl.load(sp.SINK + h, mask=(h < H) & (sp.sink_on != 0), other=float("-inf"))
    return sink * KERNEL_LOG2E     # the kernels' scores are in base 2


@gluon.jit
def copy_tile(ring, ring_pe, ready, buf, row0, kv_desc):
    """The TMA copies of one tile of rows in q's dtype, from cache row row0 into ring slot buf:
    8 latent boxes and k_pe, each on its own ready barrier (ready[9 buf + c])."""
    for c in gl.static_range(8):
        bar = ready.index(buf * 9 + c)
        mbarrier.expect(bar, kv_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(kv_desc, [row0, c * 64], bar, ring.index(buf).slice(c * 64, 64, dim=1))
    bar = ready.index(buf * 9 + 8)
    mbarrier.expect(bar, kv_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(kv_desc, [row0, 512], bar, ring_pe.index(buf))


@gluon.jit
def copy_fp8_tile(ring, ring_pe, ring_sc, ready, buf, row0, kv_desc, pe_desc, sc_desc, KV_FMT: gl.constexpr):
    """The TMA copies of one tile of FP8 rows (KV_FMT 1) or tile rows (2), from cache row row0
    into ring slot buf, all on the slot's one ready barrier."""
    NBUF: gl.constexpr = ring.shape[0]
    bar = ready.index(buf * (ready.shape[0] // NBUF))
    if KV_FMT == 1:
        mbarrier.expect(bar, 9 * kv_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(kv_desc, [row0, 512], bar, ring_pe.index(buf))
    else:
        mbarrier.expect(bar, 8 * kv_desc.block_type.nbytes + pe_desc.block_type.nbytes
                        + sc_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(pe_desc, [row0, 0], bar, ring_pe.index(buf))
        tma.async_copy_global_to_shared(sc_desc, [row0, 0], bar, ring_sc.index(buf))
    for c in gl.static_range(8):
        tma.async_copy_global_to_shared(kv_desc, [row0, c * 64], bar, ring.index(buf).slice(c * 64, 64, dim=1))


@gluon.jit
def wait_prerequisites():
    """Wait until the kernels this one follows have finished and their writes are visible. The
    Gluon decode kernels are launched as programmatic dependents (``pdl_launch``) and call this
    before they read anything (after setting up their mbarriers, which read no memory); without
    PDL it returns at once."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def launch_dependents():
    """Let a programmatic dependent launch (the split combine, ``pdl_launch``) start once every
    program has passed this point, instead of after the last one exits (no-op without PDL)."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


def pdl_launch(rows: int, pdl: bool = True) -> dict:
    """Launch options of a Gluon decode kernel for ``rows`` query rows (H * s_q): with ``pdl``
    and at most 32 rows a programmatic dependent launch, so that its programs are placed on the
    SMs as the kernel before it drains (they wait in ``wait_prerequisites``) instead of after it
    has exited. That saves up to 7% of a step at 16 heads (batch 1 the most); at 128 heads (the
    seesaw, many programs a wave) the early placement costs 1-3%, so not there."""
    return {"launch_pdl": True} if pdl and rows <= 32 else {}


@gluon.constexpr_function
def thread_major(layout):
    """A shared layout for a tensor in the distributed linear ``layout`` (``gl.to_linear_layout``)
    of one warpgroup: register k of thread t at word 128 k + t, so that a warp's access to one
    register is 128 adjacent bytes (no bank conflicts) and a warpgroup in the same layout reads
    back what another wrote, thread for thread."""
    return gl.SharedLinearLayout(list(layout.lane_bases) + list(layout.warp_bases) + list(layout.reg_bases))


@gluon.jit
def merge_buffers(R: gl.constexpr):
    """The mbarrier and the [2 R] row maxima and sums through which warpgroup 1 hands its state
    to warpgroup 0 (``send_state``, ``merge_weights``)."""
    xbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(xbar, count=1)
    xml = gl.allocate_shared_memory(gl.float32, [2 * R], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    return xbar, xml


@gluon.jit
def send_state(xo, o, xml, m_i, l_i, xbar):
    """Warpgroup 1's half of merging the two warpgroups' results of a split: its O (into xo, a
    ``thread_major`` buffer in o's layout), row maxima and sums (xml [2 R]) into shared memory,
    then xbar (one arrival)."""
    R: gl.constexpr = m_i.shape[0]
    xo.store(o)
    xml.slice(0, R).store(m_i)
    xml.slice(R, R).store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(xbar, count=1)


@gluon.jit
def merge_weights(xml, xbar, m_i, l_i, v_scale):
    """Warpgroup 0's half, once xbar says warpgroup 1's state is in: per query row the weights
    (w0, w1) of out = w0 O0 + w1 O1 (the rescales to the common max over the merged sum, times
    v_scale; 0 for a row that saw no key) and the merged lse (natural log, -inf without keys)."""
    R: gl.constexpr = m_i.shape[0]
    mbarrier.wait(xbar, 0)
    m1 = xml.slice(0, R).load(m_i.type.layout)
    l1 = xml.slice(R, R).load(m_i.type.layout)
    m = gl.maximum(m_i, m1)
    m_safe = gl.where(m == float("-inf"), 0.0, m)
    a0 = gl.exp2(m_i - m_safe)
    a1 = gl.exp2(m1 - m_safe)
    l_i = a0 * l_i + a1 * l1
    empty = l_i == 0.0
    inv = v_scale / gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), (m_safe + gl.log2(gl.where(empty, 1.0, l_i))) * LN2)
    return a0 * inv, a1 * inv, lse


@gluon.constexpr_function
def acc_layout(R):
    """A warpgroup MMA accumulator [M, R] with R query rows on N (the keys-on-M kernels)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, R, 16])


_ROW = {0: D_QK, 1: D_QK, 2: D_V + 4 * D_V // 128 + 2 * (D_QK - D_V)}     # elements (bytes for FP8) per row


def supports(q: torch.Tensor, kv_cache: torch.Tensor, block_size: int | None = None) -> bool:
    """True when the Hopper kernels take these tensors (else the portable kernel serves them):
    bf16/fp16 queries over rows in their dtype, FP8 rows (float8_e4m3fn) or FP8 tile rows
    (uint8, ``mla.quant``)."""
    if kv_cache.dim() == 4:
        if kv_cache.shape[2] != 1:
            return False
        kv_cache = kv_cache.squeeze(2)
    if block_size is None:
        block_size = kv_cache.shape[1]
    if not (q.is_cuda and kv_cache.is_cuda and q.device == kv_cache.device):
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    fmt = kv_fmt(kv_cache)
    if q.dtype not in (torch.bfloat16, torch.float16) or (fmt == 0 and kv_cache.dtype != q.dtype):
        return False
    if q.dim() != 4 or q.shape[-1] != D_QK or kv_cache.shape[-1] != _ROW[fmt] or q.stride(-1) != 1:
        return False
    if block_size % BLOCK_N != 0 or kv_cache.shape[1] != block_size:
        return False
    # the cache must be one 2-D matrix of rows for the TMA descriptor
    if kv_cache.stride(-1) != 1 or kv_cache.stride(0) != block_size * kv_cache.stride(1):
        return False
    if (kv_cache.stride(1) * kv_cache.element_size()) % 16 or kv_cache.data_ptr() % 16:
        return False
    return True


def default_splits(B: int, rows: int, max_len: int, device, waves: int = 1) -> int:
    """Splits of the cache per sequence. More splits give each program fewer keys, but each
    split leaves partials (2 KB per query row in float32, 1 KB in 16 bits) to write and
    combine: a step takes about a + b L / S + c B rows S, best at S = sqrt(b L / (c B rows)).
    Fitted on the H200 with float32 partials (128 heads, batch 1, 4k: b = 0.019 us per key,
    c = 0.49 ns per row and split) that is 6.2 sqrt(L / (B rows)); capped at ``waves`` waves of
    one-per-SM programs and one split per 64 keys."""
    ctas = B * triton.cdiv(rows, BLOCK_M)
    per_seq = max(1, waves * num_sms(device.index or 0) // max(ctas, 1))
    balanced = 6.2 * math.sqrt(max_len / max(B * rows, 1))
    # a count that gives every split of the longest sequence whole 64-key tiles (the plan,
    # ``split_plan``, splits in whole tiles), as many tiles as the balance asks and at least
    # what one wave needs
    tiles = max(1, round(max_len / (BLOCK_N * balanced)), triton.cdiv(max_len, BLOCK_N * per_seq))
    return triton.cdiv(max_len, BLOCK_N * tiles)


def launch_splits(B: int, rows: int, max_len: int, device, groups: int = 1) -> tuple[int, int]:
    """(programs a sequence, programs a sequence at equal lengths) of a default launch: the
    second ``default_splits`` (each of a sequence's ``groups`` row groups counted as a sequence
    of its own), the first ``split_plan.mixed_splits`` of it, so that a mixed batch still
    shares its long sequences out where equal lengths want one program a sequence."""
    eq = default_splits(B * groups, rows, max_len, device)
    return mixed_splits(B, eq, max_len), eq


def descriptors(kv_cache, fmt: int, block_n: int, gdt):
    """TMA descriptors over the cache rows as one 2-D matrix: (rows or FP8 latent, k_pe, scales);
    the last two only for FP8 tile rows (else the first again)."""
    num_blocks, block_size, width = kv_cache.shape
    rows = kv_cache.as_strided((num_blocks * block_size, width), (kv_cache.stride(1), 1))

    def desc(t, cols, dt):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [block_n, cols],
                                gl.NVMMASharedLayout.get_default_for([block_n, cols], dt))
    if fmt == 0:
        d = desc(rows, 64, gdt)
        return d, d, d
    if fmt == 1:
        d = desc(rows, 64, gl.float8e4nv)
        return d, d, d
    lat, pe, sc = tile_row_parts(rows)
    return desc(lat, 64, gl.float8e4nv), desc(pe, 64, gl.bfloat16), desc(sc, 4, gl.float32)


def tile_row_parts(rows: torch.Tensor):
    """FP8 tile rows as one uint8 matrix [N, 656] -> views of its parts, each a matrix of rows at
    the same byte stride: (latent [N, 512] e4m3, k_pe [N, 64] bf16, scales [N, 4] float32)."""
    lat = rows[:, :D_V].view(torch.float8_e4m3fn)
    sc = rows[:, D_V: D_V + 4 * D_V // 128].view(torch.float32)
    pe = rows[:, D_V + 4 * D_V // 128:].view(torch.bfloat16)
    return lat, pe, sc
