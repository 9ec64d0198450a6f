"""Sparse MLA on the GPU: the kernels of ``indexer_logits``, ``topk_indices``,
``sparse_mla_decode`` and ``sparse_prefill_attention`` (Triton; the Gluon seesaw on Hopper)
against the reference on real shapes (DeepSeek-V3.2: latent 512 + rope 64, topk up to 2048,
index heads 64 x 128), and a sparse layer through them against the reference path. Tolerance: 2x PyTorch's own bf16 error against
a float64 oracle, as the dense kernels' tests."""
from __future__ import annotations

import math

import pytest
import torch

import mla
from mla import quant
from mla.ops import reference
from mla.testing import random_state_dict
from test_layer_gpu import STEPS, _run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
R, DR = 512, 64


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _lse_err(lse, want):
    return ((lse.double() - want).abs() / want.abs().clamp_min(1)).max().item()


def _attend(q, rows, valid, dv, scale, dtype, sink=None):
    """Sparse attention in ``dtype`` arithmetic (float64: the oracle; bf16: PyTorch's own error).
    q [N, H, d], rows [N, topk, d] float64, valid [N, topk] -> out [N, H, dv] float64, lse float64."""
    rows = torch.where(valid[..., None], rows, 0.0).to(dtype)
    s = (q.to(dtype) @ rows.transpose(1, 2)).double() * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.double().view(1, -1, 1).expand(s.shape[0], -1, 1)], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(lse.isfinite(), lse, 0.0)[..., None])[..., : rows.shape[1]]
    return (p.to(dtype) @ rows[..., :dv]).double(), lse


def _case(B, s_q, H, topk, fmt, seed, ctx=8192, page=64):
    """A paged cache of B sequences x ctx rows (shuffled blocks, NaN in the unused ones), FP8
    formats by the library's quantizer, and per query topk distinct positions of its sequence
    (a few -1 in the first query). Returns q, stored cache, indices, float64 rows per slot."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = B * ctx // page
    nb = blocks + 7
    rows = torch.randn(nb * page, R + DR, device="cuda", generator=g)
    perm = torch.randperm(nb, device="cuda", generator=g)
    table = perm[:blocks].view(B, -1).int()
    unused = perm[blocks:]
    rows.view(nb, page, -1)[unused] = float("nan")
    if fmt == "plain":
        stored = rows.to(torch.bfloat16).view(nb, page, -1)
        values = stored.view(nb * page, -1).double()
    else:
        stored = quant.quantize_rows(rows.nan_to_num(), fmt, R, 0.5).view(nb, page, -1)
        stored.view(nb, page, -1)[unused] = 0x7F if fmt == "fp8_tile" else float("nan")
        values = quant.dequantize_rows(stored.view(nb * page, -1), fmt, R, torch.float64, 0.5)
    pos = torch.rand(B * s_q, ctx, device="cuda", generator=g).argsort(-1)[:, :topk].view(B, s_q, topk)
    b = torch.arange(B, device="cuda")[:, None, None]
    idx = (table.long()[b, pos // page] * page + pos % page).int()
    idx[0, 0, -5:] = -1
    q = torch.randn(B, s_q, H, R + DR, device="cuda", generator=g).to(torch.bfloat16)
    return q, stored, idx, values


@pytest.mark.parametrize("fmt", ["plain", "fp8", "fp8_tile"])
@pytest.mark.parametrize("H,B,s_q,topk", [(1, 3, 1, 64), (3, 2, 2, 300), (16, 8, 1, 2048), (64, 4, 2, 2048),
                                          (128, 16, 1, 2048), (128, 2, 3, 1000)])
def test_sparse_decode_kernel(H, B, s_q, topk, fmt):
    q, stored, idx, values = _case(B, s_q, H, topk, fmt, seed=H + B + topk)
    scale = 1 / math.sqrt(192)
    sink = torch.randn(H, device="cuda") if H == 3 else None
    out, lse = mla.ops.sparse_mla_decode(q, stored, idx, R, scale, kv_scale=0.5 if fmt == "fp8" else 1.0,
                                         attn_sink=sink)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    flat = idx.view(B * s_q, topk).long()
    valid = flat >= 0
    rows = values[flat.clamp(min=0)]
    want_o, want_l = _attend(q.view(B * s_q, H, -1).double(), rows, valid, R, scale, torch.float64, sink)
    low_o, low_l = _attend(q.view(B * s_q, H, -1).double(), rows, valid, R, scale, torch.bfloat16, sink)
    out, lse = out.view(B * s_q, H, R), lse.view(B * s_q, H)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert _rel(out, want_o) <= 2 * _rel(low_o, want_o), (_rel(out, want_o), _rel(low_o, want_o))
    assert _lse_err(lse, want_l) <= 2 * _lse_err(low_l, want_l) + 1e-5


def test_sparse_decode_kernel_empty_and_out_of_range():
    """Queries with no index get out 0 and lse -inf (the sink with one); indices past the pool
    (unchecked on CUDA) are never read."""
    q, stored, idx, values = _case(2, 2, 16, 128, "plain", seed=5)
    idx[0, 1] = -1
    idx[1, 0, :3] = torch.tensor([2 ** 31 - 1, stored.shape[0] * 64, -9], dtype=torch.int32, device="cuda")
    out, lse = mla.ops.sparse_mla_decode(q, stored, idx, R, 0.07)
    assert (out[0, 1] == 0).all() and (lse[0, 1] == float("-inf")).all()
    clean = idx.clone()
    clean[1, 0, :3] = -1
    o2, l2 = mla.ops.sparse_mla_decode(q, stored, clean, R, 0.07)
    assert torch.equal(out, o2) and torch.equal(lse, l2)
    sink = torch.randn(16, device="cuda")
    o3, l3 = mla.ops.sparse_mla_decode(q, stored, idx, R, 0.07, attn_sink=sink)
    assert (o3[0, 1] == 0).all() and torch.allclose(l3[0, 1], sink)


@pytest.mark.parametrize("H", [64, 128])
def test_sparse_prefill_kernel(H):
    g = torch.Generator(device="cuda").manual_seed(H)
    s_q, s_kv, topk = 257, 3000, 512
    q = torch.randn(s_q, H, R + DR, device="cuda", generator=g).to(torch.bfloat16)
    kv = torch.randn(s_kv, 1, R + DR, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.rand(s_q, s_kv, device="cuda", generator=g).argsort(-1)[:, :topk].int()
    idx[::7, -11:] = -1
    scale = 1 / math.sqrt(192)
    out, lse = mla.ops.sparse_prefill_attention(q, kv, idx[:, None], scale, R)
    valid = idx >= 0
    rows = kv[:, 0].double()[idx.long().clamp(min=0)]
    want_o, want_l = _attend(q.double(), rows, valid, R, scale, torch.float64)
    low_o, low_l = _attend(q.double(), rows, valid, R, scale, torch.bfloat16)
    assert _rel(out, want_o) <= 2 * _rel(low_o, want_o)
    assert _lse_err(lse, want_l) <= 2 * _lse_err(low_l, want_l) + 1e-5


@pytest.mark.parametrize("H,N,topk,splits,sink,dtype", [(128, 5, 2048, 3, False, torch.bfloat16),
                                                         (64, 7, 300, 2, True, torch.bfloat16),
                                                         (100, 9, 513, None, True, torch.float16),
                                                         (128, 6, 77, 1, False, torch.float16)])
def test_sparse_gluon_seesaw(H, N, topk, splits, sink, dtype):
    """The Hopper kernel (``decode.gluon.sparse``) with forced split counts (float32 partials and
    the combine), a sink in split 0 only, head counts off its 64-head tile, rows [s_kv, 1, 576],
    bf16 and fp16."""
    from mla.ops.decode.gluon import sparse as gluon_sparse
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels need sm90")
    g = torch.Generator(device="cuda").manual_seed(H + N + topk)
    s_kv = 4000
    q = torch.randn(N, H, R + DR, device="cuda", generator=g).to(dtype)
    kv = torch.randn(s_kv, 1, R + DR, device="cuda", generator=g).to(dtype)
    idx = torch.rand(N, s_kv, device="cuda", generator=g).argsort(-1)[:, :topk].int()
    idx[::3, -7:] = -1
    unused = torch.ones(s_kv, dtype=torch.bool, device="cuda")
    unused[idx[idx >= 0].long()] = False
    kv[unused] = float("nan")
    scale = 1 / math.sqrt(192)
    s = torch.randn(H, device="cuda", generator=g) if sink else None
    assert gluon_sparse.supports(q, kv, R)
    out, lse = gluon_sparse.launch(q, kv, idx, R, scale, s, num_splits=splits)
    valid = idx >= 0
    rows = kv[:, 0].double().nan_to_num()[idx.long().clamp(min=0)]
    want_o, want_l = _attend(q.double(), rows, valid, R, scale, torch.float64, s)
    low_o, low_l = _attend(q.double(), rows, valid, R, scale, dtype, s)
    assert out.dtype == dtype and torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert _rel(out, want_o) <= 2 * _rel(low_o, want_o), (_rel(out, want_o), _rel(low_o, want_o))
    assert _lse_err(lse, want_l) <= 2 * _lse_err(low_l, want_l) + 1e-5


@pytest.mark.parametrize("fmt", ["fp8", "fp8_tile"])
@pytest.mark.parametrize("H,N,topk,splits,sink,dtype", [(128, 5, 2048, 3, False, torch.bfloat16),
                                                         (64, 7, 300, 2, True, torch.bfloat16),
                                                         (100, 9, 513, None, True, torch.float16),
                                                         (128, 6, 77, 1, False, torch.bfloat16),
                                                         (16, 33, 2048, None, False, torch.bfloat16)])
def test_sparse_gluon_seesaw_fp8_rows(H, N, topk, splits, sink, dtype, fmt):
    """The Hopper kernel on FP8 rows (its producer warpgroup gathers them by cp.async and widens
    them): per-tensor rows with kv_scale 0.5 and tile rows, forced and default splits, a sink,
    16 heads and heads off the 64-head tile, unindexed rows all 0x7F bytes (NaN values; tile
    rows' scales NaN too). Against the rows as stored, dequantized in float64."""
    from mla.ops.decode.gluon import sparse as gluon_sparse
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels need sm90")
    g = torch.Generator(device="cuda").manual_seed(H + N + topk + len(fmt))
    s_kv, kv_scale = 4000, 0.5 if fmt == "fp8" else 1.0
    q = torch.randn(N, H, R + DR, device="cuda", generator=g).to(dtype)
    kv = quant.quantize_rows(torch.randn(s_kv, R + DR, device="cuda", generator=g), fmt, R, kv_scale)
    idx = torch.rand(N, s_kv, device="cuda", generator=g).argsort(-1)[:, :topk].int()
    idx[::3, -7:] = -1
    unused = torch.ones(s_kv, dtype=torch.bool, device="cuda")
    unused[idx[idx >= 0].long()] = False
    kv.view(torch.uint8)[unused] = 0x7F                 # e4m3 NaN: values, and tile rows' scales
    values = quant.dequantize_rows(kv, fmt, R, torch.float64, kv_scale).nan_to_num()
    kv = kv.view(s_kv, 1, -1)
    scale = 1 / math.sqrt(192)
    s = torch.randn(H, device="cuda", generator=g) if sink else None
    assert gluon_sparse.supports(q, kv, R)
    out, lse = gluon_sparse.launch(q, kv, idx, R, scale, s, num_splits=splits, kv_scale=kv_scale)
    valid = idx >= 0
    rows = values[idx.long().clamp(min=0)]
    want_o, want_l = _attend(q.double(), rows, valid, R, scale, torch.float64, s)
    low_o, low_l = _attend(q.double(), rows, valid, R, scale, dtype, s)
    assert out.dtype == dtype and torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert _rel(out, want_o) <= 2 * _rel(low_o, want_o), (_rel(out, want_o), _rel(low_o, want_o))
    assert _lse_err(lse, want_l) <= 2 * _lse_err(low_l, want_l) + 1e-5
    # the same launch again: the producer's stages and slots leave no state behind
    again = gluon_sparse.launch(q, kv, idx, R, scale, s, num_splits=splits, kv_scale=kv_scale)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)


@pytest.mark.parametrize("index_format", [None, "fp8_ue8m0"])
@pytest.mark.parametrize("B,nq,n_heads", [(32, 1, 64), (3, 2, 64), (2, 300, 32), (4, 3, 7)])
def test_indexer_kernels(B, nq, n_heads, index_format):
    """The logits kernel against the reference on bf16 inputs (both sum float32 products), bf16
    keys or DeepSeek's FP8 key rows, and the top-k: the selected set equals the reference's where
    scores are distinct."""
    g = torch.Generator(device="cuda").manual_seed(B * nq)
    d, page, topk = 128, 64, 256
    lens = torch.randint(nq, 5000, (B,), device="cuda", generator=g).int()
    lens[0] = nq                              # a sequence with exactly its queries
    max_blocks = -(-5000 // page)
    nb = B * max_blocks + 3
    table = torch.randperm(nb, device="cuda", generator=g)[:B * max_blocks].view(B, max_blocks).int()
    cache = torch.randn(nb, page, d, device="cuda", generator=g).to(torch.bfloat16)
    q = torch.randn(B * nq, n_heads, d, device="cuda", generator=g).to(torch.bfloat16)
    if index_format is not None:   # as the layer stores and queries them (mla.sparse)
        cache = quant.quantize_index(quant.rotate(cache.view(-1, d)), index_format).view(nb, page, -1)
        q = quant.fake_quant(quant.rotate(q), index_format).to(torch.bfloat16)
    w = torch.randn(B * nq, n_heads, device="cuda", generator=g)
    cu = torch.arange(0, B * nq + 1, nq, device="cuda", dtype=torch.int32)
    K = 5000
    args = (q, w, cache, table, lens, cu, K, d ** -0.5)
    got = mla.ops.indexer_logits(*args)
    want = reference.indexer_logits(*args)
    assert torch.equal(got.isinf(), want.isinf())
    fin = want.isfinite()
    assert ((got[fin] - want[fin]).abs() / (1 + want[fin].abs())).max() <= 1e-4
    sel = mla.ops.topk_indices(got, topk, table, cu, page)
    ref = reference.topk_indices(want, topk, table, cu, page)
    assert torch.equal(sel < 0, ref < 0)
    # the sets agree except where the k-th and (k+1)-th scores are within the logits' rounding
    top = want.sort(-1, descending=True).values
    k = min(topk, K)
    gap = (top[:, k - 1] - top[:, k]).abs() if K > k else torch.full_like(top[:, 0], float("inf"))
    clear = (gap > 1e-3 * (1 + top[:, k - 1].abs())) | ~top[:, k - 1].isfinite()
    for t in clear.nonzero().flatten().tolist():
        assert set(sel[t].tolist()) == set(ref[t].tolist()), t


_SPARSE_CFG = dict(hidden_size=1024, num_heads=16, q_lora_rank=768, kv_lora_rank=R, qk_nope_head_dim=128,
                   qk_rope_head_dim=DR, v_head_dim=128, max_position_embeddings=4096, index_topk=256,
                   index_n_heads=64, index_head_dim=128)
# GLM-5.3-Flash's shapes: no RoPE (rows of the 512-value latent: the portable decode kernel), nope and
# v 256, the k-pool indexer (pools of 16: the best 16 and the open pool)
_KPOOL_CFG = dict(_SPARSE_CFG, qk_rope_head_dim=0, qk_nope_head_dim=256, v_head_dim=256, rope_type="none",
                  index_kpool=16)
# test_layer_gpu's steps (a 700-token prompt past index_topk beside a short one, decode, drafts,
# a prompt beside a decode, a long prompt over a cached prefix) and its runner, workspace 256


@pytest.mark.parametrize("fields,cache_dtype,scaling", [(_SPARSE_CFG, None, "tensor"),
                                                        (_SPARSE_CFG, torch.float8_e4m3fn, "tile"),
                                                        (_KPOOL_CFG, None, "tensor")], ids=["dsa", "dsa-fp8", "kpool"])
def test_sparse_layer_triton_matches_reference(fields, cache_dtype, scaling):
    cfg = mla.MLAConfig(**fields)
    sd = random_state_dict(cfg, torch.Generator().manual_seed(0))
    ref = _run(cfg, sd, torch.float32, "torch", STEPS, 256, cache_dtype, scaling)
    low = _run(cfg, sd, torch.bfloat16, "torch", STEPS, 256, cache_dtype, scaling)
    fast = _run(cfg, sd, torch.bfloat16, "auto", STEPS, 256, cache_dtype, scaling)
    for r, lo, f in zip(ref, low, fast):
        assert torch.isfinite(f).all()
        assert _rel(f, r) <= 2 * _rel(lo, r) + 1e-3
