"""Pure-PyTorch reference implementations of the attention ops.

Each function here is the specification of its op: the CPU path, the test oracle
and the benchmark baseline. Arithmetic is float32 whatever the input dtype; the
output takes the dtype of the query (or of ``out_a`` for the merge) and ``lse`` is
always float32. A query that sees no key gets ``out = 0`` and ``lse = -inf``.

Arguments are validated by the public wrappers in ``mla.ops``; these functions
assume well-formed input.
"""
from __future__ import annotations

import torch

from ..quant import cache_format, dequantize_index, dequantize_rows, quantize_rows
from ..rope import apply_rope

__all__ = ["mla_decode", "prefill_attention", "combine", "merge_attention", "rms_norm", "rms_norm_pair", "rope",
           "rope_append", "gather_latent", "softmax_attend",
           "quantize_act_1x128", "fp8_linear", "fp8_bmm",
           "indexer_logits", "topk_indices", "sparse_mla_decode", "sparse_prefill_attention",
           "quantize_rows_fp8", "fp8_prefill_attention", "FP8_P_BLOCK"]


def softmax_attend(scores: torch.Tensor, visible: torch.Tensor, v: torch.Tensor):
    """Masked softmax(scores) @ v in float32, safe for rows with no visible key.

    scores [..., Q, K] float32, visible [..., Q, K] bool (broadcastable),
    v [..., K, dv] float32 -> (out [..., Q, dv] float32, lse [..., Q] float32).
    """
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # exp(-inf - (-inf)) would be NaN for an empty row: subtract 0 there instead.
    p = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    return p @ v, lse


def decode_visible(n: int, s_q: int, causal: bool, device) -> torch.Tensor:
    """[s_q, n] bool: which of a sequence's n cached keys each of its s_q new queries sees
    (causal: query i sees keys < n - s_q + i + 1; else all)."""
    if not causal:
        return torch.ones(s_q, n, dtype=torch.bool, device=device)
    limit = n - s_q + 1 + torch.arange(s_q, device=device)
    return torch.arange(n, device=device)[None, :] < limit[:, None]


def gather_rows(kv_cache: torch.Tensor, block_table_row: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` rows of one sequence from a paged cache [num_blocks, block_size, d]."""
    block_size = kv_cache.shape[1]
    idx = torch.arange(n, device=kv_cache.device)
    blocks = block_table_row[: (n + block_size - 1) // block_size].long()
    return kv_cache[blocks[idx // block_size], idx % block_size]


def mla_decode(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal=True, kv_scale=1.0):
    """Absorbed MLA attention over a paged latent cache.

    q [B, s_q, H, d]; kv_cache [num_blocks, block_size, d]; block_table [B, max_blocks] int32;
    cache_seqlens [B] int32 (including the s_q new tokens). Keys are whole rows, values the
    first ``head_dim_v`` values of each row. Causal: query i sees keys < len - s_q + i + 1.
    FP8 rows (float8_e4m3fn with kv_scale, or the uint8 tile layout) are dequantized here.
    Returns out [B, s_q, H, head_dim_v] (q.dtype) and lse [B, s_q, H] float32.
    """
    fmt = cache_format(kv_cache)
    B, s_q, H, _ = q.shape
    out = torch.zeros(B, s_q, H, head_dim_v, dtype=torch.float32, device=q.device)
    lse = torch.full((B, s_q, H), float("-inf"), dtype=torch.float32, device=q.device)
    lengths = cache_seqlens.tolist()
    for b in range(B):
        n = int(lengths[b])
        if n <= 0 or s_q == 0:
            continue
        kv = dequantize_rows(gather_rows(kv_cache, block_table[b], n), fmt, head_dim_v, torch.float32, kv_scale)
        qb = q[b].float().transpose(0, 1)                                # [H, s_q, d]
        scores = (qb @ kv.T) * softmax_scale                             # [H, s_q, n]
        o, l = softmax_attend(scores, decode_visible(n, s_q, causal, q.device)[None], kv[:, :head_dim_v])
        out[b] = o.transpose(0, 1)
        lse[b] = l.transpose(0, 1)
    return out.to(q.dtype), lse


def _sequences(cu_seqlens_q, cu_seqlens_k, offsets_q, offsets_k):
    """(q0, q1, k0, k1) of each sequence with queries and keys (the host offsets where given)."""
    cq = list(offsets_q) if offsets_q is not None else cu_seqlens_q.tolist()
    ck = list(offsets_k) if offsets_k is not None else cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        if cq[b + 1] > cq[b] and ck[b + 1] > ck[b]:
            yield cq[b], cq[b + 1], ck[b], ck[b + 1]


def prefill_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal=True, max_seqlen_q=None,
                      max_seqlen_k=None, offsets_q=None, offsets_k=None):
    """Varlen packed attention. q [Tq, H, dq], k [Tk, H, dq], v [Tk, H, dv];
    cu_seqlens_* [B + 1] int32 (max_seqlen_* are hints for the GPU paths; the host offsets_*,
    where given, are cu_seqlens_*'s values, read here instead of copying them back). Causal
    aligns the ends: query i of a sequence with nq queries and nk keys sees keys j <= i + nk - nq.
    Returns out [Tq, H, dv] (q.dtype) and lse [Tq, H] float32.
    """
    Tq, H, _ = q.shape
    dv = v.shape[-1]
    out = torch.zeros(Tq, H, dv, dtype=torch.float32, device=q.device)
    lse = torch.full((Tq, H), float("-inf"), dtype=torch.float32, device=q.device)
    for q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k, offsets_q, offsets_k):
        nq, nk = q1 - q0, k1 - k0
        qb = q[q0:q1].float().transpose(0, 1)                            # [H, nq, dq]
        kb = k[k0:k1].float().transpose(0, 1)                            # [H, nk, dq]
        vb = v[k0:k1].float().transpose(0, 1)                            # [H, nk, dv]
        scores = (qb @ kb.transpose(1, 2)) * softmax_scale
        if causal:
            i = torch.arange(nq, device=q.device)[:, None]
            j = torch.arange(nk, device=q.device)[None, :]
            visible = j <= i + (nk - nq)
        else:
            visible = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
        o, l = softmax_attend(scores, visible[None], vb)
        out[q0:q1] = o.transpose(0, 1)
        lse[q0:q1] = l.transpose(0, 1)
    return out.to(q.dtype), lse


# ---------------------------------------------------------------- FP8 context attention
FP8_P_BLOCK = 64    # keys per block of P rounded to e4m3 (the GPU kernel's BLOCK_N)


def quantize_rows_fp8(x: torch.Tensor):
    """x [..., d] float -> (x_q [..., d] float8_e4m3fn, scale [...] float32): one scale a row
    (the last dim), max(amax, 1e-12) / 448, x_q = round_to_nearest_even(x / scale)."""
    amax = x.float().abs().amax(-1).clamp_min(AMAX_FLOOR)
    scale = amax / torch.full_like(amax, 448.0)
    return (x.float() / scale[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()


def fp8_prefill_attention(q, k, v, k_scale, v_scale, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal=True,
                          offsets_q=None, offsets_k=None, block_n: int = FP8_P_BLOCK):
    """Varlen attention in e4m3 arithmetic, emulated in float32 exactly as the kernel rounds.

    q [Tq, H, dq] (a float dtype); k [Tk, Hk, dq], v [Tk, Hk, dv] float8_e4m3fn, Hk = H or 1
    (one key row for every head: the absorbed form); k_scale, v_scale float32 of shape [] / [1]
    (per tensor) or [Tk, Hk] (per row): k ~ k_q * k_scale. The arithmetic:

    - each query row (token, head) is rounded to e4m3 with its own scale (``quantize_rows_fp8``);
      S = (q_q . k_q) * q_scale * k_scale * softmax_scale, accumulated in float32
    - keys are walked in blocks of ``block_n`` from key 0, with the online softmax's running
      max m: P = exp(S - m) in [0, 1], times w = v_scale / max(v_scale of the head), times 448,
      rounded to e4m3: P_q; acc = acc * exp(m_old - m) + P_q @ v_q, l likewise from P_q / (448 w)
    - out = acc * max(v_scale) / 448 / l, lse = m + log l

    so out is a convex combination of the dequantized value rows whatever the rounding.
    Causal aligns the ends as ``prefill_attention``. Returns out [Tq, H, dv] (q.dtype), lse [Tq, H].
    """
    Tq, H, _ = q.shape
    Hk, dv = k.shape[1], v.shape[-1]
    out = torch.zeros(Tq, H, dv, dtype=torch.float32, device=q.device)
    lse = torch.full((Tq, H), float("-inf"), dtype=torch.float32, device=q.device)
    Tk = k.shape[0]
    ks = k_scale.float().reshape(1, 1).expand(Tk, Hk) if k_scale.dim() < 2 else k_scale.float()
    vs = v_scale.float().reshape(1, 1).expand(Tk, Hk) if v_scale.dim() < 2 else v_scale.float()
    q_q, q_s = quantize_rows_fp8(q)
    for q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k, offsets_q, offsets_k):
        nq, nk = q1 - q0, k1 - k0
        qb = q_q[q0:q1].float().transpose(0, 1)                             # [H, nq, dq]
        qsb = q_s[q0:q1].transpose(0, 1)[..., None]                         # [H, nq, 1]
        kb = k[k0:k1].float().transpose(0, 1).expand(H, -1, -1)             # [H, nk, dq]
        vb = v[k0:k1].float().transpose(0, 1).expand(H, -1, -1)
        ksb = ks[k0:k1].transpose(0, 1).expand(H, -1)[:, None, :]           # [H, 1, nk]
        vsb = vs[k0:k1].transpose(0, 1).expand(H, -1)                       # [H, nk]
        vmax = vs.amax(0).expand(H)                                         # the head's largest row scale
        w = vsb / vmax[:, None]
        s = (qb @ kb.transpose(1, 2)) * qsb * ksb * softmax_scale            # [H, nq, nk]
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(nk, device=q.device)[None, :]
        s = s.masked_fill(~(j <= i + (nk - nq)) if causal else torch.zeros_like(s, dtype=torch.bool), float("-inf"))
        m = torch.full((H, nq), float("-inf"), device=q.device)
        l = torch.zeros(H, nq, device=q.device)
        acc = torch.zeros(H, nq, dv, device=q.device)
        for n0 in range(0, nk, block_n):
            sl = slice(n0, min(n0 + block_n, nk))
            m_new = torch.maximum(m, s[..., sl].amax(-1))
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            alpha = torch.exp(m - m_safe)
            p_q = _e4m3(torch.exp(s[..., sl] - m_safe[..., None]) * (w[:, None, sl] * 448.0))
            l = l * alpha + (p_q / (w[:, None, sl] * 448.0)).sum(-1)
            acc = acc * alpha[..., None] + p_q @ vb[:, sl]
            m = m_new
        seen = l > 0
        o = acc * (vmax[:, None, None] / 448.0) / torch.where(seen, l, 1.0)[..., None]
        out[q0:q1] = o.transpose(0, 1)
        lse[q0:q1] = torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)), float("-inf")).transpose(0, 1)
    return out.to(q.dtype), lse


def combine(out_parts, lse_parts, out_dtype=None):
    """Exact merge of S partial attentions over disjoint key sets by log-sum-exp.

    out_parts [S, ..., d], lse_parts [S, ...] float32 -> (out [..., d] in out_dtype (default
    out_parts'), lse [...] float32): lse = logaddexp over the parts (in order), out = sum_s
    out_s exp(lse_s - lse). A part with lse = -inf has weight 0 whatever its out holds (even
    NaN); if every part is empty the result is out = 0, lse = -inf (never NaN).
    """
    lse = lse_parts[0]
    for part in lse_parts[1:]:
        lse = torch.logaddexp(lse, part)
    safe = torch.where(torch.isfinite(lse), lse, 0.0)
    out = None
    for o, part in zip(out_parts, lse_parts):
        w = torch.exp(part - safe).unsqueeze(-1)
        term = torch.where(torch.isfinite(part).unsqueeze(-1), o.float() * w, 0.0)
        out = term if out is None else out + term
    return out.to(out_parts.dtype if out_dtype is None else out_dtype), lse


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Exact merge of two partial attentions over disjoint key sets: ``combine`` of two parts.

    out_* [..., d], lse_* [...] float32 -> (out in out_a's dtype, lse float32).
    """
    return combine(torch.stack((out_a, out_b)), torch.stack((lse_a, lse_b)), out_a.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, cast back, times weight (transformers' DeepseekV3RMSNorm)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm_pair(x1, weight1, eps1, x2, weight2, eps2) -> tuple[torch.Tensor, torch.Tensor]:
    """Two ``rms_norm``s: (rms_norm(x1, weight1, eps1), rms_norm(x2, weight2, eps2))."""
    return rms_norm(x1, weight1, eps1), rms_norm(x2, weight2, eps2)


def rope(q_pe, k_pe, cos, sin, interleave):
    """Rotate q_pe [T, H, dr] and k_pe [T, dr] in place by cos/sin [T, dr/2] (float32)."""
    q_pe.copy_(apply_rope(q_pe, cos, sin, interleave))
    k_pe.copy_(apply_rope(k_pe, cos, sin, interleave))


def rope_append(q_pe, k_pe, c_kv, cos, sin, kv_cache, slot_mapping, interleave, kv_scale=1.0, q_out=None):
    """Rotate q_pe [T, H, dr] (into q_out where given, else in place) and k_pe [T, dr] in place
    by cos/sin [T, dr/2] (float32), and write the latent rows [c_kv | rope(k_pe)] (c_kv [T, r])
    into kv_cache [num_blocks, block_size, r + dr] at flat slots slot_mapping [T] int64 (slot =
    block * block_size + offset; a negative slot is not written).
    """
    (q_pe if q_out is None else q_out).copy_(apply_rope(q_pe, cos, sin, interleave))
    k_pe.copy_(apply_rope(k_pe, cos, sin, interleave))
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    keep = slot_mapping >= 0   # a negative slot: the token is stored elsewhere (another CP rank)
    rows = torch.cat((c_kv, k_pe), dim=-1)[keep]
    fmt = cache_format(kv_cache)
    flat[slot_mapping[keep]] = rows.to(kv_cache.dtype) if fmt == "plain" else quantize_rows(
        rows, fmt, c_kv.shape[-1], kv_scale)


def gather_latent(kv_cache, block_table, starts, cu_seqlens, num_tokens):
    """Copy latent rows of several sequences from the paged cache into one contiguous buffer.

    Sequence b contributes its tokens starts[b] .. starts[b] + (cu_seqlens[b+1] - cu_seqlens[b])
    to rows cu_seqlens[b] .. cu_seqlens[b+1] of the result [num_tokens, d] (kv_cache's dtype).
    block_table [B, max_blocks] int32, starts [B] int32, cu_seqlens [B + 1] int32.
    """
    out = torch.empty(num_tokens, kv_cache.shape[-1], dtype=kv_cache.dtype, device=kv_cache.device)
    block_size = kv_cache.shape[1]
    cu, st = cu_seqlens.tolist(), starts.tolist()
    for b in range(len(cu) - 1):
        n = cu[b + 1] - cu[b]
        if n == 0:
            continue
        tok = torch.arange(st[b], st[b] + n, device=kv_cache.device)
        blocks = block_table[b].long()[tok // block_size]
        out[cu[b]:cu[b + 1]] = kv_cache[blocks, tok % block_size]
    return out


# ---------------------------------------------------------------- block-scaled FP8 GEMM
ACT_GROUP = 128        # activation columns sharing one scale (and the weight's block size)
AMAX_FLOOR = 1e-12     # a group of zeros gets scale 1e-12 / 448: it quantizes to zeros


def quantize_act_1x128(x):
    """Per-token, per-128-column quantization of activations to float8_e4m3fn.

    x [..., K] float -> (x_q [..., K] float8_e4m3fn, x_scale [..., ceil(K/128)] float32) with
    scale = max(amax(group), 1e-12) / 448 and x_q = round_to_nearest_even(x / scale), so that
    x ~ x_q * scale. The last group may be partial; padding never enters the amax.
    """
    K = x.shape[-1]
    G = -(-K // ACT_GROUP)
    xp = torch.nn.functional.pad(x.float(), (0, G * ACT_GROUP - K)).unflatten(-1, (G, ACT_GROUP))
    amax = xp.abs().amax(-1).clamp_min(AMAX_FLOOR)
    scale = amax / torch.full_like(amax, 448.0)   # a tensor divisor: CUDA divides by a scalar via its reciprocal
    q = (xp / scale[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.flatten(-2)[..., :K], scale


def _block_scaled_mm(x_q, x_scale, weight, weight_scale_inv):
    """sum over 128-column groups g of (x_q[..., g] @ weight[..., g]^T) * x_scale[..., g] * w_scale,
    in float32. x_q [..., M, K], x_scale [..., M, G], weight [..., N, K], weight_scale_inv
    [..., ceil(N/128), G] (leading dims broadcast) -> [..., M, N] float32."""
    N, K = weight.shape[-2:]
    w_scale = weight_scale_inv.float().repeat_interleave(ACT_GROUP, -2)[..., :N, :]   # [..., N, G]
    y = None
    for g in range(x_scale.shape[-1]):
        ks = slice(g * ACT_GROUP, min(K, (g + 1) * ACT_GROUP))
        part = (x_q[..., ks].float() @ weight[..., ks].float().transpose(-1, -2))
        part = part * x_scale[..., g, None] * w_scale[..., None, :, g]
        y = part if y is None else y + part
    if y is None:   # K = 0
        y = x_q.new_zeros(*x_q.shape[:-1], N, dtype=torch.float32)
    return y


def fp8_linear(x, weight, weight_scale_inv, out_dtype):
    """y = x @ W^T with W block-scaled FP8 and x quantized per token per 128 columns.

    x [M, K] float; weight [N, K] float8_e4m3fn; weight_scale_inv [ceil(N/128), ceil(K/128)]
    float32 (block (i, j) of W dequantizes as w * scale). Returns [M, N] in out_dtype.
    """
    x_q, x_scale = quantize_act_1x128(x)
    return _block_scaled_mm(x_q, x_scale, weight, weight_scale_inv).to(out_dtype)


def fp8_bmm(x, weight, weight_scale_inv, out_dtype):
    """fp8_linear per batch entry h: x [H, T, K], weight [H, N, K] float8_e4m3fn,
    weight_scale_inv [H, ceil(N/128), ceil(K/128)] float32 -> [H, T, N] in out_dtype."""
    return fp8_linear(x, weight, weight_scale_inv, out_dtype)   # its math broadcasts over H


# ---------------------------------------------------------------- sparse MLA (DeepSeek Sparse Attention)
def indexer_logits(q, weights, index_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_k, softmax_scale,
                   causal=True):
    """The lightning indexer's scores of every key a query sees, over a paged key cache.

    q [Tq, n_heads, d] (RoPE applied), packed by sequence (cu_seqlens_q [B + 1] int32);
    weights [Tq, n_heads] float32 (the head weights, scaled); index_cache [num_blocks,
    block_size, d], or uint8 FP8 key rows (``mla.quant.dequantize_index``); block_table [B, max_blocks] int32; cache_seqlens [B] int32 keys of each
    sequence, including its queries. Returns logits [Tq, max_seqlen_k] float32:
    logits[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s] * softmax_scale) where query i of
    a sequence with nq queries sees key s (causal: s < cache_seqlens - nq + i + 1), -inf elsewhere.
    """
    Tq, n_heads, _ = q.shape
    out = torch.full((Tq, max_seqlen_k), float("-inf"), dtype=torch.float32, device=q.device)
    cq, lengths = cu_seqlens_q.tolist(), cache_seqlens.tolist()
    for b in range(len(lengths)):
        q0, q1, n = cq[b], cq[b + 1], int(lengths[b])
        if q1 == q0 or n <= 0:
            continue
        k = gather_rows(index_cache, block_table[b], n)
        k = dequantize_index(k, q.shape[-1]) if k.dtype == torch.uint8 else k.float()   # [n, d]
        qb, wb = q[q0:q1].float(), weights[q0:q1].float()
        logits = torch.zeros(q1 - q0, n, dtype=torch.float32, device=q.device)
        for h in range(n_heads):   # one head at a time: never an [nq, n_heads, n] intermediate
            logits += wb[:, h, None] * torch.relu((qb[:, h] @ k.T) * softmax_scale)
        visible = decode_visible(n, q1 - q0, causal, q.device)
        out[q0:q1, :n] = logits.masked_fill(~visible, float("-inf"))
    return out


def topk_indices(logits, topk, block_table, cu_seqlens_q, block_size):
    """The ``topk`` best keys of every query as flat cache slots (FlashMLA's sparse ``indices``).

    logits [Tq, K] float32 (-inf: a key the query does not see), rows packed by sequence
    (cu_seqlens_q [B + 1] int32); key s of sequence b lives at slot
    block_table[b, s // block_size] * block_size + s % block_size. Returns [Tq, topk] int32:
    the selected keys in key order (ascending position, as the attention reads them), then -1.
    Ties at the k-th score go to the lower key index (a stable sort), so the selection is
    deterministic; a query that sees fewer than topk keys gets all of them, then -1.
    """
    Tq, K = logits.shape
    out = torch.full((Tq, topk), -1, dtype=torch.int32, device=logits.device)
    k = min(topk, K)
    if Tq == 0 or k == 0:
        return out
    values, pos = torch.sort(logits, dim=-1, descending=True, stable=True)
    values, pos = values[:, :k], pos[:, :k]
    # key order; an unseen key (-inf) sorts past every seen one and becomes -1
    pos = torch.where(torch.isneginf(values), K, pos).sort(dim=-1).values
    seen = pos < K
    pos = pos.clamp(max=K - 1)
    counts = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(counts.shape[0], device=logits.device), counts)   # [Tq]
    col = (pos // block_size).clamp(max=max(block_table.shape[1] - 1, 0))
    slots = block_table.long()[seq[:, None], col] * block_size + pos % block_size
    out[:, :k] = torch.where(seen, slots, -1).to(torch.int32)
    return out


def _sparse_attend(q, rows, valid, head_dim_v, softmax_scale, attn_sink=None):
    """q [N, H, d], rows [N, topk, d] float32, valid [N, topk] bool -> out [N, H, head_dim_v]
    float32, lse [N, H] float32: softmax over each query's valid rows (invalid rows weigh 0,
    whatever they hold). ``attn_sink`` [H] float32: one more logit per head in the softmax's
    denominator, with a zero value (``_with_sink``)."""
    rows = torch.where(valid[..., None], rows, 0.0)
    scores = (q.float() @ rows.transpose(1, 2)) * softmax_scale                      # [N, H, topk]
    out, lse = softmax_attend(scores, valid[:, None, :], rows[..., :head_dim_v])
    return (out, lse) if attn_sink is None else _with_sink(out, lse, attn_sink)


def _with_sink(out, lse, attn_sink):
    """FlashMLA's attn_sink: the sink s_h joins the softmax as a key whose value is 0, so
    lse' = logaddexp(lse, s_h) and out' = out * exp(lse - lse'). A query with no key gets
    out 0 and lse = s_h (the sink alone); a sink of -inf is no sink."""
    sink = attn_sink.float().expand_as(lse)
    total = torch.logaddexp(lse, sink)
    # where both are -inf (no key, sink -inf) keep lse -inf and out 0, never NaN
    w = torch.where(torch.isneginf(total), 0.0, torch.exp(lse - total))
    return out * w[..., None], total


def sparse_mla_decode(q, kv_cache, indices, head_dim_v, softmax_scale, kv_scale=1.0, attn_sink=None):
    """Absorbed MLA attention of each query over the cache rows its ``indices`` name.

    q [B, s_q, H, d]; kv_cache [num_blocks, block_size, d] (plain, or FP8 rows: see mla_decode);
    indices [B, s_q, topk] int32 flat slots (block * block_size + offset), -1 = none. Values
    are the first head_dim_v values of each row. ``attn_sink`` [H] float32 or None: a logit per
    head in the softmax's denominator only (``_with_sink``). Returns out [B, s_q, H, head_dim_v]
    (q.dtype) and lse [B, s_q, H] float32; a query with no index gets out 0, lse -inf (the sink
    with one).
    """
    B, s_q, H, d = q.shape
    topk = indices.shape[-1]
    flat = kv_cache.reshape(-1, kv_cache.shape[-1])
    idx = indices.reshape(B * s_q, topk).long()
    valid = idx >= 0
    stored = flat[idx.clamp(min=0).flatten()]
    rows = dequantize_rows(stored, cache_format(kv_cache), head_dim_v, torch.float32, kv_scale)
    out, lse = _sparse_attend(q.reshape(B * s_q, H, d), rows.view(B * s_q, topk, d), valid, head_dim_v,
                              softmax_scale, attn_sink)
    return out.view(B, s_q, H, head_dim_v).to(q.dtype), lse.view(B, s_q, H)


def sparse_prefill_attention(q, kv, indices, sm_scale, d_v, attn_sink=None):
    """FlashMLA's ``flash_mla_sparse_fwd``: q [s_q, H, d], kv [s_kv, 1, d], indices
    [s_q, 1, topk] int32 rows of kv (-1 = none); values are the first d_v values of each row;
    ``attn_sink`` [H] float32 or None as in ``sparse_mla_decode``. Returns out [s_q, H, d_v]
    (q.dtype) and lse [s_q, H] float32 (natural log; out 0 and lse -inf, or the sink, for a
    query with no index)."""
    s_q, H, d = q.shape
    idx = indices[:, 0].long()
    valid = idx >= 0
    src = kv[:, 0].float() if kv.shape[0] else kv.new_zeros(1, d, dtype=torch.float32)   # s_kv = 0: all -1
    rows = src[idx.clamp(min=0)]                                                     # [s_q, topk, d]
    out, lse = _sparse_attend(q, rows, valid, d_v, sm_scale, attn_sink)
    return out.to(q.dtype), lse
