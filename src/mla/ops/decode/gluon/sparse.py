"""Sparse MLA attention on Hopper (sm90) in Gluon: the seesaw (``seesaw``) over gathered keys.

Same contract as ``mla.ops.sparse_attention.launch`` (the Triton kernel) for what ``supports``
takes: bf16/fp16 queries [N, H, 576] over rows of 576 values in their dtype ([num_blocks,
block_size, 576], one 2-D matrix of rows), indices [N, topk] int32 flat slots (-1 = none),
head_dim_v 512. Every query token is its own "sequence" of topk keys (its index list), so decode
(N = B s_q) and prefill are the same launch.

Grid (ceil(H / 64), N * S): 64 heads of token t against split s of its index list, S from
shapes only (``default_splits``). The compute is the seesaw's, unchanged: two warpgroups take
alternate 64-key tiles and hand each other P; only the keys' way in differs:

    loader:  one warpgroup (``common.gather_loader``), cp.async of each indexed row, 16 bytes a
             thread and instruction, into the seesaw's ring of two 64-key tiles; a row whose
             index is -1, outside the pool or past the split is zero-filled, never read
    softmax: the tile's keys masked by their indices (``common.key_mask``), not by position;
             split 0 starts from the attention sink (``common.sink_start``: a key of value 0)
    out:     one split and whole 64-head tiles: bf16 straight into out by TMA (the seesaw's
             epilogue); else float32 partials and ``combine.combine``
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from ..._jit import num_sms
from ..combine import combine
from .common import BLOCK_M, D_QK, D_V, LOG2E, MAXNREG, Gathered, gather_loader
from .seesaw import REGS_WITH_LOADER, SeesawWork, _wg0, _wg1, seesaw_buffers

__all__ = ["supports", "default_splits", "default_block_n", "launch"]


@gluon.jit
def _sparse_kernel(
    Q, KV, IDX, SINK, O, LSE, o_desc,
    stride_qn, stride_qh, stride_row, stride_in,
    stride_os, stride_on, stride_oh, stride_ls, stride_ln,
    H, num_slots, topk, chunk, num_splits, qk_scale, has_sink,
    BN: gl.constexpr, dtype: gl.constexpr, SM_L: gl.constexpr, P_SM: gl.constexpr, TMA_OUT: gl.constexpr,
    num_warps: gl.constexpr,
):
    gl.static_assert(num_warps == 4)
    NBUF: gl.constexpr = 128 // BN      # two tiles of 64 keys or four of 32 (the seesaw's rings)
    pid_m = gl.program_id(0)
    p = gl.program_id(1)
    t = p // num_splits
    split = p % num_splits

    sm = seesaw_buffers(dtype, NBUF, BN, SM_L, P_SM, NBUF, 128)    # ready: a tile's 128 copiers

    start = split * chunk
    end = gl.minimum(start + chunk, topk)
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), BN)
    ml = pid_m * 64
    t64 = t.to(gl.int64)
    fence_async_shared()      # the barriers' init, before the partitions use them
    gl.thread_barrier()

    sp = Gathered(IDX + t64 * stride_in, num_slots, SINK, has_sink * (split == 0).to(gl.int32))
    # token t is a "sequence" of one query row a head (s_q 1: no stride between query tokens) whose
    # keys are its index list: its "length" is the split's end (no causal mask); rows in q's dtype
    # (v_scale 1)
    wk = SeesawWork(Q, O, LSE, t64 * stride_qn, split.to(gl.int64) * stride_os + t64 * stride_on,
                    split.to(gl.int64) * stride_ls + t64 * stride_ln, ml, end, start, end, n_tiles, H, 1, 0, stride_qh,
                    0, stride_oh, 0, qk_scale, 1.0, o_desc, t * H + ml)
    gl.warp_specialize([
        (_wg0, (sm, wk, False, 0, TMA_OUT, sp)),
        (_wg1, (sm, wk, False, 0, TMA_OUT, sp)),
        (gather_loader, (sm.k_smem, sm.kpe_smem, sm.ready, sm.empty, KV, stride_row, sp, start, end, n_tiles)),
    ], [4, 4], REGS_WITH_LOADER)


def supports(q: torch.Tensor, kv_rows: torch.Tensor, head_dim_v: int) -> bool:
    """True when this kernel takes the inputs (else the Triton kernel serves them): CUDA tensors
    on a compute-capability-9.x device, q [N, H, 576] bf16/fp16 with unit column stride, rows of
    576 values in q's dtype laid out as one 2-D matrix (rows at a stride of 16-byte multiples,
    unit column stride), head_dim_v 512."""
    if not (q.is_cuda and kv_rows.is_cuda and q.device == kv_rows.device) or head_dim_v != D_V:
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or kv_rows.dtype != q.dtype:
        return False
    if q.dim() != 3 or q.shape[-1] != D_QK or kv_rows.dim() != 3 or kv_rows.shape[-1] != D_QK:
        return False
    if q.stride(-1) != 1 or kv_rows.stride(-1) != 1 or kv_rows.stride(0) != kv_rows.shape[1] * kv_rows.stride(1):
        return False
    return (kv_rows.stride(1) * kv_rows.element_size()) % 16 == 0 and kv_rows.data_ptr() % 16 == 0


def default_splits(N: int, H: int, topk: int, device) -> int:
    """Splits of each token's index list: enough programs for one wave (a program per SM: the
    seesaw's shared memory), no split under 256 keys (each split costs a float32 partial of the
    token's heads and the combine's pass over it)."""
    programs = N * triton.cdiv(H, BLOCK_M)
    return max(1, min(num_sms(device.index or 0) // max(programs, 1), triton.cdiv(topk, 256)))


def default_block_n(N: int, H: int) -> int:
    """Tiles of 32 keys (a ring of four) for at most 64 programs before the split, 64 keys (two)
    otherwise. On the H200 (top-2048, B 32 and 128, s_q 1 and 2, 16-128 heads) 32-key tiles take
    0.95-0.98x the time of 64-key ones up to 64 programs and 1.09-1.12x from 128."""
    return 32 if N * triton.cdiv(H, BLOCK_M) <= 64 else 64


def launch(q, kv_rows, indices, head_dim_v, softmax_scale, attn_sink=None, num_splits: int | None = None,
           block_n: int | None = None):
    """Sparse attention of q [N, H, 576] over kv_rows at indices [N, topk] (``supports``): out
    [N, H, 512] in q's dtype and lse [N, H] float32. num_splits overrides ``default_splits``;
    block_n: keys a tile, 64 (a ring of two) or 32 (four); default ``default_block_n``."""
    if block_n not in (None, 32, 64):
        raise ValueError(f"block_n: expected 32 or 64, got {block_n!r}")
    N, H, _ = q.shape
    topk = indices.shape[-1]
    out = torch.empty(N, H, D_V, dtype=q.dtype, device=q.device)
    lse = torch.empty(N, H, dtype=torch.float32, device=q.device)
    if N == 0 or H == 0:
        return out, lse
    indices = indices.contiguous()
    S = num_splits or default_splits(N, H, topk, q.device)
    block_n = block_n or default_block_n(N, H)
    chunk = triton.cdiv(triton.cdiv(max(topk, 1), S), 64) * 64        # whole pairs of 32-key tiles
    S = max(1, triton.cdiv(topk, chunk))
    gdt = gl.float16 if q.dtype == torch.float16 else gl.bfloat16
    tma_out = S == 1 and H % BLOCK_M == 0
    if S == 1:
        o_part, l_part = out.unsqueeze(0), lse.unsqueeze(0)
    else:
        o_part = torch.empty(S, N, H, D_V, dtype=torch.float32, device=q.device)
        l_part = torch.empty(S, N, H, dtype=torch.float32, device=q.device)
    rows = kv_rows.as_strided((kv_rows.shape[0] * kv_rows.shape[1], D_QK), (kv_rows.stride(1), 1))
    # out's rows by TMA (the seesaw's epilogue) when tma_out; else a stand-in the kernel does not use
    flat = out.view(N * H, D_V)
    o_desc = TensorDescriptor(flat, list(flat.shape), [D_V, 1], [BLOCK_M, 64],
                              gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    sink = attn_sink.float().contiguous() if attn_sink is not None else lse
    _sparse_kernel[(triton.cdiv(H, BLOCK_M), N * S)](
        q, rows, indices, sink, o_part, l_part, o_desc,
        q.stride(0), q.stride(1), rows.stride(0), indices.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), l_part.stride(0), l_part.stride(1),
        H, rows.shape[0], topk, chunk, S, softmax_scale * LOG2E, int(attn_sink is not None),
        BN=block_n, dtype=gdt, SM_L=gl.NVMMASharedLayout.get_default_for([block_n, 64], gdt),
        P_SM=gl.NVMMASharedLayout.get_default_for([64, block_n], gdt), TMA_OUT=tma_out,
        num_warps=4, maxnreg=MAXNREG,
    )
    if S > 1:
        combine(o_part.unsqueeze(2), l_part.unsqueeze(2), out.unsqueeze(1), lse.unsqueeze(1), pdl=False)
    return out, lse
