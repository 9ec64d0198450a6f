"""The reference ops against independent dense computations, and the merge's edge cases."""
from __future__ import annotations

import math

import pytest
import torch

import mla


def _dense(q, k, v, visible, scale):
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), 0.0).nan_to_num()
    return torch.einsum("hqk,khd->qhd", p, v.double()), lse.T


def test_merge_is_exact_and_never_nan():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 3, 8, generator=g, dtype=torch.float64) for _ in range(3))
    full_o, full_l = _dense(q, k, v, torch.ones(5, 5, dtype=torch.bool), 0.3)
    a_o, a_l = _dense(q, k[:2], v[:2], torch.ones(5, 2, dtype=torch.bool), 0.3)
    b_o, b_l = _dense(q, k[2:], v[2:], torch.ones(5, 3, dtype=torch.bool), 0.3)
    o, l = mla.ops.merge_attention(a_o.float(), a_l.float(), b_o.float(), b_l.float())
    assert torch.allclose(o.double(), full_o, atol=1e-6) and torch.allclose(l.double(), full_l, atol=1e-6)
    ninf = torch.full_like(a_l, float("-inf")).float()
    o, l = mla.ops.merge_attention(a_o.float(), a_l.float(), torch.full_like(a_o, float("nan")).float(), ninf)
    assert torch.equal(o, a_o.float()) and torch.equal(l, a_l.float())
    o, l = mla.ops.merge_attention(torch.zeros(5, 3, 8), ninf, torch.zeros(5, 3, 8), ninf)
    assert not o.isnan().any() and (o == 0).all() and (l == float("-inf")).all()


@pytest.mark.parametrize("H,s_q,block_size", [(1, 1, 4), (3, 2, 3), (16, 4, 16)])
def test_decode_reference_matches_dense(H, s_q, block_size):
    g = torch.Generator().manual_seed(H * 10 + s_q)
    r, dr, B = 32, 8, 3
    lens = [s_q, 17, 0] if s_q > 0 else [0, 0, 0]
    nb = 40
    kv = torch.full((nb, block_size, r + dr), float("nan"))
    perm = torch.randperm(nb, generator=g)
    table = torch.zeros(B, 8, dtype=torch.int32)
    used = 0
    rows = []
    for b, n in enumerate(lens):
        x = torch.randn(n, r + dr, generator=g)
        rows.append(x)
        for i in range((n + block_size - 1) // block_size):
            blk = int(perm[used]); used += 1
            table[b, i] = blk
            chunk = x[i * block_size:(i + 1) * block_size]
            kv[blk, : chunk.shape[0]] = chunk
    q = torch.randn(B, s_q, H, r + dr, generator=g)
    out, lse = mla.ops.mla_decode(q, kv, table, torch.tensor(lens, dtype=torch.int32), r, 0.2, backend="torch")
    for b, n in enumerate(lens):
        pos = torch.arange(s_q)[:, None]
        visible = torch.arange(n)[None, :] < n - s_q + 1 + pos
        ref_o, ref_l = _dense(q[b], rows[b][:, None].expand(n, H, -1), rows[b][:, None, :r].expand(n, H, r), visible, 0.2)
        assert torch.allclose(out[b].double(), ref_o, atol=1e-5)
        assert torch.equal(torch.isinf(lse[b]), torch.isinf(ref_l))
        fin = torch.isfinite(ref_l)
        assert torch.allclose(lse[b].double()[fin], ref_l[fin], atol=1e-5)
    assert not out.isnan().any()


def test_prefill_reference_matches_dense_causal_end_aligned():
    g = torch.Generator().manual_seed(3)
    nq, nk = [3, 0, 5], [7, 4, 5]
    cq = torch.tensor([0] + list(torch.tensor(nq).cumsum(0)), dtype=torch.int32)
    ck = torch.tensor([0] + list(torch.tensor(nk).cumsum(0)), dtype=torch.int32)
    q = torch.randn(sum(nq), 3, 12, generator=g)
    k = torch.randn(sum(nk), 3, 12, generator=g)
    v = torch.randn(sum(nk), 3, 6, generator=g)
    out, lse = mla.ops.prefill_attention(q, k, v, cq, ck, 1 / math.sqrt(12), backend="torch")
    for b in range(3):
        if nq[b] == 0:
            continue
        i = torch.arange(nq[b])[:, None]
        j = torch.arange(nk[b])[None, :]
        ref_o, ref_l = _dense(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], j <= i + nk[b] - nq[b],
                              1 / math.sqrt(12))
        assert torch.allclose(out[cq[b]:cq[b + 1]].double(), ref_o, atol=1e-5)
        assert torch.allclose(lse[cq[b]:cq[b + 1]].double(), ref_l, atol=1e-5)


def test_gather_and_append_roundtrip():
    g = torch.Generator().manual_seed(4)
    kv = torch.full((10, 4, 12), float("nan"))
    T = 9
    table = torch.randperm(10, generator=g)[:3].to(torch.int32)[None]          # one sequence, 3 blocks
    slots = torch.tensor([int(table[0, t // 4]) * 4 + t % 4 for t in range(T)])
    q_pe = torch.randn(T, 3, 4, generator=g)
    k_pe = torch.randn(T, 4, generator=g)
    c_kv = torch.randn(T, 8, generator=g)
    cos, sin = torch.ones(T, 2), torch.zeros(T, 2)     # identity rotation
    q0 = q_pe.clone()
    mla.ops.rope_append(q_pe, k_pe, c_kv, cos, sin, kv, slots, True, backend="torch")
    assert torch.equal(q_pe, q0)
    rows = torch.cat((c_kv, k_pe), -1)
    assert torch.equal(kv.view(-1, 12)[slots], rows)
    got = mla.ops.gather_latent(kv, table, torch.tensor([2], dtype=torch.int32),
                                torch.tensor([0, 5], dtype=torch.int32), 5, backend="torch")
    assert torch.equal(got, rows[2:7])
