"""The rope_append kernel: fused RoPE + latent-cache append in one kernel (and, with APPEND off,
``rope``: the rotation alone, for the sparse indexer's query and key slices).

For every token t (one program per token and block of heads):

    q_out[t, h] <- rope(q_pe[t, h])            every head h (q_out: q_pe itself, or another tensor)
    k_pe[t]     <- rope(k_pe[t])               in place (first head block only)
    kv_cache[slot_mapping[t]] <- [c_kv[t] | k_pe[t]]   (r + dr values, cast to the cache dtype,
                                                        or quantized to an FP8 row, mla.quant)

RoPE pairs (x1, x2) are (2i, 2i + 1) (interleaved) or (i, i + dr/2) (neox); the rotation
is (x1 c - x2 s, x2 c + x1 s) in float32 with cos, sin [T, dr/2], cast back to the input
dtype, exactly as ``mla.rope.apply_rope``. Every tensor is passed with its strides, so
q_pe may be the view q[..., dn:] of [T, H, dn + dr] and k_pe, c_kv views of [T, r + dr].
A negative slot (padding) rotates but writes no cache row, and so does a slot past the pool
(``mla.ops.rope_append`` refuses those on CPU; on CUDA they are unchecked, and never written). Rows are loaded whole (16-byte
accesses) and split into pairs in registers; dr must be a power of two (64 in every preset;
``rope_append_takes`` says which inputs the kernel serves, the op sends the others to the
reference), or 0 (GLM-5.3-Flash: no RoPE part, the row is c_kv alone, one program a token).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._jit import jit, kv_fmt
from .fp8_gemm import nan_if_any, round_to_bf16, to_e4m3

__all__ = ["rope_append", "rope", "rope_takes", "rope_append_takes", "CACHE_FORMATS"]

# the cache rows rope_append writes (mla.quant.cache_format): all of them
CACHE_FORMATS = ("plain", "fp8", "fp8_tile")


@jit
def _rotate(x, c, s, ROWS: tl.constexpr, HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """rope of rows x [ROWS, 2 * HALF] (loaded whole, so the access stays contiguous)."""
    if INTERLEAVE:
        x1, x2 = tl.split(tl.reshape(x, (ROWS, HALF, 2)))
    else:
        x1, x2 = tl.split(tl.permute(tl.reshape(x, (ROWS, 2, HALF)), (0, 2, 1)))
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    y1 = x1 * c[None, :] - x2 * s[None, :]
    y2 = x2 * c[None, :] + x1 * s[None, :]
    if INTERLEAVE:
        return tl.reshape(tl.join(y1, y2), (ROWS, 2 * HALF))
    return tl.reshape(tl.permute(tl.join(y1, y2), (0, 2, 1)), (ROWS, 2 * HALF))


@jit
def _to_cache(x, kv_scale, out_ty: tl.constexpr, KV_FMT: tl.constexpr):
    """Values in the cache's storage: a cast (plain rows) or x / kv_scale clamped to +-448 and
    rounded to e4m3 (FP8 rows), as ``mla.quant.quantize_rows`` does (correctly rounded division;
    rounded in float32 first, so the cast is exact: Triton 3.6's interpreter rounds some casts
    to e4m3 and bf16 down; NaN stays NaN, +-inf saturate: ``to_e4m3``)."""
    if KV_FMT == 1:
        return to_e4m3(tl.math.div_rn(x.to(tl.float32), kv_scale))
    return x.to(out_ty)


@jit
def _store_tile_row(dst, c_ptr, stride_cd, R):
    """The latent part of one FP8 tile row (bytes, unit stride): per 128 latent values e4m3 of
    value / scale with scale = max(amax, 1e-12) / 448 (float32, after the R latent bytes); k_pe
    follows as bfloat16 (the caller's). A tile holding a NaN gets a NaN scale and NaN values, as
    in ``mla.quant.quantize_rows``."""
    j = tl.arange(0, 128)
    for t0 in range(0, R, 128):
        x = tl.load(c_ptr + (t0 + j) * stride_cd).to(tl.float32)
        scale = nan_if_any(tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12), 448.0), x, 0)
        q8 = to_e4m3(tl.math.div_rn(x, scale))
        tl.store(dst + t0 + j, q8.to(tl.uint8, bitcast=True))
        tl.store((dst + R).to(tl.pointer_type(tl.float32)) + t0 // 128, scale)


@jit
def _rope_append_kernel(
    QPE, QOUT, KPE, CKV, COS, SIN, KV, SLOTS,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od, stride_kt, stride_kd, stride_ct, stride_cd,
    stride_cos, stride_sin, stride_kvb, stride_kvr, stride_kvd,
    H, R, block_size, num_slots, kv_scale,
    HALF: tl.constexpr, ROPE: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr, KV_FMT: tl.constexpr, APPEND: tl.constexpr = True,
):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    t64 = t.to(tl.int64)
    i = tl.arange(0, HALF)
    d = tl.arange(0, 2 * HALF)
    if ROPE:
        c = tl.load(COS + t64 * stride_cos + i)
        s = tl.load(SIN + t64 * stride_sin + i)
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = (h < H)[:, None]
        x = tl.load(QPE + t64 * stride_qt + h[:, None] * stride_qh + d[None, :] * stride_qd, mask=ok, other=0.0)
        o_ptr = QOUT + t64 * stride_ot + h[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(o_ptr, _rotate(x, c, s, BLOCK_H, HALF, INTERLEAVE).to(QOUT.dtype.element_ty), mask=ok)

    if hb == 0:
        if ROPE:
            k_ptr = KPE + t64 * stride_kt + d[None, :] * stride_kd
            k = _rotate(tl.load(k_ptr), c, s, 1, HALF, INTERLEAVE).to(KPE.dtype.element_ty)
            tl.store(k_ptr, k)
        if APPEND:     # False: ``rope``, the rotation alone
            slot = tl.load(SLOTS + t)
            if (slot >= 0) & (slot < num_slots):   # unchecked on CUDA: a slot past the pool is skipped
                dst = KV + (slot // block_size) * stride_kvb + (slot % block_size) * stride_kvr
                if KV_FMT == 2:
                    _store_tile_row(dst, CKV + t64 * stride_ct, stride_cd, R)
                    if ROPE:
                        k16 = round_to_bf16(k.to(tl.float32)).to(tl.bfloat16)
                        tl.store((dst + R + 4 * (R // 128)).to(tl.pointer_type(tl.bfloat16)) + d[None, :], k16)
                else:
                    if ROPE:
                        tl.store(dst + (R + d[None, :]) * stride_kvd,
                                 _to_cache(k, kv_scale, KV.dtype.element_ty, KV_FMT))
                    for r0 in range(0, R, BLOCK_R):
                        r = r0 + tl.arange(0, BLOCK_R)
                        c_kv = tl.load(CKV + t64 * stride_ct + r * stride_cd, mask=r < R, other=0.0)
                        tl.store(dst + r * stride_kvd, _to_cache(c_kv, kv_scale, KV.dtype.element_ty, KV_FMT),
                                 mask=r < R)


def rope_append(q_pe, k_pe, c_kv, cos, sin, kv_cache, slot_mapping, interleave, kv_scale=1.0, q_out=None):
    """Rotate q_pe [T, H, dr] (into q_out, default in place) and k_pe [T, dr] in place by cos/sin
    [T, dr/2] float32 and write [c_kv | rope(k_pe)] (c_kv [T, r]) into kv_cache [num_blocks,
    block_size, r + dr] at the flat slots slot_mapping [T] int64, quantized for FP8 rows
    (float8_e4m3fn with kv_scale, or uint8 tile rows). Returns None (see
    ``mla.ops.reference.rope_append``)."""
    q_out = q_pe if q_out is None else q_out
    T, H, dr = q_pe.shape
    r = c_kv.shape[-1]
    if T == 0:
        return None
    # dr 0 (no RoPE part, GLM-5.3-Flash): only c_kv is written; a 1-pair placeholder keeps the
    # aranges legal, and the ROPE branches that would read it compile away
    rope = dr > 0
    half = max(dr // 2, 1)
    fmt = kv_fmt(kv_cache)
    # the kernel reads cos/sin rows at unit stride (their row stride is passed) and slots at unit stride
    cos, sin, slot_mapping = cos.contiguous(), sin.contiguous(), slot_mapping.contiguous()
    block_h = min(32, triton.next_power_of_2(max(H, 1)))
    grid = (T, triton.cdiv(H, block_h) if H > 0 and rope else 1)
    # without RoPE the rotation's tensors are never read: c_kv stands in for them (an empty
    # tensor's pointer may be null, which a launcher may refuse)
    rot = (q_pe, q_out, k_pe, cos, sin) if rope else (c_kv,) * 5
    _rope_append_kernel[grid](
        rot[0], rot[1], rot[2], c_kv, rot[3], rot[4], kv_cache, slot_mapping,
        q_pe.stride(0), q_pe.stride(1), q_pe.stride(2), q_out.stride(0), q_out.stride(1), q_out.stride(2),
        k_pe.stride(0), k_pe.stride(1),
        c_kv.stride(0), c_kv.stride(1), cos.stride(0), sin.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        H, r, kv_cache.shape[1], kv_cache.shape[0] * kv_cache.shape[1], float(kv_scale),
        HALF=half, ROPE=rope, INTERLEAVE=bool(interleave), BLOCK_H=block_h,
        BLOCK_R=min(512, triton.next_power_of_2(max(r, 1))), KV_FMT=fmt, num_warps=4,
    )
    return None


def rope(q_pe, k_pe, cos, sin, interleave):
    """Rotate q_pe [T, H, dr] and k_pe [T, dr] in place by cos/sin [T, dr/2] float32: the
    kernel's rotation alone (see ``mla.ops.reference.rope``). Returns None."""
    T, H, dr = q_pe.shape
    if T == 0 or dr == 0:
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    block_h = min(32, triton.next_power_of_2(max(H, 1)))
    # no row is written: the cache's pointers and strides are q_pe's, never read
    _rope_append_kernel[(T, triton.cdiv(H, block_h) if H > 0 else 1)](
        q_pe, q_pe, k_pe, q_pe, cos, sin, q_pe, q_pe,
        q_pe.stride(0), q_pe.stride(1), q_pe.stride(2), q_pe.stride(0), q_pe.stride(1), q_pe.stride(2),
        k_pe.stride(0), k_pe.stride(1), 0, 0,
        cos.stride(0), sin.stride(0), 0, 0, 0, H, 0, 1, 0, 1.0,
        HALF=dr // 2, ROPE=True, INTERLEAVE=bool(interleave), BLOCK_H=block_h, BLOCK_R=1, KV_FMT=0,
        APPEND=False, num_warps=4,
    )
    return None


def rope_takes(q_pe, k_pe) -> bool:
    """Whether the kernel rotates these: dr a power of two (it splits whole rows in two)."""
    dr = q_pe.shape[-1]
    return dr >= 2 and not dr & (dr - 1)


def rope_append_takes(q_pe, c_kv, kv_cache) -> bool:
    """Whether the kernel serves these inputs: it splits whole rows in two (dr a power of two, or
    0: no RoPE part), and tile rows in whole 128-value tiles of unit stride."""
    dr, r = q_pe.shape[-1], c_kv.shape[-1]
    if dr == 1 or dr & (dr - 1):
        return False
    return kv_fmt(kv_cache) != 2 or (r % 128 == 0 and kv_cache.stride(-1) == 1)

