"""The narrow kernel: Hopper decode for few query rows (H * s_q <= 32, e.g. 16 heads per GPU under TP 8): the
keys are the MMAs' M dimension ("swap AB").

The seesaw (``seesaw``) puts the query rows on M, which a warpgroup MMA fixes at 64: with 16
rows three quarters of its tensor work is padding, and at 16 heads that kernel is as much
compute-bound as memory-bound (the same keys per us per SM at 16 and at 128 heads on the H200), so an FP8 cache (half the bytes) cannot make it faster. Here each warpgroup
computes, for a 64-key tile,

    S^T [64 keys, R] = K [64, 576] . Q^T [576, R]          (A: the K tile, B: Q, both in shared)
    O^T [512, R]    += V^T [512, 64] . P^T [64, R]         (A: the K tile read transposed, B: P^T)

with R = 16 or 32 query rows, a quarter or half of the padded work. The softmax runs down the
columns of S^T (per query row, across the keys of the tile).

Grid (splits x B), shared out over the sequences by length (``split_plan``).
Partitions: two warpgroups that take alternate tiles, each with its own online softmax and its
own O^T, and a 1-warp TMA loader:
    bf16/fp16 rows: a ring of two 64-key tiles, one per warpgroup, 9 boxes per tile;
    FP8 rows:       a staging ring of 32-key FP8 tiles that each warpgroup widens into its own
                    64-key tile (``common.widen``) before its S^T.
Masking as in the seesaw: tail rows of a tile zeroed in shared memory (0 * NaN), keys past
each query's causal limit at -inf. At the end warpgroup 1 hands O^T, its row max and sum to
warpgroup 0 through its own tile (thread-major, ``common.thread_major``) and warpgroup 0
merges them: one result per split for ``combine``, or the output itself when there is one
split (two results per split would double the partials the combine reads; a plain row-major
buffer for the hand-over costs bank conflicts).
"""
import torch
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
from .common import (D_QK, D_V, LOG2E, MAXNREG, SplitShare, acc_layout, aggregate, copy_tile, descriptors,
                     launch_dependents, launch_splits, loader, merge_buffers, merge_weights, pdl_launch, plan_and_query,
                     ring_barriers, send_state, supports, thread_major, wait_prerequisites, widen, zero_tail)

__all__ = ["launch", "narrow_rows"]

# Registers (``common.MAXNREG``): the second warpgroup's and the TMA loader's (which only issues
# copies and waits); the first warpgroup, the default partition, takes what they free
REGS_WITH_LOADER = gl.constexpr([232, 24])


@aggregate
class NarrowSmem:
    """The narrow kernel's shared memory and barriers, as its two warpgroups use them."""
    q_smem: gl.shared_memory_descriptor      # the query rows' latent part [R, 512] (S^T's B operand)
    q_pe: gl.shared_memory_descriptor        # their RoPE part [R, 64]
    k_smem: gl.shared_memory_descriptor      # one 64-key tile a warpgroup [2, 64, 512]
    kpe_smem: gl.shared_memory_descriptor    # their RoPE part [2, 64, 64]
    p_smem: gl.shared_memory_descriptor      # P^T a warpgroup [2, 64, R]
    st8: gl.tuple                            # FP8 rows: the staging ring (k8, pe8, sc8, free)
    ready: gl.shared_memory_descriptor       # the loader's "landed" barriers
    free: gl.shared_memory_descriptor        # a tile (or stage) released
    turn: gl.shared_memory_descriptor        # FP8 rows: the two warpgroups widen in turn
    xbar: gl.shared_memory_descriptor        # warpgroup 1's result handed to warpgroup 0: its barrier,
    xml: gl.shared_memory_descriptor         # and its row maxima and sums (``merge_buffers``)

    @gluon.constexpr_function
    def __init__(self, q_smem, q_pe, k_smem, kpe_smem, p_smem, st8, ready, free, turn, xbar, xml):
        self.q_smem, self.q_pe, self.k_smem, self.kpe_smem, self.p_smem = q_smem, q_pe, k_smem, kpe_smem, p_smem
        self.st8, self.ready, self.free, self.turn, self.xbar, self.xml = st8, ready, free, turn, xbar, xml


@gluon.jit
def _narrow_wg(sm, sh, WG: gl.constexpr, CAUSAL: gl.constexpr, KV_FMT: gl.constexpr):
    """Tiles WG, WG + 2, ... of the split: S^T, softmax down the columns, O^T += V^T P^T."""
    R: gl.constexpr = sm.q_smem.shape[0]
    NBUF: gl.constexpr = sm.k_smem.shape[0]
    A_L: gl.constexpr = acc_layout(R)
    COL_L: gl.constexpr = gl.SliceLayout(0, A_L)       # one value per query row
    dtype: gl.constexpr = sm.q_smem.dtype
    r = gl.arange(0, R, layout=COL_L)
    if CAUSAL:
        limit = sh.seqlen - sh.S_Q + r // sh.H + 1      # query i sees keys < limit
    else:
        limit = gl.full([R], 0, gl.int32, COL_L) + sh.seqlen
    m_i = gl.full([R], float("-inf"), gl.float32, COL_L)
    l_i = gl.full([R], 0.0, gl.float32, COL_L)
    acc = gl.zeros([512, R], gl.float32, A_L)
    k_buf = sm.k_smem.index(WG)
    kpe_buf = sm.kpe_smem.index(WG)
    for t in range((sh.n_tiles - WG + 1) // 2):
        j = 2 * t + WG
        n0 = sh.start + j * 64
        ph = (j // NBUF) & 1
        if KV_FMT == 0:
            if n0 + 64 > sh.end:   # tail tile: wait for all of it, zero rows >= end
                for c in gl.static_range(9):
                    mbarrier.wait(sm.ready.index(WG * 9 + c), ph)
                zero_tail(k_buf, kpe_buf, n0, sh.end)
                fence_async_shared()
                gl.thread_barrier()
        else:                   # widen the two 32-key FP8 halves (an absent second half -> zeros)
            # in turn with the other warpgroup (tile j - 1 first): the staging ring is consumed in
            # order, so a stage's ready barrier is never waited on a phase ahead of its last landing
            if j > 0:
                mbarrier.wait(sm.turn.index(1 - WG), ((j - 1) // 2) & 1)
            widen(sm.st8, sm.ready, 2 * j, k_buf.slice(0, 32, dim=0), kpe_buf.slice(0, 32, dim=0), n0, sh.end, KV_FMT)
            if n0 + 32 < sh.end:
                widen(sm.st8, sm.ready, 2 * j + 1, k_buf.slice(32, 32, dim=0), kpe_buf.slice(32, 32, dim=0), n0 + 32,
                       sh.end, KV_FMT)
            else:
                zero_tail(k_buf, kpe_buf, n0, sh.end)
                fence_async_shared()
                gl.thread_barrier()
            mbarrier.arrive(sm.turn.index(WG), count=1)
        s = gl.zeros([64, R], gl.float32, A_L)
        for c in gl.static_range(8):
            if KV_FMT == 0:
                mbarrier.wait(sm.ready.index(WG * 9 + c), ph)
            s = warpgroup_mma(k_buf.slice(c * 64, 64, dim=1), sm.q_smem.slice(c * 64, 64, dim=1).permute((1, 0)), s,
                              use_acc=c > 0, is_async=True)
        if KV_FMT == 0:
            mbarrier.wait(sm.ready.index(WG * 9 + 8), ph)
        s = warpgroup_mma(kpe_buf, sm.q_pe.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        n = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, A_L))
        visible = (n < sh.end)[:, None] & (n[:, None] < limit[None, :])
        s = gl.where(visible, s * sh.qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_safe[None, :])
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha + gl.sum(p, axis=0)
        m_i = m_new
        sm.p_smem.index(WG).store(p.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        acc = acc * alpha[None, :]
        acc = warpgroup_mma(k_buf.slice(0, 512, dim=1).permute((1, 0)), sm.p_smem.index(WG), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        if KV_FMT == 0:
            mbarrier.arrive(sm.free.index(WG), count=1)
    # one result per split: warpgroup 1 hands O^T, its row max and sum to warpgroup 0 through
    # shared memory (in its own tile, which no load reaches any more), warpgroup 0 merges them
    XL: gl.constexpr = thread_major(gl.to_linear_layout(A_L, [512, R]))
    xo = sm.k_smem.index(1)._reinterpret(gl.float32, [512, R], XL)
    if WG == 1:
        send_state(xo, acc, sm.xml, m_i, l_i, sm.xbar)
    else:
        w0, w1, lse = merge_weights(sm.xml, sm.xbar, m_i, l_i, sh.v_scale)
        out = acc * w0[None, :] + xo.load(A_L) * w1[None, :]
        d = gl.arange(0, 512, layout=gl.SliceLayout(1, A_L))
        row = sh.O + sh.o_base + (r // sh.H) * sh.stride_oi + (r % sh.H) * sh.stride_oh
        gl.store(row[None, :] + d[:, None], out.to(sh.O.dtype.element_ty),
                 mask=(r < sh.H * sh.S_Q)[None, :] & (d < 512)[:, None])
        gl.store(sh.LSE + sh.l_base + (r // sh.H) * sh.stride_li + r % sh.H, lse, mask=r < sh.H * sh.S_Q)


@gluon.jit
def _narrow_kernel(
    Q, kv_desc, pe_desc, sc_desc, BT, SEQLENS, O, LSE, INFO,
    stride_qb, stride_qi, stride_qh,
    stride_bt, bt_width,
    stride_os, stride_ob, stride_oi, stride_oh,
    stride_ls, stride_lb, stride_li,
    H, S_Q, B, block_size, num_splits, eq_splits, qk_scale, v_scale,
    R: gl.constexpr, CAUSAL: gl.constexpr, KV_FMT: gl.constexpr, NST: gl.constexpr, dtype: gl.constexpr,
    SM_L: gl.constexpr, P_SM: gl.constexpr, BLOCK_B: gl.constexpr, num_warps: gl.constexpr,
):
    gl.static_assert(num_warps == 4)
    wait_prerequisites()
    p = gl.program_id(0)           # the plan's program (``split_plan``)
    q_smem = gl.allocate_shared_memory(dtype, [R, 512], SM_L)
    qpe_smem = gl.allocate_shared_memory(dtype, [R, 64], SM_L)
    k_smem = gl.allocate_shared_memory(dtype, [2, 64, 512], SM_L)      # one 64-key tile per warpgroup
    kpe_smem = gl.allocate_shared_memory(dtype, [2, 64, 64], SM_L)
    p_smem = gl.allocate_shared_memory(dtype, [2, 64, R], P_SM)
    # the loads first (the lengths, the query, the first tile's block), then the set-up under them
    b, seqlen, start, end, n_tiles, bt_row, blk0, xq, slot = plan_and_query(
        SEQLENS, INFO, BT, stride_bt, bt_width, block_size, B, p, num_splits, eq_splits, BLOCK_B, Q, stride_qb, H, S_Q,
        stride_qi, stride_qh, 0, R)
    if slot < 0:      # idle (equal lengths, more programs than they use): its slot is never read
        return
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())   # FP8: widening in turn
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    xbar, xml = merge_buffers(R)     # warpgroup 1's result -> warpgroup 0
    if KV_FMT == 0:   # the loader fills the two tiles (tile j -> warpgroup j % 2)
        ready, free = ring_barriers(2)
        st8 = (k_smem, kpe_smem, k_smem, free)            # not used
        ring, ring_pe, ring_sc = k_smem, kpe_smem, k_smem
        n_loads = n_tiles
        # tile 0 goes out now, under the query's landing and stores (the loader starts at tile 1)
        if n_tiles > 0:
            copy_tile(k_smem, kpe_smem, ready, 0, blk0 * block_size + start % block_size, kv_desc)
    else:             # FP8 staging ring of 32-key tiles; each warpgroup widens two into its tile
        k8 = gl.allocate_shared_memory(kv_desc.dtype, [NST, 32, 512], kv_desc.layout)
        if KV_FMT == 1:
            pe8 = gl.allocate_shared_memory(kv_desc.dtype, [NST, 32, 64], kv_desc.layout)
            sc8 = k8                                       # not used
        else:
            pe8 = gl.allocate_shared_memory(pe_desc.dtype, [NST, 32, 64], pe_desc.layout)
            sc8 = gl.allocate_shared_memory(sc_desc.dtype, [NST, 32, 4], sc_desc.layout)
        ready, free = ring_barriers(NST)
        st8 = (k8, pe8, sc8, free)
        ring, ring_pe, ring_sc = k8, pe8, sc8
        n_loads = gl.maximum(end - start + 31, 0) // 32

    # the query rows (zero past H * s_q) -> shared memory, the B operand of S^T
    for c in gl.static_range(8):
        q_smem.slice(c * 64, 64, dim=1).store(xq[c].to(dtype))
    qpe_smem.store(xq[8].to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    launch_dependents()

    # the program writes the plan's slot: p (the output itself when there is one split)
    o_base = slot.to(gl.int64) * stride_os + b.to(gl.int64) * stride_ob
    l_base = slot.to(gl.int64) * stride_ls + b.to(gl.int64) * stride_lb
    sm = NarrowSmem(q_smem, qpe_smem, k_smem, kpe_smem, p_smem, st8, ready, free, turn, xbar, xml)
    sh = SplitShare(O, LSE, o_base, l_base, seqlen, start, end, n_tiles, H, S_Q, stride_oi, stride_oh, stride_li,
                    qk_scale, v_scale)
    gl.warp_specialize([
        (_narrow_wg, (sm, sh, 0, CAUSAL, KV_FMT)),
        (_narrow_wg, (sm, sh, 1, CAUSAL, KV_FMT)),
        (loader, (ring, ring_pe, ring_sc, ready, free, start, n_loads, kv_desc, pe_desc, sc_desc, BT, bt_row,
                   block_size, blk0, KV_FMT, False, gl.minimum(n_loads, 1 if KV_FMT == 0 else 0))),
    ], [4, 1], REGS_WITH_LOADER)


def narrow_rows(q: torch.Tensor, kv_cache: torch.Tensor) -> int:
    """The padded row count R (16 or 32) this kernel uses for q, or 0 when it does not take
    them: H * s_q > 32, or 32 rows over FP8 tile rows (two staging stages would not fit in
    shared memory beside Q and P^T)."""
    rows = q.shape[1] * q.shape[2]
    R = 16 if rows <= 16 else 32 if rows <= 32 else 0
    return 0 if (R == 32 and kv_cache.dtype == torch.uint8) else R


def launch(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal=True,
           num_splits: int | tuple[int, int] | None = None, kv_scale: float = 1.0, *, pdl: bool = True):
    """Absorbed MLA decode (contract of ``mla.ops.reference.mla_decode``) for H * s_q <= 32 on
    the inputs ``common.supports`` takes. No host synchronisation.
    num_splits: programs a sequence, or (that, programs a sequence at equal lengths: the plan idles the
    rest, ``split_plan``); default ``common.launch_splits``."""
    if kv_cache.dim() == 4:
        kv_cache = kv_cache.squeeze(2)
    B, s_q, H, d = q.shape
    # the kernel takes the table's row stride only, and reads lengths at unit stride
    block_table, cache_seqlens = block_table.contiguous(), cache_seqlens.contiguous()
    num_blocks, block_size, _ = kv_cache.shape
    R = narrow_rows(q, kv_cache)
    if head_dim_v != D_V or d != D_QK or not R or not supports(q, kv_cache, block_size):
        raise ValueError("narrow.launch: unsupported shapes/dtypes/layout (see narrow_rows() and common.supports())")
    fmt = kv_fmt(kv_cache)
    max_len = block_table.shape[1] * block_size
    gdt = gl.float16 if q.dtype == torch.float16 or fmt == 1 else gl.bfloat16
    v_scale = float(kv_scale) if fmt == 1 else 1.0
    # FP8 staging stages of 32 keys: as many as fit in 227 KB next to Q, two 64-key tiles and P^T
    nst = 3 if (fmt == 1 and R == 16) else 2

    def split_kernel(o_part, l_part, info, S, eq, direct):    # float32 partials: never direct
        kv_desc, pe_desc, sc_desc = descriptors(kv_cache, fmt, 64 if fmt == 0 else 32, gdt)
        _narrow_kernel[(S * B,)](
            q, kv_desc, pe_desc, sc_desc, block_table, cache_seqlens, o_part, l_part, info,
            q.stride(0), q.stride(1), q.stride(2),
            block_table.stride(0), block_table.shape[1],
            o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
            l_part.stride(0), l_part.stride(1), l_part.stride(2),
            H, s_q, B, block_size, S, eq, softmax_scale * LOG2E * v_scale, v_scale,
            R=R, CAUSAL=bool(causal), KV_FMT=fmt, NST=nst, dtype=gdt,
            SM_L=gl.NVMMASharedLayout.get_default_for([64, 64], gdt),
            P_SM=gl.NVMMASharedLayout.get_default_for([64, R], gdt), BLOCK_B=block_b(B),
            num_warps=4, maxnreg=MAXNREG, **pdl_launch(H * s_q, pdl),
        )
    splits = num_splits if num_splits is not None else (lambda: launch_splits(B, H * s_q, max_len, q.device))
    return run_splits(q, D_V, max_len, splits, split_kernel, pdl=pdl)
