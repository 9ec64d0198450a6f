"""Sparse MLA attention on Hopper (sm90) in Gluon: the seesaw (``seesaw``) over gathered keys.

Same contract as ``mla.ops.sparse_attention.launch`` (the Triton kernel) for what ``supports``
takes: bf16/fp16 queries [N, H, 576] over rows of 576 values in their dtype, of FP8 rows
(float8_e4m3fn, per-tensor kv_scale) or of FP8 tile rows (uint8, 656 bytes, ``mla.quant``), as
[num_blocks, block_size, width] (one 2-D matrix of rows), indices [N, topk] int32 flat slots
(-1 = none), head_dim_v 512. Every query token is its own "sequence" of topk keys (its index
list), so decode (N = B s_q) and prefill are the same launch.

Grid (ceil(H / 64), N * S): 64 heads of token t against split s of its index list, S from
shapes only (``default_splits``). The compute is the seesaw's, unchanged: two warpgroups take
alternate key tiles and hand each other P; only the keys' way in differs:

    rows in q's dtype: one warpgroup (``common.gather_loader``) copies each indexed row by
             cp.async, 16 bytes a thread and instruction, into the seesaw's ring of two 64-key
             tiles (four of 32)
    FP8 rows: the producer warpgroup (``_gather_producer``) copies each indexed FP8 row by
             cp.async into two staging stages of 32 keys, then widens a stage into one of
             three 32-key K slots in the MMAs' dtype (``common.widen_by_parts``, as the dense
             seesaw's producer does with tiles it copied by TMA), while the two warpgroups
             multiply the slots widened before
    both:    a row whose index is -1, outside the pool or past the split is zero-filled,
             never read
    softmax: the tile's keys masked by their indices (``common.key_mask``), not by position;
             split 0 starts from the attention sink (``common.sink_start``: a key of value 0)
    out:     one split and whole 64-head tiles in the MMAs' dtype: straight into out by TMA
             (the seesaw's epilogue); else float32 partials and ``combine.combine``
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from ..._jit import kv_fmt, num_sms
from ..combine import combine
from .common import (_ROW, BLOCK_M, D_QK, D_V, LOG2E, MAXNREG, Gathered, gather_loader, tile_row_parts,
                     widen_by_parts)
from .seesaw import REGS_WITH_LOADER, REGS_WITH_PRODUCER, SeesawWork, _wg0, _wg1, seesaw_buffers

__all__ = ["supports", "default_splits", "default_block_n", "launch"]

# FP8 rows: 16 bytes of FP8 a thread, [32 keys, 64 values] a warpgroup; k_pe of tile rows (bf16), 16
# bytes a thread; their scales, a float32 a thread. All three put key r on the same threads.
_FP8_L = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
# [box, key, value] copies of a stage's eight 64-value boxes (``_copy_fp8_rows``): _FP8_L over
# keys and values, the boxes on top; the stage's shared layout (64-byte swizzle) seen as boxes
_FP8_3L = gl.BlockedLayout([1, 1, 16], [1, 8, 4], [1, 4, 1], [2, 1, 0])
_BOX8_L = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=3)
_PE16_L = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
_SC_L = gl.BlockedLayout([1, 1], [8, 4], [4, 1], [1, 0])


@gluon.jit
def _gathered_rows(sp, n0, end, BN: gl.constexpr):
    """The cache rows of index positions n0 .. n0 + BN (int64, 0 where there is none) and
    which exist (an index in [0, num_slots) before end), keys on ``_FP8_L``'s rows."""
    n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, _FP8_L))
    slot = gl.load(sp.idx_row + n, mask=n < end, other=-1)
    ok = (slot >= 0) & (slot < sp.num_slots)
    return gl.where(ok, slot, 0).to(gl.int64), ok


@gluon.jit
def _copy_fp8_rows(st8, st, row, ok, KV, PE, SC, stride_row, stride_pe, stride_sc, KV_FMT: gl.constexpr):
    """cp.async of FP8 rows ``row`` (``_gathered_rows``; those not ok zero-filled, never read)
    into staging stage st: the latent 64 values an instruction, then k_pe (e4m3 at value 512 of
    an FP8 row; bf16 in PE for tile rows) and a tile row's four scales (SC); one commit group."""
    k8, pe8, sc8 = st8
    BN: gl.constexpr = k8.shape[1]
    # the eight boxes in one copy: a loop of copies had a warpgroup barrier between each two
    box = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, _FP8_3L)))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, _FP8_3L)))
    base = (KV + gl.convert_layout(row, gl.SliceLayout(0, gl.SliceLayout(2, _FP8_3L))) * stride_row)[None, :, None]
    live = gl.convert_layout(ok, gl.SliceLayout(0, gl.SliceLayout(2, _FP8_3L)))[None, :, None] & (cols < 64)[None, None, :]
    async_copy.async_copy_global_to_shared(k8.index(st)._reinterpret(k8.dtype, [8, BN, 64], _BOX8_L),
                                           base + (box * 64)[:, None, None] + cols[None, None, :],
                                           mask=live & (box < 8)[:, None, None])
    if KV_FMT == 1:
        async_copy.async_copy_global_to_shared(pe8.index(st)._reinterpret(pe8.dtype, [1, BN, 64], _BOX8_L),
                                               base + (512 + cols)[None, None, :], mask=live)
    else:
        # a row is 16-byte aligned (``supports``): its k_pe is too, 8 bf16 values a copy
        rp = gl.multiple_of(gl.convert_layout(row, gl.SliceLayout(1, _PE16_L)) * stride_pe, 8)
        okp = gl.convert_layout(ok, gl.SliceLayout(1, _PE16_L))
        cp = gl.arange(0, 64, layout=gl.SliceLayout(0, _PE16_L))
        async_copy.async_copy_global_to_shared(pe8.index(st), (PE + rp)[:, None] + cp[None, :],
                                               mask=okp[:, None] & (cp < 64)[None, :])
        rs = gl.convert_layout(row, gl.SliceLayout(1, _SC_L))
        oks = gl.convert_layout(ok, gl.SliceLayout(1, _SC_L))
        cs = gl.arange(0, 4, layout=gl.SliceLayout(0, _SC_L))
        async_copy.async_copy_global_to_shared(sc8.index(st), (SC + rs * stride_sc)[:, None] + cs[None, :],
                                               mask=oks[:, None] & (cs < 4)[None, :])
    async_copy.commit_group()


@gluon.jit
def _gather_producer(st8, k_smem, kpe_smem, kready, empty, KV, PE, SC, stride_row, stride_pe, stride_sc, sp, start,
                     end, n_tiles, KV_FMT: gl.constexpr):
    """FP8 rows: the fourth warpgroup gathers and widens, so the two that compute only wait.
    Tile j: its rows copied by cp.async into staging stage j % NST, NST tiles ahead (one commit
    group a tile: tile j has landed once at most NST - 1 groups are outstanding); once both
    warpgroups released K slot j % NBUF (``empty``), widened into it (``widen_by_parts``),
    fenced for the MMAs' proxy and signalled on kready. The indices of tile j + NST are loaded
    before the waits, so their latency passes under them."""
    k8, pe8, sc8 = st8
    BN: gl.constexpr = k_smem.shape[1]
    NBUF: gl.constexpr = k_smem.shape[0]
    NST: gl.constexpr = k8.shape[0]
    for j in gl.static_range(NST):      # a group a stage even past the split (no rows: nothing copied)
        row, ok = _gathered_rows(sp, start + j * BN, end, BN)
        _copy_fp8_rows(st8, j, row, ok, KV, PE, SC, stride_row, stride_pe, stride_sc, KV_FMT)
    for j in range(n_tiles):
        st = j % NST
        b = j % NBUF
        kph = (j // NBUF) & 1
        row, ok = _gathered_rows(sp, start + (j + NST) * BN, end, BN)
        mbarrier.wait(empty.index(2 * b), kph ^ 1)
        mbarrier.wait(empty.index(2 * b + 1), kph ^ 1)
        async_copy.wait_group(NST - 1)
        gl.thread_barrier()           # every thread's copies of tile j landed
        widen_by_parts(k8, pe8, sc8, st, k_smem.index(b), kpe_smem.index(b), start + j * BN, end, KV_FMT, False)
        fence_async_shared()
        gl.thread_barrier()           # every thread's part written (and the stage read)
        mbarrier.arrive(kready.index(b), count=1)
        _copy_fp8_rows(st8, st, row, ok, KV, PE, SC, stride_row, stride_pe, stride_sc, KV_FMT)
    async_copy.wait_group(0)          # no copy outlives the program


@gluon.jit
def _sparse_kernel(
    Q, KV, PE, SC, IDX, SINK, O, LSE, o_desc,
    stride_qn, stride_qh, stride_row, stride_pe, stride_sc, stride_in,
    stride_os, stride_on, stride_oh, stride_ls, stride_ln,
    H, num_slots, topk, chunk, num_splits, qk_scale, v_scale, has_sink,
    BN: gl.constexpr, dtype: gl.constexpr, SM_L: gl.constexpr, P_SM: gl.constexpr, TMA_OUT: gl.constexpr,
    KV_FMT: gl.constexpr, num_warps: gl.constexpr,
):
    gl.static_assert(num_warps == 4)
    pid_m = gl.program_id(0)
    p = gl.program_id(1)
    t = p // num_splits
    split = p % num_splits

    if KV_FMT == 0:
        NBUF: gl.constexpr = 128 // BN      # two tiles of 64 keys or four of 32 (the seesaw's rings)
        sm = seesaw_buffers(dtype, NBUF, BN, SM_L, P_SM, NBUF, 128)    # ready: a tile's 128 copiers
    else:
        # FP8 rows (32-key tiles): three K slots the producer widens into (the dense seesaw's), and
        # two FP8 staging stages: 221 KB of shared memory with tile rows
        sm = seesaw_buffers(dtype, 3, BN, SM_L, P_SM, 3, 1)
        ST_L: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, 64], gl.float8e4nv)
        k8 = gl.allocate_shared_memory(gl.float8e4nv, [2, BN, 512], ST_L)
        if KV_FMT == 1:
            pe8 = gl.allocate_shared_memory(gl.float8e4nv, [2, BN, 64], ST_L)
            sc8 = sm.stats[0]                            # not used
        else:
            pe8 = gl.allocate_shared_memory(gl.bfloat16, [2, BN, 64],
                                            gl.NVMMASharedLayout.get_default_for([BN, 64], gl.bfloat16))
            sc8 = gl.allocate_shared_memory(gl.float32, [2, BN, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))

    start = split * chunk
    end = gl.minimum(start + chunk, topk)
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), BN)
    ml = pid_m * 64
    t64 = t.to(gl.int64)
    fence_async_shared()      # the barriers' init, before the partitions use them
    gl.thread_barrier()

    sp = Gathered(IDX + t64 * stride_in, num_slots, SINK, has_sink * (split == 0).to(gl.int32))
    # token t is a "sequence" of one query row a head (s_q 1: no stride between query tokens) whose
    # keys are its index list: its "length" is the split's end (no causal mask)
    o_base = split.to(gl.int64) * stride_os + t64 * stride_on
    l_base = split.to(gl.int64) * stride_ls + t64 * stride_ln
    if KV_FMT == 0:      # rows in q's dtype: v_scale 1, a constant
        wk = SeesawWork(Q, O, LSE, t64 * stride_qn, o_base, l_base, ml, end, start, end, n_tiles, H, 1, 0, stride_qh,
                        0, stride_oh, 0, qk_scale, 1.0, o_desc, t * H + ml)
        gl.warp_specialize([
            (_wg0, (sm, wk, False, 0, TMA_OUT, sp)),
            (_wg1, (sm, wk, False, 0, TMA_OUT, sp)),
            (gather_loader, (sm.k_smem, sm.kpe_smem, sm.ready, sm.empty, KV, stride_row, sp, start, end, n_tiles)),
        ], [4, 4], REGS_WITH_LOADER)
    else:
        wk = SeesawWork(Q, O, LSE, t64 * stride_qn, o_base, l_base, ml, end, start, end, n_tiles, H, 1, 0, stride_qh,
                        0, stride_oh, 0, qk_scale, v_scale, o_desc, t * H + ml)
        gl.warp_specialize([
            (_wg0, (sm, wk, False, KV_FMT, TMA_OUT, sp)),
            (_wg1, (sm, wk, False, KV_FMT, TMA_OUT, sp)),
            (_gather_producer, ((k8, pe8, sc8), sm.k_smem, sm.kpe_smem, sm.ready, sm.empty, KV, PE, SC, stride_row,
                                stride_pe, stride_sc, sp, start, end, n_tiles, KV_FMT)),
        ], [4, 4], REGS_WITH_PRODUCER)


def supports(q: torch.Tensor, kv_rows: torch.Tensor, head_dim_v: int) -> bool:
    """True when this kernel takes the inputs (else the Triton kernel serves them): CUDA tensors
    on a compute-capability-9.x device, q [N, H, 576] bf16/fp16 with unit column stride, rows of
    576 values in q's dtype, FP8 rows (float8_e4m3fn, 576) or FP8 tile rows (uint8, 656), laid
    out as one 2-D matrix (rows at a stride of 16-byte multiples, unit column stride),
    head_dim_v 512."""
    if not (q.is_cuda and kv_rows.is_cuda and q.device == kv_rows.device) or head_dim_v != D_V:
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    fmt = kv_fmt(kv_rows)
    if q.dtype not in (torch.bfloat16, torch.float16) or (fmt == 0 and kv_rows.dtype != q.dtype):
        return False
    if q.dim() != 3 or q.shape[-1] != D_QK or kv_rows.dim() != 3 or kv_rows.shape[-1] != _ROW[fmt]:
        return False
    if q.stride(-1) != 1 or kv_rows.stride(-1) != 1 or kv_rows.stride(0) != kv_rows.shape[1] * kv_rows.stride(1):
        return False
    return (kv_rows.stride(1) * kv_rows.element_size()) % 16 == 0 and kv_rows.data_ptr() % 16 == 0


def default_splits(N: int, H: int, topk: int, device) -> int:
    """Splits of each token's index list: enough programs for one wave (a program per SM: the
    seesaw's shared memory), each split at least 64 keys per 64-head block (every split adds a
    float32 partial of the token's heads, which the combine reads back). On the H100 (top-2048;
    N 1-8; 128 and 16 heads; bf16 at N 1, FP8 and tile rows) this is the fastest of 2, 4, 8, 16
    and 32 splits in 16 of 17 shapes and 1.10x it in the last, and at N 1 takes 0.52-0.77x the
    time of the splits of 256 keys that few tokens had before: a pipeline of a few tiles never
    fills."""
    blocks = triton.cdiv(H, BLOCK_M)
    programs = N * blocks
    return max(1, min(num_sms(device.index or 0) // max(programs, 1), triton.cdiv(topk, 64 * blocks)))


def default_block_n(N: int, H: int) -> int:
    """Tiles of 32 keys (a ring of four) for at most 64 programs before the split, 64 keys (two)
    otherwise. On the H200 (top-2048, B 32 and 128, s_q 1 and 2, 16-128 heads) 32-key tiles take
    0.95-0.98x the time of 64-key ones up to 64 programs and 1.09-1.12x from 128. (FP8 rows: 32
    always, the K slots the producer widens into.)"""
    return 32 if N * triton.cdiv(H, BLOCK_M) <= 64 else 64


def launch(q, kv_rows, indices, head_dim_v, softmax_scale, attn_sink=None, num_splits: int | None = None,
           block_n: int | None = None, *, kv_scale: float = 1.0):
    """Sparse attention of q [N, H, 576] over kv_rows at indices [N, topk] (``supports``): out
    [N, H, 512] in q's dtype and lse [N, H] float32. num_splits overrides ``default_splits``;
    block_n: keys a tile, 64 (a ring of two) or 32 (four); default ``default_block_n`` (FP8 rows:
    32 only); kv_scale: FP8 rows' per-tensor scale."""
    if block_n not in (None, 32, 64):
        raise ValueError(f"block_n: expected 32 or 64, got {block_n!r}")
    fmt = kv_fmt(kv_rows)
    if fmt != 0 and block_n not in (None, 32):
        raise ValueError(f"block_n: FP8 rows are read in tiles of 32 keys, got {block_n}")
    N, H, _ = q.shape
    topk = indices.shape[-1]
    out = torch.empty(N, H, D_V, dtype=q.dtype, device=q.device)
    lse = torch.empty(N, H, dtype=torch.float32, device=q.device)
    if N == 0 or H == 0:
        return out, lse
    indices = indices.contiguous()
    S = num_splits or default_splits(N, H, topk, q.device)
    block_n = block_n or (default_block_n(N, H) if fmt == 0 else 32)
    chunk = triton.cdiv(triton.cdiv(max(topk, 1), S), 64) * 64        # whole pairs of 32-key tiles
    S = max(1, triton.cdiv(topk, chunk))
    # the MMAs' dtype: q's; FP8 rows widen to fp16 (e4m3 exactly, kv_scale applied to the scores and
    # out; tile rows times their scales, the product in fp16: ``seesaw.launch``)
    gdt = gl.float16 if q.dtype == torch.float16 or fmt != 0 else gl.bfloat16
    tma_out = S == 1 and H % BLOCK_M == 0 and gdt == (gl.float16 if q.dtype == torch.float16 else gl.bfloat16)
    v_scale = float(kv_scale) if fmt == 1 else 1.0
    if S == 1:
        o_part, l_part = out.unsqueeze(0), lse.unsqueeze(0)
    else:
        o_part = torch.empty(S, N, H, D_V, dtype=torch.float32, device=q.device)
        l_part = torch.empty(S, N, H, dtype=torch.float32, device=q.device)
    rows = kv_rows.as_strided((kv_rows.shape[0] * kv_rows.shape[1], kv_rows.shape[2]), (kv_rows.stride(1), 1))
    lat, pe, sc = tile_row_parts(rows) if fmt == 2 else (rows, rows, rows)
    # out's rows by TMA (the seesaw's epilogue) when tma_out; else a stand-in the kernel does not use
    flat = out.view(N * H, D_V)
    o_desc = TensorDescriptor(flat, list(flat.shape), [D_V, 1], [BLOCK_M, 64],
                              gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    sink = attn_sink.float().contiguous() if attn_sink is not None else lse
    _sparse_kernel[(triton.cdiv(H, BLOCK_M), N * S)](
        q, lat, pe, sc, indices, sink, o_part, l_part, o_desc,
        q.stride(0), q.stride(1), lat.stride(0), pe.stride(0), sc.stride(0), indices.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), l_part.stride(0), l_part.stride(1),
        H, rows.shape[0], topk, chunk, S, softmax_scale * LOG2E * v_scale, v_scale, int(attn_sink is not None),
        BN=block_n, dtype=gdt, SM_L=gl.NVMMASharedLayout.get_default_for([block_n, 64], gdt),
        P_SM=gl.NVMMASharedLayout.get_default_for([64, block_n], gdt), TMA_OUT=tma_out, KV_FMT=fmt,
        num_warps=4, maxnreg=MAXNREG,
    )
    if S > 1:
        combine(o_part.unsqueeze(2), l_part.unsqueeze(2), out.unsqueeze(1), lse.unsqueeze(1), pdl=False)
    return out, lse
