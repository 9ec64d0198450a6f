"""Hy4 (transformers' hy_v4): attention sinks in the sparse ops against a straightforward
oracle, the layer's output gate, and the layer exact against HYV4Attention.

Hy4 is DeepSeek-V3.2's sparse MLA with neox RoPE, the indexer's RoPE on the last
qk_rope_head_dim values of its head, a learnable sink logit per head, and a sigmoid output
gate per head (attn * sigmoid(gate_proj(x))) before o_proj.
"""
from __future__ import annotations

import pytest
import torch

import mla

NAN = float("nan")


def _sink_oracle(q, rows_per_query, scale, dv, sink):
    """The sink as one more logit per head whose value is 0: q [N, H, d]; rows_per_query: list of
    [k_i, d] float64; sink [H] -> out [N, H, dv], lse [N, H] float64."""
    N, H, _ = q.shape
    out = torch.zeros(N, H, dv, dtype=torch.float64)
    lse = torch.zeros(N, H, dtype=torch.float64)
    for t, kv in enumerate(rows_per_query):
        s = torch.cat([(q[t].double() @ kv.T) * scale, sink.double()[:, None]], -1)    # [H, k_i + 1]
        lse[t] = torch.logsumexp(s, -1)
        p = torch.softmax(s, -1)[:, :-1]                                              # the sink dropped
        out[t] = p @ kv[:, :dv]
    return out, lse


@pytest.mark.parametrize("H", [1, 3, 16])
def test_sparse_mla_decode_sink(H):
    g = torch.Generator().manual_seed(H)
    r, dr, bs, nb, topk = 64, 16, 4, 10, 6
    d = r + dr
    cache = torch.full((nb, bs, d), NAN)
    used = torch.randperm(nb * bs, generator=g)[:24]
    flat = cache.view(-1, d)
    flat[used] = torch.randn(24, d, generator=g)
    B, s_q = 2, 3
    idx = torch.full((B, s_q, topk), -1, dtype=torch.int32)
    for b in range(B):
        for i in range(s_q):
            k = [6, 2, 0][i] if b == 0 else 4     # full, partial, none
            idx[b, i, :k] = used[torch.randperm(24, generator=g)[:k]].int()
    q = torch.randn(B, s_q, H, d, generator=g)
    sink = torch.randn(H, generator=g) * 2
    out, lse = mla.ops.sparse_mla_decode(q, cache, idx, r, 0.1, attn_sink=sink)
    rows = [flat[[s for s in row.tolist() if s >= 0]].double() for row in idx.view(B * s_q, topk)]
    want_o, want_l = _sink_oracle(q.view(B * s_q, H, d), rows, 0.1, r, sink)
    assert not out.isnan().any() and lse.isfinite().all()
    assert torch.allclose(out.view(-1, H, r).double(), want_o, atol=1e-5)
    assert torch.allclose(lse.view(-1, H).double(), want_l, atol=1e-5)
    # a query with no index: out 0 and lse the sink alone (the sink is the only logit)
    assert (out[0, 2] == 0).all() and torch.equal(lse[0, 2], sink)
    # the sink only lowers every weight: out = out_without * exp(lse_without - lse)
    o0, l0 = mla.ops.sparse_mla_decode(q, cache, idx, r, 0.1)
    fin = l0.isfinite()
    assert torch.allclose(out[fin], (o0 * torch.exp(l0 - lse)[..., None])[fin], atol=1e-6)
    # a sink of -inf is no sink
    o1, l1 = mla.ops.sparse_mla_decode(q, cache, idx, r, 0.1, attn_sink=torch.full((H,), float("-inf")))
    assert torch.equal(o1, o0) and torch.equal(l1.isinf(), l0.isinf()) and not o1.isnan().any()


@pytest.mark.parametrize("H", [1, 7])
def test_sparse_prefill_attention_sink(H):
    g = torch.Generator().manual_seed(H)
    s_q, s_kv, d, dv, topk = 5, 11, 40, 32, 4
    q = torch.randn(s_q, H, d, generator=g)
    kv = torch.randn(s_kv, 1, d, generator=g)
    idx = torch.full((s_q, 1, topk), -1, dtype=torch.int32)
    for t in range(s_q - 1):                                   # the last query has no index
        idx[t, 0, :t + 1] = torch.randperm(s_kv, generator=g)[:t + 1].int()[:topk]
    sink = torch.randn(H, generator=g)
    out, lse = mla.ops.sparse_prefill_attention(q, kv, idx, 0.2, dv, attn_sink=sink)
    rows = [kv[[s for s in idx[t, 0].tolist() if s >= 0], 0].double() for t in range(s_q)]
    want_o, want_l = _sink_oracle(q, rows, 0.2, dv, sink)
    assert torch.allclose(out.double(), want_o, atol=1e-5) and torch.allclose(lse.double(), want_l, atol=1e-5)
    assert (out[-1] == 0).all() and torch.equal(lse[-1], sink)
    o2, l2 = mla.ops.sparse_mla_decode(q[None], kv[:, 0][None], idx[:, 0][None], dv, 0.2, attn_sink=sink)
    assert torch.allclose(o2[0], out, atol=1e-6) and torch.allclose(l2[0], lse, atol=1e-6)


def test_sink_validation():
    q, cache = torch.randn(1, 1, 2, 24), torch.randn(3, 4, 24)
    idx = torch.tensor([[[1]]], dtype=torch.int32)
    for bad in (torch.zeros(3), torch.zeros(2, dtype=torch.float64), torch.zeros(1, 2), [0.0, 0.0]):
        with pytest.raises(ValueError, match="attn_sink"):
            mla.ops.sparse_mla_decode(q, cache, idx, 16, 0.1, attn_sink=bad)
        with pytest.raises(ValueError, match="attn_sink"):
            mla.ops.sparse_prefill_attention(q[0], cache[0][:, None], idx[0][:, None], 0.1, 16, attn_sink=bad)
