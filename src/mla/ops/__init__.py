"""Kernel-level attention ops: the public wrappers, validation, and the one place
that chooses a backend.

Every op takes ``backend=None`` (CUDA tensors -> "triton" when Triton is importable,
else "torch"), "torch" (the reference in ``reference.py``) or "triton" (GPU kernels;
on CPU tensors they run under Triton's interpreter). ``lse`` is float32 with the
shape of ``out`` minus its last dimension; a query with no visible key gets
``out = 0`` and ``lse = -inf``.
"""
from __future__ import annotations

import importlib
import math
from typing import Callable

import torch

from .. import quant
from . import reference

__all__ = ["mla_decode", "prefill_attention", "merge_attention", "rope_append", "gather_latent",
           "quantize_act_1x128", "fp8_linear", "fp8_bmm",
           "resolve_backend", "triton_available"]

BACKENDS = ("torch", "triton")
_FLOAT = (torch.float32, torch.float16, torch.bfloat16)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """The backend an op runs on: an explicit choice, or the default for the device."""
    if backend is None:
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton" and not triton_available():
        raise ValueError("backend: 'triton' requested but triton is not installed")
    return backend


def _impl(op: str, backend: str | None, device: torch.device, cache_format: str = "plain") -> Callable:
    """The implementation of an op. A kernel declares the cache formats it reads in a
    ``cache_formats`` attribute (default: plain rows only); for any other format the
    reference serves, on any device."""
    if resolve_backend(backend, device) == "torch":
        return getattr(reference, op)
    from . import triton as triton_ops  # imported lazily: triton is optional

    fn = getattr(triton_ops, op)
    return fn if cache_format in getattr(fn, "cache_formats", ("plain",)) else getattr(reference, op)


def _check_interpretable(op: str, impl: Callable, device: torch.device, *tensors: torch.Tensor) -> None:
    """Triton's interpreter (3.6 to 3.9) computes ``tl.dot`` on bfloat16 operands wrongly: refuse the
    kernels on CPU bf16 tensors rather than return garbage (DESIGN.md section 5)."""
    _check(device.type != "cpu" or impl is getattr(reference, op) or all(t.dtype != torch.bfloat16 for t in tensors),
           f"backend: expected 'torch' for bfloat16 {op} on CPU (Triton's interpreter computes bfloat16 dot "
           "products wrongly; its kernels run float32 and float16 there)")


def cache_format(kv_cache: torch.Tensor) -> str:
    """"plain" (rows in a float dtype), "fp8" (float8_e4m3fn, per-tensor scale) or
    "fp8_tile" (uint8 rows of FlashMLA's FP8 layout, see mla.quant)."""
    if kv_cache.dtype == torch.float8_e4m3fn:
        return "fp8"
    if kv_cache.dtype == torch.uint8:
        return "fp8_tile"
    return "plain"


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_int_vector(name: str, t: torch.Tensor, length: int | None, device: torch.device) -> None:
    _check(isinstance(t, torch.Tensor) and t.dim() == 1 and t.dtype == torch.int32,
           f"{name}: expected a 1-D int32 tensor, got {_describe(t)}")
    _check(length is None or t.shape[0] == length, f"{name}: expected length {length}, got {t.shape[0]}")
    _check(t.device == device, f"{name}: expected device {device}, got {t.device}")


def _float(name: str, x) -> float:
    """A scale as a Python float: any real number (int, float, numpy or 0-d tensor), not a string."""
    try:
        f = None if isinstance(x, (str, bytes)) else float(x)
    except (TypeError, ValueError):
        f = None
    _check(f is not None and math.isfinite(f), f"{name}: expected a finite real number, got {x!r}"[:200])
    return f


def _check_paged_values(block_table, cache_seqlens, num_blocks: int, block_size: int) -> None:
    """CPU tensors only: every length fits the table, and every block a length reaches is in the
    pool (a table's tail past a sequence's last block may hold anything, e.g. -1). On CUDA,
    reading the values back would sync the stream and break CUDA-graph capture of decode."""
    if block_table.device.type != "cpu":
        return
    cap = block_table.shape[1] * block_size
    lens = cache_seqlens.long()
    bad = ((lens < 0) | (lens > cap)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"cache_seqlens: expected lengths in 0..{cap} (block_table.shape[1] * block_size), "
                         f"got {lens[bad[0]].item()} at index {bad[0]}")
    reached = torch.arange(block_table.shape[1]) < (lens[:, None] + block_size - 1) // max(block_size, 1)
    bad = (reached & ((block_table < 0) | (block_table >= num_blocks))).nonzero().tolist()
    if bad:
        b, j = bad[0]
        raise ValueError(f"block_table: expected block ids in [0, {num_blocks}) for the blocks cache_seqlens "
                         f"reach, got block_table[{b}, {j}] = {block_table[b, j].item()}")


def _offsets_ok(h: list, total: int) -> bool:
    """Host offsets of packed rows: from 0 to ``total``, never decreasing."""
    return h[0] == 0 and h[-1] == total and all(a <= b for a, b in zip(h, h[1:]))


def _host_offsets(name: str, cu: torch.Tensor, rows: str, total: int, hint_name: str, hint) -> list:
    """cu's values on the host (``_offsets_ok``); a host copy the caller gave (``hint``) must hold
    the same values."""
    h = cu.tolist()
    _check(_offsets_ok(h, total), f"{name}: expected non-decreasing offsets from 0 to {rows} = {total}, got {h}"[:300])
    _check(hint is None or list(hint) == h, f"{hint_name}: expected {name}'s values {h}, got {hint!r}"[:300])
    return h


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"
    return type(t).__name__


def mla_decode(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal=True, *,
               kv_scale=1.0, backend=None):
    """Absorbed MLA attention of ``s_q`` new tokens per sequence over a paged latent cache.

    q:             [B, s_q, H, d] float16/bfloat16/float32, d = kv_lora_rank + qk_rope_head_dim (576)
    kv_cache:      [num_blocks, block_size, d] (or [num_blocks, block_size, 1, d]) in q's dtype; or
                   float8_e4m3fn rows (value = fp8 * kv_scale); or uint8 rows of the FP8 tile layout
                   [num_blocks, block_size, r + 4 * r/128 + 2 * dr] (mla.quant), r = head_dim_v.
                   The GPU kernels compute on float8_e4m3fn rows in float16 (e4m3 widens to it
                   exactly, in one instruction a pair): bf16 queries there must stay within
                   float16's range (|q| <= 65504); values past it become inf
    block_table:   [B, max_blocks] int32; block j of sequence b is kv_cache[block_table[b, j]]
    cache_seqlens: [B] int32, lengths including the s_q new tokens
    head_dim_v:    values are the first head_dim_v (= kv_lora_rank) entries of each row
    causal:        query i sees keys < cache_seqlens - s_q + i + 1; else every key
    Returns out [B, s_q, H, head_dim_v] in q's dtype and lse [B, s_q, H] float32.

    On CPU tensors the lengths (0..max_blocks * block_size) and the block ids they reach (in
    [0, num_blocks); entries past a sequence's last block may hold anything) are checked. On
    CUDA they are the caller's responsibility: reading them back would sync the stream, and
    decode must stay capturable in a CUDA graph.
    """
    _check(isinstance(q, torch.Tensor) and q.dim() == 4, f"q: expected [B, s_q, H, d], got {_describe(q)}")
    _check(q.dtype in _FLOAT, f"q: expected float16, bfloat16 or float32, got {q.dtype}")
    if isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 4:
        _check(kv_cache.shape[2] == 1, f"kv_cache: expected [num_blocks, block_size, 1, d], got {tuple(kv_cache.shape)}")
        kv_cache = kv_cache.squeeze(2)
    B, s_q, H, d = q.shape
    _check(isinstance(head_dim_v, int) and 0 < head_dim_v <= d, f"head_dim_v: expected an int in 1..{d}, got {head_dim_v!r}")
    _check(isinstance(kv_cache, torch.Tensor), f"kv_cache: expected a tensor, got {_describe(kv_cache)}")
    fmt = cache_format(kv_cache)
    width = quant.row_width(fmt, head_dim_v, d - head_dim_v)
    _check(kv_cache.dim() == 3 and kv_cache.shape[-1] == width,
           f"kv_cache: expected [num_blocks, block_size, {width}] for {fmt} rows, got {_describe(kv_cache)}")
    _check(fmt != "plain" or kv_cache.dtype == q.dtype, f"kv_cache: expected dtype {q.dtype} (q's), got {kv_cache.dtype}")
    _check(fmt != "fp8_tile" or head_dim_v % quant.TILE == 0,
           f"head_dim_v: expected a multiple of {quant.TILE} for the FP8 tile layout, got {head_dim_v}")
    _check(kv_cache.device == q.device, f"kv_cache: expected device {q.device}, got {kv_cache.device}")
    _check(isinstance(block_table, torch.Tensor) and block_table.dim() == 2 and block_table.shape[0] == B
           and block_table.dtype == torch.int32,
           f"block_table: expected [{B}, max_blocks] int32, got {_describe(block_table)}")
    _check(block_table.device == q.device, f"block_table: expected device {q.device}, got {block_table.device}")
    _check_int_vector("cache_seqlens", cache_seqlens, B, q.device)
    _check_paged_values(block_table, cache_seqlens, kv_cache.shape[0], kv_cache.shape[1])
    softmax_scale, kv_scale = _float("softmax_scale", softmax_scale), _float("kv_scale", kv_scale)
    impl = _impl("mla_decode", backend, q.device, fmt)
    _check_interpretable("mla_decode", impl, q.device, q, kv_cache)
    if fmt == "plain":
        return impl(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, bool(causal))
    return impl(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, bool(causal), kv_scale)


def prefill_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal=True, *, max_seqlen_q=None,
                      max_seqlen_k=None, offsets_q=None, offsets_k=None, backend=None):
    """Varlen packed attention with log-sum-exp (the expanded, "MHA" path).

    q [Tq, H, dq], k [Tk, H, dq], v [Tk, H, dv]; cu_seqlens_q/k [B + 1] int32 offsets.
    causal aligns the ends: the last query of a sequence sees all its keys.
    max_seqlen_q/k: the longest query / key length, as the caller knows them on the host
    (flash-attn's varlen convention; optional). offsets_q/k: cu_seqlens_q/k themselves as
    host ints (a list or tuple; optional; they give max_seqlen_q/k where those are None).
    Both must be exact: with them the GPU path picks its kernel without reading the offsets
    back (a stream sync), and FlashInfer's prefill, where installed, plans from the host
    offsets.
    Returns out [Tq, H, dv] in q's dtype and lse [Tq, H] float32.

    The offsets' values (0 first, never decreasing, Tq / Tk last) are checked on CPU tensors
    and for backend="torch", which read them on the host anyway; on CUDA with the kernels they
    are the caller's responsibility.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(isinstance(t, torch.Tensor) and t.dim() == 3, f"{name}: expected a 3-D [tokens, heads, dim] tensor, got {_describe(t)}")
        _check(t.dtype in _FLOAT, f"{name}: expected float16, bfloat16 or float32, got {t.dtype}")
        _check(t.device == q.device, f"{name}: expected device {q.device}, got {t.device}")
    _check(k.dtype == q.dtype and v.dtype == q.dtype, f"k, v: expected dtype {q.dtype}, got {k.dtype}, {v.dtype}")
    _check(k.shape[1:] == q.shape[1:], f"k: expected [Tk, {q.shape[1]}, {q.shape[2]}], got {tuple(k.shape)}")
    _check(v.shape[:2] == k.shape[:2], f"v: expected [{k.shape[0]}, {k.shape[1]}, dv], got {tuple(v.shape)}")
    _check_int_vector("cu_seqlens_q", cu_seqlens_q, None, q.device)
    _check(cu_seqlens_q.shape[0] >= 1, "cu_seqlens_q: expected [B + 1] offsets (B >= 0), got an empty tensor")
    _check_int_vector("cu_seqlens_k", cu_seqlens_k, cu_seqlens_q.shape[0], q.device)
    B = cu_seqlens_q.shape[0] - 1
    softmax_scale = _float("softmax_scale", softmax_scale)
    for name, h, total in (("offsets_q", offsets_q, q.shape[0]), ("offsets_k", offsets_k, k.shape[0])):
        # what the host can check: B + 1 ints from 0 to the row count, never decreasing
        _check(h is None or (isinstance(h, (list, tuple)) and len(h) == B + 1
                             and all(isinstance(x, int) and not isinstance(x, bool) for x in h)
                             and _offsets_ok(h, total)),
               f"{name}: expected None or {B + 1} non-decreasing host ints from 0 to {total}, got {h!r}"[:300])
    impl = _impl("prefill_attention", backend, q.device)
    _check_interpretable("prefill_attention", impl, q.device, q, k, v)
    if q.device.type == "cpu" or impl is reference.prefill_attention:
        # The offsets' values, checked on the one host copy this path makes anyway: free on CPU,
        # and the reference reads them back on CUDA too (it takes this copy instead). The CUDA
        # kernels' path copies none of them to the host, so there they are the caller's, as
        # offsets_q/k are: checking them would add a stream sync.
        offsets_q = _host_offsets("cu_seqlens_q", cu_seqlens_q, "Tq", q.shape[0], "offsets_q", offsets_q)
        offsets_k = _host_offsets("cu_seqlens_k", cu_seqlens_k, "Tk", k.shape[0], "offsets_k", offsets_k)
    if offsets_q is not None and max_seqlen_q is None:
        max_seqlen_q = max(b - a for a, b in zip(offsets_q, offsets_q[1:])) if B else 0
    if offsets_k is not None and max_seqlen_k is None:
        max_seqlen_k = max(b - a for a, b in zip(offsets_k, offsets_k[1:])) if B else 0
    for name, m, total in (("max_seqlen_q", max_seqlen_q, q.shape[0]), ("max_seqlen_k", max_seqlen_k, k.shape[0])):
        # what the host can check: B sequences of at most m rows hold all the rows, none more than all
        _check(m is None or (isinstance(m, int) and not isinstance(m, bool) and m <= total <= B * m),
               f"{name}: expected None or the longest length, an int with {name} <= {total} <= {B} * {name}, "
               f"got {m!r}")
    return impl(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, bool(causal), max_seqlen_q, max_seqlen_k,
                offsets_q, offsets_k)


def merge_attention(out_a, lse_a, out_b, lse_b, *, backend=None):
    """Merge two partial attention results over disjoint key sets, exactly, by log-sum-exp.

    out_* [..., d], lse_* [...] float32 (out's shape minus its last dim). Empty parts
    (lse = -inf) weigh 0; returns (out in out_a's dtype, lse float32), never NaN.
    """
    _check(isinstance(out_a, torch.Tensor) and out_a.dim() >= 1 and out_a.dtype in _FLOAT,
           f"out_a: expected a float16, bfloat16 or float32 tensor [..., d], got {_describe(out_a)}")
    _check(isinstance(out_b, torch.Tensor) and out_b.shape == out_a.shape and out_b.dtype in _FLOAT,
           f"out_b: expected a float16, bfloat16 or float32 tensor of out_a's shape {tuple(out_a.shape)}, "
           f"got {_describe(out_b)}")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        _check(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.shape == out_a.shape[:-1],
               f"{name}: expected float32 of shape {tuple(out_a.shape[:-1])}, got {_describe(t)}")
    for name, t in (("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        _check(t.device == out_a.device, f"{name}: expected device {out_a.device} (out_a's), got {t.device}")
    return _impl("merge_attention", backend, out_a.device)(out_a, lse_a, out_b, lse_b)


def rope_append(q_pe, k_pe, c_kv, cos, sin, kv_cache, slot_mapping, interleave, *, kv_scale=1.0, backend=None):
    """Fused RoPE + latent-cache append (in place).

    q_pe [T, H, dr] and k_pe [T, dr] are rotated in place by cos, sin [T, dr/2] float32
    (interleaved pairs (2i, 2i+1) or neox pairs (i, i + dr/2)); rows [c_kv | rope(k_pe)]
    (c_kv [T, r]) are written to kv_cache [num_blocks, block_size, r + dr] at the flat
    slots slot_mapping [T] int64 (negative slots are skipped), quantized where the cache is FP8
    (see mla_decode for the formats). Returns None.
    """
    T = c_kv.shape[0]
    _check(q_pe.dim() == 3 and q_pe.shape[0] == T, f"q_pe: expected [{T}, H, dr], got {_describe(q_pe)}")
    dr = q_pe.shape[-1]
    _check(k_pe.shape == (T, dr), f"k_pe: expected [{T}, {dr}], got {_describe(k_pe)}")
    _check(cos.shape == (T, dr // 2) and sin.shape == cos.shape and cos.dtype == torch.float32,
           f"cos, sin: expected float32 [{T}, {dr // 2}], got {_describe(cos)}, {_describe(sin)}")
    fmt = cache_format(kv_cache)
    width = quant.row_width(fmt, c_kv.shape[-1], dr)
    _check(kv_cache.dim() == 3 and kv_cache.shape[-1] == width,
           f"kv_cache: expected [num_blocks, block_size, {width}] for {fmt} rows, got {_describe(kv_cache)}")
    _check(slot_mapping.shape == (T,) and slot_mapping.dtype == torch.int64,
           f"slot_mapping: expected int64 [{T}], got {_describe(slot_mapping)}")
    for name, t in (("q_pe", q_pe), ("k_pe", k_pe), ("c_kv", c_kv), ("cos", cos), ("sin", sin),
                    ("slot_mapping", slot_mapping)):
        _check(t.device == kv_cache.device, f"{name}: expected device {kv_cache.device} (kv_cache's), got {t.device}")
    if slot_mapping.device.type == "cpu":   # on CUDA the slots are the caller's (no stream sync)
        slots = kv_cache.shape[0] * kv_cache.shape[1]
        bad = (slot_mapping >= slots).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"slot_mapping: expected slots < {slots} (num_blocks * block_size) or negative "
                             f"(skipped), got {slot_mapping[bad[0]].item()} at index {bad[0]}")
    kv_scale = _float("kv_scale", kv_scale)
    impl = _impl("rope_append", backend, kv_cache.device, fmt)
    if fmt == "plain":
        return impl(q_pe, k_pe, c_kv, cos, sin, kv_cache, slot_mapping, bool(interleave))
    return impl(q_pe, k_pe, c_kv, cos, sin, kv_cache, slot_mapping, bool(interleave), kv_scale)


def gather_latent(kv_cache, block_table, starts, cu_seqlens, num_tokens, *, backend=None):
    """Rows starts[b] .. starts[b] + len_b of each sequence b, from the paged cache into one
    contiguous [num_tokens, d] buffer at rows cu_seqlens[b] .. cu_seqlens[b + 1], as stored
    (FP8 rows stay FP8: mla.quant.dequantize_rows turns the chunk into values).

    kv_cache [num_blocks, block_size, d]; block_table [B, max_blocks] int32; starts [B] int32;
    cu_seqlens [B + 1] int32 with cu_seqlens[-1] == num_tokens (an int, so no host sync).
    """
    _check(kv_cache.dim() == 3, f"kv_cache: expected [num_blocks, block_size, d], got {_describe(kv_cache)}")
    _check(block_table.dim() == 2 and block_table.dtype == torch.int32,
           f"block_table: expected [B, max_blocks] int32, got {_describe(block_table)}")
    B = block_table.shape[0]
    _check_int_vector("starts", starts, B, kv_cache.device)
    _check_int_vector("cu_seqlens", cu_seqlens, B + 1, kv_cache.device)
    _check(isinstance(num_tokens, int) and num_tokens >= 0, f"num_tokens: expected an int >= 0, got {num_tokens!r}")
    return _impl("gather_latent", backend, kv_cache.device, "plain")(
        kv_cache, block_table, starts, cu_seqlens, num_tokens)


def _check_act(x, dims: str) -> None:
    ndim = dims.count(",") + 1
    _check(isinstance(x, torch.Tensor) and x.dim() == ndim, f"x: expected a {ndim}-D tensor {dims}, got {_describe(x)}")
    _check(x.dtype in _FLOAT, f"x: expected float16, bfloat16 or float32, got {x.dtype}")


def _check_fp8_weight(x, weight, weight_scale_inv, out_dtype) -> torch.dtype:
    """Checks of fp8_linear / fp8_bmm (any leading batch dims must match x's); returns out_dtype."""
    lead, K = tuple(x.shape[:-2]), x.shape[-1]
    _check(isinstance(weight, torch.Tensor) and weight.dim() == x.dim() and tuple(weight.shape[:-2]) == lead
           and weight.shape[-1] == K,
           f"weight: expected [{', '.join(map(str, lead + ('N',)))}, {K}], got {_describe(weight)}")
    _check(weight.dtype == torch.float8_e4m3fn, f"weight: expected float8_e4m3fn, got {weight.dtype}")
    blocks = lead + (-(-weight.shape[-2] // 128), -(-K // 128))
    _check(isinstance(weight_scale_inv, torch.Tensor) and weight_scale_inv.dtype == torch.float32
           and tuple(weight_scale_inv.shape) == blocks,
           f"weight_scale_inv: expected float32 of shape {blocks}, got {_describe(weight_scale_inv)}")
    for name, t in (("weight", weight), ("weight_scale_inv", weight_scale_inv)):
        _check(t.device == x.device, f"{name}: expected device {x.device}, got {t.device}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    _check(out_dtype in _FLOAT, f"out_dtype: expected float16, bfloat16, float32 or None, got {out_dtype}")
    return out_dtype


def quantize_act_1x128(x, *, backend=None):
    """Activations to FP8, per token and per 128 columns (DeepSeek-V3's 1x128 scaling).

    x [M, K] float16/bfloat16/float32 -> (x_q [M, K] float8_e4m3fn, x_scale [M, ceil(K/128)]
    float32): scale = max(amax of the group, 1e-12) / 448, x_q = x / scale rounded to nearest
    even (a group of zeros quantizes to zeros). The last group may be partial.
    """
    _check_act(x, "[M, K]")
    return _impl("quantize_act_1x128", backend, x.device)(x)


def fp8_linear(x, weight, weight_scale_inv, out_dtype=None, *, backend=None):
    """y = x @ W^T on a block-scaled FP8 weight, the activation quantized per token per 128 columns.

    x:                [M, K] float16/bfloat16/float32
    weight:           [N, K] float8_e4m3fn (a checkpoint's ``weight``, [out, in])
    weight_scale_inv: [ceil(N/128), ceil(K/128)] float32; block (i, j) of W is w * scale[i, j]
                      (DeepSeek-V3's format; edge blocks partial; ue8m0 scales: mla.quant.scale_to_float)
    out_dtype:        float16/bfloat16/float32, default x's dtype
    Returns y [M, N]: sum over groups g of (x_q @ w_q^T)[:, :] * x_scale[m, g] * scale[n // 128, g],
    accumulated in float32 (x_q, x_scale from quantize_act_1x128).

    Accuracy against F.linear(x, dequantized W): the only extra rounding is x's, |x - x_q * s| <=
    2^-4 |x| (+ 2^-10 s for values in e4m3's subnormal range), so |y - y_ref| <= 2^-4 * (|x| @ |W|^T)
    elementwise; for random data the relative error is about 2-3 % (tests/test_fp8_gemm.py).
    """
    _check_act(x, "[M, K]")
    out_dtype = _check_fp8_weight(x, weight, weight_scale_inv, out_dtype)
    return _impl("fp8_linear", backend, x.device)(x, weight, weight_scale_inv, out_dtype)


def fp8_bmm(x, weight, weight_scale_inv, out_dtype=None, *, backend=None):
    """fp8_linear for each of H independent weights (the absorbed W_UK / W_UV of MLA).

    x [H, T, K] float; weight [H, N, K] float8_e4m3fn; weight_scale_inv [H, ceil(N/128),
    ceil(K/128)] float32 -> [H, T, N] in out_dtype (default x's). Each row x[h, t] is quantized
    per 128 columns as in quantize_act_1x128.
    """
    _check_act(x, "[H, T, K]")
    out_dtype = _check_fp8_weight(x, weight, weight_scale_inv, out_dtype)
    return _impl("fp8_bmm", backend, x.device)(x, weight, weight_scale_inv, out_dtype)
