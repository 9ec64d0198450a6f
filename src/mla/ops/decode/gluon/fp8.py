"""Hopper decode over FP8 rows (float8_e4m3fn with a per-tensor kv_scale, or tile rows) for at
most 32 query rows (16 a program, in row groups):
S^T as e4m3 tensor-core MMAs straight from the key tile, O^T as fp16 MMAs with the values
widened in registers.

The narrow kernel (``narrow``) widens every FP8 tile into an fp16 copy in shared
memory (~4.8 KB of shared-memory traffic per key, 0.80-0.92x the bf16 kernel's throughput on the
H200). Here nothing is widened in shared memory:

    S^T [64 keys, 32] = K8 [64, 576] . [Q_hi; Q_lo]^T [576, 32]   e4m3, both operands shared
    O^T [512, 16]    += V^T [512, 64] . P^T [64, 16]              A = V^T in registers (fp16)

- S^T: the key tile as TMA left it is already the K-major A operand FP8 MMAs need. Each query
  row is written once per program as scale (hi + lo), scale a power of two that brings its
  largest |q| to <= 448, hi its e4m3 rounding and lo the rounded remainder (``_store_q8``; a
  bf16 row splits exactly down to 2^-10 of its largest entry); hi and lo sit side by side on N,
  so one MMA reads each key chunk once and S^T = (columns j + columns 16 + j) times the row's
  scale, a sum inside each thread. What is lost: e4m3 MMAs sum in the tensor core with about 13
  fraction bits (measured 0.5-1.2e-4 relative at K = 32-128, 4e-4 over the 576 columns), so the
  scores carry ~1e-3 of relative error, about 1/30 of what the FP8 cache's own rounding adds.
- O^T: lane group (w, g) of the A fragment owns rows 16 w + g and + 8 of each of the eight
  64-row MMA tiles i; those 16 rows are the adjacent value columns 16 (8 w + g) .. + 15 (row
  r = 64 i + 16 w + 8 h + g holds column 128 w + 16 g + 2 i + h: the "column order" of O^T), so
  a lane reads a key's 16 columns with one 16-byte load and widens them (e4m3 -> fp16 is exact).
  The keys of a k16 MMA are lane t's {2t, 2t+1, 2t+8, 2t+9} in the MMA's order; the kernel
  relabels them (``_swap_key_bits``: bits 0 and 1 of the key exchanged, in V^T and P^T alike) so
  that the lanes of a value load take keys + 1 and + 4, rows of both parities of the 64-byte
  swizzle: 4 shared-memory wavefronts a load instead of 8 (5% of the time at 2M keys). The
  epilogue puts the columns back in registers.

Tile rows (``mla.quant``'s 656-byte rows: 512 e4m3 values, a float32 scale per 128 of them, 64
bf16 k_pe; TILE): S^T by value group g, two e4m3 MMAs each, every key's row of it times that
key's scale of group g as it lands (two groups in flight), plus the rope part as a bf16 MMA
against the query's k_pe columns split into two bf16 terms; the values times their key's scale
in fp16, which a warp can do alone because its A-fragment rows are one value group (columns
128 w ..: the column order above). Each 16-key step's values and scales are read from the
stage just before its MMA (held in registers through the softmax, with the scales, they
spilled), so the stage goes back to the loader after the fourth step, not before the softmax.

Grid (splits x B x row groups), shared out over the sequences by length
(``split_plan``). Partitions: two warpgroups that take alternate 64-key
tiles, each with its own online softmax and O^T, and a 1-warp TMA loader filling a ring of four FP8 tiles
(``loader``, one mbarrier per tile; with FP8 rows the prologue copies the first, before the
query split). A warpgroup hands its stage back to the loader once S^T is done and the value
bytes are in its registers, before the softmax; tail rows (NaN in unused slots) are zeroed
in shared memory first. Row sums of P stay per thread (each its own keys, the same rescales) and
are reduced across the warpgroup once, at the end. Then warpgroup 1 hands its state to
warpgroup 0 through shared memory (O in its own ring stage, 128 adjacent bytes a warp store) and
warpgroup 0 merges the two: one result per split, merged with the other splits by
``combine``, or the output itself when there is one split (no combine), which halves the partials the combine reads. kv_scale and
the query rows' scales are folded into the softmax scale, kv_scale into the output.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..._jit import kv_fmt
from ..combine import run_splits
from ..split_plan import block_b
from .common import (D_QK, D_V, LOG2E, MAXNREG, IntArg, SplitShare, acc_layout, aggregate, constant, copy_fp8_tile,
                     descriptors, launch_dependents, launch_splits, loader, merge_buffers, merge_weights, pdl_launch,
                     plan_and_query, ring_barriers, send_state, supports, thread_major, wait_prerequisites, zero_tail)

__all__ = ["launch", "takes", "MAX_ROWS"]

_R = gl.constexpr(16)     # query rows per program (the MMAs' N)
_NST = gl.constexpr(4)         # FP8 tiles in the ring (even: each stage always serves the same warpgroup)


@gluon.constexpr_function
def _v_load_layout():
    """[16 keys, 512 columns] of FP8: lane group (w, g) owns columns 16 (8 w + g) .. + 15
    (registers), keys: + 2 and + 8 in registers, + 1 and + 4 the lanes t (after
    ``_swap_key_bits``, the A fragment's + 1 and + 8 in registers, + 2 and + 4 the lanes)."""
    reg = [[0, 1], [0, 2], [0, 4], [0, 8], [2, 0], [8, 0]]
    lane = [[1, 0], [4, 0], [0, 16], [0, 32], [0, 64]]
    warp = [[0, 128], [0, 256]]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [16, 512])


@gluon.constexpr_function
def _o_layout():
    """O [512 columns, 16 query rows] as the O^T accumulator holds it once its rows are put
    back in column order: lane group (w, g) owns columns 128 w + 16 g .. + 15 (registers first,
    so that they are stored 16 bytes at a time), lanes t the rows 2t, 2t + 1, 2t + 8, 2t + 9."""
    reg = [[1, 0], [2, 0], [4, 0], [8, 0], [0, 1], [0, 8]]
    lane = [[0, 2], [0, 4], [16, 0], [32, 0], [64, 0]]
    warp = [[128, 0], [256, 0]]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [512, _R])


@gluon.constexpr_function
def _acc8_layout():
    """S^T's accumulator for the e4m3 MMAs: [64 keys, 32] (Q_hi's 16 rows, then Q_lo's)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 2 * _R, 32])


@gluon.jit
def _swap_key_bits(x, GROUPS: gl.constexpr):
    """x [16 GROUPS keys, C] with bits 0 and 1 of each key index exchanged (keys 1 and 2 of each
    four swap places): the O^T MMA's key order, the same in V^T and in P^T."""
    C: gl.constexpr = x.shape[1]
    return x.reshape([GROUPS, 2, 2, 2, 2, C]).permute((0, 1, 2, 4, 3, 5)).reshape([16 * GROUPS, C])


@gluon.jit
def _column_order(acc):
    """O^T's accumulator [512, 16] with its rows put back in column order (registers only), in
    ``_o_layout``: each lane then holds 16 adjacent columns of its query rows, stored 16 bytes at
    a time (stored in the permuted order, every 4-byte value went to its own 32-byte sector)."""
    out = acc.reshape([8, 4, 2, 8, _R]).permute((1, 3, 0, 2, 4)).reshape([512, _R])
    return gl.convert_layout(out, _o_layout())


@gluon.jit
def _v_frag(x):
    """16 keys x 512 value columns (FP8, registers) -> V^T, the O^T MMA's A operand (fp16), its
    rows in O^T's column order (module docstring)."""
    A_L: gl.constexpr = acc_layout(_R)
    y = _swap_key_bits(x.to(gl.float16), 1).permute((1, 0))
    y = y.reshape([4, 8, 8, 2, 16]).permute((2, 0, 3, 1, 4)).reshape([512, 16])
    return gl.convert_layout(y, gl.DotOperandLayout(operand_index=0, parent=A_L, k_width=2))


@gluon.jit
def _q_exponents(Q, q_off, H, S_Q, stride_qi, stride_qh, r0, L2: gl.constexpr):
    """Per query row (SliceLayout(0, L2)) the biased float32 exponent e of its scale 2^(e - 127):
    the least power of two >= max |q| / 448 (127 for a zero row), from [64 columns, 16 rows]
    loads in layout L2. The prologue and both warpgroups compute it alike (the same bits)."""
    r = r0 + gl.arange(0, _R, layout=gl.SliceLayout(0, L2))
    cl = gl.arange(0, 64, layout=gl.SliceLayout(1, L2))
    ptr = Q + q_off + (r // H) * stride_qi + (r % H) * stride_qh
    mask = (cl < 64)[:, None] & (r < H * S_Q)[None, :]
    amax = gl.zeros([64, _R], gl.float32, L2)
    for c in gl.static_range(9):
        x = gl.load(ptr[None, :] + (c * 64 + cl)[:, None], mask=mask, other=0.0).to(gl.float32)
        amax = gl.maximum(amax, gl.abs(x))
    return _row_exponents(gl.max(amax, axis=0))


@gluon.jit
def _row_exponents(amax):
    """The biased exponent e of the least power of two 2^(e - 127) >= amax / 448 (127 for 0)."""
    ex = ((amax * (1.0 / 448.0)).to(gl.int32, bitcast=True) + 0x7FFFFF) >> 23    # rounded up to a power of two
    ex = gl.where(amax > 0.0, ex, 127)
    return gl.where(amax * ((254 - ex) << 23).to(gl.float32, bitcast=True) > 448.0, ex + 1, ex)


@gluon.jit
def _store_q8(xq, q8, qpe, TILE: gl.constexpr):
    """q8[c] = [Q_hi; Q_lo] of chunk c of the query rows xq (``plan_and_query``), the rows over their
    power-of-two scales (the same bits as ``_q_exponents``: a max is exact in any order; the
    division is exact). TILE (tile rows, bf16 k_pe): the rope chunk goes to qpe [2 R, 64] as two
    bf16 terms instead, [hi; lo] like q8 (exact for bf16 and fp16 queries). hi is the hardware's
    rounding (to nearest even, e4m3 subnormals below 2^-6), widened back through fp16: Triton 3.6
    widens e4m3 to float32 wrongly in this layout (elements swapped within a thread's 8), e4m3 ->
    fp16 is right. Bit for bit the same q8 as rounding in float32 bit arithmetic, with ~620 fewer
    instructions in a prologue that one warp per scheduler runs."""
    amax = gl.abs(xq[0].to(gl.float32))
    for c in gl.static_range(1, 9):
        amax = gl.maximum(amax, gl.abs(xq[c].to(gl.float32)))
    inv = ((254 - _row_exponents(gl.max(amax, axis=1))) << 23).to(gl.float32, bitcast=True)
    for c in gl.static_range(8 if TILE else 9):
        x = xq[c].to(gl.float32) * inv[:, None]
        hi = x.to(gl.float8e4nv)                                         # round to nearest even
        q8.index(c).slice(0, _R, dim=0).store(hi)
        lo = x - hi.to(gl.float16).to(gl.float32)                        # exact
        q8.index(c).slice(_R, _R, dim=0).store(lo.to(gl.float8e4nv))
    if TILE:
        x = xq[8].to(gl.float32) * inv[:, None]
        hi = x.to(gl.bfloat16)
        qpe.slice(0, _R, dim=0).store(hi)
        qpe.slice(_R, _R, dim=0).store((x - hi.to(gl.float32)).to(gl.bfloat16))


@gluon.jit
def _s_e4m3_ss(tile, tile_pe, q8):
    """S^T [64 keys, 32] = K8 [Q_hi; Q_lo]^T as e4m3 MMAs with both operands in shared memory
    (the key tile as TMA left it: K-major, as FP8 MMAs need), all in flight on return."""
    A_L: gl.constexpr = _acc8_layout()
    s = warpgroup_mma(tile.slice(0, 64, dim=1), q8.index(0).permute((1, 0)), gl.zeros([64, 2 * _R], gl.float32, A_L),
                      use_acc=False, is_async=True)
    for c in gl.static_range(1, 8):
        s = warpgroup_mma(tile.slice(c * 64, 64, dim=1), q8.index(c).permute((1, 0)), s, is_async=True)
    return warpgroup_mma(tile_pe, q8.index(8).permute((1, 0)), s, is_async=True)


@gluon.constexpr_function
def _scale_rows_layout():
    """A tile's scales [64 keys, 4] with the keys where S^T's accumulator (``_acc8_layout``)
    holds them (lanes' bits 2-4: keys + 1, 2, 4; a register: + 8; warps: + 16, 32; lanes' bits
    0-1 repeat) and the four scales of a key in registers."""
    return gl.DistributedLinearLayout([[0, 1], [0, 2], [8, 0]], [[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
                                      [[16, 0], [32, 0]], [], [64, 4])


@gluon.constexpr_function
def _v_groups_layout():
    """``_v_load_layout`` with the 512 value columns as [4 groups of 128 columns, 128]: a warp
    holds one group (the tile rows' scale granule), so each thread needs 4 keys' scales."""
    reg = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [2, 0, 0], [8, 0, 0]]
    lane = [[1, 0, 0], [4, 0, 0], [0, 0, 16], [0, 0, 32], [0, 0, 64]]
    warp = [[0, 1, 0], [0, 2, 0]]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [16, 4, 128])


@gluon.jit
def _scaled_group(g, tile_sc, c: gl.constexpr):
    """A landed group's S^T [64 keys, 32] (``_s_group``) -> its Q_hi part + Q_lo part [64, 16]
    (within each thread) times each key's scale of value group c."""
    SL: gl.constexpr = _scale_rows_layout()
    sc = tile_sc.load(SL)
    col = gl.sum(gl.where(gl.arange(0, 4, layout=gl.SliceLayout(0, SL))[None, :] == c, sc, 0.0), axis=1)
    s = gl.sum(g.reshape([64, 2, _R]), axis=1)
    return s * gl.convert_layout(col, gl.SliceLayout(1, s.type.layout))[:, None]


@gluon.jit
def _s_group(tile, q8, g: gl.constexpr):
    """S^T of value group g (columns 128 g .. + 127) of tile rows: two e4m3 MMAs, in flight."""
    A_L: gl.constexpr = _acc8_layout()
    s = warpgroup_mma(tile.slice(128 * g, 64, dim=1), q8.index(2 * g).permute((1, 0)),
                      gl.zeros([64, 2 * _R], gl.float32, A_L), use_acc=False, is_async=True)
    return warpgroup_mma(tile.slice(128 * g + 64, 64, dim=1), q8.index(2 * g + 1).permute((1, 0)), s, is_async=True)


@gluon.jit
def _v_scaled(x, sc):
    """16 keys x 512 FP8 values of tile rows (``_v_load_layout``) times their keys' scales sc
    ([16, 4] in ``SliceLayout(2, _v_groups_layout())``), in fp16 (the scale rounded to fp16,
    then the product: within 2^-10 of the exact value, as close as bf16 rows are to it)."""
    x3 = gl.convert_layout(x.to(gl.float16).reshape([16, 4, 128]), _v_groups_layout())
    y = (x3 * sc.to(gl.float16)[:, :, None]).reshape([16, 512])
    return gl.convert_layout(y, _v_load_layout())


@gluon.jit
def _zero_tail_scales(tile_sc, n0, end):
    """A tail tile's scales of rows >= end -> 0 (unused slots may hold NaN scales)."""
    ZL: gl.constexpr = gl.BlockedLayout([1, 2], [16, 2], [4, 1], [1, 0])
    x = tile_sc.load(ZL)
    keep = (n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, ZL)) < end)[:, None]
    tile_sc.store(gl.where(keep, x, gl.zeros_like(x)))


@gluon.jit
def _v_tile_step(tile, tile_sc, g: gl.constexpr):
    """Keys 16 g .. 16 g + 15 of a stage of tile rows: their values times their scales, fp16."""
    x = tile.slice(16 * g, 16, dim=0).load(_v_load_layout())
    w = tile_sc.slice(16 * g, 16, dim=0).load(gl.SliceLayout(2, _v_groups_layout()))
    return _v_scaled(x, w)

# Registers (``common.MAXNREG``): the second warpgroup's and the TMA loader's (which only issues
# copies and waits); the first warpgroup, the default partition, takes what they free
REGS_WITH_LOADER = gl.constexpr([232, 24])


@aggregate
class Fp8Shared:
    """What the FP8 kernel's two warpgroups share: the query rows as e4m3 operands and where to
    re-read their exponents, the FP8 ring, P^T and the barriers."""
    q8: gl.shared_memory_descriptor          # the query rows as two e4m3 terms (hi, lo) [9, 2 R, 64]
    qpe: gl.shared_memory_descriptor         # tile rows: their bf16 RoPE part [2 R, 64] (else unused)
    Q: gl.tensor                             # the query rows r0 .. at Q + q_off + i stride_qi + h stride_qh
    q_off: gl.tensor
    r0: IntArg
    stride_qi: IntArg
    stride_qh: IntArg
    k8: gl.shared_memory_descriptor          # the FP8 ring of 64-key tiles [NST, 64, 512]
    pe8: gl.shared_memory_descriptor         # their RoPE part
    sc8: gl.shared_memory_descriptor         # tile rows: their scales [NST, 64, 4] (else unused)
    p_smem: gl.shared_memory_descriptor      # P^T a warpgroup [2, 64, R] float16
    ready: gl.shared_memory_descriptor       # a stage landed
    free: gl.shared_memory_descriptor        # a stage released
    xbar: gl.shared_memory_descriptor        # warpgroup 1's result handed to warpgroup 0: its barrier,
    xml: gl.shared_memory_descriptor         # and its row maxima and sums (``merge_buffers``)

    @gluon.constexpr_function
    def __init__(self, q8, qpe, Q, q_off, r0, stride_qi, stride_qh, k8, pe8, sc8, p_smem, ready, free, xbar, xml):
        self.q8, self.qpe, self.Q, self.q_off = q8, qpe, Q, q_off
        self.r0, self.stride_qi, self.stride_qh = constant(r0), constant(stride_qi), constant(stride_qh)
        self.k8, self.pe8, self.sc8, self.p_smem = k8, pe8, sc8, p_smem
        self.ready, self.free, self.xbar, self.xml = ready, free, xbar, xml


@gluon.jit
def _fp8_wg(fs, sh, WG: gl.constexpr, CAUSAL: gl.constexpr, TILE: gl.constexpr):
    """Tiles WG, WG + 2, ... of the split: S^T, softmax down the columns, O^T += V^T P^T.
    TILE: tile rows (a float32 scale per key and 128 values, bf16 k_pe)."""
    A_L: gl.constexpr = acc_layout(_R)
    COL_L: gl.constexpr = gl.SliceLayout(0, A_L)       # one value per query row
    r = fs.r0 + gl.arange(0, _R, layout=COL_L)          # this program's query rows
    if CAUSAL:
        limit = sh.seqlen - sh.S_Q + r // sh.H + 1      # query i sees keys < limit
    else:
        limit = gl.full([_R], 0, gl.int32, COL_L) + sh.seqlen
    # S^T's column scale: the query row's (recomputed here, the same bits as the prologue's), the softmax's
    e = _q_exponents(fs.Q, fs.q_off, sh.H, sh.S_Q, fs.stride_qi, fs.stride_qh, fs.r0, A_L)
    sc = (e << 23).to(gl.float32, bitcast=True) * sh.qk_scale
    m_i = gl.full([_R], float("-inf"), gl.float32, COL_L)
    l_t = gl.zeros([64, _R], gl.float32, A_L)
    acc = gl.zeros([512, _R], gl.float32, A_L)
    p_buf = fs.p_smem.index(WG)
    for t in range((sh.n_tiles - WG + 1) // 2):
        j = 2 * t + WG
        n0 = sh.start + j * 64
        st = j % _NST
        mbarrier.wait(fs.ready.index(st), (j // _NST) & 1)     # the whole tile (see loader)
        tile = fs.k8.index(st)
        tile_pe = fs.pe8.index(st)
        if n0 + 64 > sh.end:       # tail tile: rows >= end may hold NaN (0 * NaN in P V would leak)
            zero_tail(tile, tile_pe, n0, sh.end)
            if TILE:
                _zero_tail_scales(fs.sc8.index(st), n0, sh.end)
            fence_async_shared()
            gl.thread_barrier()
        VL: gl.constexpr = _v_load_layout()
        if TILE:
            # S^T group by group (a key's scale per 128 values), two groups in flight, each summed
            # (Q_hi's part + Q_lo's) and scaled as it lands; the rope part as a bf16 MMA. The
            # values stay in the stage until their O^T steps (below), which release it
            tile_sc = fs.sc8.index(st)
            g0 = _s_group(tile, fs.q8, 0)
            g1 = _s_group(tile, fs.q8, 1)
            g0 = warpgroup_mma_wait(num_outstanding=2, deps=(g0,))
            s8 = _scaled_group(g0, tile_sc, 0)
            g2 = _s_group(tile, fs.q8, 2)
            g1 = warpgroup_mma_wait(num_outstanding=2, deps=(g1,))
            s8 = s8 + _scaled_group(g1, tile_sc, 1)
            g3 = _s_group(tile, fs.q8, 3)
            g2 = warpgroup_mma_wait(num_outstanding=2, deps=(g2,))
            s8 = s8 + _scaled_group(g2, tile_sc, 2)
            RL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 2 * _R, 16])
            rope = warpgroup_mma(tile_pe, fs.qpe.permute((1, 0)), gl.zeros([64, 2 * _R], gl.float32, RL),
                                 use_acc=False, is_async=True)
            g3 = warpgroup_mma_wait(num_outstanding=1, deps=(g3,))
            s8 = s8 + _scaled_group(g3, tile_sc, 3)
            rope = warpgroup_mma_wait(num_outstanding=0, deps=(rope,))
            rope = gl.sum(rope.reshape([64, 2, _R]), axis=1)
            s = gl.convert_layout(s8 + gl.convert_layout(rope, s8.type.layout), A_L)
        else:
            # S^T in flight while the value bytes go into registers; then the stage goes back to
            # the loader. The proxy fence stays although the loads only read: without it the TMA
            # refill raced them on the H200 (outputs differed between identical launches)
            s = _s_e4m3_ss(tile, tile_pe, fs.q8)
            v0 = tile.slice(0, 16, dim=0).load(VL)
            v1 = tile.slice(16, 16, dim=0).load(VL)
            v2 = tile.slice(32, 16, dim=0).load(VL)
            v3 = tile.slice(48, 16, dim=0).load(VL)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(fs.free.index(st), count=1)
            s = gl.convert_layout(gl.sum(s.reshape([64, 2, _R]), axis=1), A_L)    # Q_hi's part + Q_lo's
        # softmax down the columns (per query row, across the tile's keys)
        n = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, A_L))
        visible = (n < sh.end)[:, None] & (n[:, None] < limit[None, :])
        s = gl.where(visible, s * sc[None, :], float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_safe[None, :])
        alpha = gl.exp2(m_i - m_safe)
        l_t = l_t * alpha[None, :] + p
        m_i = m_new
        p_buf.store(_swap_key_bits(p.to(gl.float16), 4))
        fence_async_shared()
        gl.thread_barrier()
        acc = acc * alpha[None, :]
        # O^T += V^T P^T, 16 keys a step. Tile rows: each step's values and scales come from the
        # stage now (not held in registers through the softmax: with the scales that spilled),
        # and the stage goes back to the loader after the last of them
        if TILE:
            a_prev = _v_frag(_v_tile_step(tile, fs.sc8.index(st), 0))
        else:
            a_prev = _v_frag(v0)
        acc = warpgroup_mma(a_prev, p_buf.slice(0, 16, dim=0), acc, is_async=True)
        for g in gl.static_range(1, 4):
            if TILE:
                a_c = _v_frag(_v_tile_step(tile, fs.sc8.index(st), g))
                if g == 3:
                    fence_async_shared()
                    gl.thread_barrier()
                    mbarrier.arrive(fs.free.index(st), count=1)
            elif g == 1:
                a_c = _v_frag(v1)
            elif g == 2:
                a_c = _v_frag(v2)
            else:
                a_c = _v_frag(v3)
            acc = warpgroup_mma(a_c, p_buf.slice(16 * g, 16, dim=0), acc, is_async=True)
            acc, a_prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_prev))
            a_prev = a_c
        acc, a_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_prev))
    # one result per split: warpgroup 1 hands O, its row max and sum to warpgroup 0 through shared
    # memory (O in its ring stage, which no tile reaches any more), and warpgroup 0 merges them
    l_i = gl.sum(l_t, axis=0)
    out = _column_order(acc)
    xo = fs.k8.index(1)._reinterpret(gl.float32, [512, _R], thread_major(_o_layout()))
    if WG == 1:
        send_state(xo, out, fs.xml, m_i, l_i, fs.xbar)
    else:
        w0, w1, lse = merge_weights(fs.xml, fs.xbar, m_i, l_i, sh.v_scale)
        OL: gl.constexpr = _o_layout()
        ROW_L: gl.constexpr = gl.SliceLayout(0, OL)
        out = out * gl.convert_layout(w0, ROW_L)[None, :] + xo.load(OL) * gl.convert_layout(w1, ROW_L)[None, :]
        d = gl.arange(0, 512, layout=gl.SliceLayout(1, OL))
        ro = fs.r0 + gl.arange(0, _R, layout=ROW_L)
        row = sh.O + sh.o_base + (ro // sh.H) * sh.stride_oi + (ro % sh.H) * sh.stride_oh
        gl.store(row[None, :] + d[:, None], out.to(sh.O.dtype.element_ty),
                 mask=(ro < sh.H * sh.S_Q)[None, :] & (d < 512)[:, None])
        gl.store(sh.LSE + sh.l_base + (r // sh.H) * sh.stride_li + r % sh.H, lse, mask=r < sh.H * sh.S_Q)


@gluon.jit
def _fp8_kernel(
    Q, kv_desc, pe_desc, sc_desc, BT, SEQLENS, O, LSE, INFO,
    stride_qb, stride_qi, stride_qh,
    stride_bt, bt_width,
    stride_os, stride_ob, stride_oi, stride_oh,
    stride_ls, stride_lb, stride_li,
    H, S_Q, B, block_size, num_splits, eq_splits, qk_scale, v_scale,
    CAUSAL: gl.constexpr, TILE: gl.constexpr, ROW_GROUPS: gl.constexpr, P_SM: gl.constexpr, Q8_SM: gl.constexpr,
    QPE_SM: gl.constexpr, BLOCK_B: gl.constexpr, num_warps: gl.constexpr, DIRECT: gl.constexpr = False,
):
    """TILE: tile rows (``mla.quant``: 512 e4m3 values, 4 float32 scales, 64 bf16 k_pe; pe_desc
    and sc_desc over the last two); else FP8 rows of 576 e4m3 values (pe_desc, sc_desc unused)."""
    gl.static_assert(num_warps == 4)
    # the barriers first: they read no memory, so under a dependent launch they are set up while
    # the kernel before drains (``wait_prerequisites``)
    ready, free = ring_barriers(_NST, 1)
    xbar, xml = merge_buffers(_R)     # warpgroup 1's result -> warpgroup 0
    wait_prerequisites()
    # program (the plan's program p, ``split_plan``; row group g) at p ROW_GROUPS + g: the
    # row groups of a split run side by side, so that the second reads its keys from L2
    if ROW_GROUPS == 1:
        p = gl.program_id(0)
        r0 = 0
    else:
        p = gl.program_id(0) // ROW_GROUPS
        r0 = (gl.program_id(0) % ROW_GROUPS) * _R      # query rows r0 .. r0 + 15 (m = i H + h)
    # the loads first (the query, the lengths, the first tile's block), then the set-up under them
    b, seqlen, start, end, n_tiles, bt_row, blk0, xq, slot = plan_and_query(
        SEQLENS, INFO, BT, stride_bt, bt_width, block_size, B, p, num_splits, eq_splits, BLOCK_B, Q, stride_qb, H, S_Q,
        stride_qi, stride_qh, r0, _R, DIRECT)
    if slot < 0:      # idle (equal lengths, more programs than they use): its slot is never read
        return
    q8 = gl.allocate_shared_memory(gl.float8e4nv, [9, 2 * _R, 64], Q8_SM)
    p_smem = gl.allocate_shared_memory(gl.float16, [2, 64, _R], P_SM)
    k8 = gl.allocate_shared_memory(kv_desc.dtype, [_NST, 64, 512], kv_desc.layout)
    if TILE:
        pe8 = gl.allocate_shared_memory(pe_desc.dtype, [_NST, 64, 64], pe_desc.layout)
        sc8 = gl.allocate_shared_memory(sc_desc.dtype, [_NST, 64, 4], sc_desc.layout)
        qpe = gl.allocate_shared_memory(gl.bfloat16, [2 * _R, 64], QPE_SM)
    else:
        pe8 = gl.allocate_shared_memory(kv_desc.dtype, [_NST, 64, 64], kv_desc.layout)
        sc8 = pe8      # not used
        qpe = p_smem   # not used
    # FP8 rows: the first tile goes out now, so that the memory works under the query split. Each
    # copy into the ring's one allocation costs the prologue a thread barrier: measured, copying 2
    # or 4 tiles here is slower, and tile rows (11 copies a tile) lose with one
    KV_FMT: gl.constexpr = 2 if TILE else 1
    PRE: gl.constexpr = 0 if TILE else 1
    if PRE > 0:
        if n_tiles > 0:
            copy_fp8_tile(k8, pe8, sc8, ready, 0, blk0 * block_size + start % block_size, kv_desc, pe_desc, sc_desc,
                           KV_FMT)
    # the query rows as two e4m3 terms under a power-of-two scale per row
    _store_q8(xq, q8, qpe, TILE)
    fence_async_shared()
    gl.thread_barrier()
    launch_dependents()

    # the program writes the plan's slot: p, or the output (one split, or DIRECT and alone)
    o_base = slot.to(gl.int64) * stride_os + b.to(gl.int64) * stride_ob
    l_base = slot.to(gl.int64) * stride_ls + b.to(gl.int64) * stride_lb
    fs = Fp8Shared(q8, qpe, Q, b.to(gl.int64) * stride_qb, r0, stride_qi, stride_qh, k8, pe8, sc8, p_smem, ready,
                   free, xbar, xml)
    sh = SplitShare(O, LSE, o_base, l_base, seqlen, start, end, n_tiles, H, S_Q, stride_oi, stride_oh, stride_li,
                    qk_scale, v_scale)
    gl.warp_specialize([
        (_fp8_wg, (fs, sh, 0, CAUSAL, TILE)),
        (_fp8_wg, (fs, sh, 1, CAUSAL, TILE)),
        (loader, (k8, pe8, sc8, ready, free, start, n_tiles, kv_desc, pe_desc, sc_desc, BT, bt_row, block_size,
                  blk0, KV_FMT, False, gl.minimum(n_tiles, PRE))),
    ], [4, 1], REGS_WITH_LOADER)


# query rows a launch takes: one program per 16 rows (a row group) and split; each group reads
# the split's keys itself (the second read mostly from L2), so only a few groups pay
MAX_ROWS = 2 * _R.value


def takes(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """True when ``launch_fp8`` handles these inputs: FP8 rows (float8_e4m3fn) or FP8 tile rows
    (uint8, ``mla.quant``) that ``common.supports`` accepts, and at most ``MAX_ROWS`` query
    rows (H * s_q)."""
    return (kv_cache.dtype in (torch.float8_e4m3fn, torch.uint8) and q.dim() == 4
            and q.shape[1] * q.shape[2] <= MAX_ROWS and supports(q, kv_cache))


def launch(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal=True,
           num_splits: int | tuple[int, int] | None = None, kv_scale: float = 1.0, *, pdl: bool = True):
    """Absorbed MLA decode (contract of ``mla.ops.reference.mla_decode``) over FP8 rows (kv_scale
    applies) or FP8 tile rows (their own scales; kv_scale is not used) for H * s_q <= ``MAX_ROWS``
    (``takes``), 16 query rows a program. No host synchronisation.
    num_splits: programs a sequence, or (that, programs a sequence at equal lengths: the plan idles the
    rest, ``split_plan``); default ``common.launch_splits``."""
    if kv_cache.dim() == 4:
        kv_cache = kv_cache.squeeze(2)
    B, s_q, H, d = q.shape
    # the kernel takes the table's row stride only, and reads lengths at unit stride
    block_table, cache_seqlens = block_table.contiguous(), cache_seqlens.contiguous()
    block_size = kv_cache.shape[1]
    if head_dim_v != D_V or d != D_QK or not takes(q, kv_cache):
        raise ValueError("fp8.launch: expected float8_e4m3fn rows of 576 or FP8 tile rows that "
                         f"common.supports() takes, head_dim_v 512 and H * s_q <= {MAX_ROWS}")
    max_len = block_table.shape[1] * block_size
    groups = triton.cdiv(H * s_q, _R.value)
    fmt = kv_fmt(kv_cache)
    v_scale = float(kv_scale) if fmt == 1 else 1.0

    def split_kernel(o_part, l_part, info, S, eq, direct):
        kv_desc, pe_desc, sc_desc = descriptors(kv_cache, fmt, 64, gl.float16)
        _fp8_kernel[(S * B * groups,)](
            q, kv_desc, pe_desc, sc_desc, block_table, cache_seqlens, o_part, l_part, info,
            q.stride(0), q.stride(1), q.stride(2),
            block_table.stride(0), block_table.shape[1],
            o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
            l_part.stride(0), l_part.stride(1), l_part.stride(2),
            H, s_q, B, block_size, S, eq, softmax_scale * LOG2E * v_scale, v_scale,
            CAUSAL=bool(causal), TILE=fmt == 2, ROW_GROUPS=groups, BLOCK_B=block_b(B),
            P_SM=gl.NVMMASharedLayout.get_default_for([64, _R], gl.float16),
            Q8_SM=gl.NVMMASharedLayout.get_default_for([2 * _R, 64], gl.float8e4nv),
            QPE_SM=gl.NVMMASharedLayout.get_default_for([2 * _R, 64], gl.bfloat16), DIRECT=direct,
            num_warps=4, maxnreg=MAXNREG, **pdl_launch(H * s_q, pdl),
        )
    # each row group as a sequence of its own
    splits = num_splits if num_splits is not None else (
        lambda: launch_splits(B, min(H * s_q, _R.value), max_len, q.device, groups))
    # partials in out's dtype, 16-byte stores a thread (thread-major rows): less to write and
    # read back than float32 ones
    return run_splits(q, D_V, max_len, splits, split_kernel, part_dtype=q.dtype, pdl=pdl, direct=True)
