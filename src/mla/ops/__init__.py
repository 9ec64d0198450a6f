"""Kernel-level attention ops: the public wrappers, their validation, and the one place that
chooses a backend.

Every op takes ``backend=None`` (CUDA tensors -> "triton" when Triton is importable, else
"torch"), "torch" (the reference in ``reference.py``) or "triton" (GPU kernels; on CPU tensors
they run under Triton's interpreter). ``lse`` is float32 with the shape of ``out`` minus its
last dimension; a query with no visible key gets ``out = 0`` and ``lse = -inf``.

The "triton" backend of each op family is a module or package here (``decode``, ``prefill``, ``norm``,
``merge``, ``cache_append``, ``gather``, ``fp8_gemm``, ``indexer``, ``sparse_attention``),
imported where it first runs (Triton is optional); where a family has several kernels, its own
``choose_kernel`` chooses among them.

Each wrapper checks its arguments' types, shapes, dtypes and devices, then calls its op
registered with ``torch.library`` (``torch.ops.mla.<name>``, ``_library.py``), which checks the
values of CPU index tensors, picks the kernel or the reference (``backend.use_kernels``, then
the inputs the kernel module serves) and calls it: a reader follows
``mla_decode`` -> ``_library.mla_decode`` -> ``decode.mla_decode`` -> ``decode.choose_kernel``
-> ``gluon.seesaw.launch`` (say) by plain calls. The wrappers read no tensor values, so they
trace under ``torch.compile(fullgraph=True)``: the checks run once at trace time on FakeTensors,
the value checks whenever the op runs.
"""
from __future__ import annotations

import torch

from .. import quant
from . import _library, reference
from ._checks import (FLOAT, as_float, check, check_act, check_flag, check_fp8_tensor_cores, check_fp8_weight,
                      check_int, check_int_vector, check_latent_query_cache, dense, describe, offsets_ok)
from .backend import resolve_backend, triton_available

__all__ = ["mla_decode", "prefill_attention", "fp8_prefill_attention", "merge_attention", "rms_norm", "rms_norm_pair",
           "rope", "rope_append",
           "gather_latent", "quantize_act_1x128", "quantize_rows_fp8", "fp8_linear", "fp8_bmm",
           "resolve_backend", "triton_available"]


def mla_decode(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal=True, *,
               kv_scale=1.0, backend=None, pdl=True):
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
    pdl:           (backend "triton") launch the Hopper kernels and the split combine as
                   programmatic dependents of the kernel before them (Hopper and later: their
                   programs are placed on the SMs as it drains); False keeps plain stream order
    Returns out [B, s_q, H, head_dim_v] in q's dtype and lse [B, s_q, H] float32.

    On CPU tensors the lengths (0..max_blocks * block_size) and the block ids they reach (in
    [0, num_blocks); entries past a sequence's last block may hold anything) are checked. On
    CUDA they are the caller's responsibility: reading them back would sync the stream, and
    decode must stay capturable in a CUDA graph. Every tensor may have any strides (strided
    block_table and cache_seqlens are copied to a contiguous layout on the device: no sync).
    """
    kv_cache, _ = check_latent_query_cache(q, kv_cache, head_dim_v)
    B = q.shape[0]
    check_flag("causal", causal)
    check_flag("pdl", pdl)
    check(isinstance(block_table, torch.Tensor) and block_table.dim() == 2 and block_table.shape[0] == B
           and block_table.dtype == torch.int32,
           lambda: f"block_table: expected [{B}, max_blocks] int32, got {describe(block_table)}")
    check(block_table.device == q.device, lambda: f"block_table: expected device {q.device}, got {block_table.device}")
    check_int_vector("cache_seqlens", cache_seqlens, B, q.device)
    softmax_scale, kv_scale = as_float("softmax_scale", softmax_scale), as_float("kv_scale", kv_scale, positive=True)
    block_table, cache_seqlens = dense(block_table), dense(cache_seqlens)
    resolve_backend(backend, q.device)
    return _library.mla_decode(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, kv_scale,
                               backend, pdl)


def prefill_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal=True, *, max_seqlen_q=None,
                      max_seqlen_k=None, offsets_q=None, offsets_k=None, backend=None, kernel=None, workspace=None):
    """Varlen packed attention with log-sum-exp (the expanded, "MHA" path).

    q [Tq, H, dq], k [Tk, H, dq], v [Tk, H, dv]; cu_seqlens_q/k [B + 1] int32 offsets.
    causal aligns the ends: the last query of a sequence sees all its keys.
    max_seqlen_q/k: the longest query / key length, as the caller knows them on the host
    (flash-attn's varlen convention; optional). offsets_q/k: cu_seqlens_q/k themselves as
    host ints (a list or tuple; optional; they give max_seqlen_q/k where those are None).
    Both must be exact: with them the GPU path picks its kernel without reading the offsets
    back (a stream sync), and FlashInfer's prefill, where installed, plans from the host
    offsets.
    kernel: (backend "triton") None for the rule of ``mla.ops.prefill`` (FlashInfer where it
    serves, then cuDNN, then the Triton kernel), or "flashinfer", "cudnn" or "triton" to force
    one (ValueError where it does not serve the inputs). workspace: FlashInfer's buffers, a
    ``mla.ops.prefill.FlashInferWorkspace`` (default ``mla.ops.prefill.DEFAULT_WORKSPACE``, which
    holds 128 MiB per device once FlashInfer has run there; ``free()`` releases it).
    Returns out [Tq, H, dv] in q's dtype and lse [Tq, H] float32.

    The offsets' values (0 first, never decreasing, Tq / Tk last) are checked on CPU tensors
    and for backend="torch", which read them on the host anyway; on CUDA with the kernels they
    are the caller's responsibility. Every tensor may have any strides (strided cu_seqlens are
    copied to a contiguous layout on the device: no sync).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check(isinstance(t, torch.Tensor) and t.dim() == 3,
              lambda: f"{name}: expected a 3-D [tokens, heads, dim] tensor, got {describe(t)}")
        check(t.dtype in FLOAT, lambda: f"{name}: expected float16, bfloat16 or float32, got {t.dtype}")
        check(t.device == q.device, lambda: f"{name}: expected device {q.device}, got {t.device}")
    check(k.dtype == q.dtype and v.dtype == q.dtype,
          lambda: f"k, v: expected dtype {q.dtype}, got {k.dtype}, {v.dtype}")
    check(k.shape[1:] == q.shape[1:], lambda: f"k: expected [Tk, {q.shape[1]}, {q.shape[2]}], got {tuple(k.shape)}")
    check(v.shape[:2] == k.shape[:2], lambda: f"v: expected [{k.shape[0]}, {k.shape[1]}, dv], got {tuple(v.shape)}")
    cu_seqlens_q, cu_seqlens_k, softmax_scale = _varlen_args(q, k, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                                                             offsets_q, offsets_k)
    B = cu_seqlens_q.shape[0] - 1
    resolve_backend(backend, q.device)
    check(kernel is None or kernel in ("flashinfer", "cudnn", "triton"),
          lambda: f"kernel: expected None, or 'flashinfer', 'cudnn' or 'triton' with backend 'triton', got {kernel!r}")
    for name, m, total in (("max_seqlen_q", max_seqlen_q, q.shape[0]), ("max_seqlen_k", max_seqlen_k, k.shape[0])):
        # what the host can check: B sequences of at most m rows hold all the rows, none more than all
        if not (m is None or (isinstance(m, int) and not isinstance(m, bool) and m <= total <= B * m)):
            raise ValueError(f"{name}: expected None or the longest length, an int with {name} <= {total} <= {B} * "
                             f"{name}, got {m!r}")
    # the offsets' values (CPU, or the reference) are checked where they are read, and the
    # choice of implementation made, in the op
    offsets_q, offsets_k = (None if h is None else list(h) for h in (offsets_q, offsets_k))
    if workspace is not None:   # an object no op schema holds: the op's body, run as a plain call
        return _library.run_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, max_seqlen_q,
                                    max_seqlen_k, offsets_q, offsets_k, backend, kernel, workspace)
    return _library.prefill_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, max_seqlen_q,
                                      max_seqlen_k, offsets_q, offsets_k, backend, kernel)


def fp8_prefill_attention(q, k, v, k_scale, v_scale, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal=True, *,
                          offsets_q=None, offsets_k=None, backend=None):
    """Varlen packed attention in e4m3 arithmetic, with log-sum-exp (context attention over an
    FP8 latent cache: the expanded form with per-head keys, or the absorbed form with one key
    row for every head). Which products run on e4m3 MMAs on the GPU is the kernel's
    (``mla.ops.prefill.triton``, docs/kernels.md); the values are the same either way.

    q [Tq, H, dq] float16, bfloat16 or float32: each (token, head) row is rounded to e4m3 on its
    own scale inside the kernel (no FP8 copy of q is written). k [Tk, Hk, dq], v [Tk, Hk, dv]
    float8_e4m3fn with Hk = H, or Hk = 1 (every head reads the same key row, e.g. latent rows
    [c_kv | k_pe] with v their first dv columns); k_scale, v_scale float32 of shape [] or [1]
    (one scale) or [Tk, Hk] (one a row): k ~ k * k_scale. P is rounded to e4m3 per block of keys
    (``mla.ops.reference.fp8_prefill_attention`` states the arithmetic). cu_seqlens_q/k,
    offsets_q/k and causal as ``prefill_attention``. Returns out [Tq, H, dv] in q's dtype and
    lse [Tq, H] float32.

    backend "triton" on CUDA needs FP8 tensor cores (compute capability >= 8.9); "torch" runs the
    float32 emulation, rounding P per block of ``reference.FP8_P_BLOCK`` keys.
    """
    check(isinstance(q, torch.Tensor) and q.dim() == 3,
          lambda: f"q: expected a 3-D [tokens, heads, dim] tensor, got {describe(q)}")
    check(q.dtype in FLOAT, lambda: f"q: expected float16, bfloat16 or float32, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        check(isinstance(t, torch.Tensor) and t.dim() == 3 and t.dtype == quant.FP8,
              lambda: f"{name}: expected a 3-D float8_e4m3fn tensor, got {describe(t)}")
        check(t.device == q.device, lambda: f"{name}: expected device {q.device}, got {t.device}")
    H, dq = q.shape[1:]
    check(k.shape[1] in (H, 1) and k.shape[2] == dq,
          lambda: f"k: expected [Tk, {H} or 1, {dq}], got {tuple(k.shape)}")
    check(v.shape[:2] == k.shape[:2], lambda: f"v: expected [{k.shape[0]}, {k.shape[1]}, dv], got {tuple(v.shape)}")
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        check(isinstance(t, torch.Tensor) and t.dtype == torch.float32
              and (t.shape in ((), (1,)) or t.shape == k.shape[:2]),
              lambda: f"{name}: expected a float32 tensor of shape [], [1] or [{k.shape[0]}, {k.shape[1]}], "
                      f"got {describe(t)}")
        check(t.device == q.device, lambda: f"{name}: expected device {q.device}, got {t.device}")
    cu_seqlens_q, cu_seqlens_k, softmax_scale = _varlen_args(q, k, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                                                             offsets_q, offsets_k)
    if resolve_backend(backend, q.device) == "triton":
        check_fp8_tensor_cores("q: fp8_prefill_attention", q.device)
    offsets_q, offsets_k = (None if h is None else list(h) for h in (offsets_q, offsets_k))
    return _library.fp8_prefill_attention(q, k, v, k_scale, v_scale, cu_seqlens_q, cu_seqlens_k, softmax_scale,
                                          causal, offsets_q, offsets_k, backend)


def _varlen_args(q, k, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, offsets_q, offsets_k):
    """The checks varlen attention's offsets and scalars share: returns the offsets laid out as
    the kernels read them and the scale as a float."""
    check_int_vector("cu_seqlens_q", cu_seqlens_q, None, q.device)
    check(cu_seqlens_q.shape[0] >= 1, "cu_seqlens_q: expected [B + 1] offsets (B >= 0), got an empty tensor")
    check_int_vector("cu_seqlens_k", cu_seqlens_k, cu_seqlens_q.shape[0], q.device)
    B = cu_seqlens_q.shape[0] - 1
    cu_seqlens_q, cu_seqlens_k = dense(cu_seqlens_q), dense(cu_seqlens_k)
    softmax_scale = as_float("softmax_scale", softmax_scale)
    check_flag("causal", causal)
    for name, h, total in (("offsets_q", offsets_q, q.shape[0]), ("offsets_k", offsets_k, k.shape[0])):
        # what the host can check: B + 1 ints from 0 to the row count, never decreasing (the
        # message built only on failure: torch.compile cannot repr traced ints)
        if not (h is None or (isinstance(h, (list, tuple)) and len(h) == B + 1
                              and all(isinstance(x, int) and not isinstance(x, bool) for x in h)
                              and offsets_ok(h, total))):
            raise ValueError(f"{name}: expected None or {B + 1} non-decreasing host ints from 0 to {total}, "
                             f"got {h!r}"[:300])
    return cu_seqlens_q, cu_seqlens_k, softmax_scale


def merge_attention(out_a, lse_a, out_b, lse_b, *, backend=None):
    """Merge two partial attention results over disjoint key sets, exactly, by log-sum-exp.

    out_* [..., d], lse_* [...] float32 (out's shape minus its last dim). Empty parts
    (lse = -inf) weigh 0; returns (out in out_a's dtype, lse float32), never NaN. The two-part
    case of the one LSE combine (``reference.combine``; on "triton" the split-KV decode's combine
    kernel).
    """
    check(isinstance(out_a, torch.Tensor) and out_a.dim() >= 1 and out_a.dtype in FLOAT,
           lambda: f"out_a: expected a float16, bfloat16 or float32 tensor [..., d], got {describe(out_a)}")
    check(isinstance(out_b, torch.Tensor) and out_b.shape == out_a.shape and out_b.dtype in FLOAT,
           lambda: f"out_b: expected a float16, bfloat16 or float32 tensor of out_a's shape {tuple(out_a.shape)}, "
           f"got {describe(out_b)}")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        check(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.shape == out_a.shape[:-1],
               lambda: f"{name}: expected float32 of shape {tuple(out_a.shape[:-1])}, got {describe(t)}")
    for name, t in (("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        check(t.device == out_a.device, lambda: f"{name}: expected device {out_a.device} (out_a's), got {t.device}")
    resolve_backend(backend, out_a.device)
    return _library.merge_attention(out_a, lse_a, out_b, lse_b, backend)


def rms_norm(x, weight, eps, *, backend=None):
    """RMSNorm of each row, as transformers' DeepseekV3RMSNorm computes it: x [T, N] (any
    strides) float16/bfloat16/float32, weight [N] of x's dtype, eps >= 0 -> weight *
    (x / sqrt(mean(x^2) + eps)), the statistics in float32, the normalized row rounded to x's
    dtype before the product (rounded again). Returns [T, N] contiguous, x's dtype."""
    eps = _norm_args("x", "weight", "eps", x, weight, eps)
    resolve_backend(backend, x.device)
    return _library.rms_norm(x, weight, eps, backend)


def rms_norm_pair(x1, weight1, eps1, x2, weight2, eps2, *, backend=None):
    """``rms_norm`` of two tensors with the same rows, in one launch on the "triton" backend: the
    layer's query and KV latents at a decode step, where a launch is a few microseconds of a
    small step. x1 [T, N1] and x2 [T, N2] on one device, each with its own weight and eps, as in
    ``rms_norm``. Returns (rms_norm(x1, weight1, eps1), rms_norm(x2, weight2, eps2)), the same
    values."""
    eps1 = _norm_args("x1", "weight1", "eps1", x1, weight1, eps1)
    eps2 = _norm_args("x2", "weight2", "eps2", x2, weight2, eps2)
    check(x2.shape[0] == x1.shape[0] and x2.device == x1.device,
          lambda: f"x2: expected {x1.shape[0]} rows on {x1.device} (x1's), got {describe(x2)}")
    resolve_backend(backend, x1.device)
    return _library.rms_norm_pair(x1, weight1, eps1, x2, weight2, eps2, backend)


def _norm_args(x_name: str, w_name: str, eps_name: str, x, weight, eps) -> float:
    """``rms_norm``'s checks of one input, weight and eps, named; returns eps as a float."""
    check(isinstance(x, torch.Tensor) and x.dim() == 2 and x.dtype in FLOAT,
          lambda: f"{x_name}: expected a float16, bfloat16 or float32 [T, N] tensor, got {describe(x)}")
    check(x.shape[1] > 0, lambda: f"{x_name}: expected at least one column, got {describe(x)}")
    check(isinstance(weight, torch.Tensor) and weight.shape == (x.shape[1],) and weight.dtype == x.dtype
          and weight.device == x.device,
          lambda: f"{w_name}: expected [{x.shape[1]}] {x.dtype} on {x.device}, got {describe(weight)}")
    eps = as_float(eps_name, eps)
    check(eps >= 0, lambda: f"{eps_name}: expected a finite real number >= 0, got {eps!r}")
    return eps


def rope(q_pe, k_pe, cos, sin, interleave, *, backend=None):
    """RoPE in place: q_pe [T, H, dr] and k_pe [T, dr] (float, any strides, no overlapping
    elements) rotated by cos, sin [T, dr/2] float32, pairs as in ``rope_append``, in float32 and
    cast back. ``rope_append`` without the cache: the sparse indexer's queries and keys, whose
    RoPE part is a slice of their rows. Returns None."""
    for name, t in (("q_pe", q_pe), ("k_pe", k_pe), ("cos", cos), ("sin", sin)):
        check(isinstance(t, torch.Tensor), lambda: f"{name}: expected a tensor, got {describe(t)}")
    check(q_pe.dim() == 3 and q_pe.dtype in FLOAT, lambda: f"q_pe: expected float [T, H, dr], got {describe(q_pe)}")
    T, _, dr = q_pe.shape
    check(k_pe.shape == (T, dr) and k_pe.dtype in FLOAT,
          lambda: f"k_pe: expected float [{T}, {dr}], got {describe(k_pe)}")
    check(dr % 2 == 0, lambda: f"q_pe: expected an even RoPE width (pairs), got {dr}")
    check(cos.shape == (T, dr // 2) and sin.shape == cos.shape and cos.dtype == torch.float32
          and sin.dtype == torch.float32,
          lambda: f"cos, sin: expected float32 [{T}, {dr // 2}], got {describe(cos)}, {describe(sin)}")
    for name, t in (("k_pe", k_pe), ("cos", cos), ("sin", sin)):
        check(t.device == q_pe.device, lambda: f"{name}: expected device {q_pe.device} (q_pe's), got {t.device}")
    check_flag("interleave", interleave)
    resolve_backend(backend, q_pe.device)
    _library.rope(q_pe, k_pe, dense(cos), dense(sin), interleave, backend)


def rope_append(q_pe, k_pe, c_kv, cos, sin, kv_cache, slot_mapping, interleave, *, kv_scale=1.0, backend=None,
                q_out=None):
    """Fused RoPE + latent-cache append (in place).

    q_pe [T, H, dr] and k_pe [T, dr] are rotated in place by cos, sin [T, dr/2] float32
    (interleaved pairs (2i, 2i+1) or neox pairs (i, i + dr/2)); rows [c_kv | rope(k_pe)]
    (c_kv [T, r]) are written to kv_cache [num_blocks, block_size, r + dr] at the flat
    slots slot_mapping [T] int64 (negative slots are skipped), quantized where the cache is FP8
    (see mla_decode for the formats; NaN stays NaN there, see mla.quant). kv_scale: the FP8
    rows' per-tensor scale, finite and > 0. q_out: [T, H, dr] of q_pe's dtype, where the rotated
    q_pe goes instead (q_pe is then only read): the decode query's RoPE columns, written in
    place of a copy (q_pe itself, or memory apart from it). Returns None.

    Every tensor may have any strides; q_pe (or q_out), k_pe and kv_cache are written through
    theirs (no overlapping elements). Slots past the pool are refused on CPU tensors; on CUDA
    they are the caller's (checking them would sync the stream), and the kernel skips them
    (never writes out of bounds).
    """
    for name, t in (("q_pe", q_pe), ("k_pe", k_pe), ("c_kv", c_kv), ("cos", cos), ("sin", sin),
                    ("kv_cache", kv_cache), ("slot_mapping", slot_mapping)):
        check(isinstance(t, torch.Tensor), lambda: f"{name}: expected a tensor, got {describe(t)}")
    check(c_kv.dim() == 2 and c_kv.dtype in FLOAT, lambda: f"c_kv: expected float [T, r], got {describe(c_kv)}")
    T = c_kv.shape[0]
    check(q_pe.dim() == 3 and q_pe.shape[0] == T and q_pe.dtype in FLOAT,
          lambda: f"q_pe: expected float [{T}, H, dr], got {describe(q_pe)}")
    dr = q_pe.shape[-1]
    check(k_pe.shape == (T, dr) and k_pe.dtype in FLOAT,
          lambda: f"k_pe: expected float [{T}, {dr}], got {describe(k_pe)}")
    check(cos.shape == (T, dr // 2) and sin.shape == cos.shape and cos.dtype == torch.float32
          and sin.dtype == torch.float32,
          lambda: f"cos, sin: expected float32 [{T}, {dr // 2}], got {describe(cos)}, {describe(sin)}")
    fmt = quant.cache_format(kv_cache)
    width = quant.row_width(fmt, c_kv.shape[-1], dr)
    check(kv_cache.dim() == 3 and kv_cache.shape[-1] == width,
           lambda: f"kv_cache: expected [num_blocks, block_size, {width}] for {fmt} rows, got {describe(kv_cache)}")
    check(fmt != "plain" or kv_cache.dtype in FLOAT,
          lambda: f"kv_cache: expected a float or FP8 dtype, got {kv_cache.dtype}")
    check(slot_mapping.shape == (T,) and slot_mapping.dtype == torch.int64,
           lambda: f"slot_mapping: expected int64 [{T}], got {describe(slot_mapping)}")
    for name, t in (("q_pe", q_pe), ("k_pe", k_pe), ("c_kv", c_kv), ("cos", cos), ("sin", sin),
                    ("slot_mapping", slot_mapping)):
        check(t.device == kv_cache.device,
              lambda: f"{name}: expected device {kv_cache.device} (kv_cache's), got {t.device}")
    if q_out is not None:
        check(isinstance(q_out, torch.Tensor) and q_out.shape == q_pe.shape and q_out.dtype == q_pe.dtype
              and q_out.device == q_pe.device,
              lambda: f"q_out: expected [{T}, {q_pe.shape[1]}, {dr}] {q_pe.dtype} on {q_pe.device} (q_pe's), "
                      f"got {describe(q_out)}")
    check_flag("interleave", interleave)
    kv_scale = as_float("kv_scale", kv_scale, positive=True)
    resolve_backend(backend, kv_cache.device)
    cos, sin, slot_mapping = dense(cos), dense(sin), dense(slot_mapping)
    # the slots' values (CPU), that no written tensor overlaps itself and that q_out keeps apart
    # from q_pe are checked in the op before it writes (under torch.compile the op may write
    # other buffers than the traced ones)
    _library.rope_append(q_pe, k_pe, c_kv, cos, sin, kv_cache, slot_mapping, interleave, kv_scale, backend, q_out)


def gather_latent(kv_cache, block_table, starts, cu_seqlens, num_tokens, *, backend=None):
    """Rows starts[b] .. starts[b] + len_b of each sequence b, from the paged cache into one
    contiguous [num_tokens, d] buffer at rows cu_seqlens[b] .. cu_seqlens[b + 1], as stored
    (FP8 rows stay FP8: mla.quant.dequantize_rows turns the chunk into values).

    kv_cache [num_blocks, block_size, d]; block_table [B, max_blocks] int32; starts [B] int32;
    cu_seqlens [B + 1] int32 with cu_seqlens[-1] == num_tokens (an int, so no host sync).

    On CPU tensors the values are checked: cu_seqlens non-decreasing from 0 to num_tokens,
    starts >= 0, and every block the rows reach inside block_table's row and in
    [0, num_blocks). On CUDA they are the caller's (reading them would sync the stream); the
    kernel then clamps every index into its tensor, so wrong values give wrong rows (rows past
    cu_seqlens[-1] are zeros) but never a read out of bounds.
    """
    check(isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 3,
          lambda: f"kv_cache: expected [num_blocks, block_size, d], got {describe(kv_cache)}")
    check(isinstance(block_table, torch.Tensor) and block_table.dim() == 2 and block_table.dtype == torch.int32,
           lambda: f"block_table: expected [B, max_blocks] int32, got {describe(block_table)}")
    check(block_table.device == kv_cache.device,
          lambda: f"block_table: expected device {kv_cache.device} (kv_cache's), got {block_table.device}")
    B = block_table.shape[0]
    check_int_vector("starts", starts, B, kv_cache.device)
    check_int_vector("cu_seqlens", cu_seqlens, B + 1, kv_cache.device)
    check_int("num_tokens", num_tokens, 0)
    resolve_backend(backend, kv_cache.device)
    block_table, starts, cu_seqlens = dense(block_table), dense(starts), dense(cu_seqlens)
    # the index values (CPU) are checked in the op
    return _library.gather_latent(kv_cache, block_table, starts, cu_seqlens, num_tokens, backend)


def quantize_act_1x128(x, *, backend=None):
    """Activations to FP8, per token and per 128 columns (DeepSeek-V3's 1x128 scaling).

    x [M, K] float16/bfloat16/float32 -> (x_q [M, K] float8_e4m3fn, x_scale [M, ceil(K/128)]
    float32): scale = max(amax of the group, 1e-12) / 448, x_q = x / scale rounded to nearest
    even (a group of zeros quantizes to zeros). The last group may be partial.
    """
    check_act(x, "[M, K]")
    resolve_backend(backend, x.device)
    return _library.quantize_act_1x128(x, backend)


def quantize_rows_fp8(x, *, backend=None):
    """Rows to FP8, one scale a row (the last dim): x [..., D] float16/bfloat16/float32 ->
    (x_q [..., D] float8_e4m3fn, scale [...] float32), scale = max(amax of the row, 1e-12) / 448,
    x_q = x / scale rounded to nearest even; a row holding a NaN gets a NaN scale. The keys and
    values of FP8 context attention (``fp8_prefill_attention``) are rounded so."""
    check(isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[-1] >= 1,
          lambda: f"x: expected a tensor [..., D] with D >= 1, got {describe(x)}")
    check(x.dtype in FLOAT, lambda: f"x: expected float16, bfloat16 or float32, got {x.dtype}")
    resolve_backend(backend, x.device)
    return _library.quantize_rows_fp8(x, backend)


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
    check_act(x, "[M, K]")
    out_dtype = check_fp8_weight(x, weight, weight_scale_inv, out_dtype)
    resolve_backend(backend, x.device)
    return _library.fp8_linear(x, weight, weight_scale_inv, out_dtype, backend)


def fp8_bmm(x, weight, weight_scale_inv, out_dtype=None, *, backend=None):
    """fp8_linear for each of H independent weights (the absorbed W_UK / W_UV of MLA).

    x [H, T, K] float; weight [H, N, K] float8_e4m3fn; weight_scale_inv [H, ceil(N/128),
    ceil(K/128)] float32 -> [H, T, N] in out_dtype (default x's). Each row x[h, t] is quantized
    per 128 columns as in quantize_act_1x128.
    """
    check_act(x, "[H, T, K]")
    out_dtype = check_fp8_weight(x, weight, weight_scale_inv, out_dtype)
    resolve_backend(backend, x.device)
    return _library.fp8_bmm(x, weight, weight_scale_inv, out_dtype, backend)


# Sparse MLA (DeepSeek Sparse Attention): their own module, imported last (it uses resolve_backend)
from .sparse import indexer_logits, sparse_mla_decode, sparse_prefill_attention, topk_indices  # noqa: E402

__all__ += ["indexer_logits", "topk_indices", "sparse_mla_decode", "sparse_prefill_attention"]
